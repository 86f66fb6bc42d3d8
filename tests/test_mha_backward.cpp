// MultiHeadAttention::backward against central finite differences of a float64 forward of the
// same layer written here (projections as plain loops, RoPE from the RoFormer formula,
// attention by qkv::reference::attention on float64 tensors), for the scalar loss
// L = sum(dy * y): every gradient (dx or dx_q and dx_kv, every weight and bias) over self- and
// cross-attention, MHA/GQA/MQA, masks, RoPE styles, odd sizes and strided activations; then
// apply_rope_inverse, accumulation into MhaGrads, aliasing, and the errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/mha.hpp"
#include "qkv/reference.hpp"
#include "qkv/rope.hpp"

namespace {

using qkv::DType;
using qkv::MhaConfig;
using qkv::MhaGrads;
using qkv::MhaOptions;
using qkv::MultiHeadAttention;
using qkv::RopeConfig;
using qkv::RopeStyle;
using qkv::Tensor;
using qkv::TensorView;

void fill_normal(const TensorView& t, std::uint32_t seed, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, sd);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = nd(rng);
}

MhaConfig cfg(std::int64_t dm, std::int64_t hq, std::int64_t hkv, std::int64_t d = 0, std::int64_t dv = 0,
              bool bias = true, std::optional<RopeConfig> rope = std::nullopt) {
  MhaConfig c;
  c.d_model = dm;
  c.num_heads = hq;
  c.num_kv_heads = hkv;
  c.head_dim = d;
  c.head_dim_v = dv;
  c.qkv_bias = c.out_bias = bias;
  c.rope = rope;
  return c;
}

MhaConfig scored(MhaConfig c, bool sinks, bool alibi) {
  c.sinks = sinks;
  c.alibi = alibi;
  return c;
}

RopeConfig rope(RopeStyle style, std::int64_t rotary_dim = 0, double theta = 10000.0,
                qkv::RopeAngles angles = qkv::RopeAngles::f64) {
  RopeConfig r;
  r.style = style;
  r.rotary_dim = rotary_dim;
  r.theta = theta;
  r.angles = angles;
  return r;
}

MultiHeadAttention make_layer(const MhaConfig& c, std::uint32_t seed = 100) {
  MultiHeadAttention m(c);
  const float sd = 1.f / std::sqrt(static_cast<float>(m.config().d_model));
  fill_normal(m.in_proj_weight(), seed, sd);
  fill_normal(m.w_o(), seed + 1, sd);
  if (m.config().qkv_bias) fill_normal(m.in_proj_bias(), seed + 2, 0.1f);
  if (m.config().out_bias) fill_normal(m.b_o(), seed + 3, 0.1f);
  if (m.config().sinks) {
    // sink logits on a grid of 2^-8, so that the finite differences' steps of the sinks (kSinkStep)
    // are exact in the float32 sinks the attention reads
    fill_normal(m.sinks(), seed + 4, 1.0f);
    for (std::int64_t h = 0; h < m.sinks().numel(); ++h)
      m.sinks().data_as<float>()[h] = std::round(m.sinks().data_as<float>()[h] * 256.f) / 256.f;
  }
  return m;
}

// A float32 activation [B, S, d] in one of three layouts (the values are the same):
enum class Layout {
  contiguous,
  padded,  // rows dm+5 apart, batches S*(dm+5)+3 apart: not one evenly spaced matrix
  sbd,     // stored [S, B, d] and viewed as [B, S, d] (strides d, B*d, 1)
};
struct Act {
  std::vector<float> mem;
  TensorView view;
};
Act make_act(std::int64_t B, std::int64_t S, std::int64_t d, Layout layout, std::uint32_t seed) {
  Act a;
  qkv::Shape strides;
  if (layout == Layout::contiguous) {
    a.mem.assign(static_cast<std::size_t>(B * S * d), 0.f);
    strides = {S * d, d, 1};
  } else if (layout == Layout::padded) {
    a.mem.assign(static_cast<std::size_t>(B * (S * (d + 5) + 3)), 0.f);
    strides = {S * (d + 5) + 3, d + 5, 1};
  } else {
    a.mem.assign(static_cast<std::size_t>(B * S * d), 0.f);
    strides = {d, B * d, 1};
  }
  a.view = TensorView(a.mem.data(), DType::f32, {B, S, d}, strides);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t i = 0; i < d; ++i)
        a.mem[static_cast<std::size_t>(b * strides[0] + s * strides[1] + i)] = nd(rng);
  return a;
}

