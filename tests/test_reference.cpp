// Attention semantics, checked on qkv::reference::attention (float64, the specification) and on
// qkv::attention (whatever kernel it dispatches to): hand-computed cases from the formulas,
// properties, every option against an independent float64 computation (attention_case.hpp),
// every dtype and layout, and the NaN/inf isolation guarantee.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention_case.hpp"
#include "qkv/error.hpp"

namespace qkv::test {
namespace {

std::string name_of(Impl impl) { return impl_name(impl); }

// Q = K = [[1,0],[0,1]], V = [[1,2],[3,4]]: the 2x2 case of docs/semantics.md.
Case identity_case() {
  Case c;
  c.Sq = c.Sk = 2;
  c.D = c.Dv = 2;
  c.q = {1, 0, 0, 1};
  c.k = {1, 0, 0, 1};
  c.v = {1, 2, 3, 4};
  return c;
}

// Q = K = 0 (all scores equal) with V column [1..Sk]: each output is the mean of the values of
// the admitted keys, so the alignment of the diagonal can be read off directly.
Case equal_scores_case(std::int64_t Sq, std::int64_t Sk) {
  Case c;
  c.Sq = Sq;
  c.Sk = Sk;
  c.D = 2;
  c.Dv = 1;
  c.resize();
  for (std::int64_t j = 0; j < Sk; ++j) c.v[static_cast<std::size_t>(j)] = static_cast<double>(j + 1);
  return c;
}

// --- the specified cases, each with its right value ---------------------------------------------

TEST(Reference, FullyMaskedRowGivesZeroAndMinusInfLse) {
  Case c = identity_case();
  c.mask_shape = {2, 2};
  c.mask = {0, 0, 1, 1};  // row 0 all false, row 1 all true
  for (Impl impl : kImpls) {
    for (DType md : {DType::b8, DType::f32}) {
      Case cm = c;
      cm.mask_dtype = md;
      if (md != DType::b8) cm.mask = {-kInf, -kInf, 0, 0};  // the additive form of the same mask
      const Result r = run(cm, impl, options_for(impl));
      const double t = tol_for(impl).o;
      EXPECT_EQ(r.o[0], 0.0) << name_of(impl);
      EXPECT_EQ(r.o[1], 0.0) << name_of(impl);
      EXPECT_EQ(r.lse[0], -kInf) << name_of(impl);
      EXPECT_EQ(r.probs[0], 0.0);
      EXPECT_EQ(r.probs[1], 0.0);
      EXPECT_NEAR(r.o[2], 2.3395231, std::max(t, 5e-8)) << name_of(impl);
      EXPECT_NEAR(r.o[3], 3.3395231, std::max(t, 5e-8)) << name_of(impl);
      EXPECT_NEAR(r.lse[1], 1.1079403, 5e-8) << name_of(impl);
    }
  }
}

TEST(Reference, LseIsTheNaturalLog) {
  // Row 0: scores [1/sqrt2, 0] -> lse = log(e^(1/sqrt2) + 1) = 1.1079403; row 1 the same.
  const Case c = identity_case();
  for (Impl impl : kImpls) {
    const Result r = run(c, impl, options_for(impl));
    EXPECT_NEAR(r.lse[0], 1.1079403, 5e-8) << name_of(impl);
    EXPECT_NEAR(r.lse[1], 1.1079403, 5e-8) << name_of(impl);
    EXPECT_NEAR(r.lse[0], std::log(std::exp(1 / std::sqrt(2.0)) + 1.0), tol_for(impl).lse_rel);
  }
}

TEST(Reference, CausalAlignmentSqLessThanSk) {
  for (Impl impl : kImpls) {
    Case c = equal_scores_case(2, 4);
    c.params.causal = true;
    Result r = run(c, impl, options_for(impl));
    // bottom-right: query 0 sits at key 2 (keys 0..2), query 1 at key 3 (keys 0..3)
    EXPECT_DOUBLE_EQ(r.o[0], 2.0) << name_of(impl);
    EXPECT_DOUBLE_EQ(r.o[1], 2.5) << name_of(impl);
    c.params.align = Alignment::top_left;
    r = run(c, impl, options_for(impl));
    EXPECT_DOUBLE_EQ(r.o[0], 1.0) << name_of(impl);
    EXPECT_DOUBLE_EQ(r.o[1], 1.5) << name_of(impl);
  }
}

TEST(Reference, CausalAlignmentSqGreaterThanSk) {
  for (Impl impl : kImpls) {
    Case c = equal_scores_case(4, 2);
    c.params.causal = true;
    Result r = run(c, impl, options_for(impl));
    // bottom-right: query i sits at key i - 2, so rows 0 and 1 see no key at all
    EXPECT_EQ(r.o[0], 0.0) << name_of(impl);
    EXPECT_EQ(r.o[1], 0.0) << name_of(impl);
    EXPECT_EQ(r.lse[0], -kInf) << name_of(impl);
    EXPECT_EQ(r.lse[1], -kInf) << name_of(impl);
    EXPECT_DOUBLE_EQ(r.o[2], 1.0) << name_of(impl);
    EXPECT_DOUBLE_EQ(r.o[3], 1.5) << name_of(impl);
    EXPECT_NEAR(r.lse[2], 0.0, 1e-7);            // one key, score 0
    EXPECT_NEAR(r.lse[3], std::log(2.0), 1e-7);  // two keys, scores 0
    c.params.align = Alignment::top_left;
    r = run(c, impl, options_for(impl));
    EXPECT_DOUBLE_EQ(r.o[0], 1.0) << name_of(impl);
    EXPECT_DOUBLE_EQ(r.o[1], 1.5) << name_of(impl);
    EXPECT_DOUBLE_EQ(r.o[2], 1.5) << name_of(impl);
    EXPECT_DOUBLE_EQ(r.o[3], 1.5) << name_of(impl);
  }
}

TEST(Reference, DecodeQuerySeesEveryKey) {
  for (Impl impl : kImpls) {
    Case c = equal_scores_case(1, 4);
    c.params.causal = true;
    EXPECT_DOUBLE_EQ(run(c, impl, options_for(impl)).o[0], 2.5) << name_of(impl);
    c.params.align = Alignment::top_left;  // PyTorch is_causal: the one query sees key 0 only
    EXPECT_DOUBLE_EQ(run(c, impl, options_for(impl)).o[0], 1.0) << name_of(impl);
  }
}

TEST(Reference, GroupedQueryHeadsReadTheirKvHead) {
  for (Impl impl : kImpls) {
    for (std::int64_t Hkv : {2, 1}) {
      Case c;
      c.Hq = 4;
      c.Hkv = Hkv;
      c.Sq = 3;
      c.Sk = 5;
      c.D = 4;
      c.Dv = 2;
      randomize(c, 7);
      for (std::int64_t h = 0; h < Hkv; ++h)
        for (std::int64_t j = 0; j < c.Sk; ++j)
          for (std::int64_t x = 0; x < c.Dv; ++x) c.v[static_cast<std::size_t>(c.vi(0, h, j, x))] = 10.0 * (h + 1);
      const Result r = run(c, impl, options_for(impl));
      for (std::int64_t h = 0; h < 4; ++h) {
        const double want = Hkv == 2 ? (h < 2 ? 10.0 : 20.0) : 10.0;
        for (std::int64_t i = 0; i < c.Sq; ++i)
          for (std::int64_t x = 0; x < c.Dv; ++x)
            EXPECT_NEAR(r.o[static_cast<std::size_t>((h * c.Sq + i) * c.Dv + x)], want, 1e-5 * want)
                << name_of(impl) << " Hkv=" << Hkv << " h=" << h;
      }
      EXPECT_TRUE(matches_naive(c, impl, options_for(impl), "gqa"));
    }
  }
}

TEST(Reference, GroupedQueryHeadsMustDivide) {
  Case c;
  c.Hq = 3;
  c.Hkv = 2;
  randomize(c, 1);
  for (Impl impl : kImpls) {
    try {
      run(c, impl, options_for(impl));
      FAIL() << name_of(impl) << ": Hq=3, Hkv=2 was accepted";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("Hq % Hkv"), std::string::npos) << m;
      EXPECT_NE(m.find("Hq = 3"), std::string::npos) << m;
      EXPECT_NE(m.find("Hkv = 2"), std::string::npos) << m;
    }
  }
}

TEST(Reference, DefaultScaleIsOneOverSqrtD) {
  // D = 4: scores [2, 0] scaled by 1/2 -> softmax of [1, 0].
  Case c;
  c.Sk = 2;
  c.D = 4;
  c.Dv = 2;
  c.q = {1, 1, 0, 0};
  c.k = {1, 1, 0, 0, 0, 0, 1, 1};
  c.v = {1, 0, 0, 1};
  const double w0 = std::exp(1.0) / (std::exp(1.0) + 1.0), w1 = 1.0 / (std::exp(1.0) + 1.0);
  for (Impl impl : kImpls) {
    const Result r = run(c, impl, options_for(impl));
    EXPECT_NEAR(r.o[0], w0, tol_for(impl).o) << name_of(impl);
    EXPECT_NEAR(r.o[1], w1, tol_for(impl).o) << name_of(impl);
    EXPECT_NEAR(r.probs[0], w0, tol_for(impl).probs);
    EXPECT_NEAR(r.lse[0], std::log(std::exp(1.0) + 1.0), 1e-6);
  }
}

TEST(Reference, ScaleZeroGivesTheMeanOfV) {
  Case c;
  c.Sk = 4;
  c.D = 3;
  c.Dv = 2;
  randomize(c, 3, 5.0);
  c.v = {1, 2, 3, 5, 6, 7, 10, 11};
  c.params.scale = 0.0;
  // The mean of V, [5, 6.25], is exact in binary: the reference must hit it exactly.
  const Result r = run(c, Impl::reference);
  EXPECT_EQ(r.o[0], 5.0);
  EXPECT_EQ(r.o[1], 6.25);
  for (int j = 0; j < 4; ++j) EXPECT_EQ(r.probs[static_cast<std::size_t>(j)], 0.25);
  EXPECT_EQ(r.lse[0], std::log(4.0));
  const Result d = run(c, Impl::dispatch, options_for(Impl::dispatch));
  EXPECT_NEAR(d.o[0], 5.0, 1e-6);
  EXPECT_NEAR(d.o[1], 6.25, 1e-6);
}

TEST(Reference, ExplicitScaleMultipliesTheScores) {
  Case c;
  c.Sk = 2;
  c.D = 1;
  c.Dv = 1;
  c.q = {1};
  c.k = {3, 1};
  c.v = {1, 0};
  c.params.scale = 0.5;  // scores [1.5, 0.5] -> weight of key 0 = 1/(1+e^-1)
  for (Impl impl : kImpls)
    EXPECT_NEAR(run(c, impl, options_for(impl)).o[0], 1.0 / (1.0 + std::exp(-1.0)), tol_for(impl).o);
}

// For D in 1..256 and odd Sk, the last element of D and the last key must both count: the
// answer differs from the one computed without them, and qkv matches the full computation.
TEST(Reference, EveryFeatureAndEveryKeyCounts) {
  for (std::int64_t Sk : {1, 17, 97}) {
    for (std::int64_t D = 1; D <= 256; ++D) {
      Case c;
      c.Sk = Sk;
      c.D = D;
      c.Dv = 3;
      randomize(c, static_cast<std::uint32_t>(1000 * Sk + D));
      // Make the last feature and the last key weigh enough to be seen through float32.
      const double big = std::sqrt(static_cast<double>(D));
      c.q[static_cast<std::size_t>(D - 1)] = 1.5;
      for (std::int64_t j = 0; j < Sk; ++j) c.k[static_cast<std::size_t>(c.ki(0, 0, j, D - 1))] = big * ((j % 3) - 1.0);
      c.k[static_cast<std::size_t>(c.ki(0, 0, Sk - 1, D - 1))] = big;
      for (std::int64_t x = 0; x < c.Dv; ++x) c.v[static_cast<std::size_t>(c.vi(0, 0, Sk - 1, x))] = 4.0 + x;

      const Result full = naive(c);
      Case no_feature = c;  // the last element of D dropped from the dot products
      no_feature.q[static_cast<std::size_t>(D - 1)] = 0.0;
      no_feature.params.scale = 1.0 / std::sqrt(static_cast<double>(D));
      const Result nf = naive(no_feature);
      Case no_key = c;  // the last key dropped
      no_key.kv_lens = {Sk - 1};
      const Result nk = naive(no_key);

      auto max_diff = [](const Result& a, const Result& b) {
        double m = 0;
        for (std::size_t n = 0; n < a.o.size(); ++n) m = std::max(m, std::fabs(a.o[n] - b.o[n]));
        for (std::size_t n = 0; n < a.lse.size(); ++n)
          m = std::max(m, std::isinf(b.lse[n]) ? 1.0 : std::fabs(a.lse[n] - b.lse[n]));
        return m;
      };
      ASSERT_GT(max_diff(full, nf), 1e-3) << "D=" << D << " Sk=" << Sk;
      ASSERT_GT(max_diff(full, nk), 1e-3) << "D=" << D << " Sk=" << Sk;
      for (Impl impl : kImpls) {
        RunOptions ro = options_for(impl);
        ro.want_probs = false;
        ASSERT_TRUE(matches_naive(c, impl, ro, "D=" + std::to_string(D) + " Sk=" + std::to_string(Sk)));
      }
    }
  }
}

// --- hand-computed options ---------------------------------------------------------------------

TEST(Reference, SoftcapAfterScaleBeforeTheAdditiveMask) {
  // scores (scale 1): [q.k0, q.k1] = [6, 0]; softcap 5: [5 tanh(1.2), 0]; then the additive
  // mask [0, 1] -> [5 tanh(1.2), 1]. Adding the mask before the cap would give 5 tanh(0.2).
  Case c;
  c.Sk = 2;
  c.D = 1;
  c.Dv = 1;
  c.q = {2};
  c.k = {3, 0};
  c.v = {1, 0};
  c.params.scale = 1.0;
  c.params.softcap = 5.0;
  c.mask_shape = {2};
  c.mask_dtype = DType::f64;
  c.mask = {0.0, 1.0};
  const double s0 = 5.0 * std::tanh(6.0 / 5.0), s1 = 1.0;
  const double w0 = std::exp(s0) / (std::exp(s0) + std::exp(s1));
  for (Impl impl : kImpls) {
    const Result r = run(c, impl, options_for(impl));
    EXPECT_NEAR(r.o[0], w0, tol_for(impl).o) << name_of(impl);
    EXPECT_NEAR(r.lse[0], std::log(std::exp(s0) + std::exp(s1)), 1e-6) << name_of(impl);
  }
  // The cap applies to the scaled score: scale 2 gives 5 tanh(12/5).
  c.params.scale = 2.0;
  c.mask_shape.clear();
  const double t0 = 5.0 * std::tanh(12.0 / 5.0);
  for (Impl impl : kImpls)
    EXPECT_NEAR(run(c, impl, options_for(impl)).lse[0], std::log(std::exp(t0) + 1.0), 1e-6) << name_of(impl);
}

TEST(Reference, AdditiveMaskAddsToTheScores) {
  Case c = equal_scores_case(1, 2);  // scores 0, V = [1, 2]
  c.mask_shape = {1, 2};
  c.mask_dtype = DType::f32;
  c.mask = {0.0, std::log(3.0)};  // weights [1/4, 3/4]
  for (Impl impl : kImpls) {
    const Result r = run(c, impl, options_for(impl));
    EXPECT_NEAR(r.o[0], 1.75, 1e-6) << name_of(impl);
    EXPECT_NEAR(r.probs[0], 0.25, 1e-6);
    EXPECT_NEAR(r.probs[1], 0.75, 1e-6);
  }
}

TEST(Reference, BoolMaskTrueMeansAttend) {
  Case c = equal_scores_case(1, 4);  // V = [1, 2, 3, 4]
  c.mask_shape = {4};
  c.mask = {1, 0, 1, 0};
  for (Impl impl : kImpls) {
    const Result r = run(c, impl, options_for(impl));
    EXPECT_DOUBLE_EQ(r.o[0], 2.0) << name_of(impl);
    EXPECT_EQ(r.probs[1], 0.0);
    EXPECT_EQ(r.probs[3], 0.0);
  }
}

TEST(Reference, SlidingWindow) {
  // Sq = Sk = 5, all scores equal, V = [1..5]: each row averages the keys of its window.
  for (Impl impl : kImpls) {
    Case c = equal_scores_case(5, 5);
    c.params.window_left = 1;
    c.params.window_right = 1;
    Result r = run(c, impl, options_for(impl));
    const double want_11[5] = {1.5, 2, 3, 4, 4.5};
    for (int i = 0; i < 5; ++i) EXPECT_DOUBLE_EQ(r.o[static_cast<std::size_t>(i)], want_11[i]) << name_of(impl) << " row " << i;
    // causal with window (2, 3) is window (2, 0): keys [i-2, i]
    c.params.causal = true;
    c.params.window_left = 2;
    c.params.window_right = 3;
    r = run(c, impl, options_for(impl));
    const double want_c[5] = {1, 1.5, 2, 3, 4};
    for (int i = 0; i < 5; ++i) EXPECT_DOUBLE_EQ(r.o[static_cast<std::size_t>(i)], want_c[i]) << name_of(impl) << " row " << i;
    // window (0, -1): keys [i, Sk)
    c.params.causal = false;
    c.params.window_left = 0;
    c.params.window_right = -1;
    r = run(c, impl, options_for(impl));
    const double want_r[5] = {3, 3.5, 4, 4.5, 5};
    for (int i = 0; i < 5; ++i) EXPECT_DOUBLE_EQ(r.o[static_cast<std::size_t>(i)], want_r[i]) << name_of(impl) << " row " << i;
  }
}

TEST(Reference, WindowFollowsTheAlignment) {
  // Sq = 2, Sk = 6, window (1, 0). bottom-right: queries at keys 4, 5 -> keys {3,4}, {4,5};
  // top-left: queries at keys 0, 1 -> keys {0}, {0,1}.
  for (Impl impl : kImpls) {
    Case c = equal_scores_case(2, 6);
    c.params.window_left = 1;
    c.params.window_right = 0;
    Result r = run(c, impl, options_for(impl));
    EXPECT_DOUBLE_EQ(r.o[0], 4.5) << name_of(impl);
    EXPECT_DOUBLE_EQ(r.o[1], 5.5) << name_of(impl);
    c.params.align = Alignment::top_left;
    r = run(c, impl, options_for(impl));
    EXPECT_DOUBLE_EQ(r.o[0], 1.0) << name_of(impl);
    EXPECT_DOUBLE_EQ(r.o[1], 1.5) << name_of(impl);
  }
}

TEST(Reference, KvLensMoveTheBottomRightDiagonal) {
  // B = 3, Sq = 1, Sk = 4, lens [2, 4, 0], V = [1..4], equal scores.
  for (Impl impl : kImpls) {
    for (DType ld : {DType::i32, DType::i64}) {
      Case c;
      c.B = 3;
      c.Sq = 1;
      c.Sk = 4;
      c.D = 2;
      c.Dv = 1;
      c.resize();
      for (std::int64_t b = 0; b < 3; ++b)
        for (std::int64_t j = 0; j < 4; ++j) c.v[static_cast<std::size_t>(c.vi(b, 0, j, 0))] = static_cast<double>(j + 1);
      c.kv_lens = {2, 4, 0};
      c.lens_dtype = ld;
      Result r = run(c, impl, options_for(impl));  // no causal: keys [0, len)
      EXPECT_DOUBLE_EQ(r.o[0], 1.5) << name_of(impl);
      EXPECT_DOUBLE_EQ(r.o[1], 2.5) << name_of(impl);
      EXPECT_EQ(r.o[2], 0.0) << name_of(impl);
      EXPECT_EQ(r.lse[2], -kInf) << name_of(impl);
      // causal bottom-right: the query sits at key len-1 and sees keys [0, len)
      c.params.causal = true;
      c.params.window_left = 0;  // ...and with window (0, 0), only the key len-1
      r = run(c, impl, options_for(impl));
      EXPECT_DOUBLE_EQ(r.o[0], 2.0) << name_of(impl);
      EXPECT_DOUBLE_EQ(r.o[1], 4.0) << name_of(impl);
      EXPECT_EQ(r.lse[2], -kInf) << name_of(impl);
      // top-left: the diagonal stays at key 0
      c.params.align = Alignment::top_left;
      r = run(c, impl, options_for(impl));
      EXPECT_DOUBLE_EQ(r.o[0], 1.0) << name_of(impl);
      EXPECT_DOUBLE_EQ(r.o[1], 1.0) << name_of(impl);
      EXPECT_EQ(r.o[2], 0.0) << name_of(impl);
    }
  }
}

TEST(Reference, KvLensWithSeveralQueries) {
  // Sq = 3, Sk = 5, len = 4, causal bottom-right: queries at keys 1, 2, 3.
  for (Impl impl : kImpls) {
    Case c = equal_scores_case(3, 5);
    c.kv_lens = {4};
    c.params.causal = true;
    const Result r = run(c, impl, options_for(impl));
    EXPECT_DOUBLE_EQ(r.o[0], 1.5) << name_of(impl);
    EXPECT_DOUBLE_EQ(r.o[1], 2.0) << name_of(impl);
    EXPECT_DOUBLE_EQ(r.o[2], 2.5) << name_of(impl);
  }
}

// --- properties --------------------------------------------------------------------------------

TEST(Reference, WeightsSumToOne) {
  Case c;
  c.B = 2;
  c.Hq = 2;
  c.Sq = 7;
  c.Sk = 9;
  c.D = 5;
  c.Dv = 3;
  randomize(c, 11, 2.0);
  c.params.causal = true;
  c.params.window_left = 3;
  c.kv_lens = {9, 4};
  for (Impl impl : kImpls) {
    const Result r = run(c, impl, options_for(impl));
    for (std::int64_t row = 0; row < c.B * c.Hq * c.Sq; ++row) {
      double sum = 0;
      for (std::int64_t j = 0; j < c.Sk; ++j) {
        const double p = r.probs[static_cast<std::size_t>(row * c.Sk + j)];
        EXPECT_GE(p, 0.0);
        sum += p;
      }
      if (std::isinf(r.lse[static_cast<std::size_t>(row)]))
        EXPECT_EQ(sum, 0.0) << "empty row " << row;
      else
        EXPECT_NEAR(sum, 1.0, impl == Impl::reference ? 1e-14 : 1e-6) << name_of(impl) << " row " << row;
    }
    EXPECT_TRUE(matches_naive(c, impl, options_for(impl), "weights"));
  }
}

TEST(Reference, PermutingKeysAndValuesLeavesTheOutputUnchanged) {
  Case c;
  c.Hq = 2;
  c.Sq = 4;
  c.Sk = 13;
  c.D = 6;
  c.Dv = 5;
  randomize(c, 5);
  std::vector<std::int64_t> perm(static_cast<std::size_t>(c.Sk));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(9));
  Case p = c;
  for (std::int64_t j = 0; j < c.Sk; ++j) {
    const std::int64_t src = perm[static_cast<std::size_t>(j)];
    for (std::int64_t x = 0; x < c.D; ++x) p.k[static_cast<std::size_t>(c.ki(0, 0, j, x))] = c.k[static_cast<std::size_t>(c.ki(0, 0, src, x))];
    for (std::int64_t x = 0; x < c.Dv; ++x) p.v[static_cast<std::size_t>(c.vi(0, 0, j, x))] = c.v[static_cast<std::size_t>(c.vi(0, 0, src, x))];
  }
  for (Impl impl : kImpls) {
    const Result a = run(c, impl, options_for(impl)), b = run(p, impl, options_for(impl));
    EXPECT_TRUE(near(b.o, a.o, impl == Impl::reference ? 1e-13 : 1e-6, 0, "permuted O"));
    EXPECT_TRUE(near(b.lse, a.lse, impl == Impl::reference ? 1e-13 : 1e-6, 0, "permuted lse"));
  }
}

