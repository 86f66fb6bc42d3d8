// Hostile numbers: NaN, infinities, huge and tiny magnitudes, -0.0, masks of -inf and -FLT_MAX,
// scale 0 and huge, a single key, empty axes and shapes whose sizes overflow. Each behaviour is
// specified in docs/semantics.md ("Hostile numbers") and checked on every attention path
// (reference, dispatcher, each forced kernel) against values computed here independently.
#include <sys/mman.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attention_runners.hpp"
#include "qkv/attention.hpp"
#include "qkv/error.hpp"
#include "qkv/npy.hpp"
#include "qkv/tensor.hpp"

namespace {

using qkv::DType;
using qkv::Tensor;
using qkv::TensorView;
using qkv::test::AttentionPath;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Tensors of one call, float32, BHSD, with B = 1 unless given.
struct Call {
  std::int64_t B, Hq, Hkv, Sq, Sk, D, Dv;
  Tensor q, k, v, out, lse, probs;
  Call(std::int64_t b, std::int64_t hq, std::int64_t hkv, std::int64_t sq, std::int64_t sk, std::int64_t d,
       std::int64_t dv, unsigned seed = 1)
      : B(b), Hq(hq), Hkv(hkv), Sq(sq), Sk(sk), D(d), Dv(dv),
        q(DType::f32, {b, hq, sq, d}), k(DType::f32, {b, hkv, sk, d}), v(DType::f32, {b, hkv, sk, dv}),
        out(DType::f32, {b, hq, sq, dv}), lse(DType::f32, {b, hq, sq}), probs(DType::f32, {b, hq, sq, sk}) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (Tensor* t : {&q, &k, &v})
      for (std::int64_t i = 0; i < t->numel(); ++i) t->data_as<float>()[i] = n(rng);
    poison_outputs();
  }
  // Outputs start as a value no correct result produces, so "not written" is visible.
  void poison_outputs() {
    for (Tensor* t : {&out, &lse, &probs})
      for (std::int64_t i = 0; i < t->numel(); ++i) t->data_as<float>()[i] = 12345.0f;
  }
  float& Q(std::int64_t h, std::int64_t i, std::int64_t x) { return q.data_as<float>()[(h * Sq + i) * D + x]; }
  float& K(std::int64_t h, std::int64_t j, std::int64_t x) { return k.data_as<float>()[(h * Sk + j) * D + x]; }
  float& V(std::int64_t h, std::int64_t j, std::int64_t x) { return v.data_as<float>()[(h * Sk + j) * Dv + x]; }
  float O(std::int64_t h, std::int64_t i, std::int64_t x) const { return out.data_as<float>()[(h * Sq + i) * Dv + x]; }
  float L(std::int64_t h, std::int64_t i) const { return lse.data_as<float>()[h * Sq + i]; }
  float P(std::int64_t h, std::int64_t i, std::int64_t j) const { return probs.data_as<float>()[(h * Sq + i) * Sk + j]; }
  bool run(const AttentionPath& path, const qkv::AttentionParams& p = {}) {
    poison_outputs();
    return qkv::test::run_attention(path, q, k, v, out, p, lse.view(), probs.view());
  }
};

// Independent float64 softmax attention of one row (B = 1, Hq == Hkv): `bias` is added to the
// scores, -inf excludes. Returns O row, fills lse and probs.
std::vector<double> naive_row(Call& c, std::int64_t h, std::int64_t i, double scale,
                              const std::vector<double>& bias, double& lse, std::vector<double>& probs) {
  std::vector<double> s(c.Sk);
  double mx = -INFINITY;
  for (std::int64_t j = 0; j < c.Sk; ++j) {
    if (!bias.empty() && bias[j] == -INFINITY) {  // excluded keys are never read
      s[j] = -INFINITY;
      continue;
    }
    double dot = 0;
    for (std::int64_t x = 0; x < c.D; ++x) dot += double(c.Q(h, i, x)) * double(c.K(h, j, x));
    s[j] = scale * dot + (bias.empty() ? 0.0 : bias[j]);
    mx = std::max(mx, s[j]);
  }
  std::vector<double> o(c.Dv, 0.0);
  probs.assign(c.Sk, 0.0);
  if (mx == -INFINITY) {
    lse = -INFINITY;
    return o;
  }
  double sum = 0;
  for (std::int64_t j = 0; j < c.Sk; ++j) sum += std::exp(s[j] - mx);
  for (std::int64_t j = 0; j < c.Sk; ++j) {
    probs[j] = std::exp(s[j] - mx) / sum;
    if (s[j] == -INFINITY) continue;
    for (std::int64_t x = 0; x < c.Dv; ++x) o[x] += probs[j] * double(c.V(h, j, x));
  }
  lse = mx + std::log(sum);
  return o;
}