// The logical [B, S, d] values of a strided float32 view, row-major, as double.
std::vector<double> act64(const TensorView& t) {
  std::vector<double> r;
  for (std::int64_t b = 0; b < t.size(0); ++b)
    for (std::int64_t s = 0; s < t.size(1); ++s)
      for (std::int64_t i = 0; i < t.size(2); ++i)
        r.push_back(t.data_as<float>()[b * t.stride(0) + s * t.stride(1) + i]);
  return r;
}
// A contiguous float32 view's values as double.
std::vector<double> flat64(const TensorView& t) {
  std::vector<double> r(static_cast<std::size_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i) r[static_cast<std::size_t>(i)] = t.data_as<float>()[i];
  return r;
}

// Everything the loss depends on, in float64.
struct State64 {
  std::vector<double> w_in, b_in, w_o, b_o, xq, xkv, dy, sinks;
};

// RoPE on a [B, S, H, Dh] row-major buffer, from the RoFormer formula (rope.hpp), in double; with
// llama2c_f32 angles the angle, cos and sin are computed in float as llama2.c does.
void rope64(std::vector<double>& x, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t Dh,
            std::span<const std::int64_t> pos, const RopeConfig& r) {
  const std::int64_t R = r.rotary_dim ? r.rotary_dim : Dh, half = R / 2;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < S; ++s) {
      const bool shared = static_cast<std::int64_t>(pos.size()) == S;
      const std::int64_t p = pos[static_cast<std::size_t>(shared ? s : b * S + s)];
      for (std::int64_t j = 0; j < half; ++j) {
        double c, sn;
        if (r.angles == qkv::RopeAngles::llama2c_f32) {
          const float freq =
              1.0f / powf(static_cast<float>(r.theta), static_cast<float>(2 * j) / static_cast<float>(R));
          const float val = static_cast<float>(p) * freq;
          c = cosf(val);
          sn = sinf(val);
        } else {
          const double w = std::pow(r.theta, -2.0 * static_cast<double>(j) / static_cast<double>(R));
          c = std::cos(static_cast<double>(p) * w);
          sn = std::sin(static_cast<double>(p) * w);
        }
        const std::int64_t ia = r.style == RopeStyle::interleaved ? 2 * j : j;
        const std::int64_t ib = r.style == RopeStyle::interleaved ? 2 * j + 1 : j + half;
        for (std::int64_t h = 0; h < H; ++h) {
          double* v = x.data() + ((b * S + s) * H + h) * Dh;
          const double xa = v[ia], xb = v[ib];
          v[ia] = xa * c - xb * sn;
          v[ib] = xb * c + xa * sn;
        }
      }
    }
}

// out[r, n] = sum_k in[r, k] W[row0 + n, k] + bias[row0 + n] (bias may be empty).
std::vector<double> linear64(const std::vector<double>& in, std::int64_t rows, std::int64_t K,
                             const std::vector<double>& w, const std::vector<double>& bias, std::int64_t row0,
                             std::int64_t N) {
  std::vector<double> out(static_cast<std::size_t>(rows * N));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t n = 0; n < N; ++n) {
      double acc = bias.empty() ? 0.0 : bias[static_cast<std::size_t>(row0 + n)];
      for (std::int64_t k = 0; k < K; ++k)
        acc += in[static_cast<std::size_t>(r * K + k)] * w[static_cast<std::size_t>((row0 + n) * K + k)];
      out[static_cast<std::size_t>(r * N + n)] = acc;
    }
  return out;
}

// The call's fixed description (everything but the State64 values).
struct Call {
  MhaConfig c;  // resolved
  std::int64_t B, Sq, Sk;
  bool self;
  MhaOptions o;
  std::vector<std::int64_t> qpos, kpos;  // what RoPE uses (the defaults made explicit)
};

