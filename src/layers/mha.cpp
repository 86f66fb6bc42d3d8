// Multi-head attention layer (Vaswani et al. 2017, sec. 3.2.2) with GQA, RoPE and a KV cache.
// Projections are detail::sgemm calls (blas/gemm.hpp) on [B*S, features] row blocks; the heads are strided views
// of the projection buffers (BSHD storage seen as BHSD), so nothing is transposed or copied
// between the GEMMs and the attention call.
#include "qkv/mha.hpp"


#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "blas/gemm.hpp"
#include "layers/mha_common.hpp"
#include "qkv/error.hpp"
#include "tensor/convert.hpp"

namespace qkv {
namespace mha_detail {

// Pitch (elements) between consecutive flattened (b, s) rows of a [B, S, width] layout with
// strides s0, s1, or 0 if the rows are not evenly spaced at >= width apart.
std::int64_t row_pitch(std::int64_t B, std::int64_t S, std::int64_t s0, std::int64_t s1, std::int64_t width) {
  std::int64_t pitch = 0;
  if (B * S <= 1)
    pitch = width;
  else if (S == 1)
    pitch = s0;
  else if (B == 1 || s0 == S * s1)
    pitch = s1;
  return pitch >= width ? pitch : 0;
}

// c[b, s, :] = x[b, s, :] W^T + bias for a [B, S, K] view x (contiguous last dim) and a
// [B, S, N] destination with strides (sbc, ldc, 1). One GEMM over all B*S rows when both sides
// are evenly spaced, else one per batch row.
void linear(const TensorView& x, const float* w, std::int64_t ldw, std::int64_t N, const float* bias,
            float* c, std::int64_t sbc, std::int64_t ldc) {
  const std::int64_t B = x.size(0), S = x.size(1), K = x.size(2);
  if (B == 0 || S == 0 || N == 0) return;
  const auto* xd = x.data_as<const float>();
  const std::int64_t xp = row_pitch(B, S, x.stride(0), x.stride(1), K), cp = row_pitch(B, S, sbc, ldc, N);
  auto gemm = [&](const float* a, std::int64_t lda, float* cb, std::int64_t ldcb, std::int64_t M) {
    for (std::int64_t r = 0; r < M; ++r) {
      if (bias)
        std::memcpy(cb + r * ldcb, bias, static_cast<std::size_t>(N) * sizeof(float));
      else
        std::fill(cb + r * ldcb, cb + r * ldcb + N, 0.0f);
    }
    qkv::detail::sgemm(CblasNoTrans, CblasTrans, static_cast<int>(M), static_cast<int>(N),
                static_cast<int>(K), 1.0f, a, static_cast<int>(lda), w, static_cast<int>(ldw), 1.0f, cb,
                static_cast<int>(ldcb));
  };
  if (xp && cp) {
    gemm(xd, xp, c, cp, B * S);
    return;
  }
  // Per batch row: within a batch the rows are S apart at stride(1) (>= width, checked), or a single row.
  for (std::int64_t b = 0; b < B; ++b)
    gemm(xd + b * x.stride(0), S > 1 ? x.stride(1) : K, c + b * sbc, S > 1 ? ldc : N, S);
}

void check_act(const TensorView& t, const char* name, const char* axes, std::int64_t d_model) {
  if (t.rank() != 3)
    throw Error(std::string("mha: ") + name + ": expected a 3-D tensor " + axes + ", got shape " +
                shape_str(t.shape()));
  if (t.dtype() != DType::f32)
    throw Error(std::string("mha: ") + name + ": expected dtype float32, got " +
                std::string(dtype_name(t.dtype())));
  if (t.size(2) > 1 && t.stride(2) != 1)
    throw Error(std::string("mha: ") + name +
                ": expected a contiguous last dimension (stride 1), got stride " + std::to_string(t.stride(2)));
  if (t.size(2) != d_model)
    throw Error(std::string("mha: ") + name + ": expected " + axes + " with d_model == " + std::to_string(d_model) +
                ", got d_model = " + std::to_string(t.size(2)) + " in shape " + shape_str(t.shape()));
  for (int a = 0; a < 2; ++a)
    if (t.stride(a) < 0) throw Error(std::string("mha: ") + name + ": negative strides are not supported");
  if (t.size(1) > 1 && t.stride(1) < t.size(2))
    throw Error(std::string("mha: ") + name + ": rows overlap (stride of S " + std::to_string(t.stride(1)) +
                " < d_model)");
  if (t.size(1) > std::numeric_limits<int>::max() / std::max<std::int64_t>(1, t.size(0)) ||
      t.size(2) > std::numeric_limits<int>::max() || t.stride(0) > std::numeric_limits<int>::max() ||
      t.stride(1) > std::numeric_limits<int>::max())
    throw Error(std::string("mha: ") + name + ": shape " + shape_str(t.shape()) +
                " exceeds the BLAS int range");
  checked_numel(t.shape(), 4, name);
  if (!t.data() && t.numel() > 0) throw Error(std::string("mha: ") + name + ": data pointer is null");
}

std::vector<std::int64_t> iota_positions(std::int64_t S) {
  std::vector<std::int64_t> p(static_cast<std::size_t>(S));
  std::iota(p.begin(), p.end(), std::int64_t{0});
  return p;
}

TensorView heads_view(const Tensor& t, std::int64_t H) {
  const std::int64_t B = t.shape()[0], S = t.shape()[1], W = t.shape()[2], d = W / H;
  return TensorView(t.data(), DType::f32, {B, H, S, d}, {std::max<std::int64_t>(S, 1) * W, d, W, 1});
}

QkvHeads project_self(const TensorView& x, const TensorView& w_in, const float* b_in, const MhaConfig& cfg) {
  const std::int64_t B = x.size(0), S = x.size(1), N = w_in.size(0);
  const std::int64_t Hq = cfg.num_heads, Hkv = cfg.num_kv_heads, D = cfg.head_dim, Dv = cfg.head_dim_v;
  QkvHeads r{Tensor(DType::f32, {B, S, N}), Tensor(), {}, {}, {}};
  linear(x, w_in.data_as<const float>(), cfg.d_model, N, b_in, r.pq.data_as<float>(), S * N, N);
  float* pd = r.pq.data_as<float>();
  r.q = TensorView(pd, DType::f32, {B, Hq, S, D}, {S * N, D, N, 1});
  r.k = TensorView(pd + Hq * D, DType::f32, {B, Hkv, S, D}, {S * N, D, N, 1});
  r.v = TensorView(pd + Hq * D + Hkv * D, DType::f32, {B, Hkv, S, Dv}, {S * N, Dv, N, 1});
  return r;
}

QkvHeads project_cross(const TensorView& x_q, const TensorView& x_kv, const TensorView& w_in,
                       const float* b_in, const MhaConfig& cfg) {
  const std::int64_t B = x_q.size(0), Sq = x_q.size(1), Sk = x_kv.size(1);
  const std::int64_t Hq = cfg.num_heads, Hkv = cfg.num_kv_heads, D = cfg.head_dim, Dv = cfg.head_dim_v;
  const std::int64_t Nq = Hq * D, Nkv = Hkv * (D + Dv);
  const float* w = w_in.data_as<const float>();
  QkvHeads r{Tensor(DType::f32, {B, Sq, Nq}), Tensor(DType::f32, {B, Sk, Nkv}), {}, {}, {}};
  linear(x_q, w, cfg.d_model, Nq, b_in, r.pq.data_as<float>(), Sq * Nq, Nq);
  // W_K and W_V are adjacent rows of the packed matrix: one GEMM for both.
  linear(x_kv, w + Nq * cfg.d_model, cfg.d_model, Nkv, b_in ? b_in + Nq : nullptr, r.pkv.data_as<float>(),
         Sk * Nkv, Nkv);
  r.q = TensorView(r.pq.data(), DType::f32, {B, Hq, Sq, D}, {Sq * Nq, D, Nq, 1});
  r.k = TensorView(r.pkv.data(), DType::f32, {B, Hkv, Sk, D}, {Sk * Nkv, D, Nkv, 1});
  r.v = TensorView(r.pkv.data_as<float>() + Hkv * D, DType::f32, {B, Hkv, Sk, Dv}, {Sk * Nkv, Dv, Nkv, 1});
  return r;
}

RopePositions::RopePositions(const MhaOptions& o, std::int64_t Sq, std::int64_t Sk, bool self)
    : q_opt_(o.q_positions), k_opt_(o.k_positions), self_(self) {
  if (q_opt_.empty()) q_def_ = iota_positions(Sq);
  if (k_opt_.empty() && !self) k_def_ = iota_positions(Sk);
}
std::span<const std::int64_t> RopePositions::q() const {
  return q_opt_.empty() ? std::span<const std::int64_t>(q_def_) : q_opt_;
}
std::span<const std::int64_t> RopePositions::k() const {
  if (!k_opt_.empty()) return k_opt_;
  return self_ ? q() : std::span<const std::int64_t>(k_def_);
}

}  // namespace mha_detail

namespace {
using mha_detail::check_act;
using mha_detail::linear;

// Self-attention input x and output y: both [B,S,d_model] float32, the same B and S.
void check_self_io(const TensorView& x, const TensorView& y, std::int64_t d_model) {
  check_act(x, "x", "[B,S,d_model]", d_model);
  check_act(y, "y", "[B,S,d_model]", d_model);
  const std::int64_t B = x.size(0), S = x.size(1);
  if (y.size(0) != B || y.size(1) != S)
    throw Error("mha: y: expected shape [B,S,d_model] = " + shape_str({B, S, d_model}) + ", got " +
                shape_str(y.shape()));
}

// Averages probs [B,Hq,Sq,Sk] over the heads into dst [B,Sq,Sk] (any strides).
void average_heads(const Tensor& all, const TensorView& dst) {
  const std::int64_t B = all.shape()[0], H = all.shape()[1], Sq = all.shape()[2], Sk = all.shape()[3];
  const auto* p = all.data_as<const float>();
  auto* d = dst.data_as<float>();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < Sq; ++i)
      for (std::int64_t j = 0; j < Sk; ++j) {
        double acc = 0.0;
        for (std::int64_t h = 0; h < H; ++h) acc += p[((b * H + h) * Sq + i) * Sk + j];
        d[b * dst.stride(0) + i * dst.stride(1) + j * dst.stride(2)] =
            static_cast<float>(acc / static_cast<double>(H));
      }
}

// Attention weights requested averaged over the heads are computed per head into a scratch
// tensor, then averaged into the caller's [B, Sq, Sk] view.
struct ProbsPlan {
  std::optional<Tensor> all;
  std::optional<TensorView> view;  // what qkv::attention() writes
};

ProbsPlan plan_probs(const MhaOptions& o, std::int64_t B, std::int64_t Hq, std::int64_t Sq, std::int64_t Sk,
                     const char* sk_note) {
  ProbsPlan plan;
  plan.view = o.probs;
  if (!o.probs || !o.average_heads) return plan;
  const TensorView& p = *o.probs;
  if (p.rank() != 3 || p.size(0) != B || p.size(1) != Sq || p.size(2) != Sk)
    throw Error("mha: probs: expected shape [B,Sq,Sk] = " + shape_str({B, Sq, Sk}) + " (averaged over heads" +
                sk_note + "), got " + shape_str(p.shape()));
  if (p.dtype() != DType::f32)
    throw Error("mha: probs: expected dtype float32, got " + std::string(dtype_name(p.dtype())));
  if (!p.data() && p.numel() > 0) throw Error("mha: probs: data pointer is null");
  plan.all.emplace(DType::f32, Shape{B, Hq, Sq, Sk});
  plan.view = plan.all->view();
  return plan;
}

void finish_probs(const ProbsPlan& plan, const MhaOptions& o) {
  if (plan.all) average_heads(*plan.all, *o.probs);
}

}  // namespace

