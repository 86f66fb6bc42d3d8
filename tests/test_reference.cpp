// Attention semantics, checked on qkv::reference::attention (float64, the specification) and on
// qkv::attention (whatever kernel it dispatches to): hand-computed cases from the formulas, each
// option by hand, and properties. Every option against an independent float64 computation, every
// dtype and layout, and the NaN/inf isolation guarantee: test_reference_options.cpp.
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

}  // namespace
}  // namespace qkv::test