// The layer's forward in float64: y [B, Sq, d_model] row-major.
std::vector<double> forward64(const Call& su, const State64& st) {
  const MhaConfig& c = su.c;
  const std::int64_t B = su.B, Sq = su.Sq, Sk = su.Sk, dm = c.d_model;
  const std::int64_t Hq = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim, Dv = c.head_dim_v;
  const std::vector<double>& xkv = su.self ? st.xq : st.xkv;
  std::vector<double> q = linear64(st.xq, B * Sq, dm, st.w_in, st.b_in, 0, Hq * D);
  std::vector<double> k = linear64(xkv, B * Sk, dm, st.w_in, st.b_in, Hq * D, Hkv * D);
  std::vector<double> v = linear64(xkv, B * Sk, dm, st.w_in, st.b_in, (Hq + Hkv) * D, Hkv * Dv);
  if (c.rope) {
    rope64(q, B, Sq, Hq, D, su.qpos, *c.rope);
    rope64(k, B, Sk, Hkv, D, su.kpos, *c.rope);
  }
  std::vector<double> o(static_cast<std::size_t>(B * Sq * Hq * Dv));
  auto heads = [](std::vector<double>& buf, std::int64_t B_, std::int64_t S, std::int64_t H, std::int64_t d) {
    return TensorView(buf.data(), DType::f64, {B_, H, S, d}, {S * H * d, d, H * d, 1});
  };
  // The layer's sinks (float32, as the library takes them) and BLOOM's slopes for 2 or 4 heads
  // (powers of two: 2^(-8h/Hq)).
  qkv::AttentionParams p = su.o.attention;
  std::vector<float> sinks(st.sinks.begin(), st.sinks.end()), slopes;
  if (c.sinks) p.sinks = TensorView(sinks.data(), DType::f32, {Hq});
  if (c.alibi) {
    for (std::int64_t h = 1; h <= Hq; ++h)
      slopes.push_back(static_cast<float>(std::pow(2.0, -8.0 * static_cast<double>(h) / static_cast<double>(Hq))));
    p.alibi_slopes = TensorView(slopes.data(), DType::f32, {Hq});
  }
  qkv::reference::attention(heads(q, B, Sq, Hq, D), heads(k, B, Sk, Hkv, D), heads(v, B, Sk, Hkv, Dv),
                            heads(o, B, Sq, Hq, Dv), p);
  return linear64(o, B * Sq, Hq * Dv, st.w_o, st.b_o, 0, dm);
}

double loss64(const Call& su, const State64& st) {
  const std::vector<double> y = forward64(su, st);
  double l = 0.0;
  for (std::size_t i = 0; i < y.size(); ++i) l += y[i] * st.dy[i];
  return l;
}

// Tolerances. The finite differences are central, in float64, with h = 1e-6: truncation error
// ~h^2 |L'''| ~ 1e-12 and rounding ~1e-16 |L| / h ~ 1e-9 for |L| ~ 10, so the estimate is exact
// to ~1e-9. The layer's gradients are float32: each passes through about five chained float32
// products (dy W_O, attention backward, RoPE, the input projections) with inner sizes <= 24,
// so the error should stay within a few hundred units of float32 rounding (6e-8) relative to
// the largest gradient of its tensor, ~1e-5; measured here it is at most 6e-7. The bound, 1e-4
// of max |grad| (max |grad| is 1..11 in these cases) plus 1e-6 for all-small tensors, leaves a
// margin of over 100 for other kernels and instruction sets, while a wrong index, sign, rotation
// direction or missing term gives errors of order max |grad|.
constexpr double kFdStep = 1e-6;
// The sinks reach the attention as float32: their step is a power of two, exact there (the sinks
// are multiples of 2^-8); truncation error ~h^2 |d3L| / 6 ~ 1e-9 |d3L|.
constexpr double kSinkStep = 1.0 / 16384;
constexpr double kRelTol = 1e-4;
constexpr double kAbsTol = 1e-6;

// Compares the layer's gradient `got` (float32, logical row-major order given by `at`) with
// central differences of the loss with respect to every element of `param`.
template <class At>
void check_grad(const Call& su, State64& st, std::vector<double>& param, std::int64_t n, At at,
                const char* what, const std::string& name, double step = kFdStep) {
  ASSERT_EQ(static_cast<std::int64_t>(param.size()), n) << name << ": " << what;
  std::vector<double> fd(static_cast<std::size_t>(n));
  double gmax = 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double keep = param[static_cast<std::size_t>(i)];
    param[static_cast<std::size_t>(i)] = keep + step;
    const double lp = loss64(su, st);
    param[static_cast<std::size_t>(i)] = keep - step;
    const double lm = loss64(su, st);
    param[static_cast<std::size_t>(i)] = keep;
    fd[static_cast<std::size_t>(i)] = (lp - lm) / (2 * step);
    gmax = std::max(gmax, std::abs(fd[static_cast<std::size_t>(i)]));
  }
  const double tol = kRelTol * gmax + kAbsTol;
  double worst = 0.0;
  std::int64_t bad = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const double e = std::abs(static_cast<double>(at(i)) - fd[static_cast<std::size_t>(i)]);
    worst = std::isnan(e) ? INFINITY : std::max(worst, e);
    if (!(e <= tol) && bad++ < 3)
      ADD_FAILURE() << name << ": " << what << "[" << i << "] = " << at(i) << ", finite differences "
                    << fd[static_cast<std::size_t>(i)];
  }
  EXPECT_LE(worst, tol) << name << ": " << what << " (max |grad| " << gmax << ")";
}

