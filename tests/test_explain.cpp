// qkv::explain: the step trace against the float64 reference and the fast path, the q/k/v
// projection, the heatmap images decoded back, and the scaling figures within sampling error.
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/error.hpp"
#include "qkv/explain.hpp"
#include "qkv/npy.hpp"
#include "qkv/reference.hpp"

#define STB_IMAGE_IMPLEMENTATION
#define STB_IMAGE_STATIC
#include <stb/stb_image.h>

namespace {

using namespace qkv;
constexpr double kInf = std::numeric_limits<double>::infinity();

Tensor random_tensor(DType dtype, Shape shape, std::mt19937_64& rng, double sd = 1.0) {
  Tensor t(dtype, shape);
  std::normal_distribution<double> nd(0.0, sd);
  for (std::int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data(), dtype, i, nd(rng));
  return t;
}

double at(const Tensor& t, std::int64_t i) { return load_as_double(t.data(), t.dtype(), i); }

struct Case {
  std::string name;
  DType dtype = DType::f32;
  std::int64_t B = 2, Hq = 4, Hkv = 2, Sq = 5, Sk = 5, D = 8, Dv = 5;
  bool causal = false;
  Alignment align = Alignment::bottom_right;
  std::int64_t wl = -1, wr = -1;
  double softcap = 0;
  int mask = 0;  // 0 none, 1 bool, 2 additive (with -inf entries)
  bool kv_lens = false;
  std::optional<double> scale;
};

std::vector<Case> cases() {
  std::vector<Case> c;
  for (DType d : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
    Case x;
    x.dtype = d;
    x.name = std::string(dtype_name(d)) + " plain";
    c.push_back(x);
  }
  Case x;
  x.name = "causal bottom-right Sq<Sk";
  x.causal = true;
  x.Sq = 3;
  x.Sk = 7;
  c.push_back(x);
  x = {};
  x.name = "causal top-left Sq>Sk";
  x.causal = true;
  x.align = Alignment::top_left;
  x.Sq = 7;
  x.Sk = 3;
  c.push_back(x);
  x = {};
  x.name = "window 2,1 GQA 4:1";
  x.wl = 2;
  x.wr = 1;
  x.Hkv = 1;
  x.Sq = 9;
  x.Sk = 9;
  c.push_back(x);
  x = {};
  x.name = "softcap scale";
  x.softcap = 1.5;
  x.scale = 0.9;
  x.Hkv = 4;
  c.push_back(x);
  x = {};
  x.name = "bool mask causal";
  x.mask = 1;
  x.causal = true;
  c.push_back(x);
  x = {};
  x.name = "additive mask softcap";
  x.mask = 2;
  x.softcap = 2.0;
  x.dtype = DType::f64;
  c.push_back(x);
  x = {};
  x.name = "kv_lens causal decode";
  x.kv_lens = true;
  x.causal = true;
  x.Sq = 1;
  x.Sk = 9;
  c.push_back(x);
  x = {};
  x.name = "kv_lens window";
  x.kv_lens = true;
  x.wl = 1;
  x.wr = 0;
  x.Sq = 4;
  x.Sk = 6;
  c.push_back(x);
  return c;
}

TEST(ExplainTrace, MatchesReferenceAndFastPath) {
  std::mt19937_64 rng(7);
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const Tensor q = random_tensor(c.dtype, {c.B, c.Hq, c.Sq, c.D}, rng);
    const Tensor k = random_tensor(c.dtype, {c.B, c.Hkv, c.Sk, c.D}, rng);
    const Tensor v = random_tensor(c.dtype, {c.B, c.Hkv, c.Sk, c.Dv}, rng);
    double bf16_floor = 0.0;
    if (c.dtype == DType::bf16)
      for (std::int64_t x = 0; x < v.numel(); ++x)
        bf16_floor = std::max(bf16_floor, std::abs(load_as_double(v.data(), v.dtype(), x)) / 256.0);
    AttentionParams p;
    p.scale = c.scale;
    p.causal = c.causal;
    p.align = c.align;
    p.window_left = c.wl;
    p.window_right = c.wr;
    p.softcap = c.softcap;
    Tensor mask, lens;
    if (c.mask == 1) {
      mask = Tensor(DType::b8, {c.B, 1, c.Sq, c.Sk});
      for (std::int64_t i = 0; i < mask.numel(); ++i) mask.data_as<std::uint8_t>()[i] = (rng() % 4) != 0;
      p.mask = mask.view();
    } else if (c.mask == 2) {
      mask = random_tensor(DType::f64, {c.Hq, c.Sq, c.Sk}, rng, 0.7);
      for (std::int64_t i = 0; i < mask.numel(); ++i)
        if (rng() % 5 == 0) mask.data_as<double>()[i] = -kInf;
      p.mask = mask.view();
    }
    if (c.kv_lens) {
      lens = Tensor(DType::i64, {c.B});
      lens.data_as<std::int64_t>()[0] = c.Sk - 2;
      lens.data_as<std::int64_t>()[1] = c.Sk;
      p.kv_lens = lens.view();
    }

    const explain::Trace t = explain::trace_attention(q, k, v, p);
    ASSERT_EQ(t.weights.size(), static_cast<std::size_t>(c.B * c.Hq * c.Sq * c.Sk));
    Tensor ref_out(DType::f64, {c.B, c.Hq, c.Sq, c.Dv}), ref_lse(DType::f64, {c.B, c.Hq, c.Sq}),
        ref_probs(DType::f64, {c.B, c.Hq, c.Sq, c.Sk});
    reference::attention(q, k, v, ref_out, p, ref_lse.view(), ref_probs.view());
    Tensor fast_out(DType::f32, {c.B, c.Hq, c.Sq, c.Dv});
    attention(q, k, v, fast_out, p);

    const double scale = c.scale ? *c.scale : 1.0 / std::sqrt(static_cast<double>(c.D));
    EXPECT_EQ(t.scale, scale);
    const std::int64_t group = c.Hq / c.Hkv;
    for (std::int64_t b = 0; b < c.B; ++b)
      for (std::int64_t h = 0; h < c.Hq; ++h)
        for (std::int64_t i = 0; i < c.Sq; ++i) {
          double sum = 0, row_max = -kInf;
          for (std::int64_t j = 0; j < c.Sk; ++j) {
            const auto e = static_cast<std::size_t>(t.at(b, h, i, j));
            const double w = t.weights[e], pr = ref_probs.data_as<double>()[e];
            EXPECT_NEAR(w, pr, 1e-15) << "weight b" << b << " h" << h << " i" << i << " j" << j;
            const bool admitted = t.status[e] == explain::KeyStatus::admitted;
            EXPECT_EQ(admitted, pr > 0) << "b" << b << " h" << h << " i" << i << " j" << j;
            if (!admitted) {
              EXPECT_EQ(t.scores[e], -kInf);
              EXPECT_EQ(t.scaled[e], -kInf);
              EXPECT_EQ(w, 0.0);
              continue;
            }
            // Steps 1 and 2 recomputed here from the inputs.
            double dot = 0;
            for (std::int64_t x = 0; x < c.D; ++x)
              dot += at(q, ((b * c.Hq + h) * c.Sq + i) * c.D + x) *
                     at(k, ((b * c.Hkv + h / group) * c.Sk + j) * c.D + x);
            EXPECT_NEAR(t.scores[e], dot, 1e-12);
            double s = scale * dot;
            if (c.softcap > 0) s = c.softcap * std::tanh(s / c.softcap);
            if (c.mask == 2) s += mask.data_as<double>()[(h * c.Sq + i) * c.Sk + j];
            EXPECT_NEAR(t.scaled[e], s, 1e-12);
            sum += w;
            row_max = std::max(row_max, t.scaled[e]);
          }
          const auto r = static_cast<std::size_t>((b * c.Hq + h) * c.Sq + i);
          if (row_max == -kInf) {
            EXPECT_EQ(sum, 0.0);
            EXPECT_EQ(t.lse[r], -kInf);
          } else {
            EXPECT_NEAR(sum, 1.0, 1e-14);
            // Step 3 again: softmax of the logits gives the weights.
            double z = 0;
            for (std::int64_t j = 0; j < c.Sk; ++j)
              z += std::exp(t.scaled[static_cast<std::size_t>(t.at(b, h, i, j))] - row_max);
            for (std::int64_t j = 0; j < c.Sk; ++j) {
              const auto e = static_cast<std::size_t>(t.at(b, h, i, j));
              EXPECT_NEAR(t.weights[e], std::exp(t.scaled[e] - row_max) / z, 1e-15);
            }
          }
          EXPECT_NEAR(t.lse[r], ref_lse.data_as<double>()[r], 1e-13);
          for (std::int64_t x = 0; x < c.Dv; ++x) {
            const auto o = r * static_cast<std::size_t>(c.Dv) + static_cast<std::size_t>(x);
            EXPECT_NEAR(t.output[o], ref_out.data_as<double>()[o], 1e-14);
            // bfloat16 inputs: the fast kernel rounds the weights to bfloat16 for its dot products,
            // so its documented floor (docs/accuracy.md) is max|v| / 256.
            EXPECT_NEAR(t.output[o], fast_out.data_as<float>()[o], 2e-5 * (1 + std::abs(t.output[o])) + bf16_floor);
          }
        }
  }
}

