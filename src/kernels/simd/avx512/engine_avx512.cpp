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
#include "kernels/engine/with_int.hpp"
#include "kernels/isa_kernels.hpp"

namespace qkv::detail {
namespace engine_avx512 {

struct Ops {
  using V = __m512;
  static constexpr int W = 16;
  static constexpr int kBq = 64, kBk = 64, kAccRegs = 24, kPvCols = 4;
  static constexpr bool kHasDpbf16 = true;

  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  // dst[c * ld + x] = rows[x][c] for x, c < 16: a 16 x 16 block transposed in registers
  // (unpack pairs, then 64-bit pairs, then 128-bit lanes twice).
  static void transpose(const float* const* rows, float* dst, std::int64_t ld) {
    V t[16], u[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      const V a = _mm512_loadu_ps(rows[2 * i]), b = _mm512_loadu_ps(rows[2 * i + 1]);
      t[2 * i] = _mm512_unpacklo_ps(a, b);
      t[2 * i + 1] = _mm512_unpackhi_ps(a, b);
    }
    // u[4g + k], 128-bit lane L: rows 4g..4g+3 of column 4L + k.
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const __m512d lo01 = _mm512_castps_pd(t[4 * g]), hi01 = _mm512_castps_pd(t[4 * g + 1]);
      const __m512d lo23 = _mm512_castps_pd(t[4 * g + 2]), hi23 = _mm512_castps_pd(t[4 * g + 3]);
      u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo01, lo23));
      u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo01, lo23));
      u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi01, hi23));
      u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi01, hi23));
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; ++k) {
      const V v0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88), w0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
      const V v1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88), w1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
      _mm512_storeu_ps(dst + k * ld, _mm512_shuffle_f32x4(v0, v1, 0x88));
      _mm512_storeu_ps(dst + (4 + k) * ld, _mm512_shuffle_f32x4(w0, w1, 0x88));
      _mm512_storeu_ps(dst + (8 + k) * ld, _mm512_shuffle_f32x4(v0, v1, 0xDD));
      _mm512_storeu_ps(dst + (12 + k) * ld, _mm512_shuffle_f32x4(w0, w1, 0xDD));
    }
  }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V safe_max(V m) {
    const __mmask16 k = _mm512_cmp_ps_mask(m, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(k, m, _mm512_setzero_ps());
  }
  static V exp(V x) {
    // Lanes below the normal range (not NaN: unordered compares true) come out as 0.
    const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3365f), _CMP_NLT_UQ);
    // min returns its second operand when either is NaN: NaN passes through.
    const V t = _mm512_min_ps(_mm512_set1_ps(88.8f), x);
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), t);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    V y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
    // 1 + r (1 + r q(r)): each fma rounds once; the last is the only rounding of a term of size 1.
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, y, n);
  }
  static V range_select(V x, V lo, V hi, V g) {
    const __mmask16 k = _mm512_cmp_ps_mask(lo, g, _CMP_LE_OQ) & _mm512_cmp_ps_mask(g, hi, _CMP_LT_OQ);
    return _mm512_mask_blend_ps(k, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), x);
  }
  static float hsum(V x) { return _mm512_reduce_add_ps(x); }
  // Lane i of the result = hsum(a[i]) bit for bit, for 16 vectors at once: a transpose-and-add
  // tree that pairs the lanes as _mm512_reduce_add_ps does (i with i + 8, then i + 4, i + 2,
  // i + 1), 45 shuffles and adds for 16 sums instead of 16 x 8 (and 16 scalar stores).
  [[gnu::always_inline]] static V hsum_w(const V* a) {
    // The tree leaves the sum of its input slot t in lane 4 (t % 4) + t / 4, so slot t takes that a.
    V p[8], q[4];
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {  // lanes i + (i + 8): 128-bit lanes 0 + 2 and 1 + 3 of two slots
      const V x = a[4 * ((2 * i) % 4) + (2 * i) / 4], y = a[4 * ((2 * i + 1) % 4) + (2 * i + 1) / 4];
      p[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)  // + (i + 4): the two halves' 128-bit lanes of each slot
      q[i] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(p[2 * i], p[2 * i + 1], 0xDD));
    // + (i + 2): elements 0 + 2 and 1 + 3 of each 128-bit lane, two slots interleaved.
    const V z01 = _mm512_add_ps(_mm512_unpacklo_ps(q[0], q[1]), _mm512_unpackhi_ps(q[0], q[1]));
    const V z23 = _mm512_add_ps(_mm512_unpacklo_ps(q[2], q[3]), _mm512_unpackhi_ps(q[2], q[3]));
    // + (i + 1).
    const __m512d x = _mm512_castps_pd(z01), y = _mm512_castps_pd(z23);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // Lanes 4r..4r+3 of x to dst + r * ld, r < 4.
  static void store_quarters(float* dst, std::int64_t ld, V x) {
    _mm_storeu_ps(dst, _mm512_castps512_ps128(x));
    _mm_storeu_ps(dst + ld, _mm512_extractf32x4_ps(x, 1));
    _mm_storeu_ps(dst + 2 * ld, _mm512_extractf32x4_ps(x, 2));
    _mm_storeu_ps(dst + 3 * ld, _mm512_extractf32x4_ps(x, 3));
  }
  // 16 bf16 -> fp32: widen and shift into the high half (exact).
  static V load_bf16(const std::uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static V load_f16(const std::uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // PV on partially masked tiles: lanes whose weight is 0 keep the accumulator (no 0 * NaN).
  static constexpr bool kMaskedFma = true;
  static __mmask16 nonzero(V p) { return _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_NEQ_UQ); }
  static V fma_mask(V a, V b, V c, __mmask16 k) { return _mm512_mask3_fmadd_ps(a, b, c, k); }
  static void f16_to_f32(const std::uint16_t* s, float* d, std::int64_t n) {
    std::int64_t x = 0;
    for (; x + 16 <= n; x += 16)
      _mm512_storeu_ps(d + x, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + x))));
    if (x < n) {
      const __mmask16 k = static_cast<__mmask16>((1u << (n - x)) - 1);
      _mm512_mask_storeu_ps(d + x, k, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, s + x)));
    }
  }

  // ---- AVX512_BF16 microkernels --------------------------------------------------------------
  template <int NQV, int MR>
  static void qk_bf16_mk(const std::uint32_t* qp, int sp, const std::uint16_t* k, std::int64_t ks,
                         std::int64_t D, float* s, int ssp) {
    V acc[MR][NQV];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < NQV; ++c) acc[r][c] = _mm512_setzero_ps();
    const std::int64_t D2 = D / 2;
    for (std::int64_t dp = 0; dp < D2; ++dp) {
      __m512bh qv[NQV];
#pragma GCC unroll 4
      for (int c = 0; c < NQV; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qp + dp * sp + c * 16);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        std::uint32_t pair;
        std::memcpy(&pair, k + r * ks + 2 * dp, 4);
        const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
        for (int c = 0; c < NQV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], kb, qv[c]);
      }
    }
    if (D & 1) {  // the last d paired with zero (never reads past the row)
      __m512bh qv[NQV];
      for (int c = 0; c < NQV; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qp + D2 * sp + c * 16);
      for (int r = 0; r < MR; ++r) {
        const __m512bh kb = (__m512bh)_mm512_set1_epi32(static_cast<int>(k[r * ks + D - 1]));
        for (int c = 0; c < NQV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], kb, qv[c]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < NQV; ++c) _mm512_storeu_ps(s + r * ssp + c * 16, acc[r][c]);
  }

  template <int NQV>
  static void qk_bf16_rows(const std::uint32_t* qp, int sp, const std::uint16_t* k, std::int64_t ks,
                           std::int64_t D, int kt, float* s, int ssp) {
    constexpr int MR = kAccRegs / NQV > 16 ? 16 : kAccRegs / NQV;
    int j = 0;
    for (; j + MR <= kt; j += MR) qk_bf16_mk<NQV, MR>(qp, sp, k + j * ks, ks, D, s + j * ssp, ssp);
    for (; j + 2 <= kt; j += 2) qk_bf16_mk<NQV, 2>(qp, sp, k + j * ks, ks, D, s + j * ssp, ssp);
    for (; j < kt; ++j) qk_bf16_mk<NQV, 1>(qp, sp, k + j * ks, ks, D, s + j * ssp, ssp);
  }

  static void qk_bf16(const std::uint32_t* qp, int nqv, const std::uint16_t* k, std::int64_t ks,
                      std::int64_t D, int kt, float* s, int ssp) {
    const int sp = nqv * 16;  // nqv = 1 .. kBq / 16
    with_int<1, kBq / 16>(nqv, [&]<int NQV>() __attribute__((always_inline)) {
      qk_bf16_rows<NQV>(qp, sp, k, ks, D, kt, s, ssp);
    });
  }

  // pp[jp][i] = (bf16(P[2jp][i]), bf16(P[2jp+1][i])), a missing last key paired with 0.
  // vcvtne2ps2bf16 rounds both rows at once (the lower row into the low 16 words), and one word
  // permutation interleaves them into pairs.
  static void pack_p_bf16(const float* s, int ssp, int nqv, int kt, std::uint32_t* pp) {
    const int sp = nqv * 16;
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int j = 0; j < kt; j += 2)
      for (int c = 0; c < nqv; ++c) {
        const V lo = _mm512_loadu_ps(s + j * ssp + c * 16);
        const V hi = j + 1 < kt ? _mm512_loadu_ps(s + (j + 1) * ssp + c * 16) : _mm512_setzero_ps();
        const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
        _mm512_storeu_si512(pp + (j / 2) * sp + c * 16, _mm512_permutexvar_epi16(pairs, both));
      }
  }

  // vp[jp][x] = (V[2jp][x], V[2jp+1][x]) for x < nvec*16 (zero beyond Dv and past the last key).
  static void pack_v_bf16(const std::uint16_t* v, std::int64_t vs, std::int64_t Dv, int nvec, int kt,
                          std::uint32_t* vp) {
    const int dvp = nvec * 16;
    for (int j = 0; j < kt; j += 2) {
      const std::uint16_t* a = v + j * vs;
      const std::uint16_t* b = v + (j + 1) * vs;
      for (int c = 0; c < nvec; ++c) {
        const std::int64_t left = Dv - c * 16;
        const __mmask16 k = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
        const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, a + c * 16));
        const __m512i hi = j + 1 < kt ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, b + c * 16))
                                      : _mm512_setzero_si512();
        _mm512_storeu_si512(vp + (j / 2) * dvp + c * 16, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
      }
    }
  }

  // acc + a . b lane by lane over W bf16 pairs (vdpbf16ps): the sums of pairs that qk_bf16 forms,
  // in the same order, for the backward's D = rowsum(dO * O).
  static V dot_pairs(V acc, const std::uint32_t* a, const std::uint32_t* b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(a), (__m512bh)_mm512_loadu_si512(b));
  }

  template <int MR, int NC>
  static void pv_bf16_mk(const std::uint32_t* pp, int sp, const std::uint32_t* vp, int dvp, int kt2,
                         float* o, std::int64_t os, const float* alpha) {
    V acc[MR][NC];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const V a = _mm512_set1_ps(alpha[r]);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * os + c * 16), a);
    }
    for (int jp = 0; jp < kt2; ++jp) {
      __m512bh vv[NC];
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vp + jp * dvp + c * 16);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const __m512bh pb = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[jp * sp + r]));
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, vv[c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + r * os + c * 16, acc[r][c]);
  }

  template <int MR>
  static void pv_bf16_rows(const std::uint32_t* pp, int sp, const std::uint32_t* vp, int nvec, int kt2,
                           float* o, std::int64_t os, const float* alpha) {
    const int dvp = nvec * 16;
    int c = 0;
    for (; c + kPvCols <= nvec; c += kPvCols) pv_bf16_mk<MR, kPvCols>(pp, sp, vp + c * 16, dvp, kt2, o + c * 16, os, alpha);
    for (; c < nvec; ++c) pv_bf16_mk<MR, 1>(pp, sp, vp + c * 16, dvp, kt2, o + c * 16, os, alpha);
  }

  static void pv_bf16(const std::uint32_t* pp, int sp, const std::uint32_t* vp, int nvec, int kt2,
                      float* o, std::int64_t os, const float* alpha, int n) {
    constexpr int MR = kAccRegs / kPvCols;
    int r = 0;
    for (; r + MR <= n; r += MR) pv_bf16_rows<MR>(pp + r, sp, vp, nvec, kt2, o + r * os, os, alpha + r);
    for (; r + 2 <= n; r += 2) pv_bf16_rows<2>(pp + r, sp, vp, nvec, kt2, o + r * os, os, alpha + r);
    for (; r < n; ++r) pv_bf16_rows<1>(pp + r, sp, vp, nvec, kt2, o + r * os, os, alpha + r);
  }
};

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

}  // namespace engine_avx512

const IsaKernels kIsaKernelsAvx512 = {
    "avx512",
    engine_avx512::E::flash_workspace, engine_avx512::E::flash_forward,
    engine_avx512::E::decode_workspace, engine_avx512::E::decode_forward,
    engine_avx512::E::backward_workspace, engine_avx512::E::backward,
    engine_avx512::Ops::kBq, engine_avx512::Ops::kBk,
    engine_avx512::E::exp_array,
    engine_avx512::bf16_dot_rate,
};

}  // namespace qkv::detail
