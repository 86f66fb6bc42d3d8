// The score options sinks, alibi_slopes and window_keep_first: qkv::alibi_slopes against the
// published values; the float64 reference against hand-computed rows and against a naive
// transcription of docs/semantics.md combined with every other option; the float64 backward
// (dq, dk, dv, d z) against central finite differences; every entry point runs them (the dense
// forward on decode or flash, the backward on flash, packed, paged and quantized batches on
// serving), as explain_dispatch names; the options' errors. The fast kernels' accuracy with them: tests/test_score_options_kernels.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "qkv/backward.hpp"
#include "qkv/error.hpp"
#include "qkv/kv_cache.hpp"
#include "qkv/kv_quant.hpp"
#include "qkv/reference.hpp"
#include "qkv/varlen.hpp"

namespace qkv::test {
namespace {

using i64 = std::int64_t;
constexpr double kInf = std::numeric_limits<double>::infinity();

double* f64(const Tensor& t) { return static_cast<double*>(t.data()); }
float* f32(const Tensor& t) { return static_cast<float*>(t.data()); }

// ---- qkv::alibi_slopes --------------------------------------------------------------------------

TEST(AlibiSlopes, KnownValues) {
  // n = 8: 2^-1 .. 2^-8 (Press et al. 2022, sec. 3).
  std::vector<float> s = alibi_slopes(8);
  ASSERT_EQ(s.size(), 8u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(s[i], std::ldexp(1.0f, -(i + 1))) << i;
  // n = 16: 2^-0.5, 2^-1, ..., 2^-8.
  s = alibi_slopes(16);
  ASSERT_EQ(s.size(), 16u);
  for (int i = 0; i < 16; ++i) EXPECT_FLOAT_EQ(s[i], static_cast<float>(std::exp2(-0.5 * (i + 1)))) << i;
  // n = 12 (BLOOM's interleaving): the 8 slopes of 8 heads, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5.
  s = alibi_slopes(12);
  ASSERT_EQ(s.size(), 12u);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(s[i], std::ldexp(1.0f, -(i + 1))) << i;
  const double extra[] = {0.7071067811865476, 0.35355339059327373, 0.17677669529663687, 0.08838834764831843};
  for (int i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(s[8 + i], static_cast<float>(extra[i])) << i;
  s = alibi_slopes(1);
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0], 1.0f / 256.0f);
  EXPECT_TRUE(alibi_slopes(0).empty());
  EXPECT_THROW(alibi_slopes(-1), Error);
}

// ---- hand-computed rows -------------------------------------------------------------------------

// One head, D = 1, scale 1: s_ij = q_i k_j.
struct Tiny {
  Tensor q, k, v, out, lse;
  Tiny(std::vector<double> qs, std::vector<double> ks, std::vector<double> vs)
      : q(DType::f64, {1, 1, static_cast<i64>(qs.size()), 1}),
        k(DType::f64, {1, 1, static_cast<i64>(ks.size()), 1}),
        v(DType::f64, {1, 1, static_cast<i64>(vs.size()), 1}),
        out(DType::f64, {1, 1, static_cast<i64>(qs.size()), 1}),
        lse(DType::f64, {1, 1, static_cast<i64>(qs.size())}) {
    std::copy(qs.begin(), qs.end(), f64(q));
    std::copy(ks.begin(), ks.end(), f64(k));
    std::copy(vs.begin(), vs.end(), f64(v));
  }
  void run(AttentionParams p) {
    p.scale = 1.0;
    reference::attention(q, k, v, out, p, lse.view());
  }
};

TEST(ScoreOptionsReference, SinkJoinsTheDenominator) {
  // s = [0, ln 2], z = 0: exp = [1, 2], sink 1, sum 4; O = (1 * 4 + 2 * 8) / 4 = 5, lse = ln 4.
  Tiny t({1.0}, {0.0, std::log(2.0)}, {4.0, 8.0});
  float z = 0.0f;
  AttentionParams p;
  p.sinks = TensorView(&z, DType::f32, {1});
  t.run(p);
  EXPECT_NEAR(f64(t.out)[0], 5.0, 1e-14);
  EXPECT_NEAR(f64(t.lse)[0], std::log(4.0), 1e-14);
  // A sink far above the scores takes the whole row: O -> 0, lse -> z.
  z = 80.0f;
  t.run(p);
  EXPECT_NEAR(f64(t.out)[0], 0.0, 1e-30);
  EXPECT_NEAR(f64(t.lse)[0], 80.0, 1e-12);
}

TEST(ScoreOptionsReference, EmptyRowWithASinkGivesZeroAndTheSinkLogit) {
  Tiny t({1.0, 2.0}, {0.5, 0.25}, {4.0, 8.0});
  float z = -1.5f;
  std::int64_t len = 0;
  AttentionParams p;
  p.sinks = TensorView(&z, DType::f32, {1});
  p.kv_lens = TensorView(&len, DType::i64, {1});
  t.run(p);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(f64(t.out)[i], 0.0);
    EXPECT_EQ(f64(t.lse)[i], -1.5);
  }
}

TEST(ScoreOptionsReference, AlibiBiasFollowsTheDiagonal) {
  // q = 0: the scores are the bias alone. Sq = 2, Sk = 3, slope 1.
  Tiny t({0.0, 0.0}, {0.0, 0.0, 0.0}, {1.0, 10.0, 100.0});
  float slope = 1.0f;
  AttentionParams p;
  p.alibi_slopes = TensorView(&slope, DType::f32, {1});
  const double e1 = std::exp(-1.0), e2 = std::exp(-2.0);
  // bottom_right: row 0 sits at key 1 (bias -1, 0, -1), row 1 at key 2 (-2, -1, 0).
  t.run(p);
  EXPECT_NEAR(f64(t.out)[0], (e1 * 1 + 10 + e1 * 100) / (1 + 2 * e1), 1e-12);
  EXPECT_NEAR(f64(t.out)[1], (e2 * 1 + e1 * 10 + 100) / (1 + e1 + e2), 1e-12);
  EXPECT_NEAR(f64(t.lse)[1], std::log(1 + e1 + e2), 1e-14);
  // top_left and causal: row 0 sees key 0 only, row 1 keys 0, 1 with bias -1, 0.
  p.align = Alignment::top_left;
  p.causal = true;
  t.run(p);
  EXPECT_NEAR(f64(t.out)[0], 1.0, 1e-14);
  EXPECT_NEAR(f64(t.out)[1], (e1 * 1 + 10) / (1 + e1), 1e-12);
  // The bias comes after softcap: softcap changes nothing when the scores are 0.
  p.softcap = 0.5;
  t.run(p);
  EXPECT_NEAR(f64(t.out)[1], (e1 * 1 + 10) / (1 + e1), 1e-12);
}

TEST(ScoreOptionsReference, KeepFirstExtendsTheLeftSideOnly) {
  // Six keys of value j, q = 0 (uniform weights). One query at key 5, window (1, 0).
  Tiny t({0.0}, {0, 0, 0, 0, 0, 0}, {0, 1, 2, 3, 4, 5});
  AttentionParams p;
  p.window_left = 1;
  p.window_right = 0;
  p.window_keep_first = 2;
  t.run(p);
  EXPECT_NEAR(f64(t.out)[0], (0 + 1 + 4 + 5) / 4.0, 1e-14);
  // Overlapping the window: keys 0..3 kept, 4, 5 in the window: all six.
  p.window_keep_first = 4;
  t.run(p);
  EXPECT_NEAR(f64(t.out)[0], 2.5, 1e-14);
  // The right bound still applies: top_left, query 0 at key 0, window (0, 0): key 0 only.
  p.align = Alignment::top_left;
  p.window_left = 0;
  p.window_keep_first = 3;
  t.run(p);
  EXPECT_NEAR(f64(t.out)[0], 0.0, 1e-14);
  // Key lengths too: two keys, keep 5 first, no window: keys 0, 1.
  std::int64_t len = 2;
  p = {};
  p.window_keep_first = 5;
  p.kv_lens = TensorView(&len, DType::i64, {1});
  t.run(p);
  EXPECT_NEAR(f64(t.out)[0], 0.5, 1e-14);
}

// ---- the reference against a naive transcription of the semantics, every option combined -------

struct Case {
  i64 B = 2, Hq = 4, Hkv = 2, Sq = 3, Sk = 5, D = 3, Dv = 2;
  bool causal = false;
  i64 wl = -1, wr = -1;
  Alignment align = Alignment::bottom_right;
  double softcap = 0.0;
  int mask = 0;  // 1: bool [Sq, Sk]; 2: additive [B, 1, Sq, Sk] with some -inf
  bool kv_lens = false;
  bool sinks = false;
  int alibi = 0;  // 1: [Hq]; 2: [B, Hq]
  i64 keep = 0;
  std::string name() const {
    return "B" + std::to_string(B) + " Hq" + std::to_string(Hq) + " Hkv" + std::to_string(Hkv) + " Sq" +
           std::to_string(Sq) + " Sk" + std::to_string(Sk) + (causal ? " causal" : "") + " win(" + std::to_string(wl) +
           "," + std::to_string(wr) + ")" + (align == Alignment::top_left ? " top_left" : "") + " cap" +
           std::to_string(softcap) + " mask" + std::to_string(mask) + (kv_lens ? " kv_lens" : "") +
           (sinks ? " sinks" : "") + " alibi" + std::to_string(alibi) + " keep" + std::to_string(keep);
  }
};

struct Inputs {
  Case c;
  Tensor q, k, v, dout, mask, lens, sinks, slopes;
  AttentionParams p;
  explicit Inputs(const Case& cs, std::uint64_t seed = 11) : c(cs) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(-1.5, 1.5);
    auto make = [&](i64 H, i64 S, i64 X) {
      Tensor t(DType::f64, {c.B, H, S, X});
      for (i64 i = 0; i < t.numel(); ++i) f64(t)[i] = u(rng);
      return t;
    };
    q = make(c.Hq, c.Sq, c.D);
    k = make(c.Hkv, c.Sk, c.D);
    v = make(c.Hkv, c.Sk, c.Dv);
    dout = make(c.Hq, c.Sq, c.Dv);
    p.causal = c.causal;
    p.window_left = c.wl;
    p.window_right = c.wr;
    p.align = c.align;
    p.softcap = c.softcap;
    p.window_keep_first = c.keep;
    if (c.mask == 1) {
      mask = Tensor(DType::b8, {c.Sq, c.Sk});
      for (i64 i = 0; i < mask.numel(); ++i) static_cast<std::uint8_t*>(mask.data())[i] = rng() % 4 != 0;
      p.mask = mask.view();
    } else if (c.mask == 2) {
      mask = Tensor(DType::f64, {c.B, 1, c.Sq, c.Sk});
      for (i64 i = 0; i < mask.numel(); ++i) f64(mask)[i] = rng() % 5 == 0 ? -kInf : u(rng);
      p.mask = mask.view();
    }
    if (c.kv_lens) {
      lens = Tensor(DType::i64, {c.B});
      for (i64 b = 0; b < c.B; ++b) static_cast<i64*>(lens.data())[b] = c.Sk - 1 - b % 2 * (c.Sk - 1);  // Sk-1, 0, ...
      p.kv_lens = lens.view();
    }
    if (c.sinks) {
      // Dyadic values: sinks +- 2^-10 are exact in float32 (finite differences below).
      sinks = Tensor(DType::f32, {c.Hq});
      for (i64 h = 0; h < c.Hq; ++h) f32(sinks)[h] = static_cast<float>(static_cast<int>(rng() % 17) - 8) / 8.0f;
      p.sinks = sinks.view();
    }
    if (c.alibi) {
      slopes = c.alibi == 1 ? Tensor(DType::f32, {c.Hq}) : Tensor(DType::f32, {c.B, c.Hq});
      const std::vector<float> std_slopes = alibi_slopes(c.Hq);
      for (i64 i = 0; i < slopes.numel(); ++i) f32(slopes)[i] = std_slopes[i % c.Hq] * (1 + i / c.Hq);
      p.alibi_slopes = slopes.view();
    }
  }
  double at(const Tensor& t, i64 b, i64 h, i64 s, i64 x) const {
    return f64(t)[((b * t.shape()[1] + h) * t.shape()[2] + s) * t.shape()[3] + x];
  }
};

