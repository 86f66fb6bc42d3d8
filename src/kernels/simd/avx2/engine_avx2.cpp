// The attention engine (src/kernels/engine/engine.hpp: FlashAttention-2 forward, Dao 2023
// Alg. 1, and flash-decoding) instantiated for AVX2 + FMA (+ F16C), 8 floats per vector.
//
// Tile traits: 32 query rows x 64 keys; QK^T microkernel MR keys x NQV vectors of 8 queries with
// MR*NQV <= 12 ymm accumulators (3 x 4 for a full block); PV microkernel 6 rows x 2 vectors.
//
// Vector exp (fp32): the Cephes expf scheme as in the AVX-512 variant (x clamped to
// [-87.34, 88.37], NaN kept; n = round(x log2 e); r = x - n ln2 in two parts; degree-7
// polynomial; 2^n built in the exponent field), x < -87.34 (incl. -inf) gives exactly 0.
// Measured max relative error over [-87, 0]: 1.2e-7 (docs/accuracy.md, Flash.VectorExp).
// bf16 inputs are converted to fp32 (no bf16 dot product on AVX2); fp16 via F16C.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "qkv/tensor.hpp"

#define QKV_ENGINE_NS engine_avx2
#include "kernels/engine/engine.hpp"
#include "kernels/isa_kernels.hpp"
#include "kernels/engine/serving_item.hpp"

