// MultiHeadAttention against a float64 implementation of the same layer written here with
// plain loops (projections) and qkv::reference (attention), plus the KV-cache path, weight
// loading under every accepted name, and PyTorch's mask polarity.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/mha.hpp"
#include "qkv/reference.hpp"

namespace {

using qkv::DType;
using qkv::MhaConfig;
using qkv::MhaOptions;
using qkv::MultiHeadAttention;
using qkv::Tensor;
using qkv::TensorView;

void fill_normal(const TensorView& t, std::uint32_t seed, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, sd);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = nd(rng);
}

Tensor random_f32(const qkv::Shape& shape, std::uint32_t seed, float sd = 1.f) {
  Tensor t(DType::f32, shape);
  fill_normal(t.view(), seed, sd);
  return t;
}

MultiHeadAttention make_layer(MhaConfig cfg, std::uint32_t seed = 100) {
  MultiHeadAttention m(cfg);
  const float sd = 1.f / std::sqrt(static_cast<float>(m.config().d_model));
  fill_normal(m.in_proj_weight(), seed, sd);
  fill_normal(m.w_o(), seed + 1, sd);
  if (m.config().qkv_bias) fill_normal(m.in_proj_bias(), seed + 2, 0.1f);
  if (m.config().out_bias) fill_normal(m.b_o(), seed + 3, 0.1f);
  if (m.config().sinks) fill_normal(m.sinks(), seed + 4, 1.0f);
  return m;
}

// BLOOM's ALiBi slopes (Press et al. 2022, sec. 3): 2^(-8h/n) for n a power of two; else those of
// the power of two p below n, then the odd powers of 2^(-4/p).
std::vector<float> bloom_slopes(std::int64_t n) {
  std::int64_t p = 1;
  while (2 * p <= n) p *= 2;
  std::vector<float> s;
  for (std::int64_t h = 1; h <= p; ++h) s.push_back(static_cast<float>(std::pow(2.0, -8.0 * h / p)));
  for (std::int64_t h = 0; h < n - p; ++h) s.push_back(static_cast<float>(std::pow(2.0, -4.0 * (2 * h + 1) / p)));
  return s;
}

// The attention options of a layer's call written out: the caller's, with the layer's sinks (its
// weight) and BLOOM's slopes when configured. `slopes` holds the slopes' memory.
qkv::AttentionParams layer_params(const MultiHeadAttention& m, qkv::AttentionParams p, std::vector<float>& slopes) {
  if (m.config().sinks) p.sinks = m.sinks();
  if (m.config().alibi) {
    slopes = bloom_slopes(m.config().num_heads);
    p.alibi_slopes = TensorView(slopes.data(), DType::f32, {m.config().num_heads});
  }
  return p;
}

// y[b,s,:] = x[b,s,:] W^T + bias, in double. x is [B,S,K] (any strides), W [N,K] contiguous float.
Tensor linear64(const TensorView& x, const TensorView& w, const TensorView& bias) {
  const std::int64_t B = x.size(0), S = x.size(1), K = x.size(2), N = w.size(0);
  Tensor y(DType::f64, {B, S, N});
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t n = 0; n < N; ++n) {
        double acc = bias.empty() ? 0.0 : bias.data_as<float>()[n];
        for (std::int64_t k = 0; k < K; ++k)
          acc += static_cast<double>(x.data_as<float>()[b * x.stride(0) + s * x.stride(1) + k]) *
                 w.data_as<float>()[n * K + k];
        y.data_as<double>()[(b * S + s) * N + n] = acc;
      }
  return y;
}