std::function<float(std::int64_t)> flat(const TensorView& t) {
  return [t](std::int64_t i) { return t.data_as<float>()[i]; };
}
std::function<float(std::int64_t)> rows(const TensorView& t) {  // [B, S, d] strided
  return [t](std::int64_t i) {
    const std::int64_t d = t.size(2), r = i / d, b = r / t.size(1), s = r % t.size(1);
    return t.data_as<float>()[b * t.stride(0) + s * t.stride(1) + i % d];
  };
}

struct Case {
  const char* name;
  MhaConfig cfg;
  std::int64_t B = 2, Sq = 7, Sk = -1;  // Sk < 0: self-attention
  bool causal = false;
  qkv::Alignment align = qkv::Alignment::bottom_right;
  std::int64_t window_left = -1;
  double softcap = 0.0;
  int mask = 0;  // 1: bool [B,1,Sq,Sk]; 2: additive float32 [Sq,Sk] with some -inf
  bool kv_lens = false;
  bool positions = false;  // explicit RoPE positions: q per sequence [B,S], k shared [Sk]
  bool reference = false;  // KernelKind::reference (the float64 forward and backward)
  std::int64_t keep_first = 0;  // AttentionParams::window_keep_first
  Layout layout = Layout::contiguous;  // of x (x_q, x_kv) and dx; dy takes the sbd layout when not contiguous
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class MhaBackwardFD : public ::testing::TestWithParam<Case> {};

TEST_P(MhaBackwardFD, EveryGradientMatchesFiniteDifferences) {
  const Case& cs = GetParam();
  const MultiHeadAttention m = make_layer(cs.cfg);
  Call su{m.config(), cs.B, cs.Sq, cs.Sk < 0 ? cs.Sq : cs.Sk, cs.Sk < 0, {}, {}, {}};
  const MhaConfig& c = su.c;
  const std::int64_t B = su.B, Sq = su.Sq, Sk = su.Sk, dm = c.d_model;

  Tensor mask, lens;
  MhaOptions& o = su.o;
  o.attention.causal = cs.causal;
  o.attention.align = cs.align;
  o.attention.window_left = cs.window_left;
  o.attention.softcap = cs.softcap;
  o.attention.window_keep_first = cs.keep_first;
  if (cs.reference) o.attention.kernel = qkv::KernelKind::reference;
  std::mt19937 rng(11);
  if (cs.mask == 1) {
    mask = Tensor(DType::b8, {B, 1, Sq, Sk});
    for (std::int64_t i = 0; i < mask.numel(); ++i) mask.data_as<std::uint8_t>()[i] = rng() % 4 != 0;
    o.attention.mask = mask.view();
  } else if (cs.mask == 2) {
    mask = Tensor(DType::f32, {Sq, Sk});
    for (std::int64_t i = 0; i < mask.numel(); ++i)
      mask.data_as<float>()[i] = rng() % 5 == 0 ? -INFINITY : static_cast<float>(rng() % 100) / 50.f - 1.f;
    o.attention.mask = mask.view();
  }
  if (cs.kv_lens) {
    lens = Tensor(DType::i64, {B});
    for (std::int64_t b = 0; b < B; ++b)
      lens.data_as<std::int64_t>()[b] = std::max<std::int64_t>(1, Sk - 2 * b - 1);
    o.attention.kv_lens = lens.view();
  }
  std::vector<std::int64_t> qpos_opt, kpos_opt;
  if (cs.positions) {
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t s = 0; s < Sq; ++s) qpos_opt.push_back(3 + 5 * b + s);
    for (std::int64_t s = 0; s < Sk; ++s) kpos_opt.push_back(2 * s + 1);
    o.q_positions = qpos_opt;
    o.k_positions = kpos_opt;
  }
  for (std::int64_t s = 0; s < Sq; ++s) su.qpos.push_back(s);
  su.kpos = su.self && !cs.positions ? su.qpos : std::vector<std::int64_t>{};
  if (cs.positions) {
    su.qpos = qpos_opt;
    su.kpos = kpos_opt;
  } else if (!su.self) {
    for (std::int64_t s = 0; s < Sk; ++s) su.kpos.push_back(s);
  }

  const Layout dy_layout = cs.layout == Layout::contiguous ? Layout::contiguous : Layout::sbd;
  Act xq = make_act(B, Sq, dm, cs.layout, 1), xkv = make_act(B, Sk, dm, cs.layout, 2);
  Act dy = make_act(B, Sq, dm, dy_layout, 3);
  Act dxq = make_act(B, Sq, dm, cs.layout, 4), dxkv = make_act(B, Sk, dm, cs.layout, 5);  // overwritten
  State64 st{flat64(m.in_proj_weight()), c.qkv_bias ? flat64(m.in_proj_bias()) : std::vector<double>{},
             flat64(m.w_o()), c.out_bias ? flat64(m.b_o()) : std::vector<double>{}, act64(xq.view),
             su.self ? std::vector<double>{} : act64(xkv.view), act64(dy.view),
             c.sinks ? flat64(m.sinks()) : std::vector<double>{}};