// docs/semantics.md, transcribed without the reference's structure: out and softmax_lse.
void naive(const Inputs& in, std::vector<double>& out, std::vector<double>& lse) {
  const Case& c = in.c;
  out.assign(static_cast<std::size_t>(c.B * c.Hq * c.Sq * c.Dv), 0.0);
  lse.assign(static_cast<std::size_t>(c.B * c.Hq * c.Sq), 0.0);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.D));
  i64 R = c.wr;
  if (c.causal) R = R < 0 ? 0 : std::min<i64>(R, 0);
  for (i64 b = 0; b < c.B; ++b)
    for (i64 h = 0; h < c.Hq; ++h)
      for (i64 i = 0; i < c.Sq; ++i) {
        const i64 len = c.kv_lens ? static_cast<const i64*>(in.lens.data())[b] : c.Sk;
        const i64 d = c.align == Alignment::bottom_right ? i + len - c.Sq : i;
        std::vector<double> s;
        std::vector<i64> keys;
        for (i64 j = 0; j < c.Sk; ++j) {
          const bool right_ok = j < len && (R < 0 || j <= d + R);
          const bool left_ok = c.wl < 0 || j >= d - c.wl || j < c.keep;
          double add = 0.0;
          if (c.mask == 1 && !static_cast<const std::uint8_t*>(in.mask.data())[i * c.Sk + j]) continue;
          if (c.mask == 2) add = f64(in.mask)[(b * c.Sq + i) * c.Sk + j];
          if (!right_ok || !left_ok || add == -kInf) continue;
          double x = 0.0;
          for (i64 e = 0; e < c.D; ++e) x += in.at(in.q, b, h, i, e) * in.at(in.k, b, h / (c.Hq / c.Hkv), j, e);
          x *= scale;
          if (c.softcap > 0) x = c.softcap * std::tanh(x / c.softcap);
          if (c.alibi) x -= f32(in.slopes)[(c.alibi == 2 ? b * c.Hq : 0) + h] * std::abs(static_cast<double>(d - j));
          s.push_back(x + add);
          keys.push_back(j);
        }
        const double z = c.sinks ? f32(in.sinks)[h] : -kInf;
        double m = z;
        for (double x : s) m = std::max(m, x);
        const std::size_t row = static_cast<std::size_t>((b * c.Hq + h) * c.Sq + i);
        if (m == -kInf) {
          lse[row] = -kInf;
          continue;
        }
        double den = c.sinks ? std::exp(z - m) : 0.0;
        for (double x : s) den += std::exp(x - m);
        lse[row] = m + std::log(den);
        for (std::size_t t = 0; t < s.size(); ++t)
          for (i64 e = 0; e < c.Dv; ++e)
            out[row * c.Dv + e] += std::exp(s[t] - m) / den * in.at(in.v, b, h / (c.Hq / c.Hkv), keys[t], e);
      }
}