// The layer in float64: returns y [B,Sq,d_model] as double; probs [B,Hq,Sq,Sk] if requested.
Tensor mha64(const MultiHeadAttention& m, const TensorView& xq, const TensorView& xkv,
             const qkv::AttentionParams& ap, std::optional<TensorView> probs = std::nullopt,
             std::span<const std::int64_t> qpos = {}, std::span<const std::int64_t> kpos = {}) {
  const auto& c = m.config();
  const std::int64_t B = xq.size(0), Sq = xq.size(1), Sk = xkv.size(1);
  const Tensor q = linear64(xq, m.w_q(), m.b_q()), k = linear64(xkv, m.w_k(), m.b_k()),
               v = linear64(xkv, m.w_v(), m.b_v());
  const TensorView qh(q.data(), DType::f64, {B, c.num_heads, Sq, c.head_dim},
                      {Sq * c.num_heads * c.head_dim, c.head_dim, c.num_heads * c.head_dim, 1});
  const TensorView kh(k.data(), DType::f64, {B, c.num_kv_heads, Sk, c.head_dim},
                      {Sk * c.num_kv_heads * c.head_dim, c.head_dim, c.num_kv_heads * c.head_dim, 1});
  const TensorView vh(v.data(), DType::f64, {B, c.num_kv_heads, Sk, c.head_dim_v},
                      {Sk * c.num_kv_heads * c.head_dim_v, c.head_dim_v, c.num_kv_heads * c.head_dim_v, 1});
  if (c.rope) {
    std::vector<std::int64_t> dq(Sq), dk(Sk);
    for (std::int64_t i = 0; i < Sq; ++i) dq[i] = i;
    for (std::int64_t i = 0; i < Sk; ++i) dk[i] = i;
    qkv::apply_rope(qh, qpos.empty() ? std::span<const std::int64_t>(dq) : qpos, *c.rope);
    qkv::apply_rope(kh, kpos.empty() ? std::span<const std::int64_t>(dk) : kpos, *c.rope);
  }
  Tensor o(DType::f64, {B, Sq, c.num_heads * c.head_dim_v});
  const TensorView oh(o.data(), DType::f64, {B, c.num_heads, Sq, c.head_dim_v},
                      {Sq * c.num_heads * c.head_dim_v, c.head_dim_v, c.num_heads * c.head_dim_v, 1});
  qkv::AttentionParams p = ap;
  p.kernel = qkv::KernelKind::reference;
  qkv::reference::attention(qh, kh, vh, oh, p, std::nullopt, probs);
  const std::int64_t N = c.d_model, K = c.num_heads * c.head_dim_v;
  Tensor y(DType::f64, {B, Sq, N});
  for (std::int64_t r = 0; r < B * Sq; ++r)
    for (std::int64_t n = 0; n < N; ++n) {
      double acc = c.out_bias ? m.b_o().data_as<float>()[n] : 0.0;
      for (std::int64_t k2 = 0; k2 < K; ++k2)
        acc += o.data_as<double>()[r * K + k2] * m.w_o().data_as<float>()[n * K + k2];
      y.data_as<double>()[r * N + n] = acc;
    }
  return y;
}

double max_err(const TensorView& got, const Tensor& want) {
  double e = 0;
  const std::int64_t N = want.shape().back();
  for (std::int64_t r = 0; r < want.numel() / N; ++r)
    for (std::int64_t n = 0; n < N; ++n) {
      const std::int64_t b = r / got.size(1), s = r % got.size(1);
      const double g = got.data_as<float>()[b * got.stride(0) + s * got.stride(1) + n];
      const double d = std::abs(g - want.data_as<double>()[r * N + n]);
      e = std::isnan(d) ? INFINITY : std::max(e, d);
    }
  return e;
}

struct Case {
  const char* name;
  MhaConfig cfg;
  std::int64_t B, Sq, Sk;  // Sk < 0: self-attention
  bool causal;
  std::int64_t window_left;
  double softcap;
  std::int64_t keep_first = 0;
};

class MhaVsFloat64 : public ::testing::TestWithParam<Case> {};

TEST_P(MhaVsFloat64, Agrees) {
  const Case& cs = GetParam();
  const MultiHeadAttention m = make_layer(cs.cfg);
  const std::int64_t dm = m.config().d_model;
  const Tensor xq = random_f32({cs.B, cs.Sq, dm}, 1);
  const Tensor xkv = random_f32({cs.B, cs.Sk < 0 ? cs.Sq : cs.Sk, dm}, 2);
  MhaOptions o;
  o.attention.causal = cs.causal;
  o.attention.window_left = cs.window_left;
  o.attention.softcap = cs.softcap;
  o.attention.window_keep_first = cs.keep_first;
  Tensor y(DType::f32, {cs.B, cs.Sq, dm});
  if (cs.Sk < 0)
    m.forward(xq, y, o);
  else
    m.forward(xq, xkv, y, o);
  std::vector<float> slopes;
  const Tensor want = mha64(m, xq, cs.Sk < 0 ? xq.view() : xkv.view(), layer_params(m, o.attention, slopes));
  EXPECT_LE(max_err(y, want), 1e-5) << cs.name;
}