TEST(Reference, EqualScoresGiveUniformWeights) {
  Case c;
  c.Sq = 3;
  c.Sk = 7;
  c.D = 4;
  c.Dv = 2;
  randomize(c, 2);
  std::fill(c.q.begin(), c.q.end(), 0.0);  // every score is 0, whatever K holds
  for (Impl impl : kImpls) {
    const Result r = run(c, impl, options_for(impl));
    for (double p : r.probs) EXPECT_NEAR(p, 1.0 / 7.0, impl == Impl::reference ? 1e-15 : 1e-7);
    for (double l : r.lse) EXPECT_NEAR(l, std::log(7.0), 1e-6);
  }
}

// --- every option against the independent float64 computation ----------------------------------

struct OptionCase {
  std::string name;
  std::function<void(Case&)> set;
};

std::vector<OptionCase> option_cases() {
  auto mask_case = [](Shape shape, DType dt, std::uint32_t seed) {
    return [shape, dt, seed](Case& c) {
      // Replace the symbolic sizes 0..3 = B, Hq, Sq, Sk by the case's sizes for the last axes.
      Shape s = shape;
      const std::int64_t full[4] = {c.B, c.Hq, c.Sq, c.Sk};
      const int r = static_cast<int>(s.size());
      for (int a = 0; a < r; ++a)
        if (s[static_cast<std::size_t>(a)] != 1) s[static_cast<std::size_t>(a)] = full[4 - r + a];
      std::int64_t n = 1;
      for (auto d : s) n *= d;
      std::mt19937 rng(seed);
      c.mask_shape = s;
      c.mask_dtype = dt;
      c.mask.resize(static_cast<std::size_t>(n));
      for (double& m : c.mask) {
        const int u = static_cast<int>(rng() % 4);
        if (dt == DType::b8) m = u != 0;  // 3/4 attend
        else m = u == 0 ? -kInf : (static_cast<double>(rng() % 1024) / 256.0 - 2.0);
      }
    };
  };
  std::vector<OptionCase> v = {
      {"plain", [](Case&) {}},
      {"scale", [](Case& c) { c.params.scale = 0.37; }},
      {"negative_scale", [](Case& c) { c.params.scale = -1.3; }},
      {"softcap", [](Case& c) { c.params.softcap = 1.5; c.params.scale = 2.0; }},
      {"causal_br", [](Case& c) { c.params.causal = true; }},
      {"causal_tl", [](Case& c) { c.params.causal = true; c.params.align = Alignment::top_left; }},
      {"window_br", [](Case& c) { c.params.window_left = 2; c.params.window_right = 1; }},
      {"window_tl", [](Case& c) { c.params.window_left = 1; c.params.window_right = 3; c.params.align = Alignment::top_left; }},
      {"window_left_only", [](Case& c) { c.params.window_left = 3; }},
      {"window_right_only", [](Case& c) { c.params.window_right = 0; }},
      {"causal_window", [](Case& c) { c.params.causal = true; c.params.window_left = 2; c.params.window_right = 5; }},
      {"causal_window_tl", [](Case& c) { c.params.causal = true; c.params.window_left = 1; c.params.window_right = 0; c.params.align = Alignment::top_left; }},
      {"huge_window", [](Case& c) { c.params.window_left = std::int64_t(1) << 62; c.params.window_right = std::int64_t(1) << 62; }},
      {"kv_lens_i32", [](Case& c) { c.kv_lens.assign(static_cast<std::size_t>(c.B), c.Sk); c.kv_lens[0] = c.Sk / 2; c.lens_dtype = DType::i32; }},
      {"kv_lens_i64_causal", [](Case& c) { c.kv_lens.assign(static_cast<std::size_t>(c.B), 1); c.kv_lens.back() = c.Sk; c.params.causal = true; }},
      {"kv_lens_zero_tl", [](Case& c) { c.kv_lens.assign(static_cast<std::size_t>(c.B), 0); c.kv_lens.back() = c.Sk - 1; c.params.causal = true; c.params.align = Alignment::top_left; }},
      {"kv_lens_window", [](Case& c) { c.kv_lens.assign(static_cast<std::size_t>(c.B), c.Sk - 2); c.params.window_left = 1; c.params.window_right = 1; }},
  };
  // bool and additive masks of every rank, with and without broadcast axes (1 = broadcast,
  // 0 = the full size of that axis)
  const std::vector<Shape> shapes = {{0}, {1}, {0, 0}, {1, 0}, {0, 1}, {0, 0, 0}, {0, 1, 0},
                                     {1, 0, 0}, {0, 0, 0, 0}, {1, 1, 0, 0}, {0, 1, 1, 0}, {1, 0, 1, 1}};
  std::uint32_t seed = 100;
  for (const Shape& s : shapes)
    for (DType dt : {DType::b8, DType::f32, DType::f64}) {
      std::string n = std::string("mask_") + std::string(dtype_name(dt)) + "_";
      for (auto d : s) n += d == 1 ? "1" : "N";
      v.push_back({n, mask_case(s, dt, seed++)});
    }
  v.push_back({"mask_causal_softcap", [mask_case](Case& c) {
                 mask_case({0, 0}, DType::f32, 7)(c);
                 c.params.causal = true;
                 c.params.softcap = 2.0;
               }});
  return v;
}

