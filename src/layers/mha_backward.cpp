// Backward of the multi-head attention layer: the derivative of each step of the forward, last
// to first (mha.hpp). The forward's q, k, v (projection + RoPE), O and softmax_lse are recomputed
// with the same code (mha_common.hpp) and options; the attention's dQ, dK, dV come from
// qkv::attention_backward; every other step is a detail::sgemm (blas/gemm.hpp) on [B*S, features] row blocks.

#include <algorithm>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "blas/gemm.hpp"
#include "layers/mha_common.hpp"
#include "qkv/backward.hpp"
#include "qkv/error.hpp"
#include "qkv/mha.hpp"
#include "qkv/rope.hpp"

namespace qkv {
namespace {

using mha_detail::check_act;
using mha_detail::heads_view;
using mha_detail::row_pitch;

// The rows of a [B, S, width] float32 layout: row (b, s) starts at p + b*sb + s*ss and holds
// `width` contiguous floats (check_act guarantees ss >= width when S > 1).
struct Rows {
  float* p;
  std::int64_t B, S, sb, ss, width;

  static Rows of(const TensorView& t) {
    return {t.data_as<float>(), t.size(0), t.size(1), t.stride(0), t.stride(1), t.size(2)};
  }
  bool empty() const { return B == 0 || S == 0 || width == 0; }
  // Pitch of all B*S rows as one matrix, or 0 if they are not evenly spaced.
  std::int64_t pitch() const { return row_pitch(B, S, sb, ss, width); }
  // Batch row b as a matrix of S rows and its leading dimension.
  float* batch(std::int64_t b) const { return p + b * sb; }
  std::int64_t ld() const { return S > 1 ? ss : width; }
};

int bi(std::int64_t v) { return static_cast<int>(v); }  // sizes were checked against the int range

// g[a.width, b.width] += sum over rows r of a[r]^T b[r] (a and b have the same B and S).
void add_at_b(const Rows& a, const Rows& b, float* g) {
  if (a.empty() || b.empty()) return;
  auto gemm = [&](const float* ap, std::int64_t lda, const float* bp, std::int64_t ldb, std::int64_t M) {
    qkv::detail::sgemm(CblasTrans, CblasNoTrans, bi(a.width), bi(b.width), bi(M), 1.0f, ap, bi(lda),
                bp, bi(ldb), 1.0f, g, bi(b.width));
  };
  const std::int64_t pa = a.pitch(), pb = b.pitch();
  if (pa && pb) {
    gemm(a.p, pa, b.p, pb, a.B * a.S);
    return;
  }
  for (std::int64_t r = 0; r < a.B; ++r) gemm(a.batch(r), a.ld(), b.batch(r), b.ld(), a.S);
}

// g[n] += sum over rows r of a[r, n], accumulated in double.
void add_colsum(const Rows& a, float* g) {
  if (a.empty()) return;
  std::vector<double> acc(static_cast<std::size_t>(a.width), 0.0);
  for (std::int64_t b = 0; b < a.B; ++b)
    for (std::int64_t s = 0; s < a.S; ++s) {
      const float* row = a.p + b * a.sb + s * a.ss;
      for (std::int64_t n = 0; n < a.width; ++n) acc[static_cast<std::size_t>(n)] += row[n];
    }
  for (std::int64_t n = 0; n < a.width; ++n) g[n] += static_cast<float>(acc[static_cast<std::size_t>(n)]);
}

// c[r] (+)= a[r] W for a [a.width, c.width] row-major W with leading dimension ldw: set when
// !accumulate, else added to c.
void rows_times(const Rows& a, const float* w, std::int64_t ldw, const Rows& c, bool accumulate) {
  if (c.B == 0 || c.S == 0 || c.width == 0) return;
  if (!accumulate)
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t s = 0; s < c.S; ++s) std::fill_n(c.p + b * c.sb + s * c.ss, c.width, 0.0f);
  if (a.width == 0) return;
  auto gemm = [&](const float* ap, std::int64_t lda, float* cp, std::int64_t ldc, std::int64_t M) {
    qkv::detail::sgemm(CblasNoTrans, CblasNoTrans, bi(M), bi(c.width), bi(a.width), 1.0f, ap, bi(lda),
                w, bi(ldw), 1.0f, cp, bi(ldc));
  };
  const std::int64_t pa = a.pitch(), pc = c.pitch();
  if (pa && pc) {
    gemm(a.p, pa, c.p, pc, a.B * a.S);
    return;
  }
  for (std::int64_t r = 0; r < a.B; ++r) gemm(a.batch(r), a.ld(), c.batch(r), c.ld(), a.S);
}

// Byte ranges of two views intersect (the views' extents, as qkv::attention checks outputs).
bool overlaps(const TensorView& a, const TensorView& b) {
  if (a.numel() == 0 || b.numel() == 0 || !a.data() || !b.data()) return false;
  auto range = [](const TensorView& t) {
    std::int64_t hi = 1;
    for (int ax = 0; ax < t.rank(); ++ax) hi += (t.size(ax) - 1) * t.stride(ax);  // strides >= 0 (check_act)
    const auto* lo = static_cast<const char*>(t.data());
    return std::pair{lo, lo + hi * static_cast<std::int64_t>(sizeof(float))};
  };
  const auto [alo, ahi] = range(a);
  const auto [blo, bhi] = range(b);
  return std::less<>{}(alo, bhi) && std::less<>{}(blo, ahi);
}

void check_shape(const TensorView& t, const char* name, const char* axes, const Shape& want) {
  if (t.shape() != want)
    throw Error(std::string("mha: ") + name + ": expected shape " + axes + " = " + shape_str(want) +
                ", got " + shape_str(t.shape()));
}

std::string describe(const MhaConfig& c) {
  return "d_model = " + std::to_string(c.d_model) + ", Hq = " + std::to_string(c.num_heads) +
         ", Hkv = " + std::to_string(c.num_kv_heads) + ", D = " + std::to_string(c.head_dim) +
         ", Dv = " + std::to_string(c.head_dim_v) + ", qkv_bias = " + (c.qkv_bias ? "true" : "false") +
         ", out_bias = " + (c.out_bias ? "true" : "false") + ", sinks = " + (c.sinks ? "true" : "false");
}

void check_grads(const MhaGrads& g, const MhaConfig& c) {
  const MhaConfig& h = g.config();
  if (h.d_model != c.d_model || h.num_heads != c.num_heads || h.num_kv_heads != c.num_kv_heads ||
      h.head_dim != c.head_dim || h.head_dim_v != c.head_dim_v || h.qkv_bias != c.qkv_bias ||
      h.out_bias != c.out_bias || h.sinks != c.sinks)
    throw Error("mha: grads: expected the gradients of this layer (MhaGrads(layer)): " + describe(c) +
                "; got " + (h.d_model < 1 ? std::string("default-constructed gradients") : describe(h)));
}

// The backward of both overloads. Self-attention: x_q and x_kv are the same x and dx_kv is null
// (dx_q receives all three input projections' contributions).
void mha_backward(const MultiHeadAttention& m, const TensorView& x_q, const TensorView& x_kv,
                  const TensorView& dy, const TensorView& dx_q, const TensorView* dx_kv, MhaGrads& g,
                  const MhaOptions& o) {
  const MhaConfig& c = m.config();
  const bool self = dx_kv == nullptr;
  const std::int64_t B = x_q.size(0), Sq = x_q.size(1), Sk = x_kv.size(1), dm = c.d_model;
  const std::int64_t Hq = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim, Dv = c.head_dim_v;

  // Recompute the forward up to the attention's O and softmax_lse.
  const TensorView w_in = m.in_proj_weight(), w_o = m.w_o();
  const float* b_in = c.qkv_bias ? m.in_proj_bias().data_as<const float>() : nullptr;
  const mha_detail::QkvHeads h = self ? mha_detail::project_self(x_q, w_in, b_in, c)
                                      : mha_detail::project_cross(x_q, x_kv, w_in, b_in, c);
  std::optional<mha_detail::RopePositions> pos;
  if (c.rope) {
    pos.emplace(o, Sq, Sk, self);
    apply_rope(h.q, pos->q(), *c.rope);
    apply_rope(h.k, pos->k(), *c.rope);
  }
  const AttentionParams params = m.attention_params(o);
  const Tensor out(DType::f32, {B, Sq, Hq * Dv}), lse(DType::f32, {B, Hq, Sq});
  const TensorView out_heads = heads_view(out, Hq);
  attention(h.q, h.k, h.v, out_heads, params, lse.view());

  // y = o W_O^T + b_O:  dW_O += dy^T o,  db_O += sum dy,  do = dy W_O.
  const Rows dyr = Rows::of(dy);
  add_at_b(dyr, Rows::of(out), g.w_o().data_as<float>());
  if (c.out_bias) add_colsum(dyr, g.b_o().data_as<float>());
  const Tensor dout(DType::f32, {B, Sq, Hq * Dv});
  rows_times(dyr, w_o.data_as<const float>(), Hq * Dv, Rows::of(dout), false);

  // Attention, then RoPE's transpose on dq and dk (gradients of the pre-rotation q and k).
  const Tensor dq(DType::f32, {B, Sq, Hq * D}), dk(DType::f32, {B, Sk, Hkv * D});
  const Tensor dv(DType::f32, {B, Sk, Hkv * Dv});
  if (c.sinks) {
    // The sinks' gradient is written by attention_backward, then accumulated like the weights'.
    const Tensor dsinks(DType::f32, {Hq});
    attention_backward(h.q, h.k, h.v, out_heads, lse.view(), heads_view(dout, Hq), heads_view(dq, Hq),
                       heads_view(dk, Hkv), heads_view(dv, Hkv), dsinks.view(), params);
    float* gs = g.sinks().data_as<float>();
    for (std::int64_t hh = 0; hh < Hq; ++hh) gs[hh] += dsinks.data_as<const float>()[hh];
  } else {
    attention_backward(h.q, h.k, h.v, out_heads, lse.view(), heads_view(dout, Hq), heads_view(dq, Hq),
                       heads_view(dk, Hkv), heads_view(dv, Hkv), params);
  }
  if (c.rope) {
    apply_rope_inverse(heads_view(dq, Hq), pos->q(), *c.rope);
    apply_rope_inverse(heads_view(dk, Hkv), pos->k(), *c.rope);
  }

  // q = x_q W_Q^T + b_Q etc.: the weight gradients first (the last reads of x_q, x_kv), then dx.
  const Rows dqr = Rows::of(dq), dkr = Rows::of(dk), dvr = Rows::of(dv);
  const Rows xq = Rows::of(x_q), xkv = Rows::of(x_kv);
  add_at_b(dqr, xq, g.w_q().data_as<float>());
  add_at_b(dkr, xkv, g.w_k().data_as<float>());
  add_at_b(dvr, xkv, g.w_v().data_as<float>());
  if (c.qkv_bias) {
    add_colsum(dqr, g.b_q().data_as<float>());
    add_colsum(dkr, g.b_k().data_as<float>());
    add_colsum(dvr, g.b_v().data_as<float>());
  }
  const float* w = w_in.data_as<const float>();
  const Rows dxq = Rows::of(dx_q), dxkv = self ? dxq : Rows::of(*dx_kv);
  rows_times(dqr, w, dm, dxq, false);
  rows_times(dkr, w + Hq * D * dm, dm, dxkv, self);
  rows_times(dvr, w + (Hq + Hkv) * D * dm, dm, dxkv, true);
}

}  // namespace

