// Row softmax for the naive baseline (portable build). Compiled with -ffast-math: the scores are
// finite and masked keys are never passed to expf, so the fast-math assumptions hold.
#include <cmath>

#include "softmax.hpp"

#ifndef QKV_SOFTMAX_NAME
#define QKV_SOFTMAX_NAME softmax_row_generic
#endif

namespace qkv::bench::detail {

void QKV_SOFTMAX_NAME(float* row, std::int64_t keep, std::int64_t n) noexcept {
  for (std::int64_t j = keep; j < n; ++j) row[j] = 0.0f;
  if (keep <= 0) return;
  float m = row[0];
  for (std::int64_t j = 1; j < keep; ++j) m = row[j] > m ? row[j] : m;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (std::int64_t j = 0; j < keep; ++j) {
    const float e = expf(row[j] - m);
    row[j] = e;
    sum += e;
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (std::int64_t j = 0; j < keep; ++j) row[j] *= inv;
}

}  // namespace qkv::bench::detail