TEST(Reference, EveryOptionMatchesTheFloat64Definition) {
  struct Dims { std::int64_t B, Hq, Hkv, Sq, Sk, D, Dv; };
  const Dims dims[] = {{2, 4, 2, 5, 9, 8, 3}, {1, 2, 2, 9, 4, 3, 5}, {2, 3, 1, 6, 6, 5, 4}, {1, 1, 1, 1, 7, 16, 1}};
  for (const OptionCase& oc : option_cases())
    for (const Dims& d : dims) {
      Case c;
      c.B = d.B; c.Hq = d.Hq; c.Hkv = d.Hkv; c.Sq = d.Sq; c.Sk = d.Sk; c.D = d.D; c.Dv = d.Dv;
      randomize(c, static_cast<std::uint32_t>(d.Sq * 31 + d.Sk), 1.5);
      oc.set(c);
      for (Impl impl : kImpls)
        for (bool bshd : {false, true}) {
          RunOptions ro = options_for(impl);
          ro.bshd = bshd;
          EXPECT_TRUE(matches_naive(c, impl, ro, oc.name + (bshd ? " bshd" : " bhsd") + " Sq=" + std::to_string(d.Sq) + " Sk=" + std::to_string(d.Sk)));
        }
    }
}

// The grid of docs/architecture.md: every head_dim and length tail, both alignments, GQA
// ratios 1/2/8, and inputs with +-20 sigma outliers.
TEST(Reference, ShapeGridWithOutliers) {
  struct Len { std::int64_t Sq, Sk; };
  const Len lens[] = {{1, 1}, {2, 17}, {17, 2}, {97, 97}, {1, 128}, {128, 97}};
  const std::int64_t ratios[] = {1, 2, 8};
  int n = 0;
  for (std::int64_t D : {1, 8, 59, 64, 111, 128, 256})
    for (const Len& l : lens) {
      Case c;
      c.Hkv = 1;
      c.Hq = ratios[n % 3];
      c.Sq = l.Sq;
      c.Sk = l.Sk;
      c.D = D;
      c.Dv = D == 1 ? 1 : D / 2 + 1;
      randomize(c, static_cast<std::uint32_t>(D * 1000 + l.Sq * 7 + l.Sk));
      std::mt19937 rng(static_cast<std::uint32_t>(n));
      for (auto* vec : {&c.q, &c.k, &c.v})
        for (int o = 0; o < 3; ++o) (*vec)[rng() % vec->size()] = (rng() % 2 ? 20.0 : -20.0);
      c.params.causal = n % 2 == 0;
      c.params.align = n % 4 == 0 ? Alignment::top_left : Alignment::bottom_right;
      ++n;
      for (Impl impl : kImpls) {
        RunOptions ro = options_for(impl);
        ro.want_probs = false;
        EXPECT_TRUE(matches_naive(c, impl, ro, "D=" + std::to_string(D) + " Sq=" + std::to_string(l.Sq) + " Sk=" + std::to_string(l.Sk)));
      }
    }
}

