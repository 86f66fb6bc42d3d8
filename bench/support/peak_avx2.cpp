// AVX2 FMA loop of the peak microbenchmark, for CPUs without AVX-512.
#include <immintrin.h>

#include "peak_kernels.hpp"

namespace qkv::bench::detail {

float fma_loop_avx2(std::int64_t iters) noexcept {
  __m256 acc[kChainsAvx2];
  for (int c = 0; c < kChainsAvx2; ++c) acc[c] = _mm256_set1_ps(static_cast<float>(c));
  const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(0.001f);
  for (std::int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < kChainsAvx2; ++c) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
  }
  __m256 s = acc[0];
  for (int c = 1; c < kChainsAvx2; ++c) s = _mm256_add_ps(s, acc[c]);
  alignas(32) float t[8];
  _mm256_store_ps(t, s);
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}

}  // namespace qkv::bench::detail