// |a - b| <= atol + rtol |b|, with a float32 result in mind.
void expect_close(double got, double want, const std::string& what, double rtol = 2e-5, double atol = 1e-6) {
  EXPECT_LE(std::fabs(got - want), atol + rtol * std::fabs(want)) << what << ": got " << got << ", want " << want;
}

// Checks rows of `c` (head h) against the naive computation.
void expect_rows_match_naive(Call& c, std::int64_t h, const std::vector<std::int64_t>& rows, double scale,
                             const std::vector<double>& bias = {}) {
  for (std::int64_t i : rows) {
    double lse;
    std::vector<double> pr;
    const std::vector<double> o = naive_row(c, h, i, scale, bias, lse, pr);
    for (std::int64_t x = 0; x < c.Dv; ++x) expect_close(c.O(h, i, x), o[x], "O[" + std::to_string(i) + "]");
    if (std::isfinite(lse)) expect_close(c.L(h, i), lse, "lse[" + std::to_string(i) + "]");
    else EXPECT_EQ(c.L(h, i), float(lse));
    for (std::int64_t j = 0; j < c.Sk; ++j) expect_close(c.P(h, i, j), pr[j], "P[" + std::to_string(i) + "]");
  }
}

bool row_all_nan(const Call& c, std::int64_t h, std::int64_t i) {
  for (std::int64_t x = 0; x < c.Dv; ++x)
    if (!std::isnan(c.O(h, i, x))) return false;
  return true;
}

class Hostile : public ::testing::TestWithParam<AttentionPath> {};