namespace qkv::detail {
namespace engine_avx2 {

struct Ops {
  using V = __m256;
  static constexpr int W = 8;
  static constexpr int kBq = 32, kBk = 64, kAccRegs = 12, kPvCols = 2;
  static constexpr bool kHasDpbf16 = false;

  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  // dst[c * ld + x] = rows[x][c] for x, c < 8: an 8 x 8 block transposed in registers.
  static void transpose(const float* const* rows, float* dst, std::int64_t ld) {
    V t[8], u[8];
    for (int i = 0; i < 4; ++i) {
      const V a = _mm256_loadu_ps(rows[2 * i]), b = _mm256_loadu_ps(rows[2 * i + 1]);
      t[2 * i] = _mm256_unpacklo_ps(a, b);
      t[2 * i + 1] = _mm256_unpackhi_ps(a, b);
    }
    // u[4g + k], 128-bit lane L: rows 4g..4g+3 of column 4L + k.
    for (int g = 0; g < 2; ++g) {
      const __m256d lo01 = _mm256_castps_pd(t[4 * g]), hi01 = _mm256_castps_pd(t[4 * g + 1]);
      const __m256d lo23 = _mm256_castps_pd(t[4 * g + 2]), hi23 = _mm256_castps_pd(t[4 * g + 3]);
      u[4 * g] = _mm256_castpd_ps(_mm256_unpacklo_pd(lo01, lo23));
      u[4 * g + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(lo01, lo23));
      u[4 * g + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(hi01, hi23));
      u[4 * g + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(hi01, hi23));
    }
    for (int k = 0; k < 4; ++k) {
      _mm256_storeu_ps(dst + k * ld, _mm256_permute2f128_ps(u[k], u[4 + k], 0x20));
      _mm256_storeu_ps(dst + (4 + k) * ld, _mm256_permute2f128_ps(u[k], u[4 + k], 0x31));
    }
  }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V safe_max(V m) {
    const V k = _mm256_cmp_ps(m, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_EQ_OQ);
    return _mm256_blendv_ps(m, _mm256_setzero_ps(), k);
  }
  static V exp(V x) {
    const V under = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365f), _CMP_LT_OQ);
    V t = _mm256_max_ps(_mm256_set1_ps(-87.3365f), x);  // NaN passes through (second operand)
    t = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), t);
    const V n = _mm256_round_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), t);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    V y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201E-1f));
    // 1 + (r + r^2 q(r)): the only rounding of a term of size 1 is the last one.
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    // 2^n for n in [-126, 127]: the exponent field.
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_blendv_ps(y, _mm256_setzero_ps(), under);
  }
  static V range_select(V x, V lo, V hi, V g) {
    const V k = _mm256_and_ps(_mm256_cmp_ps(lo, g, _CMP_LE_OQ), _mm256_cmp_ps(g, hi, _CMP_LT_OQ));
    return _mm256_blendv_ps(_mm256_set1_ps(-std::numeric_limits<float>::infinity()), x, k);
  }
  static float hsum(V x) {
    const __m128 a = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
  }
  // Lane i of the result = hsum(a[i]) bit for bit, for 8 vectors at once: the same pairs as
  // hsum (i with i + 4, then i + 2, then i + 1), 19 instructions for 8 sums.
  [[gnu::always_inline]] static V hsum_w(const V* a) {
    // u[i]: a[i] in the low 128-bit half, a[4 + i] in the high one, so that lane i ends up a[i].
    V u[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)  // lo + hi 128-bit halves of two slots
      u[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[i], a[4 + i], 0x20), _mm256_permute2f128_ps(a[i], a[4 + i], 0x31));
    const __m256d u0 = _mm256_castps_pd(u[0]), u1 = _mm256_castps_pd(u[1]);
    const __m256d u2 = _mm256_castps_pd(u[2]), u3 = _mm256_castps_pd(u[3]);
    const V w01 = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(u0, u1)), _mm256_castpd_ps(_mm256_unpackhi_pd(u0, u1)));
    const V w23 = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(u2, u3)), _mm256_castpd_ps(_mm256_unpackhi_pd(u2, u3)));
    return _mm256_hadd_ps(w01, w23);
  }
  // Lanes 2r, 2r + 1 of x to dst + r * ld, r < 4.
  static void store_quarters(float* dst, std::int64_t ld, V x) {
    const __m128 lo = _mm256_castps256_ps128(x), hi = _mm256_extractf128_ps(x, 1);
    _mm_storel_pi(reinterpret_cast<__m64*>(dst), lo);
    _mm_storeh_pi(reinterpret_cast<__m64*>(dst + ld), lo);
    _mm_storel_pi(reinterpret_cast<__m64*>(dst + 2 * ld), hi);
    _mm_storeh_pi(reinterpret_cast<__m64*>(dst + 3 * ld), hi);
  }
  // 8 bf16 -> fp32: widen and shift into the high half (exact).
  static V load_bf16(const std::uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  static V load_f16(const std::uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static V load_i8(const std::int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  // e4m3fn as e4m3_to_float (tensor/kv_codec.hpp) gives it: each code read as a normal one,
  // 2^(e - 7) (1 + m / 8), its exponent rebased in the integer bits; a subnormal code (e = 0) read
  // so is 2^-7 (1 + m / 8), and 2 v - 2^-6 = m 2^-9 is its value, exactly (never a denormal, so
  // FTZ and DAZ change nothing). Sign-extended, bit 31 of x is the code's sign.
  static V load_e4m3(const std::uint8_t* p) {
    const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256 v = _mm256_castsi256_ps(_mm256_add_epi32(
        _mm256_and_si256(_mm256_slli_epi32(x, 20), _mm256_set1_epi32(0x07f00000)), _mm256_set1_epi32(120 << 23)));
    const __m256 subnormal =
        _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x78)), _mm256_setzero_si256()));
    const __m256 m = _mm256_blendv_ps(v, _mm256_fmsub_ps(v, _mm256_set1_ps(2.0f), _mm256_set1_ps(0x1p-6f)), subnormal);
    return _mm256_or_ps(m, _mm256_and_ps(_mm256_castsi256_ps(x), _mm256_set1_ps(-0.0f)));
  }
  static constexpr bool kMaskedFma = false;
  static void f16_to_f32(const std::uint16_t* s, float* d, std::int64_t n) {
    std::int64_t x = 0;
    for (; x + 8 <= n; x += 8)
      _mm256_storeu_ps(d + x, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + x))));
    for (; x < n; ++x) d[x] = _cvtsh_ss(s[x]);
  }
};

static_assert(IsaOps<Ops>, "Ops must provide what the engine uses (kernels/engine/isa_ops.hpp)");

using E = Engine<Ops>;

// No bf16 products at this level: bf16 inputs are widened to fp32.
void serving_item(const VarlenProblem& vp, const ServingItem& it, const ServingLayout& L, float* parts, std::int64_t NS,
                  char* ws, bool) {
  ServingItemBody<Ops>::run(vp, it, L, parts, NS, ws);
}

}  // namespace engine_avx2

const IsaKernels kIsaKernelsAvx2 = {
    "avx2",
    engine_avx2::E::flash_workspace, engine_avx2::E::flash_forward,
    engine_avx2::E::decode_workspace, engine_avx2::E::decode_forward,
    engine_avx2::E::backward_workspace, engine_avx2::E::backward,
    engine_avx2::Ops::kBq, engine_avx2::Ops::kBk,
    engine_avx2::E::exp_array,
    nullptr,
    engine_avx2::serving_item,
};

}  // namespace qkv::detail