std::vector<Case> combined_cases() {
  std::vector<Case> cs;
  for (int alibi : {0, 1, 2})
    for (bool sinks : {false, true})
      for (i64 keep : {0, 2}) {
        Case c;
        c.alibi = alibi;
        c.sinks = sinks;
        c.keep = keep;
        cs.push_back(c);
        Case w = c;  // window, causal, top_left, Sq > Sk
        w.causal = true;
        w.wl = 1;
        w.align = Alignment::top_left;
        w.Sq = 6;
        w.Sk = 4;
        cs.push_back(w);
        Case m = c;  // bool mask, key lengths, softcap, window on both sides
        m.mask = 1;
        m.kv_lens = true;
        m.softcap = 0.7;
        m.wl = 1;
        m.wr = 1;
        m.Sq = 4;
        m.Sk = 7;
        cs.push_back(m);
        Case a = c;  // additive mask, MHA, bottom_right causal window, odd sizes
        a.mask = 2;
        a.Hq = 3;
        a.Hkv = 3;
        a.causal = true;
        a.wl = 2;
        a.Sq = 5;
        a.Sk = 9;
        a.D = 5;
        a.Dv = 1;
        cs.push_back(a);
      }
  return cs;
}

TEST(ScoreOptionsReference, MatchesTheSemanticsWithEveryOption) {
  for (const Case& c : combined_cases()) {
    SCOPED_TRACE(c.name());
    Inputs in(c);
    Tensor out(DType::f64, {c.B, c.Hq, c.Sq, c.Dv}), lse(DType::f64, {c.B, c.Hq, c.Sq});
    AttentionParams p = in.p;
    p.kernel = KernelKind::reference;
    attention(in.q, in.k, in.v, out, p, lse.view());
    std::vector<double> want_o, want_l;
    naive(in, want_o, want_l);
    for (std::size_t e = 0; e < want_o.size(); ++e) ASSERT_NEAR(f64(out)[e], want_o[e], 1e-12) << e;
    for (std::size_t e = 0; e < want_l.size(); ++e) {
      if (std::isinf(want_l[e])) ASSERT_EQ(f64(lse)[e], want_l[e]) << e;
      else ASSERT_NEAR(f64(lse)[e], want_l[e], 1e-12) << e;
    }
  }
}