TEST(ExplainTrace, StatusNamesWhyAKeyIsExcluded) {
  std::mt19937_64 rng(3);
  const Tensor q = random_tensor(DType::f32, {1, 1, 4, 4}, rng),
               k = random_tensor(DType::f32, {1, 1, 4, 4}, rng),
               v = random_tensor(DType::f32, {1, 1, 4, 4}, rng);
  Tensor mask(DType::b8, {4});
  for (int j = 0; j < 4; ++j) mask.data_as<std::uint8_t>()[j] = j != 0;
  Tensor lens(DType::i32, {1});
  lens.data_as<std::int32_t>()[0] = 3;
  AttentionParams p;
  p.causal = true;
  p.align = Alignment::top_left;
  p.mask = mask.view();
  p.kv_lens = lens.view();
  const explain::Trace t = explain::trace_attention(q, k, v, p);
  using S = explain::KeyStatus;
  // Row 1 (top-left causal): key 0 masked, key 1 admitted, key 2 after the diagonal, key 3 past len.
  EXPECT_EQ(t.status[static_cast<std::size_t>(t.at(0, 0, 1, 0))], S::masked);
  EXPECT_EQ(t.status[static_cast<std::size_t>(t.at(0, 0, 1, 1))], S::admitted);
  EXPECT_EQ(t.status[static_cast<std::size_t>(t.at(0, 0, 1, 2))], S::outside_window);
  EXPECT_EQ(t.status[static_cast<std::size_t>(t.at(0, 0, 1, 3))], S::beyond_kv_len);
  // Row 0 has only key 0, which the mask excludes: an empty row gives z = 0, lse = -inf.
  EXPECT_EQ(t.lse[0], -kInf);
  for (std::int64_t x = 0; x < 4; ++x) EXPECT_EQ(t.output[static_cast<std::size_t>(x)], 0.0);
  EXPECT_EQ(t.weights[static_cast<std::size_t>(t.at(0, 0, 1, 1))], 1.0);
  EXPECT_STREQ(explain::key_status_name(S::beyond_kv_len), "kv_len");
  const std::string row = explain::format_row(t, 0, 0, 0, {"a", "b", "c", "d"});
  EXPECT_NE(row.find("excluded by mask"), std::string::npos) << row;
  EXPECT_NE(row.find("none (no admissible key"), std::string::npos) << row;
}