#define RUN_OR_SKIP(call, ...) \
  if (!(call).run(GetParam(), ##__VA_ARGS__)) GTEST_SKIP() << GetParam().name << " is not available here"

// ---- NaN and infinities in Q, K, V ---------------------------------------------------------------

TEST_P(Hostile, NanInQueryStaysInItsRow) {
  Call c(1, 2, 2, 5, 7, 8, 6);
  c.Q(1, 2, 3) = kNaN;
  RUN_OR_SKIP(c);
  EXPECT_TRUE(row_all_nan(c, 1, 2));
  EXPECT_TRUE(std::isnan(c.L(1, 2)));
  for (std::int64_t j = 0; j < c.Sk; ++j) EXPECT_TRUE(std::isnan(c.P(1, 2, j)));
  expect_rows_match_naive(c, 0, {0, 1, 2, 3, 4}, 1 / std::sqrt(8.0));
  expect_rows_match_naive(c, 1, {0, 1, 3, 4}, 1 / std::sqrt(8.0));
}

TEST_P(Hostile, NanInKeyReachesOnlyRowsThatAdmitIt) {
  Call c(1, 1, 1, 6, 6, 8, 4);
  c.K(0, 3, 0) = kNaN;
  qkv::AttentionParams p;
  p.causal = true;  // rows 0..2 never see key 3
  RUN_OR_SKIP(c, p);
  for (std::int64_t i = 3; i < 6; ++i) EXPECT_TRUE(row_all_nan(c, 0, i)) << "row " << i;
  for (std::int64_t i = 0; i < 3; ++i) {
    std::vector<double> bias(6, 0.0);
    for (std::int64_t j = i + 1; j < 6; ++j) bias[j] = -INFINITY;
    expect_rows_match_naive(c, 0, {i}, 1 / std::sqrt(8.0), bias);
  }
}

TEST_P(Hostile, NanInValueReachesOnlyItsColumnInRowsThatAdmitIt) {
  Call c(1, 1, 1, 6, 6, 8, 4);
  c.V(0, 3, 2) = kNaN;
  qkv::AttentionParams p;
  p.causal = true;
  RUN_OR_SKIP(c, p);
  for (std::int64_t i = 0; i < 6; ++i)
    for (std::int64_t x = 0; x < 4; ++x)
      EXPECT_EQ(std::isnan(c.O(0, i, x)), i >= 3 && x == 2) << "O[" << i << "," << x << "] = " << c.O(0, i, x);
  for (std::int64_t i = 0; i < 6; ++i) EXPECT_TRUE(std::isfinite(c.L(0, i)));
}

TEST_P(Hostile, NanInHalfAndBfloat16InputsStaysInItsRow) {
  for (DType dt : {DType::f16, DType::bf16}) {
    Call c(1, 1, 1, 4, 5, 8, 8);
    c.Q(0, 1, 0) = kNaN;
    const Tensor q = qkv::to_contiguous(c.q, dt), k = qkv::to_contiguous(c.k, dt), v = qkv::to_contiguous(c.v, dt);
    c.poison_outputs();
    if (!qkv::test::run_attention(GetParam(), q, k, v, c.out, {}, c.lse.view()))
      GTEST_SKIP() << GetParam().name << " is not available for " << qkv::dtype_name(dt);
    EXPECT_TRUE(row_all_nan(c, 0, 1)) << qkv::dtype_name(dt);
    for (std::int64_t i : {0, 2, 3})
      for (std::int64_t x = 0; x < 8; ++x) EXPECT_TRUE(std::isfinite(c.O(0, i, x))) << qkv::dtype_name(dt);
  }
}

TEST_P(Hostile, PositiveInfiniteScoreMakesItsRowNaN) {
  Call c(1, 1, 1, 4, 5, 4, 4);
  for (std::int64_t j = 0; j < 5; ++j) c.K(0, j, 0) = std::fabs(c.K(0, j, 0)) + 0.5f;
  c.Q(0, 2, 0) = kInf;  // every score of row 2 is +inf: inf - inf has no value
  RUN_OR_SKIP(c);
  EXPECT_TRUE(row_all_nan(c, 0, 2));
  EXPECT_TRUE(std::isnan(c.L(0, 2)));
  expect_rows_match_naive(c, 0, {0, 1, 3}, 0.5);
}

TEST_P(Hostile, NegativeInfiniteScoreExcludesItsKey) {
  Call c(1, 1, 1, 4, 5, 4, 4);
  for (std::int64_t i = 0; i < 4; ++i) c.Q(0, i, 0) = std::fabs(c.Q(0, i, 0)) + 0.5f;
  c.K(0, 2, 0) = -kInf;  // score of key 2 is -inf in every row: weight 0, as a -inf mask
  RUN_OR_SKIP(c);
  const float k2 = c.K(0, 2, 0);
  c.K(0, 2, 0) = 0.0f;  // the naive computation excludes key 2 by its bias instead
  std::vector<double> bias(5, 0.0);
  bias[2] = -INFINITY;
  expect_rows_match_naive(c, 0, {0, 1, 2, 3}, 0.5, bias);
  c.K(0, 2, 0) = k2;
}

TEST_P(Hostile, RowOfOnlyNegativeInfiniteScoresIsEmpty) {
  Call c(1, 1, 1, 3, 5, 4, 4);
  for (std::int64_t j = 0; j < 5; ++j) c.K(0, j, 0) = std::fabs(c.K(0, j, 0)) + 0.5f;
  c.Q(0, 1, 0) = -kInf;
  RUN_OR_SKIP(c);
  for (std::int64_t x = 0; x < 4; ++x) EXPECT_EQ(c.O(0, 1, x), 0.0f);
  EXPECT_EQ(c.L(0, 1), -kInf);
  for (std::int64_t j = 0; j < 5; ++j) EXPECT_EQ(c.P(0, 1, j), 0.0f);
  expect_rows_match_naive(c, 0, {0, 2}, 0.5);
}

TEST_P(Hostile, InfiniteValueGivesInfiniteOutputInRowsThatAdmitIt) {
  Call c(1, 1, 1, 4, 4, 4, 4);
  c.V(0, 1, 3) = kInf;
  qkv::AttentionParams p;
  p.causal = true;
  RUN_OR_SKIP(c, p);
  EXPECT_TRUE(std::isfinite(c.O(0, 0, 3)));
  for (std::int64_t i = 1; i < 4; ++i) EXPECT_EQ(c.O(0, i, 3), kInf) << "row " << i;
  for (std::int64_t i = 0; i < 4; ++i)
    for (std::int64_t x = 0; x < 3; ++x) EXPECT_TRUE(std::isfinite(c.O(0, i, x)));
}

TEST_P(Hostile, SoftcapBoundsInfiniteScores) {
  Call c(1, 1, 1, 1, 2, 1, 2);
  c.Q(0, 0, 0) = 1.0f;
  c.K(0, 0, 0) = kInf;  // score +inf, capped to softcap: 5 tanh(inf / 5) = 5
  c.K(0, 1, 0) = 0.0f;  // score 0
  c.V(0, 0, 0) = 1.0f; c.V(0, 0, 1) = -2.0f;
  c.V(0, 1, 0) = 3.0f; c.V(0, 1, 1) = 4.0f;
  qkv::AttentionParams p;
  p.scale = 1.0;
  p.softcap = 5.0;
  RUN_OR_SKIP(c, p);
  const double w0 = std::exp(5.0) / (std::exp(5.0) + 1.0), w1 = 1.0 - w0;
  expect_close(c.O(0, 0, 0), w0 * 1 + w1 * 3, "O0");
  expect_close(c.O(0, 0, 1), w0 * -2 + w1 * 4, "O1");
  expect_close(c.L(0, 0), std::log(std::exp(5.0) + 1.0), "lse");
}

// ---- magnitudes ----------------------------------------------------------------------------------

TEST_P(Hostile, HugeInputsWithModerateScores) {
  Call c(1, 2, 1, 3, 6, 8, 5);
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t i = 0; i < 3; ++i)
      for (std::int64_t x = 0; x < 8; ++x) c.Q(h, i, x) *= 1e30f;
  for (std::int64_t j = 0; j < 6; ++j) {
    for (std::int64_t x = 0; x < 8; ++x) c.K(0, j, x) *= 1e-30f;
    for (std::int64_t x = 0; x < 5; ++x) c.V(0, j, x) *= 1e30f;
  }
  RUN_OR_SKIP(c);
  // GQA: both query heads read KV head 0; the naive check indexes K/V by h, so copy head 0 there.
  for (std::int64_t i = 0; i < 3; ++i)
    for (std::int64_t x = 0; x < 5; ++x) EXPECT_TRUE(std::isfinite(c.O(0, i, x)) && std::isfinite(c.O(1, i, x)));
  expect_rows_match_naive(c, 0, {0, 1, 2}, 1 / std::sqrt(8.0));
}

TEST_P(Hostile, ScoresNearTheFloatLimitDoNotOverflow) {
  // D = 1, scale 1: scores q k_j of about +-2.9e38 (FLT_MAX = 3.4e38). The softmax subtracts the
  // row maximum first, so no exp() overflows: the largest score takes all the weight.
  Call c(1, 1, 1, 2, 4, 1, 2);
  c.Q(0, 0, 0) = 1.7e19f;
  c.Q(0, 1, 0) = -1.7e19f;
  const float ks[4] = {1.7e19f, 0.5e19f, -1.7e19f, 1.0e19f};
  for (int j = 0; j < 4; ++j) {
    c.K(0, j, 0) = ks[j];
    c.V(0, j, 0) = float(j);
    c.V(0, j, 1) = float(10 * j);
  }
  qkv::AttentionParams p;
  p.scale = 1.0;
  RUN_OR_SKIP(c, p);
  // Row 0: key 0 (score 2.89e38) wins; row 1: key 2 (score 2.89e38) wins.
  EXPECT_EQ(c.O(0, 0, 0), 0.0f);
  EXPECT_EQ(c.O(0, 0, 1), 0.0f);
  EXPECT_EQ(c.O(0, 1, 0), 2.0f);
  EXPECT_EQ(c.O(0, 1, 1), 20.0f);
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(std::isfinite(c.L(0, i)));
    expect_close(c.L(0, i), double(1.7e19f) * double(1.7e19f), "lse", 1e-6);
    for (int j = 0; j < 4; ++j) EXPECT_EQ(c.P(0, i, j), (i == 0 ? j == 0 : j == 2) ? 1.0f : 0.0f);
  }
}