TEST(Reference, StridedMaskView) {
  // A [Sk, Sq] buffer passed as its transpose, a [Sq, Sk] view with strides (1, Sq).
  Case c;
  c.Sq = 3;
  c.Sk = 4;
  c.D = 2;
  c.Dv = 2;
  randomize(c, 61);
  const std::uint8_t t[4][3] = {{1, 0, 1}, {1, 1, 0}, {0, 1, 1}, {1, 0, 0}};  // t[j][i]
  c.mask_shape = {3, 4};
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j) c.mask.push_back(t[j][i]);
  const Result want = naive(c);
  AttentionParams p;
  p.mask = TensorView(const_cast<std::uint8_t*>(&t[0][0]), DType::b8, {4, 3}).permute({1, 0});
  std::vector<double> o(6);
  const TensorView q(c.q.data(), DType::f64, {1, 1, 3, 2}), k(c.k.data(), DType::f64, {1, 1, 4, 2}),
      v(c.v.data(), DType::f64, {1, 1, 4, 2}), out(o.data(), DType::f64, {1, 1, 3, 2});
  reference::attention(q, k, v, out, p);
  EXPECT_TRUE(near(o, want.o, 1e-12, 0, "reference"));
  std::fill(o.begin(), o.end(), 0.0);
  attention(q, k, v, out, p);
  EXPECT_TRUE(near(o, want.o, 1e-6, 0, "dispatch"));
}