TEST(ExplainTrace, NanInExcludedKeyDoesNotLeak) {
  std::mt19937_64 rng(5);
  Tensor q = random_tensor(DType::f32, {1, 1, 3, 4}, rng), k = random_tensor(DType::f32, {1, 1, 3, 4}, rng),
         v = random_tensor(DType::f32, {1, 1, 3, 4}, rng);
  k.data_as<float>()[2 * 4] = std::nanf("");  // key 2: only the last row sees it under causal
  AttentionParams p;
  p.causal = true;
  const explain::Trace t = explain::trace_attention(q, k, v, p);
  for (std::int64_t i = 0; i < 2; ++i)
    for (std::int64_t x = 0; x < 4; ++x)
      EXPECT_TRUE(std::isfinite(t.output[static_cast<std::size_t>(i * 4 + x)]));
  EXPECT_TRUE(std::isnan(t.output[8]));
}

TEST(ExplainTrace, TopKeysQueryLabelsAndRowText) {
  std::mt19937_64 rng(11);
  const Tensor q = random_tensor(DType::f64, {1, 2, 3, 4}, rng),
               k = random_tensor(DType::f64, {1, 1, 5, 4}, rng),
               v = random_tensor(DType::f64, {1, 1, 5, 3}, rng);
  AttentionParams p;
  p.causal = true;  // bottom-right: query i sits at key i + 2
  const explain::Trace t = explain::trace_attention(q, k, v, p);
  const auto top = explain::top_keys(t, 0, 1, 1, 10);
  ASSERT_EQ(top.size(), 4u);  // keys 0..3 admitted
  for (std::size_t a = 1; a < top.size(); ++a) EXPECT_GE(top[a - 1].weight, top[a].weight);
  double best = 0;
  for (std::int64_t j = 0; j < 5; ++j)
    best = std::max(best, t.weights[static_cast<std::size_t>(t.at(0, 1, 1, j))]);
  EXPECT_EQ(top[0].weight, best);
  EXPECT_EQ(explain::top_keys(t, 0, 1, 1, 2).size(), 2u);
  const std::vector<std::string> labels{"the", "cat", "sat", "on", "mat"};
  EXPECT_EQ(explain::query_labels(t, labels), (std::vector<std::string>{"sat", "on", "mat"}));
  const std::string row = explain::format_row(t, 0, 1, 1, labels, 2);
  char w[32];
  std::snprintf(w, sizeof w, "%.6g", top[0].weight);
  EXPECT_NE(row.find(std::string("most weight: ") + std::to_string(top[0].key) + " \"" +
                     labels[static_cast<std::size_t>(top[0].key)] + "\" (" + w + ")"),
            std::string::npos)
      << row;
  EXPECT_NE(row.find("sum of weights = 1;"), std::string::npos) << row;
  EXPECT_NE(row.find("excluded by causal/window"), std::string::npos) << row;
  EXPECT_THROW(explain::format_row(t, 0, 2, 0), Error);
  EXPECT_THROW(explain::format_row(t, 0, 0, 0, {"a"}), Error);
  EXPECT_THROW(explain::top_keys(t, 0, 0, 3, 1), Error);
}