TEST_P(Hostile, DenormalInputs) {
  Call c(1, 1, 1, 3, 5, 4, 4);
  const float tiny = 1e-40f;  // subnormal in float32
  ASSERT_EQ(std::fpclassify(tiny), FP_SUBNORMAL);
  for (Tensor* t : {&c.q, &c.k, &c.v})
    for (std::int64_t i = 0; i < t->numel(); ++i) t->data_as<float>()[i] = (i % 2 ? tiny : -tiny) * float(1 + i % 3);
  RUN_OR_SKIP(c);
  // Scores underflow to 0: uniform weights; O is the mean of V (or 0 where a kernel flushes
  // subnormals, an error below FLT_MIN).
  for (std::int64_t i = 0; i < 3; ++i) {
    expect_close(c.L(0, i), std::log(5.0), "lse");
    for (std::int64_t j = 0; j < 5; ++j) expect_close(c.P(0, i, j), 0.2, "P");
    for (std::int64_t x = 0; x < 4; ++x) {
      double mean = 0;
      for (std::int64_t j = 0; j < 5; ++j) mean += double(c.V(0, j, x)) / 5;
      EXPECT_TRUE(std::isfinite(c.O(0, i, x)));
      EXPECT_LE(std::fabs(c.O(0, i, x) - mean), FLT_MIN);
    }
  }
}

