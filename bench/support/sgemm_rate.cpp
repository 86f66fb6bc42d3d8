// The SGEMM rate of the OpenBLAS that qkv links: a bound for the compute rows next to the FMA
// peak loop (a matrix product has to load its operands; the loop never does).
#include <cblas.h>

#include <random>
#include <vector>

#include "baseline_common.hpp"
#include "bench_support.hpp"

namespace qkv::bench {

SgemmRate measure_sgemm(int threads, int n, int repeats) {
  SgemmRate r;
  r.threads = threads < 1 ? 1 : threads;
  r.n = n < 1 ? 1 : n;
  const std::size_t nn = static_cast<std::size_t>(r.n) * static_cast<std::size_t>(r.n);
  std::vector<float> a(nn), b(nn), c(nn);
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (std::size_t i = 0; i < nn; ++i) {
    a[i] = dist(rng);
    b[i] = dist(rng);
  }
  const detail::BlasThreads blas_threads(r.threads);
  const auto m = static_cast<blasint>(r.n);
  const std::vector<double> t = time_runs(
      [&] { cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, m, m, m, 1.0f, a.data(), m, b.data(), m, 0.0f, c.data(), m); },
      repeats, 30.0);
  r.runs = static_cast<int>(t.size());
  r.seconds = median(t);
  r.gflops = 2.0 * double(r.n) * double(r.n) * double(r.n) / r.seconds * 1e-9;
  return r;
}

}  // namespace qkv::bench