TEST(ExplainTrace, SinkShareIsAColumnAndRowsSumToOne) {
  std::mt19937_64 rng(5);
  const Tensor q = random_tensor(DType::f64, {2, 2, 3, 4}, rng), k = random_tensor(DType::f64, {2, 1, 5, 4}, rng),
               v = random_tensor(DType::f64, {2, 1, 5, 3}, rng);
  float z[2] = {0.5f, -2.0f}, slopes[2] = {0.25f, 0.5f};
  std::int64_t lens[2] = {5, 0};  // batch 1: no key, the sink takes every row
  AttentionParams p;
  p.causal = true;
  p.sinks = TensorView(z, DType::f32, {2});
  p.alibi_slopes = TensorView(slopes, DType::f32, {2});
  p.kv_lens = TensorView(lens, DType::i64, {2});
  const explain::Trace t = explain::trace_attention(q, k, v, p);
  // The trace's weights and output are the reference's.
  Tensor out(DType::f64, {2, 2, 3, 3}), lse(DType::f64, {2, 2, 3});
  reference::attention(q, k, v, out, p, lse.view());
  for (std::int64_t e = 0; e < out.numel(); ++e) EXPECT_EQ(t.output[static_cast<std::size_t>(e)], out.data_as<double>()[e]);
  for (std::int64_t b = 0; b < 2; ++b) {
    const Tensor w = explain::head_weights_with_sink(t, b);
    ASSERT_EQ(w.shape(), (Shape{2, 3, 6}));
    for (std::int64_t r = 0; r < 2 * 3; ++r) {
      double sum = 0;
      for (std::int64_t j = 0; j < 6; ++j) sum += w.data_as<double>()[r * 6 + j];
      EXPECT_NEAR(sum, 1.0, 1e-14) << b << " " << r;
      const double lse_r = lse.data_as<double>()[b * 6 + r];
      EXPECT_NEAR(w.data_as<double>()[r * 6 + 5], std::exp(z[r / 3] - lse_r), 1e-14);
    }
  }
  EXPECT_EQ(explain::head_weights_with_sink(t, 1).data_as<double>()[5], 1.0);
  const std::string row = explain::format_row(t, 0, 1, 2);
  EXPECT_NE(row.find("+ alibi"), std::string::npos) << row;
  EXPECT_NE(row.find("sink"), std::string::npos) << row;
  EXPECT_NE(row.find("sum of weights (sink included) = 1;"), std::string::npos) << row;
  // The heatmap of the weights with the sink: one more column, labelled.
  const Tensor w = explain::head_weights_with_sink(t, 0);
  const std::string svg =
      explain::heatmap_svg(w.view(), {"a", "b", "c"}, {"0", "1", "2", "3", "4", "sink"});
  EXPECT_NE(svg.find(">sink</text>"), std::string::npos);
  EXPECT_THROW(explain::head_weights_with_sink(t, 2), Error);
}