// ---- the float64 backward against central finite differences -------------------------------------

// L = sum(dO * O) of the float64 forward.
double loss(const Inputs& in, const AttentionParams& p) {
  const Case& c = in.c;
  Tensor out(DType::f64, {c.B, c.Hq, c.Sq, c.Dv});
  reference::attention(in.q, in.k, in.v, out, p);
  double l = 0.0;
  for (i64 e = 0; e < out.numel(); ++e) l += f64(out)[e] * f64(in.dout)[e];
  return l;
}

TEST(ScoreOptionsBackward, MatchesFiniteDifferences) {
  for (const Case& c : combined_cases()) {
    SCOPED_TRACE(c.name());
    Inputs in(c);
    Tensor out(DType::f64, {c.B, c.Hq, c.Sq, c.Dv}), lse(DType::f64, {c.B, c.Hq, c.Sq});
    reference::attention(in.q, in.k, in.v, out, in.p, lse.view());
    Tensor dq(DType::f64, in.q.shape()), dk(DType::f64, in.k.shape()), dv(DType::f64, in.v.shape());
    Tensor dz(DType::f32, {c.Hq});
    // Through the registry (automatic: the reference takes the options).
    if (c.sinks)
      attention_backward(in.q, in.k, in.v, out, lse, in.dout, dq, dk, dv, dz, in.p);
    else
      attention_backward(in.q, in.k, in.v, out, lse, in.dout, dq, dk, dv, in.p);
    const double eps = 1e-5;
    for (const auto& [t, g] : {std::pair{&in.q, &dq}, std::pair{&in.k, &dk}, std::pair{&in.v, &dv}})
      for (i64 e = 0; e < t->numel(); ++e) {
        const double x = f64(*t)[e];
        f64(*t)[e] = x + eps;
        const double lp = loss(in, in.p);
        f64(*t)[e] = x - eps;
        const double lm = loss(in, in.p);
        f64(*t)[e] = x;
        ASSERT_NEAR(f64(*g)[e], (lp - lm) / (2 * eps), 1e-7) << e;
      }
    if (!c.sinks) continue;
    const float h = std::ldexp(1.0f, -10);
    for (i64 e = 0; e < c.Hq; ++e) {
      const float z = f32(in.sinks)[e];
      f32(in.sinks)[e] = z + h;
      const double lp = loss(in, in.p);
      f32(in.sinks)[e] = z - h;
      const double lm = loss(in, in.p);
      f32(in.sinks)[e] = z;
      ASSERT_NEAR(f32(dz)[e], (lp - lm) / (2.0 * h), 2e-5) << e;
    }
    // The overload without grad_sinks gives the same dq, dk, dv.
    Tensor dq2(DType::f64, in.q.shape()), dk2(DType::f64, in.k.shape()), dv2(DType::f64, in.v.shape());
    attention_backward(in.q, in.k, in.v, out, lse, in.dout, dq2, dk2, dv2, in.p);
    EXPECT_EQ(std::memcmp(dq.data(), dq2.data(), dq.nbytes()), 0);
    EXPECT_EQ(std::memcmp(dk.data(), dk2.data(), dk.nbytes()), 0);
    EXPECT_EQ(std::memcmp(dv.data(), dv2.data(), dv.nbytes()), 0);
  }
}