TEST_P(Hostile, NegativeZeroInputs) {
  Call c(1, 1, 1, 3, 4, 4, 4);
  for (std::int64_t i = 0; i < c.q.numel(); ++i) c.q.data_as<float>()[i] = -0.0f;
  for (std::int64_t i = 0; i < c.v.numel(); ++i) c.v.data_as<float>()[i] = -0.0f;
  RUN_OR_SKIP(c);
  for (std::int64_t i = 0; i < 3; ++i) {
    for (std::int64_t x = 0; x < 4; ++x) EXPECT_EQ(c.O(0, i, x), 0.0f);  // either sign of zero
    expect_close(c.L(0, i), std::log(4.0), "lse");
    for (std::int64_t j = 0; j < 4; ++j) expect_close(c.P(0, i, j), 0.25, "P");
  }
}

// ---- masks ---------------------------------------------------------------------------------------

TEST_P(Hostile, MaskOfNegativeInfinityEverywhereEmptiesTheRows) {
  for (DType mdt : {DType::f32, DType::f64, DType::b8}) {
    Call c(1, 2, 2, 3, 5, 4, 4);
    Tensor m(mdt, {3, 5});  // zero-initialised: bool false everywhere
    for (std::int64_t i = 0; i < 15; ++i) {
      if (mdt == DType::f32) m.data_as<float>()[i] = -kInf;
      if (mdt == DType::f64) m.data_as<double>()[i] = -INFINITY;
    }
    qkv::AttentionParams p;
    p.mask = m.view();
    RUN_OR_SKIP(c, p);
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t i = 0; i < 3; ++i) {
        for (std::int64_t x = 0; x < 4; ++x) EXPECT_EQ(c.O(h, i, x), 0.0f);
        EXPECT_EQ(c.L(h, i), -kInf);
        for (std::int64_t j = 0; j < 5; ++j) EXPECT_EQ(c.P(h, i, j), 0.0f);
      }
  }
}

TEST_P(Hostile, MaskOfNegativeInfinityInPartOfARow) {
  Call c(1, 1, 1, 4, 6, 8, 4);
  Tensor m(DType::f32, {4, 6});
  std::vector<std::vector<double>> bias(4, std::vector<double>(6, 0.0));
  for (std::int64_t i = 0; i < 4; ++i)
    for (std::int64_t j = 0; j < 6; ++j) {
      const bool out = (i + 2 * j) % 3 == 0;
      m.data_as<float>()[i * 6 + j] = out ? -kInf : 0.25f * float(j);
      bias[i][j] = out ? -INFINITY : 0.25 * j;
    }
  qkv::AttentionParams p;
  p.mask = m.view();
  RUN_OR_SKIP(c, p);
  for (std::int64_t i = 0; i < 4; ++i) {
    expect_rows_match_naive(c, 0, {i}, 1 / std::sqrt(8.0), bias[i]);
    for (std::int64_t j = 0; j < 6; ++j)
      if (bias[i][j] == -INFINITY) EXPECT_EQ(c.P(0, i, j), 0.0f);
  }
}