MultiHeadAttention::MultiHeadAttention(const MhaConfig& config) : cfg_(config) {
  if (cfg_.d_model < 1) throw Error("mha: d_model: expected >= 1, got " + std::to_string(cfg_.d_model));
  if (cfg_.num_heads < 1) throw Error("mha: num_heads: expected Hq >= 1, got " + std::to_string(cfg_.num_heads));
  if (cfg_.num_kv_heads < 0)
    throw Error("mha: num_kv_heads: expected Hkv >= 0 (0 = Hq), got " + std::to_string(cfg_.num_kv_heads));
  if (cfg_.num_kv_heads == 0) cfg_.num_kv_heads = cfg_.num_heads;
  if (cfg_.num_heads % cfg_.num_kv_heads != 0)
    throw Error("mha: num_kv_heads: expected Hq % Hkv == 0 (grouped-query attention), got Hq = " +
                std::to_string(cfg_.num_heads) + ", Hkv = " + std::to_string(cfg_.num_kv_heads));
  if (cfg_.head_dim < 0 || cfg_.head_dim_v < 0)
    throw Error("mha: head_dim: expected D, Dv >= 0 (0 = default), got D = " + std::to_string(cfg_.head_dim) +
                ", Dv = " + std::to_string(cfg_.head_dim_v));
  if (cfg_.head_dim == 0) {
    if (cfg_.d_model % cfg_.num_heads != 0)
      throw Error("mha: head_dim: d_model (" + std::to_string(cfg_.d_model) + ") is not divisible by num_heads (" +
                  std::to_string(cfg_.num_heads) + "); give head_dim explicitly");
    cfg_.head_dim = cfg_.d_model / cfg_.num_heads;
  }
  if (cfg_.head_dim_v == 0) cfg_.head_dim_v = cfg_.head_dim;
  if (cfg_.rope) {
    const std::int64_t R = cfg_.rope->rotary_dim ? cfg_.rope->rotary_dim : cfg_.head_dim;
    if (R < 0 || R % 2 || R > cfg_.head_dim)
      throw Error("mha: rope.rotary_dim: expected an even number in [0, D] = [0, " + std::to_string(cfg_.head_dim) +
                  "] (0 = D), got " + std::to_string(R));
    if (!std::isfinite(cfg_.rope->theta) || cfg_.rope->theta <= 0)
      throw Error("mha: rope.theta: expected a finite number > 0, got " + std::to_string(cfg_.rope->theta));
  }
  const std::int64_t Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads, D = cfg_.head_dim, Dv = cfg_.head_dim_v;
  const std::int64_t n_in = Hq * D + Hkv * D + Hkv * Dv;
  checked_numel({n_in, cfg_.d_model}, 4, "mha: in_proj_weight");
  checked_numel({cfg_.d_model, Hq * Dv}, 4, "mha: out_proj.weight");
  w_in_ = Tensor(DType::f32, {n_in, cfg_.d_model});
  w_o_ = Tensor(DType::f32, {cfg_.d_model, Hq * Dv});
  if (cfg_.qkv_bias) b_in_ = Tensor(DType::f32, {n_in});
  if (cfg_.out_bias) b_o_ = Tensor(DType::f32, {cfg_.d_model});
  if (cfg_.sinks) sinks_ = Tensor(DType::f32, {Hq});
  if (cfg_.alibi) {
    const std::vector<float> slopes = qkv::alibi_slopes(Hq);
    alibi_ = Tensor(DType::f32, {Hq});
    std::copy(slopes.begin(), slopes.end(), alibi_.data_as<float>());
  }
}