  // The float64 forward is the layer's forward (to float32 rounding).
  Tensor y(DType::f32, {B, Sq, dm});
  if (su.self)
    m.forward(xq.view, y, o);
  else
    m.forward(xq.view, xkv.view, y, o);
  const std::vector<double> y64 = forward64(su, st);
  double fe = 0.0;
  for (std::int64_t i = 0; i < y.numel(); ++i)
    fe = std::max(fe, std::abs(y.data_as<float>()[i] - y64[static_cast<std::size_t>(i)]));
  EXPECT_LE(fe, 1e-5) << cs.name << ": forward";

  MhaGrads g(m);
  if (su.self)
    m.backward(xq.view, dy.view, dxq.view, g, o);
  else
    m.backward(xq.view, xkv.view, dy.view, dxq.view, dxkv.view, g, o);

  const std::string n = cs.name;
  const std::int64_t n_in = g.in_proj_weight().size(0);
  check_grad(su, st, st.w_in, n_in * dm, flat(g.in_proj_weight()), "in_proj_weight", n);
  check_grad(su, st, st.w_o, dm * c.num_heads * c.head_dim_v, flat(g.w_o()), "w_o", n);
  if (c.qkv_bias) check_grad(su, st, st.b_in, n_in, flat(g.in_proj_bias()), "in_proj_bias", n);
  if (c.out_bias) check_grad(su, st, st.b_o, dm, flat(g.b_o()), "b_o", n);
  check_grad(su, st, st.xq, B * Sq * dm, rows(dxq.view), su.self ? "dx" : "dx_q", n);
  if (!su.self) check_grad(su, st, st.xkv, B * Sk * dm, rows(dxkv.view), "dx_kv", n);
  if (c.sinks) check_grad(su, st, st.sinks, c.num_heads, flat(g.sinks()), "sinks", n, kSinkStep);
}

using qkv::RopeAngles;
constexpr auto kInterleaved = RopeStyle::interleaved;
constexpr auto kHalf = RopeStyle::half_split;

INSTANTIATE_TEST_SUITE_P(
    Layers, MhaBackwardFD,
    ::testing::Values(
        Case{.name = "self_mha", .cfg = cfg(12, 4, 4)},
        Case{.name = "self_mha_causal_nobias", .cfg = cfg(12, 4, 4, 0, 0, false), .causal = true},
        Case{.name = "self_gqa_causal_rope_interleaved_partial",
             .cfg = cfg(12, 4, 2, 0, 0, true, rope(kInterleaved, 2)), .causal = true},
        Case{.name = "self_mqa_rope_half_boolmask",
             .cfg = cfg(12, 4, 1, 4, 3, true, rope(kHalf, 0, 100.0)), .mask = 1},
        Case{.name = "self_gqa_d5_rope_half_partial_positions_llama2c",
             .cfg = cfg(12, 4, 2, 5, 0, false, rope(kHalf, 4, 10000.0, RopeAngles::llama2c_f32)),
             .causal = true, .positions = true},
        Case{.name = "self_window_softcap_additive_mask_strided",
             .cfg = cfg(12, 3, 3, 0, 0, true, rope(kInterleaved)), .window_left = 2, .softcap = 1.5,
             .mask = 2, .layout = Layout::padded},
        Case{.name = "self_reference_kernel_sbd", .cfg = cfg(12, 4, 2, 3, 5), .causal = true,
             .reference = true, .layout = Layout::sbd},
        Case{.name = "cross_mha", .cfg = cfg(12, 4, 4), .Sq = 7, .Sk = 5},
        Case{.name = "cross_gqa_causal_boolmask_rope_interleaved",
             .cfg = cfg(12, 4, 2, 0, 0, true, rope(kInterleaved, 2)), .Sq = 5, .Sk = 7, .causal = true,
             .mask = 1},
        Case{.name = "cross_mqa_d5_kvlens_softcap_rope_half_positions",
             .cfg = cfg(12, 4, 1, 5, 3, true, rope(kHalf, 4)), .Sq = 7, .Sk = 6, .softcap = 2.0,
             .kv_lens = true, .positions = true},
        Case{.name = "cross_causal_rows_without_keys_nobias", .cfg = cfg(12, 4, 2, 0, 0, false), .Sq = 7,
             .Sk = 3, .causal = true},
        Case{.name = "cross_topleft_additive_mask_strided",
             .cfg = cfg(12, 2, 1, 5, 0, true, rope(kInterleaved, 4)), .B = 3, .Sq = 4, .Sk = 6,
             .causal = true, .align = qkv::Alignment::top_left, .mask = 2, .layout = Layout::padded},
        Case{.name = "self_sinks", .cfg = scored(cfg(12, 4, 4), true, false)},
        Case{.name = "self_gqa_sinks_alibi_causal_window_keep_first_rope",
             .cfg = scored(cfg(12, 4, 2, 4, 0, true, rope(kHalf)), true, true), .causal = true, .window_left = 2,
             .keep_first = 2},
        Case{.name = "self_alibi_softcap_boolmask_strided", .cfg = scored(cfg(12, 2, 1, 5), false, true),
             .softcap = 1.5, .mask = 1, .layout = Layout::padded},
        Case{.name = "cross_sinks_alibi_kvlens_rows_without_keys", .cfg = scored(cfg(12, 4, 2, 0, 0, false), true, true),
             .Sq = 7, .Sk = 5, .causal = true, .kv_lens = true},
        Case{.name = "cross_sinks_alibi_topleft_reference", .cfg = scored(cfg(12, 2, 2, 3, 5), true, true), .Sq = 4,
             .Sk = 6, .causal = true, .align = qkv::Alignment::top_left, .reference = true}),
    [](const auto& info) { return std::string(info.param.name); });