TEST_P(Hostile, MaskOfMinusFltMaxIsFiniteAndUniform) {
  Call c(1, 1, 1, 3, 5, 4, 4);
  Tensor m(DType::f32, {3, 5});
  for (std::int64_t j = 0; j < 5; ++j) {
    m.data_as<float>()[0 * 5 + j] = -FLT_MAX;              // row 0: every key at -FLT_MAX
    m.data_as<float>()[1 * 5 + j] = j < 2 ? 0.0f : -FLT_MAX;  // row 1: keys 2.. get no weight
    m.data_as<float>()[2 * 5 + j] = j == 4 ? -FLT_MAX : -kInf;  // row 2: only key 4 admitted
  }
  qkv::AttentionParams p;
  p.mask = m.view();
  RUN_OR_SKIP(c, p);
  // Row 0: -FLT_MAX swamps q.k (ulp of FLT_MAX is 2e31): equal scores, weights uniform.
  for (std::int64_t j = 0; j < 5; ++j) expect_close(c.P(0, 0, j), 0.2, "P row 0");
  for (std::int64_t x = 0; x < 4; ++x) {
    double mean = 0;
    for (std::int64_t j = 0; j < 5; ++j) mean += double(c.V(0, j, x)) / 5;
    expect_close(c.O(0, 0, x), mean, "O row 0");
  }
  EXPECT_TRUE(std::isfinite(c.L(0, 0)));
  expect_close(c.L(0, 0), -double(FLT_MAX), "lse row 0", 1e-6);
  // Row 1: keys at -FLT_MAX weigh exp(-3.4e38) = 0 beside keys at 0.
  std::vector<double> bias{0, 0, -INFINITY, -INFINITY, -INFINITY};
  expect_rows_match_naive(c, 0, {1}, 0.5, bias);
  // Row 2: a single finite key takes all the weight.
  for (std::int64_t x = 0; x < 4; ++x) EXPECT_EQ(c.O(0, 2, x), c.V(0, 4, x));
  EXPECT_EQ(c.P(0, 2, 4), 1.0f);
}

TEST_P(Hostile, MaskOfNaNOrPositiveInfinityMakesTheRowNaN) {
  for (float bad : {kNaN, kInf}) {
    Call c(1, 1, 1, 3, 4, 4, 4);
    Tensor m(DType::f32, {3, 4});
    m.data_as<float>()[1 * 4 + 2] = bad;
    qkv::AttentionParams p;
    p.mask = m.view();
    RUN_OR_SKIP(c, p);
    EXPECT_TRUE(row_all_nan(c, 0, 1)) << bad;
    expect_rows_match_naive(c, 0, {0, 2}, 0.5);
  }
}

// ---- scale ---------------------------------------------------------------------------------------

TEST_P(Hostile, ScaleZeroAveragesTheValues) {
  Call c(1, 1, 1, 3, 7, 8, 5);
  qkv::AttentionParams p;
  p.scale = 0.0;
  RUN_OR_SKIP(c, p);
  for (std::int64_t i = 0; i < 3; ++i) {
    for (std::int64_t x = 0; x < 5; ++x) {
      double mean = 0;
      for (std::int64_t j = 0; j < 7; ++j) mean += double(c.V(0, j, x)) / 7;
      expect_close(c.O(0, i, x), mean, "O");
    }
    expect_close(c.L(0, i), std::log(7.0), "lse");
    for (std::int64_t j = 0; j < 7; ++j) expect_close(c.P(0, i, j), 1.0 / 7, "P");
  }
}

TEST_P(Hostile, HugeScaleSelectsTheLargestScore) {
  Call c(1, 1, 1, 2, 5, 1, 3);
  const float ks[5] = {0.1f, -0.7f, 0.9f, 0.3f, 0.89f};
  for (int j = 0; j < 5; ++j) c.K(0, j, 0) = ks[j];
  c.Q(0, 0, 0) = 1.0f;   // argmax key 2
  c.Q(0, 1, 0) = -1.0f;  // argmax key 1
  qkv::AttentionParams p;
  p.scale = 1e30;  // scores up to 9e29: finite in float32, gaps of 1e28 between keys
  RUN_OR_SKIP(c, p);
  for (std::int64_t x = 0; x < 3; ++x) {
    EXPECT_EQ(c.O(0, 0, x), c.V(0, 2, x));
    EXPECT_EQ(c.O(0, 1, x), c.V(0, 1, x));
  }
  for (int j = 0; j < 5; ++j) {
    EXPECT_EQ(c.P(0, 0, j), j == 2 ? 1.0f : 0.0f);
    EXPECT_EQ(c.P(0, 1, j), j == 1 ? 1.0f : 0.0f);
  }
  expect_close(c.L(0, 0), 1e30 * double(0.9f), "lse", 1e-6);
}