MhaConfig cfg(std::int64_t dm, std::int64_t hq, std::int64_t hkv, std::int64_t d = 0, std::int64_t dv = 0,
              bool bias = true, std::optional<qkv::RopeConfig> rope = std::nullopt) {
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

qkv::RopeConfig rope(qkv::RopeStyle s) {
  qkv::RopeConfig r;
  r.style = s;
  return r;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MhaVsFloat64,
    ::testing::Values(Case{"mha_bias", cfg(32, 4, 4), 2, 7, -1, false, -1, 0.0},
                      Case{"gqa_causal", cfg(32, 4, 2, 0, 0, false), 2, 9, -1, true, -1, 0.0},
                      Case{"mqa_window", cfg(24, 6, 1), 1, 11, -1, true, 3, 0.0},
                      Case{"d_ne_dmodel_dv", cfg(20, 4, 2, 12, 6), 2, 5, -1, false, -1, 0.0},
                      Case{"rope_interleaved", cfg(32, 4, 2, 0, 0, false, rope(qkv::RopeStyle::interleaved)),
                           2, 8, -1, true, -1, 0.0},
                      Case{"rope_half", cfg(48, 4, 4, 0, 0, true, rope(qkv::RopeStyle::half_split)), 1, 6, -1,
                           false, -1, 0.0},
                      Case{"softcap", cfg(16, 2, 2), 2, 4, -1, false, -1, 0.5},
                      Case{"cross", cfg(32, 4, 4), 2, 5, 9, false, -1, 0.0},
                      Case{"cross_gqa_rope", cfg(32, 8, 2, 0, 0, false, rope(qkv::RopeStyle::interleaved)), 1,
                           3, 6, true, -1, 0.0},
                      Case{"seq1", cfg(8, 2, 1), 3, 1, -1, true, -1, 0.0},
                      Case{"sinks_gqa_causal", scored(cfg(32, 4, 2), true, false), 2, 7, -1, true, -1, 0.0},
                      Case{"alibi_6_heads_window_keep_first", scored(cfg(24, 6, 3), false, true), 2, 9, -1, true, 3,
                           0.0, 2},
                      Case{"sinks_alibi_rope_softcap", scored(cfg(32, 4, 4, 0, 0, true, rope(qkv::RopeStyle::half_split)),
                                                              true, true), 1, 6, -1, true, -1, 1.5},
                      Case{"cross_sinks_alibi", scored(cfg(32, 8, 2), true, true), 2, 3, 6, false, -1, 0.0}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(Mha, MaskKvLensAndProbs) {
  const MultiHeadAttention m = make_layer(cfg(16, 4, 2));
  const std::int64_t B = 2, S = 6;
  const Tensor x = random_f32({B, S, 16}, 3);
  Tensor mask(DType::b8, {B, 1, S, S});
  for (std::int64_t i = 0; i < mask.numel(); ++i) mask.data_as<std::uint8_t>()[i] = (i * 7 % 5) != 0;
  std::vector<std::int64_t> lens{6, 4};
  MhaOptions o;
  o.attention.mask = mask.view();
  o.attention.kv_lens = TensorView(lens.data(), DType::i64, {B});
  Tensor probs(DType::f32, {B, 4, S, S});
  o.probs = probs.view();
  Tensor y(DType::f32, {B, S, 16});
  m.forward(x, y, o);
  Tensor p64(DType::f64, {B, 4, S, S});
  const Tensor want = mha64(m, x, x, o.attention, p64.view());
  EXPECT_LE(max_err(y, want), 1e-5);
  double pe = 0;
  for (std::int64_t i = 0; i < probs.numel(); ++i)
    pe = std::max(pe, std::abs(probs.data_as<float>()[i] - p64.data_as<double>()[i]));
  EXPECT_LE(pe, 1e-6);

  // Averaged over heads: [B, Sq, Sk], each admissible row sums to 1.
  Tensor avg(DType::f32, {B, S, S});
  o.probs = avg.view();
  o.average_heads = true;
  m.forward(x, y, o);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t i = 0; i < S; ++i)
      for (std::int64_t j = 0; j < S; ++j) {
        double mean = 0;
        for (std::int64_t h = 0; h < 4; ++h) mean += p64.data_as<double>()[((b * 4 + h) * S + i) * S + j] / 4;
        EXPECT_NEAR(avg.data_as<float>()[(b * S + i) * S + j], mean, 1e-6);
      }
  Tensor wrong(DType::f32, {B, S, S + 1});
  o.probs = wrong.view();
  EXPECT_THROW(m.forward(x, y, o), qkv::Error);
}

TEST(Mha, StridedInputsAndInPlaceOutput) {
  const MultiHeadAttention m = make_layer(cfg(16, 2, 2));
  const std::int64_t B = 3, S = 5;
  // x is a [B,S,16] view with padded rows and a batch stride that is not S * row stride.
  Tensor buf = random_f32({B, S + 2, 20}, 4);
  const TensorView x(buf.data(), DType::f32, {B, S, 16}, {(S + 2) * 20, 20, 1});
  Tensor xc(DType::f32, {B, S, 16});
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t d = 0; d < 16; ++d)
        xc.data_as<float>()[(b * S + s) * 16 + d] = buf.data_as<float>()[b * (S + 2) * 20 + s * 20 + d];
  MhaOptions o;
  o.attention.causal = true;
  const Tensor want = mha64(m, xc, xc, o.attention);
  Tensor y(DType::f32, {B, S, 16});
  m.forward(x, y, o);
  EXPECT_LE(max_err(y, want), 1e-5);
  m.forward(x, x, o);  // y aliases x
  EXPECT_LE(max_err(x, want), 1e-5);

  // One token per batch row, broadcast from a single row (batch stride 0), into a padded output.
  const Tensor row = random_f32({16}, 8);
  const TensorView xb(row.data(), DType::f32, {B, 1, 16}, {0, 16, 1});
  Tensor xr(DType::f32, {B, 1, 16});
  for (std::int64_t b = 0; b < B; ++b) std::memcpy(xr.data_as<float>() + b * 16, row.data(), 64);
  const Tensor want1 = mha64(m, xr, xr, {});
  Tensor ybuf(DType::f32, {B, 1, 24});
  const TensorView yb(ybuf.data(), DType::f32, {B, 1, 16}, {24, 7, 1});
  m.forward(xb, yb);
  EXPECT_LE(max_err(yb, want1), 1e-5);
}

// Runs the layer over the KV cache in chunks and compares with the full causal forward.
void check_cached(const MultiHeadAttention& m, const std::vector<std::int64_t>& chunks, std::int64_t capacity,
                  bool fill_nan) {
  const std::int64_t B = 2, T = 5, dm = m.config().d_model;
  const Tensor x = random_f32({B, T, dm}, 9);
  MhaOptions o;
  o.attention.causal = true;
  Tensor full(DType::f32, {B, T, dm});
  m.forward(x, full, o);
  qkv::KVCache cache(B, m.config().num_kv_heads, capacity, m.config().head_dim);
  if (fill_nan)
    for (const TensorView& s : {cache.keys(), cache.values()})
      for (std::int64_t i = 0; i < s.numel(); ++i)
        s.data_as<float>()[i] = std::numeric_limits<float>::quiet_NaN();
  Tensor y(DType::f32, {B, T, dm});
  std::int64_t t0 = 0;
  for (std::int64_t n : chunks) {
    const TensorView xs(x.data_as<float>() + t0 * dm, DType::f32, {B, n, dm}, {T * dm, dm, 1});
    const TensorView ys(y.data_as<float>() + t0 * dm, DType::f32, {B, n, dm}, {T * dm, dm, 1});
    // Averaged weights of the new queries over every cached key: rows sum to 1, zero beyond the diagonal.
    Tensor w(DType::f32, {B, n, t0 + n});
    MhaOptions ow = o;
    ow.probs = w.view();
    ow.average_heads = true;
    m.forward(xs, cache, ys, ow);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < n; ++i) {
        double sum = 0;
        for (std::int64_t j = 0; j < t0 + n; ++j) {
          const float pj = w.data_as<float>()[(b * n + i) * (t0 + n) + j];
          sum += pj;
          if (j > t0 + i) EXPECT_EQ(pj, 0.0f);
        }
        if (m.config().sinks)
          EXPECT_LT(sum, 1.0);  // the sink takes its share of every row
        else
          EXPECT_NEAR(sum, 1.0, 1e-5);
      }
    t0 += n;
  }
  double e = 0;
  for (std::int64_t i = 0; i < y.numel(); ++i) {
    const double d = std::abs(static_cast<double>(y.data_as<float>()[i]) - full.data_as<float>()[i]);
    e = std::isnan(d) ? INFINITY : std::max(e, d);
  }
  EXPECT_LE(e, 1e-5) << "chunks of " << chunks.size() << ", capacity " << capacity;
  EXPECT_EQ(cache.length(0), T);
}

