// One training run: a fresh batch per step, forward and backward, global-norm clipping, AdamW
// (Loshchilov & Hutter 2019, Algorithm 2, with Adam's bias correction; Kingma & Ba 2015). The
// norms are summed in double in parameter order, so they do not depend on threads either.
#include <chrono>
#include <cmath>
#include <string>

#include "qkv/error.hpp"
#include "qkv/train.hpp"
#include "tensor/random.hpp"

namespace qkv::train {
using detail::mix;
namespace {

double sum_squares(const TensorView& t) {
  double s = 0;
  const float* p = t.data_as<const float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) s += static_cast<double>(p[i]) * p[i];
  return s;
}

TrainConfig resolved(TrainConfig c) {
  check_task(c.task);
  c.model.vocab = vocab_size(c.task);
  c.model.seq_len = seq_len(c.task);
  auto need = [](bool ok, const std::string& field, const std::string& want, double got) {
    if (!ok) throw Error("train: " + field + ": expected " + want + ", got " + std::to_string(got));
  };
  need(c.steps >= 0, "steps", ">= 0", static_cast<double>(c.steps));
  need(c.batch >= 1 && c.batch <= 65536, "batch", "1 .. 65536", static_cast<double>(c.batch));
  need(c.warmup >= 0, "warmup", ">= 0", static_cast<double>(c.warmup));
  need(c.lr > 0 && std::isfinite(c.lr), "lr", "a finite number > 0", c.lr);
  need(c.beta1 >= 0 && c.beta1 < 1, "beta1", "[0, 1)", c.beta1);
  need(c.beta2 >= 0 && c.beta2 < 1, "beta2", "[0, 1)", c.beta2);
  need(c.eps > 0 && std::isfinite(c.eps), "eps", "a finite number > 0", c.eps);
  need(c.weight_decay >= 0 && std::isfinite(c.weight_decay), "weight_decay", "a finite number >= 0", c.weight_decay);
  need(c.clip >= 0 && std::isfinite(c.clip), "clip", "a finite number >= 0 (0: no clipping)", c.clip);
  need(c.threads >= 0, "threads", ">= 0", c.threads);
  return c;
}

}  // namespace

Trainer::Trainer(const TrainConfig& config)
    : cfg_(resolved(config)), model_(cfg_.model, mix(cfg_.seed, 1)), params_(model_.parameters()) {
  for (const Param& p : params_) {
    m_.emplace_back(static_cast<std::size_t>(p.value.numel()), 0.0f);
    v_.emplace_back(static_cast<std::size_t>(p.value.numel()), 0.0f);
  }
}

StepStats Trainer::step() {
  const Batch batch = make_batch(cfg_.task, cfg_.batch, mix(cfg_.seed, 2), static_cast<std::uint64_t>(t_));
  StepStats st = model_.forward_backward(batch, cfg_.attention_stats, cfg_.threads);
  const auto t0 = std::chrono::steady_clock::now();
  double total = 0;
  for (const Param& p : params_) {
    const double s = sum_squares(p.grad);
    total += s;
    if (p.name.ends_with("attn.in_proj_weight")) {
      // Its rows: W_Q, then W_K, then W_V (mha.hpp); the gradients' views split them the same way.
      const std::int64_t qk = model_.config().num_heads * model_.config().d_k * model_.config().d_model;
      const float* g = p.grad.data_as<const float>();
      for (std::int64_t i = 0; i < qk; ++i) st.grad_wq += static_cast<double>(g[i]) * g[i];
      for (std::int64_t i = qk; i < 2 * qk; ++i) st.grad_wk += static_cast<double>(g[i]) * g[i];
    }
  }
  st.grad_norm = std::sqrt(total);
  st.grad_wq = std::sqrt(st.grad_wq);
  st.grad_wk = std::sqrt(st.grad_wk);
  const double clip = cfg_.clip > 0 && st.grad_norm > cfg_.clip ? cfg_.clip / st.grad_norm : 1.0;

  ++t_;
  const double lr = cfg_.lr * (cfg_.warmup > 0 ? std::min(1.0, static_cast<double>(t_) / static_cast<double>(cfg_.warmup)) : 1.0);
  const double bc1 = 1 - std::pow(cfg_.beta1, static_cast<double>(t_));
  const double bc2 = 1 - std::pow(cfg_.beta2, static_cast<double>(t_));
  for (std::size_t k = 0; k < params_.size(); ++k) {
    const Param& p = params_[k];
    float* w = p.value.data_as<float>();
    const float* g = p.grad.data_as<const float>();
    float* m = m_[k].data();
    float* v = v_[k].data();
    const double decay = p.decay ? 1 - lr * cfg_.weight_decay : 1.0;
    for (std::int64_t i = 0; i < p.value.numel(); ++i) {
      const double gi = g[i] * clip;
      m[i] = static_cast<float>(cfg_.beta1 * m[i] + (1 - cfg_.beta1) * gi);
      v[i] = static_cast<float>(cfg_.beta2 * v[i] + (1 - cfg_.beta2) * gi * gi);
      const double mh = m[i] / bc1, vh = v[i] / bc2;
      w[i] = static_cast<float>(w[i] * decay - lr * mh / (std::sqrt(vh) + cfg_.eps));
    }
  }
  opt_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return st;
}

}  // namespace qkv::train
