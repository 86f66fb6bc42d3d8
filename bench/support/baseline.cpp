// The naive unfused baseline: per head, S = scale * Q K^T, row softmax, O = P V, with the whole
// Sq x Sk score matrix in memory. It is what attention costs without fusion: two sgemm calls of
// OpenBLAS (its best kernels for the CPU, single-threaded) and a vectorised softmax, heads in
// parallel. It computes every score, masked or not.
#include <cblas.h>
#include <omp.h>

#include <cmath>

#include "qkv/error.hpp"
#include "bench_support.hpp"
#include "baseline_common.hpp"

namespace qkv::bench {

NaiveBaseline::NaiveBaseline(const BenchShape& s, int threads)
    : shape_(s), threads_(threads < 1 ? 1 : threads) {
  scores_.resize(static_cast<std::size_t>(threads_) * static_cast<std::size_t>(s.Sq) *
                 static_cast<std::size_t>(s.Sk));
}

void NaiveBaseline::run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        bool causal) {
  const BenchShape s = shape_;
  if (q.dtype() != DType::f32 || k.dtype() != DType::f32 || v.dtype() != DType::f32 ||
      out.dtype() != DType::f32)
    throw Error("baseline: q, k, v and out must be float32");
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.D)));
  const std::int64_t group = s.Hq / s.Hkv;
  const std::int64_t heads = s.B * s.Hq;
  auto* softmax = detail::best_softmax_row();
  const float* qp = q.data_as<float>();
  const float* kp = k.data_as<float>();
  const float* vp = v.data_as<float>();
  float* op = out.data_as<float>();
  float* ws = scores_.data();

  const detail::BlasThreads one_thread_blas(1);
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1)
  for (std::int64_t bh = 0; bh < heads; ++bh) {
    const std::int64_t b = bh / s.Hq, h = bh % s.Hq, hk = h / group;
    const float* qh = qp + bh * s.Sq * s.D;
    const float* kh = kp + (b * s.Hkv + hk) * s.Sk * s.D;
    const float* vh = vp + (b * s.Hkv + hk) * s.Sk * s.D;
    float* oh = op + bh * s.Sq * s.D;
    float* sc = ws + static_cast<std::size_t>(omp_get_thread_num()) * s.Sq * s.Sk;
    const auto Sq = static_cast<blasint>(s.Sq), Sk = static_cast<blasint>(s.Sk),
               D = static_cast<blasint>(s.D);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Sq, Sk, D, scale, qh, D, kh, D, 0.0f, sc, Sk);
    for (std::int64_t i = 0; i < s.Sq; ++i) {
      std::int64_t keep = s.Sk;
      if (causal) {
        keep = i + s.Sk - s.Sq + 1;
        keep = keep < 0 ? 0 : (keep > s.Sk ? s.Sk : keep);
      }
      softmax(sc + i * s.Sk, keep, s.Sk);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Sq, D, Sk, 1.0f, sc, Sk, vh, D, 0.0f, oh, D);
  }
}

}  // namespace qkv::bench