TEST(ExplainTrace, RejectsBadArguments) {
  std::mt19937_64 rng(1);
  const Tensor q = random_tensor(DType::f32, {1, 1, 3, 4}, rng),
               k = random_tensor(DType::f32, {1, 1, 3, 5}, rng),
               v = random_tensor(DType::f32, {1, 1, 3, 4}, rng),
               q3 = random_tensor(DType::f32, {1, 3, 4}, rng);
  try {
    explain::trace_attention(q, k, v);
    FAIL() << "expected qkv::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("k: expected [B,Hkv,Sk,D] with D == q.D (4), got D = 5"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(explain::trace_attention(q3, q, v), Error);
  // Too many entries: refused before allocating.
  Tensor big_q(DType::f32, {1, 1, 5000, 1}), big_k(DType::f32, {1, 1, 5000, 1});
  EXPECT_THROW(explain::trace_attention(big_q, big_k, big_k), Error);
}

TEST(ExplainProject, MatchesNaiveProduct) {
  std::mt19937_64 rng(2);
  const std::int64_t B = 2, S = 5, dm = 6, H = 2, dk = 3, dv = 4;
  const Tensor x = random_tensor(DType::f32, {B, S, dm}, rng),
               wq = random_tensor(DType::f32, {dm, H * dk}, rng),
               wk = random_tensor(DType::f32, {dm, H * dk}, rng),
               wv = random_tensor(DType::f32, {dm, H * dv}, rng);
  const explain::Projected p = explain::project_qkv(x, wq, wk, wv, H);
  ASSERT_EQ(p.q.shape(), (Shape{B, H, S, dk}));
  ASSERT_EQ(p.v.shape(), (Shape{B, H, S, dv}));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t s = 0; s < S; ++s) {
        for (std::int64_t c = 0; c < dk; ++c) {
          double eq = 0, ek = 0;
          for (std::int64_t m = 0; m < dm; ++m) {
            eq += at(x, (b * S + s) * dm + m) * at(wq, m * H * dk + h * dk + c);
            ek += at(x, (b * S + s) * dm + m) * at(wk, m * H * dk + h * dk + c);
          }
          EXPECT_NEAR(at(p.q, ((b * H + h) * S + s) * dk + c), eq, 1e-12);
          EXPECT_NEAR(at(p.k, ((b * H + h) * S + s) * dk + c), ek, 1e-12);
        }
        for (std::int64_t c = 0; c < dv; ++c) {
          double ev = 0;
          for (std::int64_t m = 0; m < dm; ++m)
            ev += at(x, (b * S + s) * dm + m) * at(wv, m * H * dv + h * dv + c);
          EXPECT_NEAR(at(p.v, ((b * H + h) * S + s) * dv + c), ev, 1e-12);
        }
      }
  // [S, d_model] input gives B = 1.
  const Tensor x2 = random_tensor(DType::f64, {S, dm}, rng);
  EXPECT_EQ(explain::project_qkv(x2, wq, wk, wv, 1).q.shape(), (Shape{1, 1, S, H * dk}));
  EXPECT_THROW(explain::project_qkv(x2, wq, wk, wv, 4), Error);  // 6 columns, 4 heads
  EXPECT_THROW(explain::project_qkv(x2, wv, wk, wv, 1), Error);  // wq, wk columns differ
  EXPECT_THROW(explain::project_qkv(random_tensor(DType::f32, {S, dm - 1}, rng), wq, wk, wv),
               Error);                                                                             // d_model
  EXPECT_THROW(explain::project_qkv(random_tensor(DType::i32, {S, dm}, rng), wq, wk, wv), Error);  // dtype
}