TEST(Mha, KVCacheTokenByTokenChunkedAndPreallocatedAgreeWithFullForward) {
  for (auto r : {qkv::RopeStyle::interleaved, qkv::RopeStyle::half_split}) {
    const MultiHeadAttention m = make_layer(cfg(32, 4, 2, 0, 0, false, rope(r)));
    check_cached(m, {1, 1, 1, 1, 1}, 5, false);
    check_cached(m, {2, 3}, 5, false);
    check_cached(m, {5}, 5, false);
    check_cached(m, {1, 1, 1, 1, 1}, 32, true);
    check_cached(m, {2, 3}, 32, true);
  }
  // learned sinks and ALiBi: the decoding diagonal is the full sequence's (bottom-right)
  const MultiHeadAttention m = make_layer(scored(cfg(32, 4, 2, 0, 0, false, rope(qkv::RopeStyle::half_split)), true, true));
  check_cached(m, {1, 1, 1, 1, 1}, 5, false);
  check_cached(m, {2, 3}, 32, true);
}

TEST(Mha, KVCacheOverflowIsRefusedAndLeavesTheCacheUnchanged) {
  const MultiHeadAttention m = make_layer(cfg(16, 2, 2));
  qkv::KVCache cache(1, 2, 3, 8);
  const Tensor x = random_f32({1, 2, 16}, 1);
  Tensor y(DType::f32, {1, 2, 16});
  m.forward(x, cache, y);
  try {
    m.forward(x, cache, y);
    ADD_FAILURE() << "expected qkv::Error";
  } catch (const qkv::Error& e) {
    EXPECT_EQ(std::string(e.what()), "kv_cache: append of 2 tokens to sequence 0 at length 2 exceeds the capacity 3 (4 > 3)");
  }
  EXPECT_EQ(cache.length(0), 2);
  qkv::KVCache wrong(1, 1, 8, 8);
  EXPECT_THROW(m.forward(x, wrong, y), qkv::Error);
  // A call the attention refuses (bad softcap) rolls the append back.
  MhaOptions bad;
  bad.attention.softcap = -1;
  const Tensor x1 = random_f32({1, 1, 16}, 2);
  Tensor y1(DType::f32, {1, 1, 16});
  EXPECT_THROW(m.forward(x1, cache, y1, bad), qkv::Error);
  EXPECT_EQ(cache.length(0), 2);
}

