// qkv::detail::sgemm (src/blas/gemm.hpp): the matrix product of the layers, the models and the
// training, whose bits must not depend on the thread count.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstring>
#include <random>
#include <vector>

#include "blas/gemm.hpp"

namespace {

// detail::sgemm, the layers' matrix product: within float32 rounding of a float64 product, and
// bitwise the same on 1 and 2 threads, for every transpose, with beta, on shapes where OpenBLAS's
// own threading gave other bits (OPENBLAS_CORETYPE=Haswell on a Zen 5: [64, 128] x [128, 64]).
TEST(Gemm, BitwiseOnOneAndTwoThreadsAndAccurate) {
  struct Shape { int M, N, K; };
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int before = omp_get_max_threads();
  for (const Shape sh : {Shape{64, 64, 128}, Shape{1, 700, 64}, Shape{300, 1100, 130}, Shape{1024, 192, 64},
                         Shape{129, 513, 7}}) {
    for (const CBLAS_TRANSPOSE ta : {CblasNoTrans, CblasTrans})
      for (const CBLAS_TRANSPOSE tb : {CblasNoTrans, CblasTrans}) {
        const int M = sh.M, N = sh.N, K = sh.K;
        const int lda = ta == CblasNoTrans ? K : M, ldb = tb == CblasNoTrans ? N : K;
        std::vector<float> A(static_cast<std::size_t>(M) * K), B(static_cast<std::size_t>(K) * N),
            C0(static_cast<std::size_t>(M) * N);
        for (float& x : A) x = u(rng);
        for (float& x : B) x = u(rng);
        for (float& x : C0) x = u(rng);
        auto run = [&](int threads) {
          omp_set_num_threads(threads);
          std::vector<float> C = C0;
          qkv::detail::sgemm(ta, tb, M, N, K, 0.5f, A.data(), lda, B.data(), ldb, 2.0f, C.data(), N);
          return C;
        };
        const std::vector<float> c1 = run(1), c2 = run(2);
        omp_set_num_threads(before);
        EXPECT_EQ(std::memcmp(c1.data(), c2.data(), c1.size() * sizeof(float)), 0)
            << M << "x" << N << "x" << K << " ta " << (ta == CblasTrans) << " tb " << (tb == CblasTrans);
        double worst = 0;
        for (int i = 0; i < M; i += std::max(1, M / 17))
          for (int j = 0; j < N; j += std::max(1, N / 13)) {
            double ref = 2.0 * C0[static_cast<std::size_t>(i) * N + j], mag = std::fabs(ref);
            for (int k = 0; k < K; ++k) {
              const double a = ta == CblasNoTrans ? A[static_cast<std::size_t>(i) * lda + k] : A[static_cast<std::size_t>(k) * lda + i];
              const double b = tb == CblasNoTrans ? B[static_cast<std::size_t>(k) * ldb + j] : B[static_cast<std::size_t>(j) * ldb + k];
              ref += 0.5 * a * b;
              mag += std::fabs(0.5 * a * b);
            }
            worst = std::max(worst, std::fabs(c1[static_cast<std::size_t>(i) * N + j] - ref) / mag);
          }
        EXPECT_LE(worst, 8 * (K + 2) * 0x1p-24) << M << "x" << N << "x" << K;  // |error| <= (K + 2) u sum |terms|, u = 2^-24, with room
      }
  }
}

}  // namespace

namespace {

// Strided leading dimensions (the layers pass row pitches wider than the rows), K = 0 (C = beta C),
// beta = 0 over NaN (C is written, not scaled), a call from inside a caller's OpenMP team, and
// the OpenMP build of OpenBLAS, whose thread count sgemm sets per block.
TEST(Gemm, StridesEmptySumsBetaZeroNestedAndTheOpenMPBuild) {
  EXPECT_EQ(openblas_get_parallel(), 2) << "OpenBLAS is not its OpenMP build: sgemm cannot keep it on one thread";
  const int M = 150, N = 530, K = 70, lda = K + 5, ldb = N + 3, ldc = N + 7;
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> A(static_cast<std::size_t>(M) * lda), B(static_cast<std::size_t>(K) * ldb);
  for (float& x : A) x = u(rng);
  for (float& x : B) x = u(rng);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto run = [&](int k, float beta) {
    std::vector<float> C(static_cast<std::size_t>(M) * ldc, k == 0 ? 3.0f : nan);
    qkv::detail::sgemm(CblasNoTrans, CblasNoTrans, M, N, k, 1.0f, A.data(), lda, B.data(), ldb, beta, C.data(), ldc);
    return C;
  };
  const std::vector<float> c = run(K, 0.0f);
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; j += 37) {
      double ref = 0;
      for (int k = 0; k < K; ++k) ref += static_cast<double>(A[static_cast<std::size_t>(i) * lda + k]) * B[static_cast<std::size_t>(k) * ldb + j];
      ASSERT_NEAR(c[static_cast<std::size_t>(i) * ldc + j], ref, 1e-4) << i << "," << j;
    }
    for (int j = N; j < ldc; ++j) ASSERT_TRUE(std::isnan(c[static_cast<std::size_t>(i) * ldc + j])) << "past N: untouched";
  }
  const std::vector<float> c0 = run(0, 0.5f);  // K = 0: C = beta C
  for (int i = 0; i < M; ++i) ASSERT_EQ(c0[static_cast<std::size_t>(i) * ldc + N - 1], 1.5f);
  // from inside a team: every thread's product bitwise the one of a plain call
  std::vector<std::vector<float>> inner(2);
#pragma omp parallel num_threads(2)
  inner[static_cast<std::size_t>(omp_get_thread_num())] = run(K, 0.0f);
  for (const auto& x : inner)
    if (!x.empty()) EXPECT_EQ(std::memcmp(x.data(), c.data(), c.size() * sizeof(float)), 0);
}

}  // namespace
