// The attention engine (src/kernels/engine/engine.hpp: FlashAttention-2 forward, Dao 2023
// Alg. 1, and flash-decoding) instantiated for AVX-512 (F/BW/DQ/VL + FMA), 16 floats per vector,
// with the AVX512_BF16 dot product (vdpbf16ps) for bfloat16 inputs when the CPU has it.
//
// Tile traits: 64 query rows x 64 keys; QK^T microkernel MR keys x NQV vectors of 16 queries with
// MR*NQV <= 24 zmm accumulators (6 x 4 for a full block); PV microkernel 6 rows x 4 vectors of Dv.
//
// Vector exp (fp32): x clamped above at 88.8 (NaN kept), n = round(x log2 e),
// r = x - n ln2 (ln2 split in two for exactness), e^r by the Cephes expf polynomial
//   1 + r (1 + r (0.5 + r (1/6 + r (1/24 + r (1/120 + r (1/720 + r/5040))))))  (minimax-fitted
//   coefficients below), scaled by 2^n with vscalefps (inf past 88.72); x < -87.34 (incl. -inf)
//   gives exactly 0 through the zero-masking of vscalefps, so no subnormal weight ever reaches
//   the PV product (subnormal operands are slow on some CPUs).
// Measured max relative error against float64 exp over every float in [-87.3, 0] (the arguments
// of the online softmax, which are <= 0): 7.5e-8; see tests/test_flash.cpp (Flash.VectorExp)
// and docs/accuracy.md.
//
// bf16 dot path: QK^T: vdpbf16ps of Q packed as (d, d+1) pairs per query with the K row's
// (d, d+1) pair broadcast (read in place); an odd D ends with a (d, 0) pair. PV: P rounded to
// bf16 (round to nearest even) and packed as (key, key+1) pairs per query, V packed as
// (key, key+1) pairs per column, vdpbf16ps accumulating in fp32. Products of bf16 values are
// exact in fp32; the only extra rounding is that of P (relative 2^-9), see docs/accuracy.md.
// GCC 12 reports its own AVX-512 intrinsics' undefined pass-through operand as maybe-uninitialized.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "qkv/tensor.hpp"

#define QKV_ENGINE_NS engine_avx512
#include "kernels/engine/engine.hpp"
#include "kernels/engine/size_switch.hpp"
#include "kernels/isa_kernels.hpp"
#include "kernels/engine/serving_item.hpp"

namespace qkv::detail {
namespace engine_avx512 {

#include "kernels/simd/avx512/ops_avx512.inc"

using Ops = OpsAvx512;

static_assert(IsaOps<Ops>, "Ops must provide what the engine uses (kernels/engine/isa_ops.hpp)");

using E = Engine<Ops>;

// Floating-point operations per second of vdpbf16ps over those of vfmadd231ps, measured on
// this thread: 16 independent accumulators each (enough to hide either's latency), the best of
// three alternating trials of about a millisecond. CPUs differ by 4x here: some run vdpbf16ps
// at twice the fp32 FMA rate, others at half of it, where the bf16 dot-product path would be the
// slower one.
double bf16_dot_rate() {
  constexpr int kAcc = 16;
  constexpr long kIters = 20000;
  auto seconds = [](auto body) {
    const auto t0 = std::chrono::steady_clock::now();
    body();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  float sink = 0.0f;
  auto dot = [&] {
    __m512 acc[kAcc];
    for (auto& a : acc) a = _mm512_setzero_ps();
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);
    for (long n = 0; n < kIters; ++n)
#pragma GCC unroll 16
      for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, x);
    for (auto& a : acc) sink += _mm512_reduce_add_ps(a);
  };
  auto fma = [&] {
    __m512 acc[kAcc];
    for (auto& a : acc) a = _mm512_setzero_ps();
    const __m512 x = _mm512_set1_ps(0.999f), y = _mm512_set1_ps(1e-7f);
    for (long n = 0; n < kIters; ++n)
#pragma GCC unroll 16
      for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
    for (auto& a : acc) sink += _mm512_reduce_add_ps(a);
  };
  double td = 1e30, tf = 1e30;
  for (int trial = 0; trial < 3; ++trial) {
    td = std::min(td, seconds(dot));
    tf = std::min(tf, seconds(fma));
  }
  volatile float keep = sink;  // the accumulators are used
  (void)keep;
  // vdpbf16ps: 32 products and 32 sums per instruction; vfmadd231ps: 16 and 16.
  return (64.0 / td) / (32.0 / tf);
}

// bf16_dot (avx512bf16): the scores of bf16 queries and keys on vdpbf16ps.
void serving_item(const VarlenProblem& vp, const ServingItem& it, const ServingLayout& L, float* parts, std::int64_t NS,
                  char* ws, bool bf16_dot) {
  using Body = ServingItemBody<Ops>;
  if (bf16_dot) Body::run<Body::Score::dp>(vp, it, L, parts, NS, ws);
  else Body::run(vp, it, L, parts, NS, ws);
}

}  // namespace engine_avx512

const IsaKernels kIsaKernelsAvx512 = {
    "avx512",
    engine_avx512::E::flash_workspace, engine_avx512::E::flash_forward,
    engine_avx512::E::decode_workspace, engine_avx512::E::decode_forward,
    engine_avx512::E::backward_workspace, engine_avx512::E::backward,
    engine_avx512::Ops::kBq, engine_avx512::Ops::kBk,
    engine_avx512::E::exp_array,
    engine_avx512::bf16_dot_rate,
    engine_avx512::serving_item,
};

}  // namespace qkv::detail