TEST(Mha, LoadsPackedAndSeparateWeightNames) {
  const MultiHeadAttention src = make_layer(cfg(16, 4, 4));
  auto copy = [](const TensorView& v) {
    Tensor t(DType::f32, v.shape());
    std::memcpy(t.data(), v.data(), static_cast<std::size_t>(v.numel()) * 4);
    return t;
  };
  const Tensor x = random_f32({2, 3, 16}, 5);
  Tensor want(DType::f32, {2, 3, 16}), got(DType::f32, {2, 3, 16});
  src.forward(x, want);

  std::map<std::string, Tensor> packed;
  packed.emplace("self_attn.in_proj_weight", copy(src.in_proj_weight()));
  packed.emplace("self_attn.in_proj_bias", copy(src.in_proj_bias()));
  packed.emplace("self_attn.out_proj.weight", copy(src.w_o()));
  packed.emplace("self_attn.out_proj.bias", copy(src.b_o()));
  const MhaConfig c = qkv::infer_mha_config(packed, 4, 0, "self_attn.");
  EXPECT_EQ(c.d_model, 16);
  EXPECT_EQ(c.head_dim, 4);
  EXPECT_TRUE(c.qkv_bias && c.out_bias);
  MultiHeadAttention a(c);
  a.load_weights(packed, "self_attn.");
  a.forward(x, got);
  for (std::int64_t i = 0; i < got.numel(); ++i) ASSERT_EQ(got.data_as<float>()[i], want.data_as<float>()[i]);

  std::map<std::string, Tensor> hf;
  hf.emplace("q_proj.weight", copy(src.w_q()));
  hf.emplace("k_proj.weight", copy(src.w_k()));
  hf.emplace("v_proj.weight", copy(src.w_v()));
  hf.emplace("q_proj.bias", copy(src.b_q()));
  hf.emplace("k_proj.bias", copy(src.b_k()));
  hf.emplace("v_proj.bias", copy(src.b_v()));
  hf.emplace("o_proj.weight", copy(src.w_o()));
  hf.emplace("o_proj.bias", copy(src.b_o()));
  MultiHeadAttention b(qkv::infer_mha_config(hf, 4));
  b.load_weights(hf);
  b.forward(x, got);
  for (std::int64_t i = 0; i < got.numel(); ++i) ASSERT_EQ(got.data_as<float>()[i], want.data_as<float>()[i]);

  // float16 weights are converted at load.
  std::map<std::string, Tensor> half;
  for (const auto& [name, t] : packed) {
    Tensor h(DType::f16, t.shape());
    for (std::int64_t i = 0; i < t.numel(); ++i)
      h.data_as<std::uint16_t>()[i] = qkv::float_to_half(t.data_as<float>()[i]);
    half.emplace(name, std::move(h));
  }
  a.load_weights(half, "self_attn.");
  EXPECT_EQ(a.w_q().data_as<float>()[3],
            qkv::half_to_float(qkv::float_to_half(src.w_q().data_as<float>()[3])));

  // Errors: wrong shape, missing tensor, bias disagreeing with the config, ambiguous names.
  std::map<std::string, Tensor> bad;
  bad.emplace("in_proj_weight", Tensor(DType::f32, {47, 16}));
  bad.emplace("out_proj.weight", copy(src.w_o()));
  EXPECT_THROW(qkv::infer_mha_config(bad, 4), qkv::Error);
  MultiHeadAttention nb(cfg(16, 4, 4, 0, 0, false));
  EXPECT_THROW(nb.load_weights(bad), qkv::Error);
  EXPECT_THROW(nb.load_weights(packed, "self_attn."), qkv::Error);  // biases present, config has none
  EXPECT_THROW(a.load_weights(packed, "other."), qkv::Error);
  hf.emplace("in_proj_weight", copy(src.in_proj_weight()));
  EXPECT_THROW(b.load_weights(hf), qkv::Error);
  try {
    a.load_weights(bad);
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("[48,16]"), std::string::npos) << e.what();
  }
}