MhaGrads::MhaGrads(const MultiHeadAttention& layer) : cfg_(layer.config()) {
  if (cfg_.d_model < 1) throw Error("mha: grads: the layer is default-constructed (no config, no weights)");
  w_in_ = Tensor(DType::f32, layer.in_proj_weight().shape());
  w_o_ = Tensor(DType::f32, layer.w_o().shape());
  if (cfg_.qkv_bias) b_in_ = Tensor(DType::f32, layer.in_proj_bias().shape());
  if (cfg_.out_bias) b_o_ = Tensor(DType::f32, layer.b_o().shape());
  if (cfg_.sinks) sinks_ = Tensor(DType::f32, layer.sinks().shape());
}

void MhaGrads::zero() {
  for (const Tensor* t : {&w_in_, &b_in_, &w_o_, &b_o_, &sinks_})
    if (t->data()) std::memset(t->data(), 0, t->nbytes());
}

TensorView MhaGrads::w_q() const {
  return TensorView(w_in_.data(), DType::f32, {cfg_.num_heads * cfg_.head_dim, cfg_.d_model});
}
TensorView MhaGrads::w_k() const {
  return TensorView(w_in_.data_as<float>() + cfg_.num_heads * cfg_.head_dim * cfg_.d_model, DType::f32,
                    {cfg_.num_kv_heads * cfg_.head_dim, cfg_.d_model});
}
TensorView MhaGrads::w_v() const {
  const std::int64_t row0 = (cfg_.num_heads + cfg_.num_kv_heads) * cfg_.head_dim;
  return TensorView(w_in_.data_as<float>() + row0 * cfg_.d_model, DType::f32,
                    {cfg_.num_kv_heads * cfg_.head_dim_v, cfg_.d_model});
}
TensorView MhaGrads::in_proj_bias() const { return cfg_.qkv_bias ? b_in_.view() : TensorView(); }
TensorView MhaGrads::b_q() const {
  if (!cfg_.qkv_bias) return {};
  return TensorView(b_in_.data(), DType::f32, {cfg_.num_heads * cfg_.head_dim});
}
TensorView MhaGrads::b_k() const {
  if (!cfg_.qkv_bias) return {};
  return TensorView(b_in_.data_as<float>() + cfg_.num_heads * cfg_.head_dim, DType::f32,
                    {cfg_.num_kv_heads * cfg_.head_dim});
}
TensorView MhaGrads::b_v() const {
  if (!cfg_.qkv_bias) return {};
  return TensorView(b_in_.data_as<float>() + (cfg_.num_heads + cfg_.num_kv_heads) * cfg_.head_dim, DType::f32,
                    {cfg_.num_kv_heads * cfg_.head_dim_v});
}
TensorView MhaGrads::b_o() const { return cfg_.out_bias ? b_o_.view() : TensorView(); }
TensorView MhaGrads::sinks() const { return cfg_.sinks ? sinks_.view() : TensorView(); }