TEST(ScoreOptionsBackward, EmptyRowsGiveNoSinkGradient) {
  Case c;
  c.sinks = true;
  c.kv_lens = true;  // batch 1 has no key
  c.B = 2;
  Inputs in(c);
  Tensor out(DType::f64, {c.B, c.Hq, c.Sq, c.Dv}), lse(DType::f64, {c.B, c.Hq, c.Sq});
  reference::attention(in.q, in.k, in.v, out, in.p, lse.view());
  Tensor dq(DType::f64, in.q.shape()), dk(DType::f64, in.k.shape()), dv(DType::f64, in.v.shape());
  Tensor dz_all(DType::f32, {c.Hq}), dz_first(DType::f32, {c.Hq});
  attention_backward(in.q, in.k, in.v, out, lse, in.dout, dq, dk, dv, dz_all, in.p);
  // Batch 0 alone gives the same dz: batch 1's rows (O = 0, D = 0) add nothing.
  const auto first = [](const Tensor& t) {
    Shape s = t.shape();
    s[0] = 1;
    return TensorView(t.data(), t.dtype(), s, t.view().strides());
  };
  Tensor dq1(DType::f64, {1, c.Hq, c.Sq, c.D}), dk1(DType::f64, {1, c.Hkv, c.Sk, c.D}), dv1(DType::f64, {1, c.Hkv, c.Sk, c.Dv});
  AttentionParams p = in.p;
  p.kv_lens = TensorView(in.lens.data(), DType::i64, {1});
  attention_backward(first(in.q), first(in.k), first(in.v), first(out), TensorView(lse.data(), DType::f64, {1, c.Hq, c.Sq}),
                     first(in.dout), dq1, dk1, dv1, dz_first, p);
  for (i64 h = 0; h < c.Hq; ++h) EXPECT_EQ(f32(dz_all)[h], f32(dz_first)[h]);
  for (i64 e = c.Hq * c.Sq * c.D; e < dq.numel(); ++e) EXPECT_EQ(f64(dq)[e], 0.0);
}

// ---- every entry point: which kernel runs the options, and explain_dispatch says why the others refuse

struct F32Call {
  i64 B = 2, Hq = 4, Hkv = 2, Sq = 3, Sk = 6, D = 8;
  Tensor q, k, v, sinks, slopes;
  explicit F32Call(std::uint64_t seed = 3) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    auto make = [&](Shape s) {
      Tensor t(DType::f32, s);
      for (i64 i = 0; i < t.numel(); ++i) f32(t)[i] = u(rng);
      return t;
    };
    q = make({B, Hq, Sq, D});
    k = make({B, Hkv, Sk, D});
    v = make({B, Hkv, Sk, D});
    sinks = make({Hq});
    slopes = make({B, Hq});
  }
  // The options one at a time, then all three.
  std::vector<std::pair<std::string, AttentionParams>> option_sets() const {
    std::vector<std::pair<std::string, AttentionParams>> sets(4);
    sets[0].first = "sinks";
    sets[0].second.sinks = sinks.view();
    sets[1].first = "alibi_slopes";
    sets[1].second.alibi_slopes = slopes.view();
    sets[2].first = "window_keep_first";
    sets[2].second.window_keep_first = 2;
    sets[2].second.window_left = 1;
    sets[2].second.causal = true;
    sets[3].first = "sinks, alibi_slopes, window_keep_first";
    sets[3].second = sets[2].second;
    sets[3].second.sinks = sinks.view();
    sets[3].second.alibi_slopes = slopes.view();
    return sets;
  }
};

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(ScoreOptionsDispatch, DenseForwardRunsDecodeAndBackwardFlash) {
  F32Call f;
  for (const auto& [names, params] : f.option_sets()) {
    SCOPED_TRACE(names);
    Tensor out(DType::f32, {f.B, f.Hq, f.Sq, f.D}), lse(DType::f32, {f.B, f.Hq, f.Sq});
    const std::string e = explain_dispatch(f.q, f.k, f.v, out, params, lse.view());
    // decode takes every option (sinks in its merge, the position terms by its score rule).
    EXPECT_TRUE(contains(e, "decode: chosen")) << e;
    attention(f.q, f.k, f.v, out, params, lse.view());
    Tensor ref(DType::f32, out.shape()), ref_lse(DType::f32, lse.shape());
    reference::attention(f.q, f.k, f.v, ref, params, ref_lse.view());
    for (i64 x = 0; x < out.numel(); ++x) EXPECT_NEAR(f32(out)[x], f32(ref)[x], 1e-5) << x;
    for (i64 x = 0; x < lse.numel(); ++x) EXPECT_NEAR(f32(lse)[x], f32(ref_lse)[x], 1e-5) << x;
    // flash, forced, runs every option too.
    AttentionParams forced = params;
    forced.kernel = KernelKind::flash;
    attention(f.q, f.k, f.v, out, forced, lse.view());
    for (i64 x = 0; x < out.numel(); ++x) EXPECT_NEAR(f32(out)[x], f32(ref)[x], 1e-5) << x;
    // Backward: flash runs.
    Tensor dq(DType::f32, f.q.shape()), dk(DType::f32, f.k.shape()), dv(DType::f32, f.v.shape());
    const std::string eb = explain_dispatch(f.q, f.k, f.v, out, lse, out, dq, dk, dv, params);
    EXPECT_TRUE(contains(eb, "flash: chosen")) << eb;
    attention_backward(f.q, f.k, f.v, out, lse, out, dq, dk, dv, params);
    Tensor rq(DType::f32, f.q.shape()), rk(DType::f32, f.k.shape()), rv(DType::f32, f.v.shape());
    reference::attention_backward(f.q, f.k, f.v, out, lse, out, rq, rk, rv, params);
    for (i64 x = 0; x < dq.numel(); ++x) EXPECT_NEAR(f32(dq)[x], f32(rq)[x], 1e-4 * (1 + std::abs(f32(rq)[x]))) << x;
    if (params.sinks) {
      Tensor dz(DType::f32, {f.Hq});
      const std::string ez = explain_dispatch(f.q, f.k, f.v, out, lse, out, dq, dk, dv, dz, params);
      EXPECT_TRUE(contains(ez, "flash: chosen")) << ez;
      attention_backward(f.q, f.k, f.v, out, lse, out, dq, dk, dv, dz, params);
      Tensor rz(DType::f32, {f.Hq});
      reference::attention_backward(f.q, f.k, f.v, out, lse, out, rq, rk, rv, rz, params);
      for (i64 h = 0; h < f.Hq; ++h) EXPECT_NEAR(f32(dz)[h], f32(rz)[h], 1e-5 * (1 + std::abs(f32(rz)[h]))) << h;
    }
  }
}