// ---- images ------------------------------------------------------------------------------------

std::filesystem::path temp_path(const std::string& name) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("qkv_test_explain_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir / name;
}

std::string slurp(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::size_t count(const std::string& s, const std::string& what) {
  std::size_t n = 0;
  for (auto p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

TEST(ExplainHeatmap, ViridisEndpoints) {
  EXPECT_EQ(explain::viridis(0.0), (std::array<std::uint8_t, 3>{68, 1, 84}));
  EXPECT_EQ(explain::viridis(1.0), (std::array<std::uint8_t, 3>{253, 231, 37}));
  EXPECT_EQ(explain::viridis(-3.0), explain::viridis(0.0));
  EXPECT_EQ(explain::viridis(std::nan("")), explain::viridis(0.0));
  // matplotlib's viridis(0.5) is #21918c.
  const auto m = explain::viridis(0.5);
  EXPECT_NEAR(m[0], 0x21, 3);
  EXPECT_NEAR(m[1], 0x91, 3);
  EXPECT_NEAR(m[2], 0x8c, 3);
  // Perceptual order: luminance grows monotonically along the map.
  double prev = -1;
  for (int s = 0; s <= 100; ++s) {
    const auto c = explain::viridis(s / 100.0);
    const double y = 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2];
    EXPECT_GT(y, prev - 0.5) << s;
    prev = y;
  }
}

TEST(ExplainHeatmap, PngDecodesBackWithTheCells) {
  const std::int64_t H = 2, Sq = 3, Sk = 4;
  std::vector<double> w(static_cast<std::size_t>(H * Sq * Sk), 0.0);
  w[0] = 1.0;  // head 0, query 0, key 0
  const TensorView wv(w.data(), DType::f64, {H, Sq, Sk});
  explain::HeatmapOptions o;
  o.cell_px = 20;
  o.title = "test";
  const std::vector<std::string> rows{"a", "b", "c"}, cols{"w", "x", "y", "\xe2\x96\x81z"};
  const explain::Image im = explain::render_heatmap(wv, rows, cols, o);
  EXPECT_GE(im.width, 2 * Sk * 20);
  EXPECT_GE(im.height, Sq * 20);
  const auto path = temp_path("h.png");
  explain::write_heatmap(path, wv, rows, cols, o);
  int x = 0, y = 0, n = 0;
  unsigned char* px = stbi_load(path.c_str(), &x, &y, &n, 3);
  ASSERT_NE(px, nullptr) << stbi_failure_reason();
  EXPECT_EQ(x, im.width);
  EXPECT_EQ(y, im.height);
  EXPECT_EQ(std::vector<std::uint8_t>(px, px + x * y * 3), im.rgb);  // lossless
  std::size_t hot = 0, cold = 0;
  const auto c1 = explain::viridis(1.0), c0 = explain::viridis(0.0);
  for (int p = 0; p < x * y; ++p) {
    const std::array<std::uint8_t, 3> c{px[3 * p], px[3 * p + 1], px[3 * p + 2]};
    hot += c == c1;
    cold += c == c0;
  }
  stbi_image_free(px);
  // One 20x20 cell at weight 1 (plus the top of the colour bar), the other 23 cells at 0 (plus its bottom).
  EXPECT_GE(hot, 400u);
  EXPECT_LT(hot, 400u + 16 * 4);
  EXPECT_GE(cold, 23u * 400);
  EXPECT_LT(cold, 23u * 400 + 16 * 4);
  // Many panels make a grid: 5 heads -> 3 columns, 2 rows.
  std::vector<double> w5(5 * 9, 0.25);
  const explain::Image g = explain::render_heatmap(TensorView(w5.data(), DType::f64, {5, 3, 3}), {}, {}, o);
  EXPECT_GE(g.width, 3 * 3 * 20);
  EXPECT_GE(g.height, 2 * 3 * 20);
}

TEST(ExplainHeatmap, SvgAndHtmlHoldTextAndCells) {
  std::vector<double> w{0.1, 0.9, 0.5, 0.5, 1.0, 0.0};
  const TensorView wv(w.data(), DType::f64, {3, 2});
  const std::vector<std::string> rows{"q<1>", "q&2", "r3"}, cols{"k\"a", "\xe2\x96\x81once"};
  const std::string svg = explain::heatmap_svg(wv, rows, cols);
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_EQ(svg.substr(svg.size() - 7), "</svg>\n");
  EXPECT_EQ(count(svg, "class=\"cell\""), 6u);
  EXPECT_NE(svg.find(">q&lt;1&gt;</text>"), std::string::npos);
  EXPECT_NE(svg.find(">q&amp;2</text>"), std::string::npos);
  EXPECT_NE(svg.find(">k&quot;a</text>"), std::string::npos);
  EXPECT_NE(svg.find(">\xe2\x96\x81once</text>"), std::string::npos);                 // UTF-8 kept as text
  EXPECT_NE(svg.find("fill=\"" + std::string("#fde725") + "\""), std::string::npos);  // the weight-1 cell
  EXPECT_EQ(count(svg, "class=\"tick\""), 5u);
  const auto html = temp_path("h.html"), svgp = temp_path("h.svg");
  explain::write_heatmap(html, wv, rows, cols);
  explain::write_heatmap(svgp, wv, rows, cols);
  EXPECT_EQ(slurp(html).rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(slurp(html).find("class=\"cell\""), std::string::npos);
  EXPECT_EQ(slurp(svgp).rfind("<?xml", 0), 0u);
  EXPECT_THROW(explain::write_heatmap(temp_path("h.bmp"), wv, rows, cols), Error);
  EXPECT_FALSE(std::filesystem::exists(temp_path("h.bmp")));
  EXPECT_THROW(explain::heatmap_svg(wv, {"a"}, cols), Error);
  EXPECT_THROW(explain::render_heatmap(wv, rows, {"a", "b", "c"}), Error);
}

// ---- the scaling argument ----------------------------------------------------------------------

TEST(ExplainScaling, JacobianNormClosedFormMatchesMatrix) {
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  for (int n : {2, 5, 64}) {
    std::vector<double> a(static_cast<std::size_t>(n));
    double s = 0;
    for (auto& x : a) s += x = u(rng);
    for (auto& x : a) x /= s;
    double f2 = 0;
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        const double jij = (i == j ? a[i] : 0.0) - a[i] * a[j];
        f2 += jij * jij;
      }
    EXPECT_NEAR(explain::softmax_jacobian_frobenius(a.data(), n), std::sqrt(f2), 1e-14);
  }
  std::vector<double> onehot(8, 0.0), uniform(64, 1.0 / 64);
  onehot[3] = 1.0;
  EXPECT_EQ(explain::softmax_jacobian_frobenius(onehot.data(), 8), 0.0);
  EXPECT_NEAR(explain::softmax_jacobian_frobenius(uniform.data(), 64), std::sqrt(1.0 / 64 - 1.0 / 4096),
              1e-15);
}

TEST(ExplainScaling, FiguresWithinSamplingError) {
  explain::ScalingOptions o;
  o.d_k = {4, 64, 256};
  o.samples = 400;
  const auto rows = explain::scaling_study(o);
  ASSERT_EQ(rows.size(), 3u);
  const double N = static_cast<double>(o.samples * o.n_keys);
  for (const auto& r : rows) {
    SCOPED_TRACE("d_k " + std::to_string(r.d_k));
    const double d = static_cast<double>(r.d_k);
    // The dot products of one sample share q but are uncorrelated: the mean has variance d / N.
    EXPECT_LT(std::abs(r.mean_dot), 5 * std::sqrt(d / N));
    EXPECT_LT(std::abs(r.var_dot - d), 5 * r.var_dot_stderr);
    EXPECT_LT(r.var_dot_stderr, 0.05 * d);
    EXPECT_LT(std::abs(r.mean_scaled), 5 * std::sqrt(1 / N));
    EXPECT_LT(std::abs(r.var_scaled - 1), 5 * r.var_dot_stderr / d);
    EXPECT_NEAR(r.var_scaled, r.var_dot / d, 1e-9);
    // Scaled: the same softmax statistics whatever d_k.
    EXPECT_GT(r.max_weight_scaled, 0.08);
    EXPECT_LT(r.max_weight_scaled, 0.14);
    EXPECT_GT(r.entropy_scaled, 3.5);
    EXPECT_LE(r.entropy_scaled, std::log(64.0));
    EXPECT_EQ(r.vanished_scaled, 0.0);
    EXPECT_EQ(r.one_hot_scaled, 0.0);
    EXPECT_GT(r.jacobian_median_scaled, 0.15);
  }
  const auto& r64 = rows[1];
  EXPECT_NEAR(std::sqrt(r64.var_dot), 8.0, 0.4);
  EXPECT_GT(r64.max_weight, 0.7);  // towards one-hot
  EXPECT_LT(r64.entropy, 1.0);     // of ln 64 = 4.16
  EXPECT_GT(r64.vanished, 0.08);   // rows whose scores get almost no gradient
  EXPECT_GT(r64.one_hot, 0.08);
  const auto& r256 = rows[2];
  EXPECT_LT(r256.jacobian_median, 0.25 * r256.jacobian_median_scaled);
  EXPECT_GT(r256.vanished, r64.vanished);
  EXPECT_GT(r64.max_weight, rows[0].max_weight);
  // Reproducible from the seed; a d_k's figures do not depend on the others measured.
  o.d_k = {64};
  const auto again = explain::scaling_study(o);
  EXPECT_EQ(again[0].var_dot, r64.var_dot);
  EXPECT_EQ(again[0].jacobian, r64.jacobian);
  const std::string text = explain::format_scaling(rows, o);
  EXPECT_NE(text.find("At d_k = 64: unscaled scores have standard deviation"), std::string::npos) << text;
  EXPECT_THROW(explain::scaling_study({{0}, 64, 10, 1}), Error);
  EXPECT_THROW(explain::scaling_study({{4}, 1, 10, 1}), Error);
}

TEST(ExplainScaling, PlotFiles) {
  explain::ScalingOptions o;
  o.d_k = {4, 16, 64};
  o.samples = 50;
  const auto rows = explain::scaling_study(o);
  const auto png = temp_path("s.png"), svg = temp_path("s.svg");
  explain::write_scaling_plot(png, rows, o);
  explain::write_scaling_plot(svg, rows, o);
  int x = 0, y = 0, n = 0;
  unsigned char* px = stbi_load(png.c_str(), &x, &y, &n, 3);
  ASSERT_NE(px, nullptr);
  stbi_image_free(px);
  EXPECT_EQ(x, 716);  // two 340-px panels and three 12-px margins
  EXPECT_EQ(y, 558);  // title 28, two 240-px panels, legend 26, two margins
  const std::string s = slurp(svg);
  EXPECT_EQ(count(s, "class=\"panel\""), 4u);
  EXPECT_EQ(count(s, "class=\"series\""), 11u);  // 3 + 2 + 3 + 3 curves
  EXPECT_THROW(explain::write_scaling_plot(temp_path("s.txt"), rows, o), Error);
}

}  // namespace
