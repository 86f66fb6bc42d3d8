// AVX-512 loops of the peak microbenchmarks (FMA, bf16 dot product, streaming reads).
#include <immintrin.h>

#include "peak_kernels.hpp"

namespace qkv::bench::detail {
namespace {

// Horizontal sum through memory (GCC 12's _mm512_reduce_add_ps trips -Wuninitialized).
float hsum(__m512 v) noexcept {
  alignas(64) float t[16];
  _mm512_store_ps(t, v);
  float s = 0;
  for (float x : t) s += x;
  return s;
}

}  // namespace

float fma_loop_avx512(std::int64_t iters) noexcept {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_set1_ps(static_cast<float>(c));
  // acc <- acc * a + b converges to b / (1 - a): no overflow, no denormals.
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(0.001f);
  for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
  }
  __m512 s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm512_add_ps(s, acc[c]);
  return hsum(s);
}

float bf16_loop_avx512(std::int64_t iters) noexcept {
  __m512 acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = _mm512_setzero_ps();
  // 2^-10 * 2^-10 * 2 per lane and iteration: stays far below overflow for any run length here.
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(0x1p-10f), _mm512_set1_ps(0x1p-10f));
  const __m512bh b = a;
  for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbf16_ps(acc[c], a, b);
  }
  __m512 s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm512_add_ps(s, acc[c]);
  return hsum(s);
}

float read_sum_avx512(const float* p, std::size_t n) noexcept {
  // Four accumulators hide the add latency; the loop is bound by memory, not by the adds.
  __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
  for (std::size_t i = 0; i < n; i += 64) {
    s0 = _mm512_add_ps(s0, _mm512_load_ps(p + i));
    s1 = _mm512_add_ps(s1, _mm512_load_ps(p + i + 16));
    s2 = _mm512_add_ps(s2, _mm512_load_ps(p + i + 32));
    s3 = _mm512_add_ps(s3, _mm512_load_ps(p + i + 48));
  }
  return hsum(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

}  // namespace qkv::bench::detail