// The packed batch of F32Call's two sequences (all Sq queries and Sk keys of each).
struct Packed {
  Tensor q, k, v;
  std::int32_t cu_q[3], cu_k[3];
  TensorView cuq() { return TensorView(cu_q, DType::i32, {3}); }
  TensorView cuk() { return TensorView(cu_k, DType::i32, {3}); }
  explicit Packed(const F32Call& f)
      : q(DType::f32, {f.B * f.Sq, f.Hq, f.D}), k(DType::f32, {f.B * f.Sk, f.Hkv, f.D}), v(DType::f32, {f.B * f.Sk, f.Hkv, f.D}) {
    for (int b = 0; b <= 2; ++b) {
      cu_q[b] = static_cast<std::int32_t>(b * f.Sq);
      cu_k[b] = static_cast<std::int32_t>(b * f.Sk);
    }
    auto pack = [](const Tensor& src, Tensor& dst) {  // [B, H, S, X] -> [B * S, H, X]
      const Shape s = src.shape();
      for (i64 b = 0; b < s[0]; ++b)
        for (i64 h = 0; h < s[1]; ++h)
          for (i64 t = 0; t < s[2]; ++t)
            for (i64 x = 0; x < s[3]; ++x)
              f32(dst)[((b * s[2] + t) * s[1] + h) * s[3] + x] = f32(src)[((b * s[1] + h) * s[2] + t) * s[3] + x];
    };
    pack(f.q, q);
    pack(f.k, k);
    pack(f.v, v);
  }
};

// out [B * Sq, Hq, D] packed against the dense [B, Hq, Sq, D]
void expect_packed_near(const Tensor& packed, const Tensor& dense, double tol) {
  const Shape s = dense.shape();
  for (i64 b = 0; b < s[0]; ++b)
    for (i64 h = 0; h < s[1]; ++h)
      for (i64 t = 0; t < s[2]; ++t)
        for (i64 x = 0; x < s[3]; ++x)
          ASSERT_NEAR(f32(packed)[((b * s[2] + t) * s[1] + h) * s[3] + x], f32(dense)[((b * s[1] + h) * s[2] + t) * s[3] + x], tol)
              << b << " " << h << " " << t << " " << x;
}