TEST(Mha, SinksLoadFromTheirNameAndAlibiIsBloomS) {
  const MultiHeadAttention src = make_layer(scored(cfg(16, 4, 2), true, true));
  auto copy = [](const TensorView& v) {
    Tensor t(DType::f32, v.shape());
    std::memcpy(t.data(), v.data(), static_cast<std::size_t>(v.numel()) * 4);
    return t;
  };
  // Hugging Face's gpt-oss attention block, with or without its sinks, or with sinks of `sinks` shape
  auto weights = [&](const qkv::Shape& sinks) {
    std::map<std::string, Tensor> w;
    w.emplace("self_attn.q_proj.weight", copy(src.w_q()));
    w.emplace("self_attn.k_proj.weight", copy(src.w_k()));
    w.emplace("self_attn.v_proj.weight", copy(src.w_v()));
    w.emplace("self_attn.q_proj.bias", copy(src.b_q()));
    w.emplace("self_attn.k_proj.bias", copy(src.b_k()));
    w.emplace("self_attn.v_proj.bias", copy(src.b_v()));
    w.emplace("self_attn.o_proj.weight", copy(src.w_o()));
    w.emplace("self_attn.o_proj.bias", copy(src.b_o()));
    if (sinks == src.sinks().shape())
      w.emplace("self_attn.sinks", copy(src.sinks()));
    else if (!sinks.empty())
      w.emplace("self_attn.sinks", Tensor(DType::f32, sinks));
    return w;
  };
  const std::map<std::string, Tensor> gpt_oss = weights({4}), without = weights({}), wrong = weights({3});
  MhaConfig c = qkv::infer_mha_config(gpt_oss, 4, 2, "self_attn.");
  EXPECT_TRUE(c.sinks);
  EXPECT_FALSE(c.alibi);  // ALiBi has no weight: the config says it
  c.alibi = true;
  MultiHeadAttention a(c);
  a.load_weights(gpt_oss, "self_attn.");
  const std::vector<float> bloom = bloom_slopes(4);
  for (std::int64_t h = 0; h < 4; ++h) {
    EXPECT_EQ(a.sinks().data_as<float>()[h], src.sinks().data_as<float>()[h]);
    EXPECT_EQ(a.alibi_slopes().data_as<float>()[h], bloom[static_cast<std::size_t>(h)]);
  }
  const Tensor x = random_f32({2, 3, 16}, 5);
  Tensor want(DType::f32, {2, 3, 16}), got(DType::f32, {2, 3, 16});
  src.forward(x, want);
  a.forward(x, got);
  for (std::int64_t i = 0; i < got.numel(); ++i) ASSERT_EQ(got.data_as<float>()[i], want.data_as<float>()[i]);
  EXPECT_TRUE(MultiHeadAttention(cfg(16, 4, 2)).sinks().empty());
  EXPECT_TRUE(MultiHeadAttention(cfg(16, 4, 2)).alibi_slopes().empty());

  auto message = [](auto&& f) {
    try {
      f();
    } catch (const qkv::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // sinks in the file but not in the config (silently dropped otherwise), and the reverse
  MultiHeadAttention no_sinks(scored(c, false, true));
  EXPECT_NE(message([&] { no_sinks.load_weights(gpt_oss, "self_attn."); }).find("sinks = false"), std::string::npos);
  EXPECT_NE(message([&] { a.load_weights(without, "self_attn."); }).find("no 'sinks' tensor"), std::string::npos);
  EXPECT_NE(message([&] { a.load_weights(wrong, "self_attn."); }).find("sinks: expected shape [4]"),
            std::string::npos);
  // the layer's sinks or slopes and the options' are exclusive
  Tensor other(DType::f32, {4});
  MhaOptions o;
  o.attention.sinks = other.view();
  EXPECT_NE(message([&] { a.forward(x, got, o); }).find("options.attention.sinks"), std::string::npos);
  o.attention.sinks.reset();
  o.attention.alibi_slopes = other.view();
  EXPECT_NE(message([&] { a.forward(x, got, o); }).find("options.attention.alibi_slopes"), std::string::npos);
  // a layer without them passes the options' through
  MultiHeadAttention plain(cfg(16, 4, 2));
  plain.load_weights(without, "self_attn.");
  o.attention.alibi_slopes.reset();
  o.attention.sinks = src.sinks();
  std::vector<float> slopes = bloom_slopes(4);
  o.attention.alibi_slopes = TensorView(slopes.data(), DType::f32, {4});
  plain.forward(x, got, o);
  for (std::int64_t i = 0; i < got.numel(); ++i) ASSERT_EQ(got.data_as<float>()[i], want.data_as<float>()[i]);
}

TEST(Mha, TorchMaskPolarityIsInverted) {
  // key_padding_mask True = padding (ignore); attn_mask True = not allowed.
  const std::int64_t B = 2, Hq = 2, Sq = 2, Sk = 3;
  Tensor kpm(DType::b8, {B, Sk});
  kpm.data_as<std::uint8_t>()[2] = 1;  // batch 0, key 2 is padding
  Tensor am(DType::b8, {Sq, Sk});
  am.data_as<std::uint8_t>()[1] = 1;  // query 0 may not see key 1
  const Tensor m = qkv::mask_from_torch(am.view(), kpm.view(), B, Hq, Sq, Sk);
  ASSERT_EQ(m.dtype(), DType::b8);
  ASSERT_EQ(m.shape(), (qkv::Shape{B, 1, Sq, Sk}));
  const auto* d = m.data_as<std::uint8_t>();
  EXPECT_EQ(std::vector<int>(d, d + 12), (std::vector<int>{1, 0, 0, 1, 1, 0, 1, 0, 1, 1, 1, 1}));

  Tensor fam(DType::f32, {B * Hq, Sq, Sk});
  fam.data_as<float>()[0] = -2.5f;
  const Tensor f = qkv::mask_from_torch(fam.view(), kpm.view(), B, Hq, Sq, Sk);
  ASSERT_EQ(f.dtype(), DType::f32);
  ASSERT_EQ(f.shape(), (qkv::Shape{B, Hq, Sq, Sk}));
  EXPECT_EQ(f.data_as<float>()[0], -2.5f);
  EXPECT_EQ(f.data_as<float>()[2], -INFINITY);
  EXPECT_EQ(f.data_as<float>()[1], 0.0f);

  // Through the layer: padding keys have zero weight.
  const MultiHeadAttention layer = make_layer(cfg(8, 2, 2));
  const Tensor x = random_f32({B, Sk, 8}, 1);
  const Tensor mk = qkv::mask_from_torch(std::nullopt, kpm.view(), B, Hq, Sk, Sk);
  MhaOptions o;
  o.attention.mask = mk.view();
  Tensor probs(DType::f32, {B, Hq, Sk, Sk});
  o.probs = probs.view();
  Tensor y(DType::f32, {B, Sk, 8});
  layer.forward(x, y, o);
  for (std::int64_t h = 0; h < Hq; ++h)
    for (std::int64_t i = 0; i < Sk; ++i) EXPECT_EQ(probs.data_as<float>()[(h * Sk + i) * Sk + 2], 0.0f);
  Tensor short_kpm(DType::b8, {B, Sk - 1});
  EXPECT_THROW(qkv::mask_from_torch(std::nullopt, short_kpm.view(), B, Hq, Sq, Sk), qkv::Error);
  Tensor int_mask(DType::i32, {Sq, Sk});
  EXPECT_THROW(qkv::mask_from_torch(int_mask.view(), std::nullopt, B, Hq, Sq, Sk), qkv::Error);
  EXPECT_TRUE(qkv::mask_from_torch(std::nullopt, std::nullopt, B, Hq, Sq, Sk).shape().empty());
}

TEST(Mha, RefusesBadConfigsAndInputs) {
  {
    const MultiHeadAttention empty;
    Tensor x(DType::f32, {1, 1, 4}), y(DType::f32, {1, 1, 4});
    EXPECT_THROW(empty.forward(x, y), qkv::Error);
  }
  EXPECT_THROW(MultiHeadAttention(cfg(10, 4, 4)), qkv::Error);  // 10 % 4 without head_dim
  EXPECT_THROW(MultiHeadAttention(cfg(16, 4, 3)), qkv::Error);  // Hq % Hkv
  EXPECT_THROW(MultiHeadAttention(cfg(0, 4, 4)), qkv::Error);
  qkv::RopeConfig odd;
  odd.rotary_dim = 3;
  EXPECT_THROW(MultiHeadAttention(cfg(16, 4, 4, 0, 0, true, odd)), qkv::Error);
  const MultiHeadAttention m = make_layer(cfg(16, 4, 4));
  const Tensor x = random_f32({2, 3, 12}, 1);
  Tensor y(DType::f32, {2, 3, 16});
  try {
    m.forward(x, y);
    FAIL();
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("d_model == 16"), std::string::npos) << e.what();
  }
  const Tensor x2 = random_f32({2, 3, 16}, 1);
  Tensor y2(DType::f32, {2, 4, 16});
  EXPECT_THROW(m.forward(x2, y2), qkv::Error);
  Tensor x64(DType::f64, {2, 3, 16});
  EXPECT_THROW(m.forward(x64, y), qkv::Error);
  const Tensor xkv = random_f32({3, 3, 16}, 1);
  Tensor y3(DType::f32, {2, 3, 16});
  EXPECT_THROW(m.forward(x2, xkv, y3), qkv::Error);
}

}  // namespace

