// The naive backward baseline: the gradients of attention with the whole Sq x Sk probability
// matrix in memory, as five sgemm calls of OpenBLAS (single-threaded) per query head and two row
// passes, (batch, KV head) pairs in parallel. It recomputes P from Q and K (it keeps nothing from
// the forward but O), and computes every score, masked or not.
#include <cblas.h>
#include <omp.h>

#include <cmath>

#include "qkv/error.hpp"
#include "bench_support.hpp"
#include "baseline_common.hpp"

namespace qkv::bench {

NaiveBackwardBaseline::NaiveBackwardBaseline(const BenchShape& s, int threads)
    : shape_(s), threads_(threads < 1 ? 1 : threads) {
  const std::size_t per = static_cast<std::size_t>(s.Sq) * static_cast<std::size_t>(s.Sk);
  probs_.resize(static_cast<std::size_t>(threads_) * per);
  dprobs_.resize(static_cast<std::size_t>(threads_) * per);
  rowdot_.resize(static_cast<std::size_t>(threads_) * static_cast<std::size_t>(s.Sq));
}

void NaiveBackwardBaseline::run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                const Tensor& grad_out, const Tensor& grad_q, const Tensor& grad_k,
                                const Tensor& grad_v, bool causal) {
  const BenchShape s = shape_;
  for (const Tensor* t : {&q, &k, &v, &out, &grad_out, &grad_q, &grad_k, &grad_v})
    if (t->dtype() != DType::f32) throw Error("backward baseline: every tensor must be float32");
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.D)));
  const std::int64_t group = s.Hq / s.Hkv;
  const std::int64_t units = s.B * s.Hkv;
  auto* softmax = detail::best_softmax_row();
  const float* qp = q.data_as<float>();
  const float* kp = k.data_as<float>();
  const float* vp = v.data_as<float>();
  const float* op = out.data_as<float>();
  const float* dop = grad_out.data_as<float>();
  float* dqp = grad_q.data_as<float>();
  float* dkp = grad_k.data_as<float>();
  float* dvp = grad_v.data_as<float>();
  const std::size_t per = static_cast<std::size_t>(s.Sq) * static_cast<std::size_t>(s.Sk);

  const detail::BlasThreads one_thread_blas(1);
#pragma omp parallel for num_threads(threads_) schedule(dynamic, 1)
  for (std::int64_t u = 0; u < units; ++u) {
    const std::int64_t b = u / s.Hkv, hk = u % s.Hkv;
    const std::size_t t = static_cast<std::size_t>(omp_get_thread_num());
    float* P = probs_.data() + t * per;
    float* dS = dprobs_.data() + t * per;
    float* Di = rowdot_.data() + t * static_cast<std::size_t>(s.Sq);
    const float* kh = kp + u * s.Sk * s.D;
    const float* vh = vp + u * s.Sk * s.D;
    float* dkh = dkp + u * s.Sk * s.D;
    float* dvh = dvp + u * s.Sk * s.D;
    const auto Sq = static_cast<blasint>(s.Sq), Sk = static_cast<blasint>(s.Sk), D = static_cast<blasint>(s.D);
    for (std::int64_t g = 0; g < group; ++g) {
      const std::int64_t bh = b * s.Hq + hk * group + g;
      const float* qh = qp + bh * s.Sq * s.D;
      const float* oh = op + bh * s.Sq * s.D;
      const float* doh = dop + bh * s.Sq * s.D;
      float* dqh = dqp + bh * s.Sq * s.D;
      // dK and dV of the KV head sum over the query heads of its group.
      const float beta = g == 0 ? 0.0f : 1.0f;
      // P = softmax(scale Q K^T), causal rows masked after computing every score.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Sq, Sk, D, scale, qh, D, kh, D, 0.0f, P, Sk);
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        std::int64_t keep = s.Sk;
        if (causal) {
          keep = i + s.Sk - s.Sq + 1;
          keep = keep < 0 ? 0 : (keep > s.Sk ? s.Sk : keep);
        }
        softmax(P + i * s.Sk, keep, s.Sk);
      }
      // dV += P^T dO
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Sk, D, Sq, 1.0f, P, Sk, doh, D, beta, dvh, D);
      // dP = dO V^T
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, Sq, Sk, D, 1.0f, doh, D, vh, D, 0.0f, dS, Sk);
      // D_i = rowsum(dO * O); dS = P * (dP - D_i) * scale, in place of dP.
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        float acc = 0.0f;
        const float* o = oh + i * s.D;
        const float* d = doh + i * s.D;
#pragma omp simd reduction(+ : acc)
        for (std::int64_t c = 0; c < s.D; ++c) acc += o[c] * d[c];
        Di[i] = acc;
      }
      for (std::int64_t i = 0; i < s.Sq; ++i) {
        float* row = dS + i * s.Sk;
        const float* p = P + i * s.Sk;
        const float di = Di[i];
#pragma omp simd
        for (std::int64_t j = 0; j < s.Sk; ++j) row[j] = p[j] * (row[j] - di) * scale;
      }
      // dQ = dS K;  dK += dS^T Q
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, Sq, D, Sk, 1.0f, dS, Sk, kh, D, 0.0f, dqh, D);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, Sk, D, Sq, 1.0f, dS, Sk, qh, D, beta, dkh, D);
    }
  }
}

}  // namespace qkv::bench