TensorView MultiHeadAttention::sinks() const { return cfg_.sinks ? sinks_.view() : TensorView(); }

AttentionParams MultiHeadAttention::attention_params(const MhaOptions& options) const {
  AttentionParams p = options.attention;
  if (cfg_.sinks) {
    if (p.sinks)
      throw Error("mha: options.attention.sinks: expected none, the layer has its own sinks (config().sinks)");
    p.sinks = sinks_.view();
  }
  if (cfg_.alibi) {
    if (p.alibi_slopes)
      throw Error("mha: options.attention.alibi_slopes: expected none, the layer has its own ALiBi slopes "
                  "(config().alibi)");
    p.alibi_slopes = alibi_.view();
  }
  return p;
}

TensorView MultiHeadAttention::w_q() const {
  return TensorView(w_in_.data(), DType::f32, {cfg_.num_heads * cfg_.head_dim, cfg_.d_model});
}
TensorView MultiHeadAttention::w_k() const {
  return TensorView(w_in_.data_as<float>() + cfg_.num_heads * cfg_.head_dim * cfg_.d_model, DType::f32,
                    {cfg_.num_kv_heads * cfg_.head_dim, cfg_.d_model});
}
TensorView MultiHeadAttention::w_v() const {
  return TensorView(
      w_in_.data_as<float>() + (cfg_.num_heads + cfg_.num_kv_heads) * cfg_.head_dim * cfg_.d_model,
      DType::f32, {cfg_.num_kv_heads * cfg_.head_dim_v, cfg_.d_model});
}
TensorView MultiHeadAttention::w_o() const { return w_o_.view(); }
TensorView MultiHeadAttention::in_proj_bias() const { return cfg_.qkv_bias ? b_in_.view() : TensorView(); }
TensorView MultiHeadAttention::b_q() const {
  if (!cfg_.qkv_bias) return {};
  return TensorView(b_in_.data(), DType::f32, {cfg_.num_heads * cfg_.head_dim});
}
TensorView MultiHeadAttention::b_k() const {
  if (!cfg_.qkv_bias) return {};
  return TensorView(b_in_.data_as<float>() + cfg_.num_heads * cfg_.head_dim, DType::f32,
                    {cfg_.num_kv_heads * cfg_.head_dim});
}
TensorView MultiHeadAttention::b_v() const {
  if (!cfg_.qkv_bias) return {};
  return TensorView(b_in_.data_as<float>() + (cfg_.num_heads + cfg_.num_kv_heads) * cfg_.head_dim, DType::f32,
                    {cfg_.num_kv_heads * cfg_.head_dim_v});
}
TensorView MultiHeadAttention::b_o() const { return cfg_.out_bias ? b_o_.view() : TensorView(); }

