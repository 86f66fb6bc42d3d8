#pragma once
// sgemm: every float32 matrix product of the layers, the models and the training.
//
//   C = alpha op(A) op(B) + beta C   (row-major; op(A) M x K, op(B) K x N, C M x N)
//
// Its bits never depend on the thread count. OpenBLAS splits C among its threads by the thread
// count, and some of its kernels give an element other bits when it lands in another part of the
// split: with OPENBLAS_CORETYPE=Haswell on a Zen 5 (OpenBLAS 0.3.21), C = A B^T of [64, 128] x
// [128, 64] differs between 1 and 2 threads, and so did a whole training run. Here C is cut into
// blocks at fixed multiples of kGemmRows rows and kGemmCols columns, whatever the thread count;
// each block is one cblas_sgemm on one thread (the current task's OpenMP thread count set to 1,
// which OpenBLAS's OpenMP build follows), and the blocks are shared by the caller's threads.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace qkv::detail {

inline constexpr int kGemmRows = 128, kGemmCols = 512;

inline void sgemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, float alpha, const float* A, int lda,
                  const float* B, int ldb, float beta, float* C, int ldc) {
  if (M <= 0 || N <= 0) return;
  const int mb = (M + kGemmRows - 1) / kGemmRows, nb = (N + kGemmCols - 1) / kGemmCols, n = mb * nb;
  auto block = [&](int x) {
    const int m0 = x / nb * kGemmRows, n0 = x % nb * kGemmCols;
    const int m = std::min(kGemmRows, M - m0), w = std::min(kGemmCols, N - n0);
    const float* a = ta == CblasNoTrans ? A + static_cast<std::int64_t>(m0) * lda : A + m0;
    const float* b = tb == CblasNoTrans ? B + n0 : B + static_cast<std::int64_t>(n0) * ldb;
    cblas_sgemm(CblasRowMajor, ta, tb, m, w, K, alpha, a, lda, b, ldb, beta,
                C + static_cast<std::int64_t>(m0) * ldc + n0, ldc);
  };
  // Threads only where the product pays for a team (results are the same either way).
  const double flops = 2.0 * M * N * std::max(K, 1);
  const int threads = n > 1 && flops >= (1 << 22) ? std::min(omp_get_max_threads(), n) : 1;
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    {
      omp_set_num_threads(1);  // this implicit task's count: OpenBLAS runs each block on one thread
#pragma omp for schedule(dynamic)
      for (int x = 0; x < n; ++x) block(x);
    }
  } else {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    for (int x = 0; x < n; ++x) block(x);
    omp_set_num_threads(saved);
  }
}

}  // namespace qkv::detail
