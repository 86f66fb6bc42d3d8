#pragma once
// What the naive baselines (baseline.cpp, baseline_backward.cpp) and the SGEMM rate (sgemm_rate.cpp)
// share: the row softmax for this CPU, and OpenBLAS held to a thread count for a while (one while
// the baselines' own OpenMP threads run the sgemm calls).
#include <cblas.h>
#include <omp.h>

#include "platform/cpu_features.hpp"
#include "softmax.hpp"

namespace qkv::bench::detail {

/// softmax_row_avx512 where the CPU has AVX-512 (and the build is x86-64), else the generic one.
inline auto best_softmax_row() noexcept {
#if defined(QKV_BENCH_X86)
  return qkv::detail::cpu_features().avx512() ? &softmax_row_avx512 : &softmax_row_generic;
#else
  return &softmax_row_generic;
#endif
}

/// For its lifetime, every sgemm runs on `threads` OpenBLAS threads. The baselines use 1: with
/// one thread their parallel region is inactive and OpenBLAS would thread the sgemm itself. In
/// OpenBLAS's OpenMP build setting its threads also sets OpenMP's default team size, so both are
/// restored afterwards.
class BlasThreads {
 public:
  explicit BlasThreads(int threads) : blas_(openblas_get_num_threads()), omp_(omp_get_max_threads()) {
    openblas_set_num_threads(threads);
  }
  ~BlasThreads() {
    openblas_set_num_threads(blas_);
    omp_set_num_threads(omp_);
  }
  BlasThreads(const BlasThreads&) = delete;
  BlasThreads& operator=(const BlasThreads&) = delete;

 private:
  int blas_, omp_;
};

}  // namespace qkv::bench::detail