// --- dtypes and layouts ------------------------------------------------------------------------

Case random_case(std::uint32_t seed) {
  Case c;
  c.B = 2;
  c.Hq = 4;
  c.Hkv = 2;
  c.Sq = 5;
  c.Sk = 11;
  c.D = 8;
  c.Dv = 6;
  randomize(c, seed);
  c.params.causal = true;
  return c;
}

TEST(Reference, InputDtypes) {
  for (DType in : {DType::f64, DType::f32, DType::f16, DType::bf16}) {
    const Case c = random_case(21);
    for (Impl impl : kImpls) {
      RunOptions ro;
      ro.in = in;
      ro.out = ro.aux = impl == Impl::reference ? DType::f64 : DType::f32;
      // The kernel sees the inputs rounded to their dtype; it then owes float64 (reference) or
      // float32-accumulation accuracy on those values.
      EXPECT_TRUE(matches_naive(c, impl, ro, std::string(dtype_name(in)))) << dtype_name(in);
    }
  }
}

TEST(Reference, OutputDtypes) {
  const Case c = random_case(22);
  const Result want = naive(rounded_case(c, DType::f32));
  for (DType out : {DType::f64, DType::f32, DType::bf16, DType::f16}) {
    for (DType aux : {DType::f32, DType::f64}) {
      for (Impl impl : kImpls) {
        RunOptions ro;
        ro.in = DType::f32;
        ro.out = out;
        ro.aux = aux;
        const Result r = run(c, impl, ro);
        // One rounding to the output dtype on top of the kernel's own error.
        const double eps = out == DType::bf16 ? 1.0 / 256 : out == DType::f16 ? 1.0 / 2048 : 0.0;
        const Tol t = tol_for(impl);
        EXPECT_TRUE(near(r.o, want.o, std::max(t.o, 1e-6), std::max(eps, t.o), "O " + std::string(dtype_name(out))));
        const double aux_eps = aux == DType::f32 ? 1.2e-7 : 0.0;
        EXPECT_TRUE(near(r.lse, want.lse, t.lse_abs, std::max(t.lse_rel, aux_eps), "lse"));
        EXPECT_TRUE(near(r.probs, want.probs, std::max(t.probs, aux_eps), aux_eps, "probs"));
      }
    }
  }
}