TEST(ScoreOptionsDispatch, VarlenPagedAndQuantizedRunServing) {
  F32Call f;
  Packed pk(f);
  for (const auto& [names, params] : f.option_sets()) {
    SCOPED_TRACE(names);
    // serving takes every option (sinks as one more partial of its merge, the position terms
    // by its score rule), packed, paged and quantized alike.
    const std::string runs = "serving: chosen";
    Tensor dense(DType::f32, {f.B, f.Hq, f.Sq, f.D});
    reference::attention(f.q, f.k, f.v, dense, params);  // same keys per batch: the packed call's meaning
    Tensor out(DType::f32, {f.B * f.Sq, f.Hq, f.D});
    std::string e = explain_dispatch(pk.q, pk.k, pk.v, out, pk.cuq(), pk.cuk(), params);
    EXPECT_TRUE(contains(e, runs)) << e;
    attention_varlen(pk.q, pk.k, pk.v, out, pk.cuq(), pk.cuk(), params);
    expect_packed_near(out, dense, 1e-5);
    // Quantized K and V (int8).
    Tensor kc(DType::i8, pk.k.shape()), vc(DType::i8, pk.v.shape());
    Tensor ks(DType::f32, {f.B * f.Sk, f.Hkv}), vs(DType::f32, {f.B * f.Sk, f.Hkv});
    const QuantizedKV qk{KVFormat::int8, kc, ks}, qv{KVFormat::int8, vc, vs};
    quantize_kv(pk.k, qk, "k");
    quantize_kv(pk.v, qv, "v");
    e = explain_dispatch(pk.q, qk, qv, out, pk.cuq(), pk.cuk(), params);
    EXPECT_TRUE(contains(e, runs)) << e;
    attention_varlen(pk.q, qk, qv, out, pk.cuq(), pk.cuk(), params);
    Tensor kd(DType::f32, pk.k.shape()), vd(DType::f32, pk.v.shape()), outd(DType::f32, out.shape());
    dequantize_kv(qk, kd);
    dequantize_kv(qv, vd);
    attention_varlen(pk.q, kd, vd, outd, pk.cuq(), pk.cuk(), params);
    for (i64 x = 0; x < out.numel(); ++x) ASSERT_NEAR(f32(out)[x], f32(outd)[x], 1e-5) << x;
    // attention_paged: blocks of 2 slots; sequence b's keys in blocks listed in reverse.
    {
      const i64 bs = 2, nb = f.B * f.Sk / bs, per = f.Sk / bs;
      Tensor kp(DType::f32, {nb, f.Hkv, bs, f.D}), vp(DType::f32, {nb, f.Hkv, bs, f.D});
      std::vector<std::int32_t> table(static_cast<std::size_t>(f.B * per));
      for (i64 b = 0; b < f.B; ++b)
        for (i64 c = 0; c < per; ++c) {
          const i64 blk = nb - 1 - (b * per + c);
          table[static_cast<std::size_t>(b * per + c)] = static_cast<std::int32_t>(blk);
          for (i64 h = 0; h < f.Hkv; ++h)
            for (i64 s = 0; s < bs; ++s)
              for (i64 x = 0; x < f.D; ++x) {
                const i64 src = ((b * f.Hkv + h) * f.Sk + c * bs + s) * f.D + x, dst = ((blk * f.Hkv + h) * bs + s) * f.D + x;
                f32(kp)[dst] = f32(f.k)[src];
                f32(vp)[dst] = f32(f.v)[src];
              }
        }
      std::int32_t lens[2] = {static_cast<std::int32_t>(f.Sk), static_cast<std::int32_t>(f.Sk)};
      const TensorView seq_lens(lens, DType::i32, {2}), bt(table.data(), DType::i32, {f.B, per});
      e = explain_dispatch(pk.q, kp, vp, out, pk.cuq(), seq_lens, bt, params);
      EXPECT_TRUE(contains(e, runs)) << e;
      attention_paged(pk.q, kp, vp, out, pk.cuq(), seq_lens, bt, params);
      expect_packed_near(out, dense, 1e-5);
    }
  }
}

TEST(ScoreOptionsDispatch, VarlenBackwardSumsTheSinkGradientOverSequences) {
  F32Call f;
  Packed pk(f);
  AttentionParams params = f.option_sets()[3].second;
  Tensor out(DType::f32, {f.B * f.Sq, f.Hq, f.D}), lse(DType::f32, {f.Hq, f.B * f.Sq});
  attention_varlen(pk.q, pk.k, pk.v, out, pk.cuq(), pk.cuk(), params, lse.view());
  Tensor dq(DType::f32, pk.q.shape()), dk(DType::f32, pk.k.shape()), dv(DType::f32, pk.v.shape()), dz(DType::f32, {f.Hq});
  const std::string e = explain_dispatch(pk.q, pk.k, pk.v, out, lse, out, dq, dk, dv, pk.cuq(), pk.cuk(), params);
  EXPECT_TRUE(contains(e, "per-sequence: chosen (one qkv::attention_backward call per sequence: flash (")) << e;
  attention_varlen_backward(pk.q, pk.k, pk.v, out, lse, out, dq, dk, dv, pk.cuq(), pk.cuk(), dz, params);
  // The dense batch: the same dz (each batch's sum, added in batch order).
  Tensor dout(DType::f32, {f.B, f.Hq, f.Sq, f.D}), dlse(DType::f32, {f.B, f.Hq, f.Sq});
  reference::attention(f.q, f.k, f.v, dout, params, dlse.view());
  Tensor gq(DType::f32, f.q.shape()), gk(DType::f32, f.k.shape()), gv(DType::f32, f.v.shape()), gz(DType::f32, {f.Hq});
  attention_backward(f.q, f.k, f.v, dout, dlse, dout, gq, gk, gv, gz, params);
  for (i64 h = 0; h < f.Hq; ++h) EXPECT_NEAR(f32(dz)[h], f32(gz)[h], 1e-5 * (1 + std::abs(f32(gz)[h])));
  expect_packed_near(dq, gq, 1e-5);
  // grad_sinks without sinks is refused by name.
  AttentionParams no_sinks = params;
  no_sinks.sinks.reset();
  try {
    attention_varlen_backward(pk.q, pk.k, pk.v, out, lse, out, dq, dk, dv, pk.cuq(), pk.cuk(), dz, no_sinks);
    ADD_FAILURE() << "ran";
  } catch (const Error& err) {
    EXPECT_TRUE(contains(err.what(), "grad_sinks: expected params.sinks")) << err.what();
  }
}