namespace {

// One attention block of llama2.c's run.c forward() for the token at `pos`, in its float
// arithmetic: q = Wq x, k = Wk x, v = Wv x; RoPE on (even, odd) pairs; k, v into the cache;
// per head softmax(q.k / sqrt(head_size)) over positions 0..pos (GQA: head h reads h / kv_mul);
// out = Wo xb.
void llama2c_attention(const float* x, int pos, int dim, int n_heads, int n_kv_heads, const float* wq,
                       const float* wk, const float* wv, const float* wo, float* key_cache,
                       float* value_cache, float* out) {
  const int head_size = dim / n_heads, kv_dim = n_kv_heads * head_size, kv_mul = n_heads / n_kv_heads;
  auto matmul = [](float* xout, const float* xin, const float* w, int n, int d) {
    for (int i = 0; i < d; i++) {
      float val = 0.0f;
      for (int j = 0; j < n; j++) val += w[i * n + j] * xin[j];
      xout[i] = val;
    }
  };
  std::vector<float> q(dim), xb(dim), att(pos + 1);
  float* k = key_cache + pos * kv_dim;
  float* v = value_cache + pos * kv_dim;
  matmul(q.data(), x, wq, dim, dim);
  matmul(k, x, wk, dim, kv_dim);
  matmul(v, x, wv, dim, kv_dim);
  for (int i = 0; i < dim; i += 2) {
    int head_dim = i % head_size;
    float freq = 1.0f / powf(10000.0f, head_dim / static_cast<float>(head_size));
    float val = pos * freq;
    float fcr = cosf(val), fci = sinf(val);
    int rotn = i < kv_dim ? 2 : 1;
    for (int r = 0; r < rotn; r++) {
      float* vec = r == 0 ? q.data() : k;
      float v0 = vec[i], v1 = vec[i + 1];
      vec[i] = v0 * fcr - v1 * fci;
      vec[i + 1] = v0 * fci + v1 * fcr;
    }
  }
  for (int h = 0; h < n_heads; h++) {
    const float* qh = q.data() + h * head_size;
    for (int t = 0; t <= pos; t++) {
      const float* kt = key_cache + t * kv_dim + (h / kv_mul) * head_size;
      float score = 0.0f;
      for (int i = 0; i < head_size; i++) score += qh[i] * kt[i];
      att[t] = score / sqrtf(static_cast<float>(head_size));
    }
    float max_val = att[0];
    for (int t = 1; t <= pos; t++) max_val = std::max(max_val, att[t]);
    float sum = 0.0f;
    for (int t = 0; t <= pos; t++) sum += (att[t] = expf(att[t] - max_val));
    for (int t = 0; t <= pos; t++) att[t] /= sum;
    float* xh = xb.data() + h * head_size;
    std::fill(xh, xh + head_size, 0.0f);
    for (int t = 0; t <= pos; t++) {
      const float* vt = value_cache + t * kv_dim + (h / kv_mul) * head_size;
      for (int i = 0; i < head_size; i++) xh[i] += att[t] * vt[i];
    }
  }
  matmul(out, xb.data(), wo, dim, dim);
}

TEST(Mha, MatchesLlama2cAttentionBlockTokenByTokenAndPrefill) {
  // The stories260K shape: dim 64, 8 query heads, 4 KV heads, head_dim 8; RoPE as llama2.c.
  const int dim = 64, Hq = 8, Hkv = 4, T = 12;
  qkv::RopeConfig r;
  r.angles = qkv::RopeAngles::llama2c_f32;
  const MultiHeadAttention m = make_layer(cfg(dim, Hq, Hkv, 0, 0, false, r), 7);
  const Tensor x = random_f32({1, T, dim}, 21);
  std::vector<float> kc(T * dim), vc(T * dim), want(T * dim);
  for (int pos = 0; pos < T; ++pos)
    llama2c_attention(x.data_as<float>() + pos * dim, pos, dim, Hq, Hkv, m.w_q().data_as<float>(),
                      m.w_k().data_as<float>(), m.w_v().data_as<float>(), m.w_o().data_as<float>(), kc.data(),
                      vc.data(), want.data() + pos * dim);
  MhaOptions o;
  o.attention.causal = true;
  // Token by token into a larger cache whose unused slots hold NaN.
  qkv::KVCache cache(1, Hkv, 64, dim / Hq);
  for (const TensorView& s : {cache.keys(), cache.values()})
    for (std::int64_t i = 0; i < s.numel(); ++i)
      s.data_as<float>()[i] = std::numeric_limits<float>::quiet_NaN();
  Tensor y(DType::f32, {1, T, dim});
  for (int pos = 0; pos < T; ++pos)
    m.forward(TensorView(x.data_as<float>() + pos * dim, DType::f32, {1, 1, dim}), cache,
              TensorView(y.data_as<float>() + pos * dim, DType::f32, {1, 1, dim}), o);
  double e = 0;
  for (int i = 0; i < T * dim; ++i)
    e = std::max(e, std::abs(static_cast<double>(y.data_as<float>()[i]) - want[i]));
  EXPECT_LE(e, 1e-5) << "decode";
  // The cached keys are llama2.c's key cache, rotated: [Hkv, pos, D] vs [pos, Hkv*D].
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < Hkv; ++h)
      for (int d = 0; d < dim / Hq; ++d)
        EXPECT_NEAR(cache.keys().data_as<float>()[(h * 64 + t) * (dim / Hq) + d],
                    kc[t * Hkv * (dim / Hq) + h * 8 + d], 1e-5);
  // Prefill of all T tokens at once, then the same through the plain self-attention forward.
  qkv::KVCache fresh(1, Hkv, T, dim / Hq);
  Tensor y2(DType::f32, {1, T, dim}), y3(DType::f32, {1, T, dim});
  m.forward(x, fresh, y2, o);
  m.forward(x, y3, o);
  double e2 = 0, e3 = 0;
  for (int i = 0; i < T * dim; ++i) {
    e2 = std::max(e2, std::abs(static_cast<double>(y2.data_as<float>()[i]) - want[i]));
    e3 = std::max(e3, std::abs(static_cast<double>(y3.data_as<float>()[i]) - want[i]));
  }
  EXPECT_LE(e2, 1e-5) << "prefill through the cache";
  EXPECT_LE(e3, 1e-5) << "prefill without a cache";
}

}  // namespace
