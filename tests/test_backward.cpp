// The fast backward kernel (src/kernels/engine/backward.hpp) against the float64 backward
// specification: a randomized grid of shapes and options on every ISA level with 1 and 2 threads
// (tests/backward_diff.hpp), determinism across 50 calls, and the edge cases of the backward.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <cstdio>
#include <cstdlib>
#include <random>

#include "backward_diff.hpp"

namespace qkv::test {
namespace {

// A random configuration: odd and tile-edge sizes, every option, GQA 1/2/8, both layouts.
// `big` draws longer rows (the soak).
BwConfig random_config(std::mt19937_64& rng, std::uint64_t seed, bool big) {
  const std::int64_t Ds[] = {1, 8, 16, 59, 64, 111, 128};
  const std::int64_t small[] = {1, 2, 17, 64, 97, 130, 200};
  const std::int64_t large[] = {1, 17, 97, 130, 200, 333, 401};
  const std::int64_t groups[] = {1, 2, 8};
  auto pick = [&](const auto& a) { return a[rng() % std::size(a)]; };
  BwConfig c;
  c.seed = seed;
  const std::int64_t g = pick(groups);
  c.Hkv = 1 + static_cast<std::int64_t>(rng() % 2);
  c.Hq = c.Hkv * g;
  c.B = 1 + static_cast<std::int64_t>(rng() % 2);
  c.Sq = big ? pick(large) : pick(small);
  c.Sk = rng() % 3 == 0 ? c.Sq : (big ? pick(large) : pick(small));
  c.D = pick(Ds);
  c.Dv = rng() % 3 == 0 ? pick(Ds) : c.D;
  const DType dts[] = {DType::f32, DType::f32, DType::bf16, DType::f16};
  c.dtype = pick(dts);
  c.grad = rng() % 4 == 0 ? c.dtype : DType::f32;
  c.causal = rng() % 2;
  c.align = rng() % 2 ? Alignment::top_left : Alignment::bottom_right;
  if (rng() % 4 == 0) {
    c.wl = static_cast<std::int64_t>(rng() % 40);
    c.wr = static_cast<std::int64_t>(rng() % 10);
  }
  c.mask = static_cast<int>(rng() % 5 == 0 ? 1 + rng() % 2 : 0);
  c.kv_lens = rng() % 5 == 0;
  c.softcap = rng() % 5 == 0 ? 3.0 : 0.0;
  c.outliers = rng() % 4 == 0;
  c.bshd = rng() % 3 == 0;
  const DType aux[] = {DType::f32, DType::f32, DType::bf16, DType::f64};
  c.dout = pick(aux);
  c.lse = rng() % 4 == 0 ? DType::f64 : DType::f32;
  return c;
}

TEST(Backward, RandomizedGrid) {
  std::mt19937_64 rng(2024);
  double worst = 0.0;
  for (int n = 0; n < 60; ++n) worst = std::max(worst, run_backward_case(random_config(rng, 100 + n, false)));
  RecordProperty("worst_error_ratio", std::to_string(worst));
}

// Soak: QKV_SOAK_N (default 1000) larger configurations, the same checks with the bound 4 x naive
// + floor (as the forward's soak); prints the worst ratio error / (2 naive + floor) and how many
// configurations exceed 1, i.e. the CI bound.
// build/tests/test_backward --gtest_also_run_disabled_tests --gtest_filter='*Soak*'
TEST(Backward, DISABLED_Soak) {
  const char* e = std::getenv("QKV_SOAK_N");
  const int n = e ? std::atoi(e) : 1000;
  std::mt19937_64 rng(77);
  double worst = 0.0;
  int above = 0;
  for (int i = 0; i < n; ++i) {
    const BwConfig c = random_config(rng, 5000 + i, true);
    const double r = run_backward_case(c, 4.0);
    if (r > worst) std::printf("soak %d: ratio %.3f  %s\n", i, r, c.str().c_str()), std::fflush(stdout);
    worst = std::max(worst, r);
    above += r > 1.0;
  }
  std::printf("backward soak: %d configurations, worst ratio %.3f, %d above 1\n", n, worst, above);
}

// Long rows and full tiles: several key groups and chunks per head, GQA, D = 128.
TEST(Backward, LongRows) {
  BwConfig c;
  c.B = 1;
  c.Hq = 4;
  c.Hkv = 2;
  c.Sq = 300;
  c.Sk = 1100;
  c.D = c.Dv = 128;
  for (bool causal : {false, true}) {
    c.causal = causal;
    run_backward_case(c);
  }
  c.dtype = DType::bf16;
  run_backward_case(c);
}

// The bf16 dot-product path (bf16 q, k, v, dO and O on AVX512_BF16): full tiles on vdpbf16ps with
// P and dS rounded to bf16, partial tiles in fp32. Every option that reaches it, checked with its
// floor (backward_diff.hpp), deterministic, and really taken: its gradients differ from the
// fp32 form's on the same inputs.
TEST(Backward, Bf16DotProducts) {
  if (!detail::isa_compiled(detail::Isa::avx512bf16) || !detail::isa_supported(detail::Isa::avx512bf16))
    GTEST_SKIP() << "no AVX512_BF16 on this CPU";
  BwConfig c;
  c.dtype = c.dout = DType::bf16;
  c.B = 1;
  c.Hq = 4;
  c.Hkv = 2;
  c.Sq = 300;
  c.Sk = 700;
  c.D = c.Dv = 128;
  run_backward_case(c);
  c.causal = true;
  run_backward_case(c);
  c.causal = false;
  c.softcap = 3.0;
  c.outliers = true;
  c.grad = DType::bf16;
  run_backward_case(c);
  BwConfig o = c;
  o.softcap = 0.0;
  o.outliers = false;
  o.grad = DType::f32;
  o.Sq = 130;
  o.Sk = 257;
  o.D = 59;
  o.Dv = 1;
  o.bshd = true;
  o.Hq = o.Hkv = 3;
  run_backward_case(o);
  o.D = o.Dv = 64;
  o.wl = 100;
  o.wr = 0;
  o.align = Alignment::top_left;
  run_backward_case(o);

  // The path is taken (it rounds P and dS) and deterministic, with vdpbf16ps and on AMX tiles.
  c.softcap = 0.0;
  c.grad = DType::f32;
  const BwInputs in = make_inputs(c);
  BwGrads plain;
  {
    IsaCap cap(detail::Isa::avx512);
    plain = run_backward(in, DType::f32, KernelKind::flash, 2);
  }
  for (detail::Isa level : {detail::Isa::avx512bf16, detail::Isa::avx512amx}) {
    if (!detail::isa_compiled(level) || !detail::isa_supported(level)) continue;
    SCOPED_TRACE(detail::isa_name(level));
    IsaCap cap(level);
    if (detail::active_isa() != level) continue;  // above a QKV_ISA cap
    const BwGrads dot = run_backward(in, DType::f32, KernelKind::flash, 2);
    for (int r = 0; r < 5; ++r) {
      const BwGrads g = run_backward(in, DType::f32, KernelKind::flash, 1 + r % 2);
      ASSERT_EQ(std::memcmp(g.dq.data(), dot.dq.data(), g.dq.nbytes()), 0);
      ASSERT_EQ(std::memcmp(g.dk.data(), dot.dk.data(), g.dk.nbytes()), 0);
      ASSERT_EQ(std::memcmp(g.dv.data(), dot.dv.data(), g.dv.nbytes()), 0);
    }
    EXPECT_NE(std::memcmp(dot.dv.data(), plain.dv.data(), dot.dv.nbytes()), 0);
  }
}

// The same gradients, bit for bit, across 50 calls and for 1, 2 and 3 threads.
TEST(Backward, Deterministic) {
  BwConfig c;
  c.B = 2;
  c.Hq = 4;
  c.Hkv = 1;
  c.Sq = 150;
  c.Sk = 333;
  c.D = c.Dv = 64;
  c.causal = true;
  const BwInputs in = make_inputs(c);
  const BwGrads first = run_backward(in, DType::f32, KernelKind::flash, 2);
  for (int r = 0; r < 50; ++r) {
    const BwGrads g = run_backward(in, DType::f32, KernelKind::flash, 1 + r % 3);
    ASSERT_EQ(std::memcmp(g.dq.data(), first.dq.data(), g.dq.nbytes()), 0) << "call " << r;
    ASSERT_EQ(std::memcmp(g.dk.data(), first.dk.data(), g.dk.nbytes()), 0) << "call " << r;
    ASSERT_EQ(std::memcmp(g.dv.data(), first.dv.data(), g.dv.nbytes()), 0) << "call " << r;
  }
}

// A query row that admits no key gives dQ = 0 exactly and adds nothing to dK and dV.
TEST(Backward, FullyMaskedRowGivesZeroDq) {
  BwConfig c;
  c.Hq = c.Hkv = 2;
  c.Sq = 70;
  c.Sk = 40;
  c.D = c.Dv = 32;
  c.causal = true;  // bottom-right, Sq > Sk: rows 0 .. 29 admit no key
  run_backward_case(c);
  const BwInputs in = make_inputs(c);
  const BwGrads g = run_backward(in, DType::f32, KernelKind::flash, 2);
  const TensorView dq = in.view(g.dq);
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t i = 0; i < 30; ++i)
      for (std::int64_t x = 0; x < 32; ++x) ASSERT_EQ(get(dq, off4(dq, 0, h, i, x)), 0.0) << "row " << i;
}

// NaN in a value that only some rows admit (causal: rows i >= 50 admit key 50): the rows that
// read it get NaN exactly where the float64 backward does, the others stay finite and exact.
TEST(Backward, NaNStaysInTheRowsThatReadIt) {
  BwConfig c;
  c.Hq = c.Hkv = 1;
  c.Sq = c.Sk = 100;
  c.D = c.Dv = 16;
  c.causal = true;
  BwInputs in = make_inputs(c);
  for (std::int64_t x = 0; x < c.Dv; ++x) static_cast<float*>(in.v.data())[50 * c.Dv + x] = std::numeric_limits<float>::quiet_NaN();
  attention(in.view(in.q), in.view(in.k), in.view(in.v), in.view(in.out), in.p, in.lse.view());
  const auto ref = bhsd(in.view(run_backward(in, DType::f64, KernelKind::reference, 1).dq));
  for (detail::Isa isa : test_isas(c.dtype)) {
    IsaCap cap(isa);
    const auto got = bhsd(in.view(run_backward(in, DType::f32, KernelKind::flash, 2).dq));
    for (std::size_t e = 0; e < got.size(); ++e) {
      ASSERT_EQ(std::isnan(got[e]), std::isnan(ref[e])) << detail::isa_name(isa) << " element " << e;
      if (!std::isnan(ref[e])) EXPECT_NEAR(got[e], ref[e], 1e-4) << detail::isa_name(isa) << " element " << e;
    }
    EXPECT_FALSE(std::isnan(got[49 * c.D])) << "row 49 does not admit key 50";
    EXPECT_TRUE(std::isnan(got[50 * c.D])) << "row 50 admits key 50";
  }
}

// Every gradient of the fast backward on every ISA (2 threads) finite and within tol max(1, max
// |reference|) of the float64 backward.
void expect_finite_and_close(const BwInputs& in, double tol, int threads = 2) {
  const BwGrads ref = run_backward(in, DType::f64, KernelKind::reference, 1);
  for (detail::Isa isa : test_isas(in.c.dtype)) {
    IsaCap cap(isa);
    const BwGrads g = run_backward(in, DType::f32, KernelKind::flash, threads);
    for (auto [a, b] : {std::pair{&g.dq, &ref.dq}, std::pair{&g.dk, &ref.dk}, std::pair{&g.dv, &ref.dv}}) {
      const auto x = bhsd(in.view(*a)), y = bhsd(in.view(*b));
      for (double e : x) ASSERT_TRUE(std::isfinite(e)) << detail::isa_name(isa);
      EXPECT_LE(max_abs_diff(x, y), tol * std::max(1.0, max_abs(y))) << detail::isa_name(isa);
    }
  }
}

// softmax_lse far below -88 (every score shifted by an additive mask of -200): the padded rows of
// a tile must still get P = 0, never exp(0 - lse) = inf.
TEST(Backward, VeryNegativeLse) {
  BwConfig c;
  c.Sq = 37;  // a padded query block
  c.Sk = 45;
  c.D = c.Dv = 16;
  BwInputs in = make_inputs(c);
  Tensor m(DType::f32, {c.Sq, c.Sk});
  for (std::int64_t i = 0; i < m.numel(); ++i) static_cast<float*>(m.data())[i] = -200.0f;
  in.p.mask = m.view();
  attention(in.view(in.q), in.view(in.k), in.view(in.v), in.view(in.out), in.p, in.lse.view());
  EXPECT_LT(static_cast<const float*>(in.lse.data())[0], -150.0f);
  expect_finite_and_close(in, 1e-4);
}

// The same without a mask (the vector path): every key equal to u and every query -20 u, so every
// score is -20 |u|^2 scale = -180 and softmax_lse is about -176.
TEST(Backward, VeryNegativeLseWithoutMask) {
  BwConfig c;
  c.Sq = 37;
  c.Sk = 45;
  c.D = c.Dv = 16;
  BwInputs in = make_inputs(c);
  for (std::int64_t j = 0; j < c.Sk * c.D; ++j) static_cast<float*>(in.k.data())[j] = 1.5f;
  for (std::int64_t i = 0; i < c.Sq * c.D; ++i) static_cast<float*>(in.q.data())[i] = -30.0f;
  attention(in.view(in.q), in.view(in.k), in.view(in.v), in.view(in.out), in.p, in.lse.view());
  EXPECT_LT(static_cast<const float*>(in.lse.data())[0], -150.0f);
  expect_finite_and_close(in, 1e-4);
}

// fp16 inputs whose products exceed 65504 (q, k ~ 300): the kernel widens to fp32 first.
TEST(Backward, Float16ProductsBeyondHalfRange) {
  BwConfig c;
  c.dtype = DType::f16;
  c.Sq = 20;
  c.Sk = 30;
  c.D = c.Dv = 16;
  c.scale = 1e-5;
  BwInputs in = make_inputs(c);
  for (Tensor* t : {&in.q, &in.k})
    for (std::int64_t i = 0; i < t->numel(); ++i)
      store_from_double(t->data(), DType::f16, i, 300.0 * load_as_double(t->data(), DType::f16, i));
  attention(in.view(in.q), in.view(in.k), in.view(in.v), in.view(in.out), in.p, in.lse.view());
  expect_finite_and_close(in, 1e-3, 1);
}

// Sq != Sk in both alignments, Sk = 1, D = 1 and odd D, with a window spanning tiles.
TEST(Backward, EdgeShapes) {
  for (Alignment a : {Alignment::bottom_right, Alignment::top_left}) {
    BwConfig c;
    c.align = a;
    c.causal = true;
    c.Sq = 90;
    c.Sk = 150;
    c.D = 33;
    c.Dv = 17;
    run_backward_case(c);
    std::swap(c.Sq, c.Sk);
    run_backward_case(c);
  }
  BwConfig one;
  one.Sq = 5;
  one.Sk = 1;
  one.D = one.Dv = 1;
  run_backward_case(one);
  BwConfig win;
  win.Sq = win.Sk = 260;
  win.D = win.Dv = 64;
  win.wl = 70;
  win.wr = 5;
  run_backward_case(win);
}

}  // namespace
}  // namespace qkv::test