TEST(Reference, OutputsAreOptional) {
  const Case c = random_case(23);
  for (Impl impl : kImpls) {
    RunOptions ro = options_for(impl);
    const Result all = run(c, impl, ro);
    ro.want_lse = ro.want_probs = false;
    EXPECT_EQ(run(c, impl, ro).o, all.o);
    ro.want_lse = true;
    const Result lse_only = run(c, impl, ro);
    EXPECT_EQ(lse_only.o, all.o);
    EXPECT_EQ(lse_only.lse, all.lse);
  }
}

TEST(Reference, PackedQkvViews) {
  // One buffer [B, S, 3, H, D] holding q, k and v side by side; out written into a strided
  // [B, S, H, 2*D] buffer (the left half). Non-trivial strides on every axis but the last.
  const std::int64_t B = 2, S = 6, H = 3, D = 4;
  Case c;
  c.B = B; c.Hq = c.Hkv = H; c.Sq = c.Sk = S; c.D = c.Dv = D;
  randomize(c, 31);
  c.params.causal = true;
  std::vector<float> qkv(static_cast<std::size_t>(B * S * 3 * H * D));
  auto at = [&](std::int64_t b, std::int64_t s, std::int64_t t, std::int64_t h, std::int64_t x) -> float& {
    return qkv[static_cast<std::size_t>((((b * S + s) * 3 + t) * H + h) * D + x)];
  };
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t x = 0; x < D; ++x) {
          at(b, s, 0, h, x) = static_cast<float>(c.q[static_cast<std::size_t>(c.qi(b, h, s, x))]);
          at(b, s, 1, h, x) = static_cast<float>(c.k[static_cast<std::size_t>(c.ki(b, h, s, x))]);
          at(b, s, 2, h, x) = static_cast<float>(c.v[static_cast<std::size_t>(c.vi(b, h, s, x))]);
        }
  const Shape shape{B, H, S, D}, st{S * 3 * H * D, D, 3 * H * D, 1};
  std::vector<float> out(static_cast<std::size_t>(B * S * H * 2 * D), -7.0f);
  const Shape ost{S * H * 2 * D, 2 * D, H * 2 * D, 1};
  const Result want = naive(rounded_case(c, DType::f32));
  for (Impl impl : kImpls) {
    std::fill(out.begin(), out.end(), -7.0f);
    const TensorView q(qkv.data(), DType::f32, shape, st), k(qkv.data() + H * D, DType::f32, shape, st),
        v(qkv.data() + 2 * H * D, DType::f32, shape, st), o(out.data(), DType::f32, shape, ost);
    if (impl == Impl::reference) reference::attention(q, k, v, o, c.params);
    else attention(q, k, v, o, c.params);
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t s = 0; s < S; ++s)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t x = 0; x < 2 * D; ++x) {
            const float got = out[static_cast<std::size_t>(((b * S + s) * H + h) * 2 * D + x)];
            if (x >= D) {
              EXPECT_EQ(got, -7.0f) << "wrote outside the view";
            } else {
              EXPECT_NEAR(got, want.o[static_cast<std::size_t>(((b * H + h) * S + s) * D + x)], 2e-6) << name_of(impl);
            }
          }
  }
}