// apply_rope_inverse undoes apply_rope and is its transpose: <R x, g> = <x, R^T g>.
TEST(RopeInverse, UndoesApplyRopeAndIsItsTranspose) {
  for (RopeStyle style : {kInterleaved, kHalf})
    for (std::int64_t R : {0, 2, 4})
      for (RopeAngles angles : {RopeAngles::f64, RopeAngles::llama2c_f32}) {
        const std::int64_t B = 2, S = 5, H = 3, D = 5 + (R == 0);  // R = 0: all of an even D
        const RopeConfig r = rope(style, R, 500.0, angles);
        // llama2c_f32 rotates in float arithmetic even for float64 storage (rope.hpp).
        const double tol = angles == RopeAngles::f64 ? 1e-14 : 1e-6;
        std::vector<std::int64_t> pos;
        for (std::int64_t i = 0; i < B * S; ++i) pos.push_back(7 * i + 1);
        Tensor x(DType::f64, {B, S, H, D}), g(DType::f64, {B, S, H, D}), x0(DType::f64, {B, S, H, D});
        std::mt19937 rng(5);
        std::normal_distribution<double> nd;
        for (std::int64_t i = 0; i < x.numel(); ++i) {
          x.data_as<double>()[i] = x0.data_as<double>()[i] = nd(rng);
          g.data_as<double>()[i] = nd(rng);
        }
        const TensorView xv = x.view().permute({0, 2, 1, 3}), gv = g.view().permute({0, 2, 1, 3});
        qkv::apply_rope(xv, pos, r);
        double lhs = 0.0, rhs = 0.0;
        for (std::int64_t i = 0; i < x.numel(); ++i) lhs += x.data_as<double>()[i] * g.data_as<double>()[i];
        qkv::apply_rope_inverse(gv, pos, r);
        for (std::int64_t i = 0; i < x.numel(); ++i) rhs += x0.data_as<double>()[i] * g.data_as<double>()[i];
        EXPECT_NEAR(lhs, rhs, 100 * tol * (1 + std::abs(lhs)));
        qkv::apply_rope_inverse(xv, pos, r);
        for (std::int64_t i = 0; i < x.numel(); ++i)
          EXPECT_NEAR(x.data_as<double>()[i], x0.data_as<double>()[i], tol);
        // float32: the same, to float32 rounding; the start overload matches explicit positions.
        Tensor f(DType::f32, {B, H, S, D}), f0(DType::f32, {B, H, S, D});
        fill_normal(f.view(), 9, 1.f);
        std::memcpy(f0.data(), f.data(), f.nbytes());
        qkv::apply_rope(f.view(), 4, r);
        qkv::apply_rope_inverse(f.view(), 4, r);
        for (std::int64_t i = 0; i < f.numel(); ++i)
          EXPECT_NEAR(f.data_as<float>()[i], f0.data_as<float>()[i], 1e-6);
      }
  Tensor bad(DType::f32, {1, 1, 2, 3});
  EXPECT_THROW(qkv::apply_rope_inverse(bad.view(), 0, rope(kInterleaved)), qkv::Error);  // D = 3 is odd
  EXPECT_THROW(qkv::apply_rope_inverse(bad.view(), -1, rope(kInterleaved, 2)), qkv::Error);
}