TEST_P(Hostile, NonFiniteScaleIsRefused) {
  for (double s : {double(INFINITY), -double(INFINITY), double(NAN)}) {
    Call c(1, 1, 1, 2, 2, 4, 4);
    qkv::AttentionParams p;
    p.scale = s;
    try {
      c.run(GetParam(), p);
      ADD_FAILURE() << "scale " << s << " was accepted";
    } catch (const qkv::Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind("scale: expected a finite number", 0), 0u) << e.what();
    }
  }
}

// ---- tiny and empty shapes -----------------------------------------------------------------------

TEST_P(Hostile, SingleKeyTakesAllTheWeight) {
  Call c(2, 4, 2, 5, 1, 16, 3);
  qkv::AttentionParams p;
  RUN_OR_SKIP(c, p);
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t h = 0; h < 4; ++h)
      for (std::int64_t i = 0; i < 5; ++i) {
        const std::int64_t hk = h / 2;
        double dot = 0;
        for (std::int64_t x = 0; x < 16; ++x)
          dot += double(c.q.data_as<float>()[((b * 4 + h) * 5 + i) * 16 + x]) *
                 double(c.k.data_as<float>()[(b * 2 + hk) * 16 + x]);
        for (std::int64_t x = 0; x < 3; ++x)
          EXPECT_EQ(c.out.data_as<float>()[((b * 4 + h) * 5 + i) * 3 + x], c.v.data_as<float>()[(b * 2 + hk) * 3 + x]);
        expect_close(c.lse.data_as<float>()[(b * 4 + h) * 5 + i], dot / 4, "lse");
        EXPECT_EQ(c.probs.data_as<float>()[(b * 4 + h) * 5 + i], 1.0f);
      }
}

TEST_P(Hostile, EmptyBatchHeadsOrQueriesGiveEmptyOutputs) {
  const std::vector<std::vector<std::int64_t>> shapes = {
      // B, Hq, Hkv, Sq, Sk, D, Dv
      {0, 2, 1, 3, 4, 8, 8}, {2, 0, 0, 3, 4, 8, 8}, {2, 2, 1, 0, 4, 8, 8}, {1, 2, 2, 3, 4, 8, 0}};
  for (const auto& s : shapes) {
    Call c(s[0], s[1], s[2], s[3], s[4], s[5], s[6]);
    bool ran = false;
    ASSERT_NO_THROW(ran = c.run(GetParam())) << qkv::shape_str(s);
    if (!ran) continue;
    if (s[6] == 0)  // Dv = 0: nothing to average, but each row's lse and probs are still defined
      for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t i = 0; i < 3; ++i) EXPECT_TRUE(std::isfinite(c.L(h, i)));
    if (s[0] != 0 && s[1] != 0) continue;
    // Null data pointers are fine when every operand is empty.
    const TensorView q(nullptr, DType::f32, {s[0], s[1], s[3], s[5]});
    const TensorView k(nullptr, DType::f32, {s[0], s[2], s[4], s[5]});
    const TensorView v(nullptr, DType::f32, {s[0], s[2], s[4], s[6]});
    const TensorView o(nullptr, DType::f32, {s[0], s[1], s[3], s[6]});
    EXPECT_NO_THROW(qkv::test::run_attention(GetParam(), q, k, v, o)) << qkv::shape_str(s);
  }
}

TEST_P(Hostile, NoKeysGiveZeroOutputAndNegativeInfiniteLse) {
  Call c(1, 2, 2, 3, 0, 8, 4);
  RUN_OR_SKIP(c);
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t i = 0; i < 3; ++i) {
      for (std::int64_t x = 0; x < 4; ++x) EXPECT_EQ(c.O(h, i, x), 0.0f);
      EXPECT_EQ(c.L(h, i), -kInf);
    }
}