TEST(Reference, EmptyShapes) {
  for (Impl impl : kImpls) {
    // Sk = 0: every row is empty.
    Case c;
    c.Sq = 2;
    c.Sk = 0;
    c.D = 3;
    c.Dv = 2;
    c.resize();
    const Result r = run(c, impl, options_for(impl));
    for (double o : r.o) EXPECT_EQ(o, 0.0);
    for (double l : r.lse) EXPECT_EQ(l, -kInf);
    // Sq = 0, B = 0: nothing to do, nothing thrown.
    Case e = c;
    e.Sq = 0;
    e.Sk = 3;
    e.resize();
    EXPECT_NO_THROW(run(e, impl, options_for(impl)));
    e.B = 0;
    e.resize();
    EXPECT_NO_THROW(run(e, impl, options_for(impl)));
  }
}

// --- NaN and inf never leak from keys that are excluded -----------------------------------------

struct Plant {
  std::string name;
  std::function<void(Case&)> set;
};

TEST(Reference, NonFiniteValuesAtExcludedKeysNeverLeak) {
  const std::vector<Plant> plants = {
      {"causal_br", [](Case& c) { c.params.causal = true; }},
      {"causal_tl", [](Case& c) { c.params.causal = true; c.params.align = Alignment::top_left; }},
      {"window", [](Case& c) { c.params.window_left = 1; c.params.window_right = 2; }},
      {"window_tl", [](Case& c) { c.params.window_left = 0; c.params.window_right = 1; c.params.align = Alignment::top_left; }},
      {"kv_lens", [](Case& c) { c.kv_lens = {3, 6}; }},
      {"kv_lens_causal", [](Case& c) { c.kv_lens = {4, 1}; c.params.causal = true; }},
  };
  for (const Plant& pl : plants) {
    Case c;
    c.B = 2;
    c.Hq = 2;
    c.Hkv = 1;
    c.Sq = 4;
    c.Sk = 7;
    c.D = 5;
    c.Dv = 3;
    randomize(c, 41);
    pl.set(c);
    for (Impl impl : kImpls) {
      const RunOptions ro = options_for(impl);
      const Result clean = run(c, impl, ro);
      for (double poison : {std::nan(""), kInf, -kInf}) {
        for (std::int64_t j = 0; j < c.Sk; ++j) {
          Case bad = c;
          for (std::int64_t b = 0; b < c.B; ++b) {
            for (std::int64_t x = 0; x < c.D; ++x) bad.k[static_cast<std::size_t>(c.ki(b, 0, j, x))] = poison;
            for (std::int64_t x = 0; x < c.Dv; ++x) bad.v[static_cast<std::size_t>(c.vi(b, 0, j, x))] = poison;
          }
          const Result r = run(bad, impl, ro);
          for (std::int64_t b = 0; b < c.B; ++b)
            for (std::int64_t h = 0; h < c.Hq; ++h)
              for (std::int64_t i = 0; i < c.Sq; ++i) {
                if (admissible(c, b, i, j)) continue;  // this row reads key j: not our concern here
                const std::int64_t row = (b * c.Hq + h) * c.Sq + i;
                for (std::int64_t x = 0; x < c.Dv; ++x) {
                  const std::size_t n = static_cast<std::size_t>(row * c.Dv + x);
                  ASSERT_TRUE(std::isfinite(r.o[n])) << pl.name << " " << name_of(impl) << " key " << j << " row " << row;
                  ASSERT_EQ(r.o[n], clean.o[n]) << pl.name << " " << name_of(impl);
                }
                ASSERT_EQ(r.lse[static_cast<std::size_t>(row)], clean.lse[static_cast<std::size_t>(row)]);
                for (std::int64_t jj = 0; jj < c.Sk; ++jj)
                  ASSERT_EQ(r.probs[static_cast<std::size_t>(row * c.Sk + jj)], clean.probs[static_cast<std::size_t>(row * c.Sk + jj)]);
              }
        }
      }
    }
  }
}