// Weight gradients accumulate (+=) over calls; zero() resets them; dx is overwritten; dx may
// alias x or dy.
TEST(MhaBackward, AccumulatesWeightGradientsAndAllowsAliasing) {
  const MultiHeadAttention m = make_layer(cfg(12, 4, 2, 0, 0, true, rope(kHalf, 2)));
  const std::int64_t B = 2, S = 7, dm = 12;
  const Act x = make_act(B, S, dm, Layout::contiguous, 1), dy = make_act(B, S, dm, Layout::contiguous, 2);
  MhaOptions o;
  o.attention.causal = true;
  MhaGrads g1(m), g2(m);
  Tensor dx1(DType::f32, {B, S, dm}), dx2(DType::f32, {B, S, dm});
  fill_normal(dx2.view(), 3, 1.f);
  m.backward(x.view, dy.view, dx1, g1, o);
  m.backward(x.view, dy.view, dx2, g2, o);
  m.backward(x.view, dy.view, dx2, g2, o);
  auto same = [](const TensorView& a, const TensorView& b, float k) {
    for (std::int64_t i = 0; i < a.numel(); ++i)
      if (a.data_as<float>()[i] * k != b.data_as<float>()[i]) return false;
    return true;
  };
  EXPECT_TRUE(same(dx1, dx2, 1.f));
  EXPECT_TRUE(same(g1.in_proj_weight(), g2.in_proj_weight(), 2.f));
  EXPECT_TRUE(same(g1.in_proj_bias(), g2.in_proj_bias(), 2.f));
  EXPECT_TRUE(same(g1.w_o(), g2.w_o(), 2.f));
  EXPECT_TRUE(same(g1.b_o(), g2.b_o(), 2.f));
  // The split views are rows of the packed gradient.
  EXPECT_EQ(g1.w_k().data_as<float>(), g1.in_proj_weight().data_as<float>() + 4 * 3 * dm);
  EXPECT_EQ(g1.w_v().shape(), (qkv::Shape{2 * 3, dm}));
  EXPECT_EQ(g1.b_v().data_as<float>(), g1.in_proj_bias().data_as<float>() + 4 * 3 + 2 * 3);
  g2.zero();
  m.backward(x.view, dy.view, dx2, g2, o);
  EXPECT_TRUE(same(g1.in_proj_weight(), g2.in_proj_weight(), 1.f));
  EXPECT_TRUE(same(g1.w_o(), g2.w_o(), 1.f));

  // dx in the place of x, then of dy: the same bits.
  for (int which = 0; which < 2; ++which) {
    Act xa = make_act(B, S, dm, Layout::contiguous, 1), dya = make_act(B, S, dm, Layout::contiguous, 2);
    MhaGrads ga(m);
    m.backward(xa.view, dya.view, which == 0 ? xa.view : dya.view, ga, o);
    EXPECT_TRUE(same(dx1, which == 0 ? xa.view : dya.view, 1.f)) << which;
    EXPECT_TRUE(same(g1.in_proj_weight(), ga.in_proj_weight(), 1.f)) << which;
  }
  // Cross-attention with x_kv = x_q is self-attention split in two: dx = dx_q + dx_kv.
  Tensor dq(DType::f32, {B, S, dm}), dkv(DType::f32, {B, S, dm});
  MhaGrads gc(m);
  m.backward(x.view, x.view, dy.view, dq, dkv, gc, o);
  for (std::int64_t i = 0; i < dq.numel(); ++i)
    EXPECT_NEAR(dq.data_as<float>()[i] + dkv.data_as<float>()[i], dx1.data_as<float>()[i], 1e-5);
  for (std::int64_t i = 0; i < gc.in_proj_weight().numel(); ++i)
    EXPECT_NEAR(gc.in_proj_weight().data_as<float>()[i], g1.in_proj_weight().data_as<float>()[i], 1e-5);
}

