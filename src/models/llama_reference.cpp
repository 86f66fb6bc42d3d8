// The float64 specification of the Llama-2 forward pass (include/qkv/llama.hpp): plain loops in
// double over the float32 weights, RoPE by apply_rope on float64 tensors (float64 angles), and the
// attention by qkv::reference::attention. Evaluated on the whole sequence at once, no cache.
#include <cmath>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/llama.hpp"
#include "qkv/reference.hpp"

namespace qkv::reference {
namespace {

// y[t, o] = sum_i x[t, i] W[o, i] for a float32 [out, in] matrix, all in double.
void matmul(const std::vector<double>& x, std::int64_t S, std::int64_t in, const TensorView& w,
            std::int64_t out, double* y, std::int64_t ldy) {
  const auto* wd = w.data_as<const float>();
  for (std::int64_t t = 0; t < S; ++t)
    for (std::int64_t o = 0; o < out; ++o) {
      double acc = 0.0;
      for (std::int64_t i = 0; i < in; ++i) acc += x[static_cast<std::size_t>(t * in + i)] * wd[o * in + i];
      y[t * ldy + o] = acc;
    }
}

std::vector<double> rmsnorm(const std::vector<double>& x, const TensorView& gain, std::int64_t S,
                            std::int64_t dim) {
  std::vector<double> y(x.size());
  const auto* g = gain.data_as<const float>();
  for (std::int64_t t = 0; t < S; ++t) {
    double ss = 0.0;
    for (std::int64_t i = 0; i < dim; ++i)
      ss += x[static_cast<std::size_t>(t * dim + i)] * x[static_cast<std::size_t>(t * dim + i)];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(dim) + Llama::rms_eps);
    for (std::int64_t i = 0; i < dim; ++i)
      y[static_cast<std::size_t>(t * dim + i)] = g[i] * (inv * x[static_cast<std::size_t>(t * dim + i)]);
  }
  return y;
}

}  // namespace

std::vector<double> llama_forward(const Llama2cModel& model, std::span<const int> tokens) {
  const Llama2cConfig& c = model.config;
  const auto S = static_cast<std::int64_t>(tokens.size());
  if (S == 0) throw Error("llama_forward: tokens: expected at least one token, got none");
  if (S > c.max_seq_len)
    throw Error("llama_forward: tokens: " + std::to_string(S) + " tokens exceed max_seq_len (" +
                std::to_string(c.max_seq_len) + ")");
  if (static_cast<int>(model.layers.size()) != c.n_layers || !model.storage)
    throw Error("llama_forward: model: expected a loaded llama2.c checkpoint, got an empty model");
  const std::int64_t dim = c.dim, kv = c.kv_dim, hid = c.hidden_dim, Hq = c.n_heads, Hkv = c.n_kv_heads,
                     D = c.head_dim, V = c.vocab_size;
  std::vector<double> x(static_cast<std::size_t>(S * dim));
  for (std::int64_t t = 0; t < S; ++t) {
    const int tok = tokens[static_cast<std::size_t>(t)];
    if (tok < 0 || tok >= V)
      throw Error("llama_forward: tokens: token " + std::to_string(t) + " is " + std::to_string(tok) +
                  ", expected an id in [0, " + std::to_string(V) + ")");
    for (std::int64_t i = 0; i < dim; ++i)
      x[static_cast<std::size_t>(t * dim + i)] = model.token_embedding.data_as<const float>()[tok * dim + i];
  }
  RopeConfig rope;
  rope.style = RopeStyle::interleaved;
  rope.theta = Llama::rope_theta;
  rope.angles = RopeAngles::f64;
  AttentionParams causal;
  causal.causal = true;
  // q [S, Hq*D], k and v [S, Hkv*D] (BSHD), seen as [1, H, S, D].
  Tensor q(DType::f64, {S, dim}), k(DType::f64, {S, kv}), v(DType::f64, {S, kv}), o(DType::f64, {S, dim});
  const TensorView qh(q.data(), DType::f64, {1, Hq, S, D}, {S * dim, D, dim, 1});
  const TensorView kh(k.data(), DType::f64, {1, Hkv, S, D}, {S * kv, D, kv, 1});
  const TensorView vh(v.data(), DType::f64, {1, Hkv, S, D}, {S * kv, D, kv, 1});
  const TensorView oh(o.data(), DType::f64, {1, Hq, S, D}, {S * dim, D, dim, 1});
  std::vector<double> h1(static_cast<std::size_t>(S * hid)), h3(h1.size()), delta(x.size());
  for (const Llama2cLayer& w : model.layers) {
    std::vector<double> xb = rmsnorm(x, w.rms_att, S, dim);
    matmul(xb, S, dim, w.wq, dim, q.data_as<double>(), dim);
    matmul(xb, S, dim, w.wk, kv, k.data_as<double>(), kv);
    matmul(xb, S, dim, w.wv, kv, v.data_as<double>(), kv);
    apply_rope(qh, 0, rope);
    apply_rope(kh, 0, rope);
    reference::attention(qh, kh, vh, oh, causal);
    const std::vector<double> att(o.data_as<double>(), o.data_as<double>() + S * dim);
    matmul(att, S, dim, w.wo, dim, delta.data(), dim);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += delta[i];
    xb = rmsnorm(x, w.rms_ffn, S, dim);
    matmul(xb, S, dim, w.w1, hid, h1.data(), hid);
    matmul(xb, S, dim, w.w3, hid, h3.data(), hid);
    for (std::size_t i = 0; i < h1.size(); ++i) h1[i] = h1[i] / (1.0 + std::exp(-h1[i])) * h3[i];
    matmul(h1, S, hid, w.w2, dim, delta.data(), dim);
    for (std::size_t i = 0; i < x.size(); ++i) x[i] += delta[i];
  }
  const std::vector<double> xf = rmsnorm(x, model.rms_final, S, dim);
  std::vector<double> logits(static_cast<std::size_t>(S * V));
  matmul(xf, S, dim, model.wcls, V, logits.data(), V);
  return logits;
}

}  // namespace qkv::reference