void MultiHeadAttention::forward(const TensorView& x, const TensorView& y, const MhaOptions& options) const {
  if (cfg_.d_model < 1) throw Error("mha: the layer is default-constructed (no config, no weights)");
  check_self_io(x, y, cfg_.d_model);
  const std::int64_t B = x.size(0), S = x.size(1);
  const std::int64_t Hq = cfg_.num_heads, Dv = cfg_.head_dim_v;
  const mha_detail::QkvHeads heads =
      mha_detail::project_self(x, w_in_, cfg_.qkv_bias ? b_in_.data_as<const float>() : nullptr, cfg_);
  const TensorView &q = heads.q, &k = heads.k, &v = heads.v;
  if (cfg_.rope) {
    const mha_detail::RopePositions pos(options, S, S, true);
    apply_rope(q, pos.q(), *cfg_.rope);
    apply_rope(k, pos.k(), *cfg_.rope);
  }
  Tensor o(DType::f32, {B, S, Hq * Dv});
  const TensorView ov = mha_detail::heads_view(o, Hq);
  const ProbsPlan probs = plan_probs(options, B, Hq, S, S, "");
  attention(q, k, v, ov, attention_params(options), std::nullopt, probs.view);
  finish_probs(probs, options);
  linear(o.view(), w_o_.data_as<const float>(), Hq * Dv, cfg_.d_model,
         cfg_.out_bias ? b_o_.data_as<const float>() : nullptr, y.data_as<float>(), y.stride(0), y.stride(1));
}

