#pragma once
// sgemm: every float32 matrix product of the layers, the models and the training.
//
//   C = alpha op(A) op(B) + beta C   (row-major; op(A) M x K, op(B) K x N, C M x N)
//
// Its bits never depend on the thread count. OpenBLAS splits C among its threads by the thread
// count, and some of its kernels give an element other bits when it lands in another part of the
// split: with OPENBLAS_CORETYPE=Haswell on a Zen 5 (OpenBLAS 0.3.21), C = A B^T of [64, 128] x
// [128, 64] differs between 1 and 2 threads, and so did a whole training run. Here C is cut into
// blocks whose size follows from the shape alone (rows: a quarter of M in multiples of 16, from
// 16 to 128, so that a product of few rows still has blocks to share; kGemmCols columns), whatever
// the thread count; each block is one cblas_sgemm on one thread (the current task's OpenMP
// thread count set to 1, which OpenBLAS's OpenMP build follows: tests/test_gemm.cpp checks that
// build), and the blocks are shared by the caller's threads. The cost against OpenBLAS's own
// threading: op(B) is packed once per row block (a 2048^3 product took 1.10 s against 0.95 s on
// 2 threads), and a product of one block (say 128 x 512 with a long K) runs on one thread.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>

namespace qkv::detail {

inline constexpr int kGemmCols = 512;

// Rows of sgemm's blocks for M rows: a function of M only.
inline int gemm_block_rows(int M) { return std::clamp((M + 63) / 64 * 16, 16, 128); }

inline void sgemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K, float alpha, const float* A, int lda,
                  const float* B, int ldb, float beta, float* C, int ldc) {
  if (M <= 0 || N <= 0) return;
  const int R = gemm_block_rows(M);
  const int mb = (M + R - 1) / R, nb = (N + kGemmCols - 1) / kGemmCols, n = mb * nb;
  auto block = [&](int x) {
    const int m0 = x / nb * R, n0 = x % nb * kGemmCols;
    const int m = std::min(R, M - m0), w = std::min(kGemmCols, N - n0);
    const float* a = ta == CblasNoTrans ? A + static_cast<std::int64_t>(m0) * lda : A + m0;
    const float* b = tb == CblasNoTrans ? B + n0 : B + static_cast<std::int64_t>(n0) * ldb;
    cblas_sgemm(CblasRowMajor, ta, tb, m, w, K, alpha, a, lda, b, ldb, beta,
                C + static_cast<std::int64_t>(m0) * ldc + n0, ldc);
  };
  // Threads only where the product pays for a team (results are the same either way).
  const double flops = 2.0 * M * N * std::max(K, 1);
  // Inside a caller's team (the training study's parallel runs): one thread per product.
  const int threads = n > 1 && flops >= (1 << 22) && !omp_in_parallel() ? std::min(omp_get_max_threads(), n) : 1;
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