TEST(ScoreOptionsDispatch, KVCacheAttendTakesTheOptions) {
  F32Call f;
  std::vector<std::int64_t> counts = {f.Sk, f.Sk - 2};
  for (bool quantized : {false, true}) {
    SCOPED_TRACE(quantized ? "int8 cache" : "float32 cache");
    KVCache cache = quantized ? KVCache(f.B, f.Hkv, 8, f.D, KVFormat::int8, KVFormat::int8) : KVCache(f.B, f.Hkv, 8, f.D);
    cache.append(f.k, f.v, counts);
    AttentionParams params = f.option_sets()[3].second;
    Tensor out(DType::f32, {f.B, f.Hq, f.Sq, f.D});
    cache.attend(f.q, out, params);
    // The same call on the cache's keys (dequantized) with the cache's key lengths.
    Tensor kd(DType::f32, {f.B, f.Hkv, 8, f.D}), vd(DType::f32, {f.B, f.Hkv, 8, f.D});
    if (quantized) {
      dequantize_kv({KVFormat::int8, cache.keys(), cache.key_scales()}, kd);
      dequantize_kv({KVFormat::int8, cache.values(), cache.value_scales()}, vd);
    } else {
      std::memcpy(kd.data(), cache.keys().data(), kd.nbytes());
      std::memcpy(vd.data(), cache.values().data(), vd.nbytes());
    }
    std::int64_t lens[2] = {f.Sk, f.Sk - 2};
    AttentionParams p = params;
    p.kv_lens = TensorView(lens, DType::i64, {2});
    Tensor want(DType::f32, out.shape());
    reference::attention(f.q, kd, vd, want, p);
    for (i64 e = 0; e < out.numel(); ++e) ASSERT_NEAR(f32(out)[e], f32(want)[e], 1e-5) << e;
  }
}

// ---- errors ---------------------------------------------------------------------------------------

void expect_error(const std::function<void()>& fn, const std::string& part) {
  try {
    fn();
    ADD_FAILURE() << "no error, expected one with: " << part;
  } catch (const Error& e) {
    EXPECT_TRUE(contains(e.what(), part)) << e.what();
  }
}

TEST(ScoreOptionsErrors, EachNamesTheArgument) {
  F32Call f;
  Tensor out(DType::f32, {f.B, f.Hq, f.Sq, f.D});
  const auto call = [&](const AttentionParams& p) { return [&, p] { attention(f.q, f.k, f.v, out, p); }; };
  AttentionParams p;
  Tensor z64(DType::f64, {f.Hq});
  p.sinks = z64.view();
  expect_error(call(p), "sinks: expected dtype float32, got float64");
  Tensor z3(DType::f32, {f.Hq - 1});
  p.sinks = z3.view();
  expect_error(call(p), "sinks: expected shape [Hq] = [4], got [3]");
  Tensor z8(DType::f32, {2 * f.Hq});
  p.sinks = TensorView(z8.data(), DType::f32, {f.Hq}, {2});
  expect_error(call(p), "sinks: expected a contiguous tensor [Hq]");
  Tensor zn(DType::f32, {f.Hq});
  std::fill(f32(zn), f32(zn) + f.Hq, 0.0f);
  f32(zn)[2] = std::numeric_limits<float>::quiet_NaN();
  p.sinks = zn.view();
  expect_error(call(p), "sinks: expected finite values, got nan at index 2");
  p = {};
  Tensor a(DType::f32, {f.B + 1, f.Hq});
  p.alibi_slopes = a.view();
  expect_error(call(p), "alibi_slopes: expected shape [Hq] = [4] or [B,Hq] = [2,4], got [3,4]");
  Tensor ai(DType::f32, {f.Hq});
  std::fill(f32(ai), f32(ai) + f.Hq, 0.5f);
  f32(ai)[1] = std::numeric_limits<float>::infinity();
  p.alibi_slopes = ai.view();
  expect_error(call(p), "alibi_slopes: expected finite values, got inf at index 1");
  p = {};
  p.window_keep_first = -1;
  expect_error(call(p), "window_keep_first: expected >= 0 (0 = off), got -1");
  // Negative slopes are accepted (a bias that grows with the distance).
  f32(ai)[1] = -0.5f;
  p = {};
  p.alibi_slopes = ai.view();
  attention(f.q, f.k, f.v, out, p);
  // grad_sinks
  Tensor lse(DType::f32, {f.B, f.Hq, f.Sq}), dq(DType::f32, f.q.shape()), dk(DType::f32, f.k.shape()),
      dv(DType::f32, f.v.shape()), dz(DType::f32, {f.Hq}), dz3(DType::f32, {3});
  p = {};
  attention(f.q, f.k, f.v, out, p, lse.view());
  expect_error([&] { attention_backward(f.q, f.k, f.v, out, lse, out, dq, dk, dv, dz, p); },
               "grad_sinks: expected params.sinks to be given");
  p.sinks = f.sinks.view();
  expect_error([&] { attention_backward(f.q, f.k, f.v, out, lse, out, dq, dk, dv, dz3, p); },
               "grad_sinks: expected shape [Hq] = [4], got [3]");
  expect_error([&] { attention_backward(f.q, f.k, f.v, out, lse, out, dq, dk, dv, TensorView(dq.data(), DType::f32, {f.Hq}), p); },
               "grad_sinks: expected memory disjoint from grad_q");
}

}  // namespace
}  // namespace qkv::test