void MultiHeadAttention::forward(const TensorView& x_q, const TensorView& x_kv, const TensorView& y,
                                 const MhaOptions& options) const {
  if (cfg_.d_model < 1) throw Error("mha: the layer is default-constructed (no config, no weights)");
  check_act(x_q, "x_q", "[B,Sq,d_model]", cfg_.d_model);
  check_act(x_kv, "x_kv", "[B,Sk,d_model]", cfg_.d_model);
  check_act(y, "y", "[B,Sq,d_model]", cfg_.d_model);
  const std::int64_t B = x_q.size(0), Sq = x_q.size(1), Sk = x_kv.size(1);
  if (x_kv.size(0) != B)
    throw Error("mha: x_kv: expected [B,Sk,d_model] with B == x_q.B (" + std::to_string(B) + "), got shape " +
                shape_str(x_kv.shape()));
  if (y.size(0) != B || y.size(1) != Sq)
    throw Error("mha: y: expected shape [B,Sq,d_model] = " + shape_str({B, Sq, cfg_.d_model}) + ", got " +
                shape_str(y.shape()));
  const std::int64_t Hq = cfg_.num_heads, Dv = cfg_.head_dim_v;
  const float* b_in = cfg_.qkv_bias ? b_in_.data_as<const float>() : nullptr;
  const mha_detail::QkvHeads heads = mha_detail::project_cross(x_q, x_kv, w_in_, b_in, cfg_);
  const TensorView &q = heads.q, &k = heads.k, &v = heads.v;
  if (cfg_.rope) {
    const mha_detail::RopePositions pos(options, Sq, Sk, false);
    apply_rope(q, pos.q(), *cfg_.rope);
    apply_rope(k, pos.k(), *cfg_.rope);
  }
  Tensor o(DType::f32, {B, Sq, Hq * Dv});
  const TensorView ov = mha_detail::heads_view(o, Hq);
  const ProbsPlan probs = plan_probs(options, B, Hq, Sq, Sk, "");
  attention(q, k, v, ov, attention_params(options), std::nullopt, probs.view);
  finish_probs(probs, options);
  linear(o.view(), w_o_.data_as<const float>(), Hq * Dv, cfg_.d_model,
         cfg_.out_bias ? b_o_.data_as<const float>() : nullptr, y.data_as<float>(), y.stride(0), y.stride(1));
}