TEST(Reference, NaNInOneQueryRowStaysInThatRow) {
  Case c;
  c.Sq = 3;
  c.Sk = 5;
  c.D = 4;
  c.Dv = 2;
  randomize(c, 51);
  for (Impl impl : kImpls) {
    const Result clean = run(c, impl, options_for(impl));
    Case bad = c;
    bad.q[static_cast<std::size_t>(c.qi(0, 0, 1, 2))] = std::nan("");
    const Result r = run(bad, impl, options_for(impl));
    for (std::int64_t x = 0; x < c.Dv; ++x) {
      EXPECT_EQ(r.o[static_cast<std::size_t>(x)], clean.o[static_cast<std::size_t>(x)]);
      EXPECT_TRUE(std::isnan(r.o[static_cast<std::size_t>(c.Dv + x)])) << name_of(impl);
      EXPECT_EQ(r.o[static_cast<std::size_t>(2 * c.Dv + x)], clean.o[static_cast<std::size_t>(2 * c.Dv + x)]);
    }
    EXPECT_TRUE(std::isnan(r.lse[1])) << name_of(impl);
  }
}

TEST(Reference, AllScoresMinusInfIsAnEmptyRow) {
  // q = [1], k = [-inf, -inf]: both admissible scores are -inf.
  Case c;
  c.Sk = 2;
  c.D = 1;
  c.Dv = 1;
  c.q = {1};
  c.k = {-kInf, -kInf};
  c.v = {3, 4};
  for (Impl impl : kImpls) {
    const Result r = run(c, impl, options_for(impl));
    EXPECT_EQ(r.o[0], 0.0) << name_of(impl);
    EXPECT_EQ(r.lse[0], -kInf) << name_of(impl);
    EXPECT_EQ(r.probs[0], 0.0);
    EXPECT_EQ(r.probs[1], 0.0);
  }
}

TEST(Reference, NaNInAMaskedKeyDoesNotLeakThroughABoolMask) {
  // An explicit mask is not required to skip reading, but the reference does skip, and a row
  // whose mask excludes the poisoned key must be unaffected.
  Case c = equal_scores_case(2, 3);
  c.mask_shape = {2, 3};
  c.mask = {1, 1, 0, 1, 1, 1};
  Case bad = c;
  bad.v[2] = std::nan("");
  const Result r = run(bad, Impl::reference);
  EXPECT_DOUBLE_EQ(r.o[0], 1.5);
  EXPECT_TRUE(std::isnan(r.o[1]));
}

}  // namespace
}  // namespace qkv::test
