// RoPE against the formula of RoFormer (Su et al. 2021, sec. 3.4) evaluated in double, and
// bit-for-bit against llama2.c's float computation.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/rope.hpp"

namespace {

using qkv::DType;
using qkv::Tensor;
using qkv::TensorView;

Tensor random_f32(const qkv::Shape& shape, std::uint32_t seed) {
  Tensor t(DType::f32, shape);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = nd(rng);
  return t;
}

// Direct double-precision evaluation of the rotation for one vector.
std::vector<double> rope_formula(const float* x, std::int64_t D, std::int64_t R, std::int64_t pos,
                                 double theta, qkv::RopeStyle style) {
  std::vector<double> y(x, x + D);
  for (std::int64_t j = 0; j < R / 2; ++j) {
    const double w = std::pow(theta, -2.0 * static_cast<double>(j) / static_cast<double>(R));
    const double c = std::cos(pos * w), s = std::sin(pos * w);
    const std::int64_t a = style == qkv::RopeStyle::interleaved ? 2 * j : j;
    const std::int64_t b = style == qkv::RopeStyle::interleaved ? 2 * j + 1 : j + R / 2;
    y[a] = x[a] * c - x[b] * s;
    y[b] = x[b] * c + x[a] * s;
  }
  return y;
}

// [B,S,H,D] storage viewed as [B,H,S,D]: the layout of a projection buffer.
TensorView bshd_as_bhsd(const Tensor& t) { return t.view().permute({0, 2, 1, 3}); }

class RopeFormula : public ::testing::TestWithParam<std::tuple<qkv::RopeStyle, std::int64_t, std::int64_t>> {
};

TEST_P(RopeFormula, MatchesDoubleFormulaOnStridedViews) {
  const auto [style, D, R] = GetParam();
  const std::int64_t B = 2, S = 6, H = 3;
  Tensor x = random_f32({B, S, H, D}, 7);
  Tensor orig = random_f32({B, S, H, D}, 7);
  std::vector<std::int64_t> pos{0, 1, 5, 17, 1000, 65535};
  qkv::RopeConfig cfg;
  cfg.style = style;
  cfg.rotary_dim = R == D ? 0 : R;
  cfg.theta = 10000.0;
  qkv::apply_rope(bshd_as_bhsd(x), pos, cfg);
  double max_err = 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < S; ++t)
      for (std::int64_t h = 0; h < H; ++h) {
        const std::int64_t off = ((b * S + t) * H + h) * D;
        const auto want = rope_formula(orig.data_as<float>() + off, D, R, pos[t], cfg.theta, style);
        for (std::int64_t d = 0; d < D; ++d) {
          max_err = std::max(max_err, std::abs(x.data_as<float>()[off + d] - want[d]));
          if (d >= R)
            EXPECT_EQ(x.data_as<float>()[off + d], orig.data_as<float>()[off + d]) << "dim beyond rotary_dim";
        }
      }
  EXPECT_LT(max_err, 2e-6) << "float32 rounding of the rotated values only";
}

INSTANTIATE_TEST_SUITE_P(Styles, RopeFormula,
                         ::testing::Values(std::make_tuple(qkv::RopeStyle::interleaved, 8, 8),
                                           std::make_tuple(qkv::RopeStyle::half_split, 8, 8),
                                           std::make_tuple(qkv::RopeStyle::interleaved, 64, 64),
                                           std::make_tuple(qkv::RopeStyle::half_split, 64, 64),
                                           std::make_tuple(qkv::RopeStyle::half_split, 12, 4),
                                           std::make_tuple(qkv::RopeStyle::interleaved, 10, 6)));

TEST(Rope, Llama2cFloatModeIsBitExact) {
  // llama2.c run.c, for one head of size D at position pos (the loop over i in steps of 2).
  const std::int64_t D = 8, S = 9;
  Tensor x = random_f32({1, 1, S, D}, 3), want = random_f32({1, 1, S, D}, 3);
  for (std::int64_t pos = 0; pos < S; ++pos) {
    float* vec = want.data_as<float>() + pos * D;
    for (int i = 0; i < D; i += 2) {
      int head_dim = i % static_cast<int>(D);
      float freq = 1.0f / powf(10000.0f, head_dim / static_cast<float>(D));
      float val = static_cast<float>(pos) * freq;
      float fcr = cosf(val), fci = sinf(val);
      float v0 = vec[i], v1 = vec[i + 1];
      vec[i] = v0 * fcr - v1 * fci;
      vec[i + 1] = v0 * fci + v1 * fcr;
    }
  }
  qkv::RopeConfig cfg;
  cfg.angles = qkv::RopeAngles::llama2c_f32;
  qkv::apply_rope(x.view(), 0, cfg);
  for (std::int64_t i = 0; i < x.numel(); ++i)
    EXPECT_EQ(x.data_as<float>()[i], want.data_as<float>()[i]) << i;
}