void MultiHeadAttention::forward(const TensorView& x, KVCache& cache, const TensorView& y,
                                 const MhaOptions& options) const {
  if (cfg_.d_model < 1) throw Error("mha: the layer is default-constructed (no config, no weights)");
  check_self_io(x, y, cfg_.d_model);
  const std::int64_t B = x.size(0), S = x.size(1);
  const std::int64_t Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads, D = cfg_.head_dim, Dv = cfg_.head_dim_v;
  if (cache.batch() != B || cache.num_kv_heads() != Hkv || cache.head_dim() != D || cache.head_dim_v() != Dv)
    throw Error("mha: cache: expected B = " + std::to_string(B) + ", Hkv = " + std::to_string(Hkv) + ", D = " + std::to_string(D) +
                ", Dv = " + std::to_string(Dv) + ", got B = " + std::to_string(cache.batch()) + ", Hkv = " + std::to_string(cache.num_kv_heads()) +
                ", D = " + std::to_string(cache.head_dim()) + ", Dv = " + std::to_string(cache.head_dim_v()));
  if (options.attention.kv_lens)
    throw Error(
        "mha: options.attention.kv_lens: expected none with a KV cache (the cache supplies the lengths)");
  const mha_detail::QkvHeads heads =
      mha_detail::project_self(x, w_in_, cfg_.qkv_bias ? b_in_.data_as<const float>() : nullptr, cfg_);
  const TensorView &q = heads.q, &k = heads.k, &v = heads.v;
  if (cfg_.rope) {
    const std::vector<std::int64_t> pos = cache.next_positions(S);
    apply_rope(q, pos, *cfg_.rope);
    apply_rope(k, pos, *cfg_.rope);
  }
  Tensor o(DType::f32, {B, S, Hq * Dv});
  const TensorView ov = mha_detail::heads_view(o, Hq);
  // Appending first makes the new tokens visible to their own queries (the diagonal). append()
  // refuses a chunk beyond the capacity and then writes nothing.
  const AttentionParams params = attention_params(options);
  const std::vector<std::int64_t> saved(cache.lengths().begin(), cache.lengths().end());
  cache.append(k, v);
  try {
    const ProbsPlan probs =
        plan_probs(options, B, Hq, S, cache.max_length(), "; Sk = the cache's max length after this call");
    cache.attend(q, ov, params, std::nullopt, probs.view);
    finish_probs(probs, options);
  } catch (...) {
    cache.truncate(saved);  // a refused call leaves the cache as it was
    throw;
  }
  linear(o.view(), w_o_.data_as<const float>(), Hq * Dv, cfg_.d_model,
         cfg_.out_bias ? b_o_.data_as<const float>() : nullptr, y.data_as<float>(), y.stride(0), y.stride(1));
}

}  // namespace qkv