TEST_P(Hostile, ShapesWhoseSizeOverflowsAreRefused) {
  float one[8] = {};
  const std::int64_t big = std::int64_t{1} << 31;
  const auto refused = [&](const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                           const std::optional<TensorView>& probs, const std::string& prefix) {
    try {
      qkv::test::run_attention(GetParam(), q, k, v, o, {}, std::nullopt, probs);
      ADD_FAILURE() << "accepted; expected an error starting '" << prefix << "'";
    } catch (const qkv::Error& e) {
      EXPECT_EQ(std::string(e.what()).rfind(prefix, 0), 0u) << e.what();
    }
  };
  const TensorView small(one, DType::f32, {1, 1, 1, 1});
  // Element count overflows int64: 2^31 * 2^31 * 2^31 * 4 (views of one float, stride 0).
  const TensorView huge(one, DType::f32, {big, big, big, 4}, {0, 0, 0, 1});
  refused(huge, small, small, small, std::nullopt, "q: element count of shape");
  // Element count fits int64 but the byte count overflows size_t: 2^61 float32.
  const std::int64_t m = std::int64_t{1} << 20;
  const TensorView bytes(one, DType::f32, {m, m, m, 2}, {0, 0, 0, 1});
  refused(small, bytes, small, small, std::nullopt, "k: byte size of shape");
  // Every operand fits, but probs [B,Hq,Sq,Sk] = [1,1,2^40,2^40] does not.
  const std::int64_t t = std::int64_t{1} << 40;
  const TensorView q(one, DType::f32, {1, 1, t, 1}, {0, 0, 0, 1});
  const TensorView kv(one, DType::f32, {1, 1, t, 1}, {0, 0, 0, 1});
  float sink[8] = {};
  const TensorView o(sink, DType::f32, {1, 1, t, 1}, {0, 0, 1, 1});
  const TensorView p(sink + 4, DType::f32, {1, 1, t, t}, {0, 0, 0, 1});
  refused(q, kv, kv, o, p, "probs: element count of shape");
  // Strides whose byte extent overflows int64 are refused before any address is formed.
  const TensorView far(one, DType::f32, {3, 1, 1, 1}, {std::int64_t{1} << 62, 1, 1, 1});
  refused(far, small, small, small, std::nullopt, "q: expected strides whose byte extent fits in int64");
}

// Element offsets beyond 2^31 (and byte offsets beyond 2^33): K and V rows lie 2^31 + 64
// elements apart inside a sparse anonymous mapping, so only a few pages are ever touched. A
// kernel indexing with 32-bit integers would read the wrong rows.
TEST_P(Hostile, OffsetsBeyondInt32) {
  const std::int64_t Sk = 3, D = 4, row = (std::int64_t{1} << 31) + 64;
  const std::size_t bytes = static_cast<std::size_t>(row * Sk + D) * sizeof(float);
  void* map = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (map == MAP_FAILED) GTEST_SKIP() << "cannot reserve " << bytes << " bytes of address space";
  struct Unmap {
    void* p; std::size_t n;
    ~Unmap() { ::munmap(p, n); }
  } unmap{map, bytes};
  auto* base = static_cast<float*>(map);
  Call c(1, 1, 1, 2, Sk, D, D);
  for (std::int64_t j = 0; j < Sk; ++j)
    for (std::int64_t x = 0; x < D; ++x) base[j * row + x] = c.K(0, j, x);
  // V shares the rows of K (reading is fine: only outputs must not overlap inputs).
  const TensorView k(base, DType::f32, {1, 1, Sk, D}, {0, 0, row, 1});
  c.poison_outputs();
  if (!qkv::test::run_attention(GetParam(), c.q, k, k, c.out, {}, c.lse.view()))
    GTEST_SKIP() << GetParam().name << " is not available here";
  for (std::int64_t j = 0; j < Sk; ++j)
    for (std::int64_t x = 0; x < D; ++x) c.V(0, j, x) = c.K(0, j, x);
  double lse;
  std::vector<double> pr;
  for (std::int64_t i = 0; i < 2; ++i) {
    const std::vector<double> o = naive_row(c, 0, i, 0.5, {}, lse, pr);
    for (std::int64_t x = 0; x < D; ++x) expect_close(c.O(0, i, x), o[x], "O");
    expect_close(c.L(0, i), lse, "lse");
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, Hostile, ::testing::ValuesIn(qkv::test::attention_paths()),
                         [](const auto& info) {
                           std::string n;
                           for (char ch : info.param.name) n += std::isalnum(static_cast<unsigned char>(ch)) ? ch : '_';
                           return n;
                         });

}  // namespace
