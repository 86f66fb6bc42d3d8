// The attention engine (src/kernels/engine/engine.hpp: FlashAttention-2 forward and
// flash-decoding, Dao 2023 Alg. 1) instantiated for portable C++: one float per "vector", exp
// from libm (correctly rounded to within an ulp), fp32 accumulation. The fallback for CPUs
// without AVX2 and for builds on other architectures. Its tests (tests/test_flash.cpp,
// tests/test_decode.cpp, forced with QKV_ISA=scalar or set_isa_cap) enforce the same fp32
// accuracy contract as the vector variants: max error <= 2x a naive fp32 attention + 1e-6.
#include <cmath>
#include <cstdint>
#include <limits>

#include "qkv/tensor.hpp"

#define QKV_ENGINE_NS engine_scalar
#include "kernels/engine/engine.hpp"
#include "kernels/isa_kernels.hpp"
#include "kernels/engine/serving_item.hpp"

namespace qkv::detail {
namespace engine_scalar {

struct Ops {
  using V = float;
  static constexpr int W = 1;
  // Tile traits: rows per query block, keys per key tile, accumulators held in registers by
  // the QK^T microkernel (MR keys x query vectors), vectors of Dv per PV microkernel.
  static constexpr int kBq = 8, kBk = 64, kAccRegs = 16, kPvCols = 4;
  static constexpr bool kHasDpbf16 = false;
  static V zero() { return 0.0f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static void store(float* p, V x) { *p = x; }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V mul(V a, V b) { return a * b; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V div(V a, V b) { return a / b; }
  static void transpose(const float* const* rows, float* dst, std::int64_t) { dst[0] = rows[0][0]; }
  static V max(V a, V b) { return b > a ? b : a; }
  static V exp(V x) { return std::exp(x); }
  static V safe_max(V m) { return m == -std::numeric_limits<float>::infinity() ? 0.0f : m; }
  static V range_select(V x, V lo, V hi, V g) {
    return lo <= g && g < hi ? x : -std::numeric_limits<float>::infinity();
  }
  static float hsum(V x) { return x; }
  static V load_bf16(const std::uint16_t* p) { return bf16_to_float(*p); }
  static V load_f16(const std::uint16_t* p) { return half_to_float(*p); }
  static V load_i8(const std::int8_t* p) { return static_cast<float>(*p); }
  static V load_e4m3(const std::uint8_t* p) { return e4m3_to_float(*p); }
  static constexpr bool kMaskedFma = false;
  static void f16_to_f32(const std::uint16_t* s, float* d, std::int64_t n) {
    for (std::int64_t x = 0; x < n; ++x) d[x] = half_to_float(s[x]);
  }
};

static_assert(IsaOps<Ops>, "Ops must provide what the engine uses (kernels/engine/isa_ops.hpp)");

using E = Engine<Ops>;

// No bf16 products at this level: bf16 inputs are widened to fp32.
void serving_item(const VarlenProblem& vp, const ServingItem& it, const ServingLayout& L, float* parts, std::int64_t NS,
                  char* ws, bool) {
  ServingItemBody<Ops>::run(vp, it, L, parts, NS, ws);
}

}  // namespace engine_scalar

const IsaKernels kIsaKernelsScalar = {
    "scalar",
    engine_scalar::E::flash_workspace, engine_scalar::E::flash_forward,
    engine_scalar::E::decode_workspace, engine_scalar::E::decode_forward,
    engine_scalar::E::backward_workspace, engine_scalar::E::backward,
    engine_scalar::Ops::kBq, engine_scalar::Ops::kBk,
    engine_scalar::E::exp_array,
    nullptr,
    engine_scalar::serving_item,
};

}  // namespace qkv::detail