TEST(Rope, DecodeStepEqualsPrefillRow) {
  // Rotating S tokens at once or one token at position p gives identical bits.
  const std::int64_t S = 7, D = 16;
  for (auto style : {qkv::RopeStyle::interleaved, qkv::RopeStyle::half_split}) {
    qkv::RopeConfig cfg;
    cfg.style = style;
    Tensor all = random_f32({1, 2, S, D}, 11);
    Tensor rows = random_f32({1, 2, S, D}, 11);
    qkv::apply_rope(all.view(), 0, cfg);
    for (std::int64_t p = 0; p < S; ++p) {
      TensorView row(rows.data_as<float>() + p * D, DType::f32, {1, 2, 1, D}, {2 * S * D, S * D, D, 1});
      qkv::apply_rope(row, p, cfg);
    }
    for (std::int64_t i = 0; i < all.numel(); ++i)
      ASSERT_EQ(all.data_as<float>()[i], rows.data_as<float>()[i]);
  }
}

TEST(Rope, PerBatchPositionsAndRelativeProperty) {
  // RoFormer sec. 3.2: <R(m) q, R(n) k> depends only on m - n.
  const std::int64_t D = 32;
  Tensor q = random_f32({1, 1, 1, D}, 1), k = random_f32({1, 1, 1, D}, 2);
  auto dot_at = [&](std::int64_t m, std::int64_t n) {
    Tensor qq(DType::f64, {2, 1, 1, D});
    for (std::int64_t d = 0; d < D; ++d) {
      qq.data_as<double>()[d] = q.data_as<float>()[d];
      qq.data_as<double>()[D + d] = k.data_as<float>()[d];
    }
    std::vector<std::int64_t> pos{m, n};  // B*S entries: batch row 0 at m, row 1 at n
    qkv::apply_rope(qq.view(), pos);
    double acc = 0;
    for (std::int64_t d = 0; d < D; ++d) acc += qq.data_as<double>()[d] * qq.data_as<double>()[D + d];
    return acc;
  };
  EXPECT_NEAR(dot_at(5, 2), dot_at(103, 100), 1e-9);
  EXPECT_NEAR(dot_at(0, 0), dot_at(77, 77), 1e-9);
  EXPECT_GT(std::abs(dot_at(5, 2) - dot_at(5, 3)), 1e-6);
}

TEST(Rope, ThetaChangesTheAngles) {
  Tensor a = random_f32({1, 1, 1, 8}, 5), b = random_f32({1, 1, 1, 8}, 5);
  qkv::RopeConfig c1, c2;
  c2.theta = 500000.0;
  qkv::apply_rope(a.view(), 3, c1);
  qkv::apply_rope(b.view(), 3, c2);
  const auto want =
      rope_formula(random_f32({8}, 5).data_as<float>(), 8, 8, 3, 500000.0, qkv::RopeStyle::interleaved);
  for (int d = 0; d < 8; ++d) EXPECT_NEAR(b.data_as<float>()[d], want[d], 2e-6);
  EXPECT_NE(a.data_as<float>()[2], b.data_as<float>()[2]);
}

TEST(Rope, RefusesBadArguments) {
  Tensor x = random_f32({1, 2, 3, 8}, 1);
  std::vector<std::int64_t> two{0, 1};
  EXPECT_THROW(qkv::apply_rope(x.view(), two), qkv::Error);
  std::vector<std::int64_t> neg{0, -1, 2};
  EXPECT_THROW(qkv::apply_rope(x.view(), neg), qkv::Error);
  qkv::RopeConfig odd;
  odd.rotary_dim = 3;
  EXPECT_THROW(qkv::apply_rope(x.view(), 0, odd), qkv::Error);
  qkv::RopeConfig big;
  big.rotary_dim = 10;
  EXPECT_THROW(qkv::apply_rope(x.view(), 0, big), qkv::Error);
  qkv::RopeConfig bad_theta;
  bad_theta.theta = 0.0;
  EXPECT_THROW(qkv::apply_rope(x.view(), 0, bad_theta), qkv::Error);
  Tensor odd_d = random_f32({1, 1, 2, 7}, 1);
  EXPECT_THROW(qkv::apply_rope(odd_d.view(), 0), qkv::Error);
  Tensor h(DType::f16, {1, 1, 2, 8});
  EXPECT_THROW(qkv::apply_rope(h.view(), 0), qkv::Error);
  Tensor r3 = random_f32({2, 3, 8}, 1);
  EXPECT_THROW(qkv::apply_rope(r3.view(), 0), qkv::Error);
  try {
    qkv::apply_rope(x.view(), two);
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("positions"), std::string::npos) << e.what();
  }
}

}  // namespace