// Empty shapes (forward and backward): no tokens at all, and cross-attention with no keys
// (O = 0, so y = b_O: only db_O = sum dy is non-zero and dx_q = 0).
TEST(MhaBackward, EmptyShapes) {
  const MultiHeadAttention m = make_layer(cfg(12, 4, 2));
  const std::int64_t dm = 12;
  {
    const Tensor x(DType::f32, {2, 0, dm}), dy(DType::f32, {2, 0, dm}), dx(DType::f32, {2, 0, dm});
    MhaGrads g(m);
    m.forward(x, dx);
    m.backward(x, dy, dx, g);
    for (const TensorView& t : {g.in_proj_weight(), g.in_proj_bias(), g.w_o(), g.b_o()})
      for (std::int64_t i = 0; i < t.numel(); ++i) EXPECT_EQ(t.data_as<float>()[i], 0.f);
  }
  const Act xq = make_act(2, 3, dm, Layout::contiguous, 1), dy = make_act(2, 3, dm, Layout::contiguous, 2);
  const Tensor xkv(DType::f32, {2, 0, dm}), dxkv(DType::f32, {2, 0, dm});
  Act dxq = make_act(2, 3, dm, Layout::contiguous, 3);
  MhaGrads g(m);
  Tensor y(DType::f32, {2, 3, dm});
  m.forward(xq.view, xkv, y);  // y = b_O
  for (std::int64_t i = 0; i < y.numel(); ++i)
    EXPECT_EQ(y.data_as<float>()[i], m.b_o().data_as<float>()[i % dm]);
  m.backward(xq.view, xkv, dy.view, dxq.view, dxkv, g);
  for (float v : dxq.mem) EXPECT_EQ(v, 0.f);
  for (const TensorView& t : {g.in_proj_weight(), g.in_proj_bias(), g.w_o()})
    for (std::int64_t i = 0; i < t.numel(); ++i) EXPECT_EQ(t.data_as<float>()[i], 0.f);
  const std::vector<double> dy64 = act64(dy.view);
  for (std::int64_t n = 0; n < dm; ++n) {
    double sum = 0.0;
    for (std::int64_t r = 0; r < 6; ++r) sum += dy64[static_cast<std::size_t>(r * dm + n)];
    EXPECT_NEAR(g.b_o().data_as<float>()[n], sum, 1e-6);
  }
}

// Throws qkv::Error whose message contains `needle`.
template <class F>
void expect_error(F f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << needle;
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(MhaBackward, RefusesBadArgumentsNamingThem) {
  const MultiHeadAttention m = make_layer(cfg(12, 4, 2));
  const std::int64_t B = 2, S = 7, dm = 12;
  const Tensor x(DType::f32, {B, S, dm}), dy(DType::f32, {B, S, dm}), dx(DType::f32, {B, S, dm});
  MhaGrads g(m);
  Tensor dy_short(DType::f32, {B, S - 1, dm}), dy_wide(DType::f32, {B, S, dm + 1});
  Tensor dy64(DType::f64, {B, S, dm});
  expect_error([&] { m.backward(x, dy_short, dx, g); },
               "mha: dy: expected shape [B,S,d_model] = [2,7,12], got [2,6,12]");
  expect_error([&] { m.backward(x, dy_wide, dx, g); }, "mha: dy: expected [B,S,d_model] with d_model == 12");
  expect_error([&] { m.backward(x, dy64, dx, g); }, "mha: dy: expected dtype float32, got float64");
  expect_error([&] { m.backward(x, dy, dy_short, g); }, "mha: dx: expected shape");
  expect_error([&] { m.backward(dy64, dy, dx, g); }, "mha: x: expected dtype float32");
  Tensor dx_bshd(DType::f32, {B, S, dm});
  const TensorView dx_strided(dx_bshd.data(), DType::f32, {B, S, dm}, {S * dm, dm, 2});
  expect_error([&] { m.backward(x, dy, dx_strided, g); }, "mha: dx: expected a contiguous last dimension");
  // Gradients of another layer, or none.
  const MultiHeadAttention other = make_layer(cfg(12, 4, 4));
  MhaGrads g_other(other), g_empty;
  expect_error([&] { m.backward(x, dy, dx, g_other); }, "mha: grads: expected the gradients of this layer");
  expect_error([&] { m.backward(x, dy, dx, g_empty); }, "default-constructed gradients");
  expect_error([] { MhaGrads bad{MultiHeadAttention()}; }, "mha: grads: the layer is default-constructed");
  // Cross-attention.
  const Tensor xkv(DType::f32, {B, 5, dm}), dxkv(DType::f32, {B, 5, dm}), xkv_b(DType::f32, {B + 1, 5, dm});
  expect_error([&] { m.backward(x, xkv, dy, dx, dx, g); },
               "mha: dx_kv: expected shape [B,Sk,d_model] = [2,5,12]");
  expect_error([&] { m.backward(x, xkv, dy_short, dx, dxkv, g); }, "mha: dy: expected shape [B,Sq,d_model]");
  expect_error([&] { m.backward(x, xkv_b, dy, dx, dxkv, g); },
               "mha: x_kv: expected [B,Sk,d_model] with B == x_q.B");
  expect_error([&] { m.backward(x, x, dy, dx, dx, g); }, "mha: dx_kv: expected memory disjoint from dx_q");
  // What attention() refuses surfaces with its own argument names.
  MhaOptions o;
  Tensor mask(DType::b8, {3, S, S});
  o.attention.mask = mask.view();
  expect_error([&] { m.backward(x, dy, dx, g, o); }, "mask");
  expect_error([&] { MultiHeadAttention().backward(x, dy, dx, g); }, "default-constructed");
}

}  // namespace