void MultiHeadAttention::backward(const TensorView& x, const TensorView& dy, const TensorView& dx,
                                  MhaGrads& grads, const MhaOptions& options) const {
  if (cfg_.d_model < 1) throw Error("mha: the layer is default-constructed (no config, no weights)");
  check_act(x, "x", "[B,S,d_model]", cfg_.d_model);
  check_act(dy, "dy", "[B,S,d_model]", cfg_.d_model);
  check_act(dx, "dx", "[B,S,d_model]", cfg_.d_model);
  check_shape(dy, "dy", "[B,S,d_model]", x.shape());
  check_shape(dx, "dx", "[B,S,d_model]", x.shape());
  check_grads(grads, cfg_);
  mha_backward(*this, x, x, dy, dx, nullptr, grads, options);
}

void MultiHeadAttention::backward(const TensorView& x_q, const TensorView& x_kv, const TensorView& dy,
                                  const TensorView& dx_q, const TensorView& dx_kv, MhaGrads& grads,
                                  const MhaOptions& options) const {
  if (cfg_.d_model < 1) throw Error("mha: the layer is default-constructed (no config, no weights)");
  check_act(x_q, "x_q", "[B,Sq,d_model]", cfg_.d_model);
  check_act(x_kv, "x_kv", "[B,Sk,d_model]", cfg_.d_model);
  check_act(dy, "dy", "[B,Sq,d_model]", cfg_.d_model);
  check_act(dx_q, "dx_q", "[B,Sq,d_model]", cfg_.d_model);
  check_act(dx_kv, "dx_kv", "[B,Sk,d_model]", cfg_.d_model);
  if (x_kv.size(0) != x_q.size(0))
    throw Error("mha: x_kv: expected [B,Sk,d_model] with B == x_q.B (" + std::to_string(x_q.size(0)) +
                "), got shape " + shape_str(x_kv.shape()));
  check_shape(dy, "dy", "[B,Sq,d_model]", x_q.shape());
  check_shape(dx_q, "dx_q", "[B,Sq,d_model]", x_q.shape());
  check_shape(dx_kv, "dx_kv", "[B,Sk,d_model]", x_kv.shape());
  if (overlaps(dx_q, dx_kv)) throw Error("mha: dx_kv: expected memory disjoint from dx_q (both are written)");
  check_grads(grads, cfg_);
  mha_backward(*this, x_q, x_kv, dy, dx_q, &dx_kv, grads, options);
}

}  // namespace qkv
