// Attention semantics, continued from test_reference.cpp, on qkv::reference::attention and on
// qkv::attention: every option against an independent float64 computation (attention_case.hpp),
// the shape grid, every dtype and layout, and the NaN/inf isolation guarantee.
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
