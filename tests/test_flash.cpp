// The flash kernel against the float64 reference (see tests/attention_diff.hpp for the checks):
// a randomized grid over the design note's shapes and options on every ISA level this machine
// supports, 1 and 2 threads, plus the fp16 range cases and the dispatch explanations.
// Soak: build/test_flash --gtest_also_run_disabled_tests --gtest_filter='*Soak*'
// (QKV_SOAK_N configurations, default 2000).
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "attention_diff.hpp"
#include "kernels/isa_kernels.hpp"
#include "qkv/error.hpp"

using namespace qkv;
using namespace qkv::test;

TEST(Flash, RandomGrid) { run_random_grid(120, 12345, 2.5e6, false); }

// Tails and sizes that a random draw may miss: every D of the grid with the long S.
TEST(Flash, GridLong) {
  for (std::int64_t D : {1, 8, 59, 64, 111, 128, 256}) {
    Config c;
    c.D = c.Dv = D;
    c.Sq = 1025;
    c.Sk = D >= 128 ? 300 : 1025;
    c.causal = D % 2 == 1;
    c.align = D == 59 ? Alignment::top_left : Alignment::bottom_right;
    c.outliers = D == 111;
    c.seed = static_cast<std::uint64_t>(D);
    run_case(c, KernelKind::flash);
  }
}

TEST(Flash, GqaPackedAndStrided) {
  for (int layout : {0, 1, 2}) {
    Config c;
    c.Hq = layout == 2 ? 2 : 8;
    c.Hkv = layout == 2 ? 2 : 1;
    c.Sq = c.Sk = 97;
    c.D = c.Dv = 64;
    c.layout = layout;
    c.causal = true;
    c.seed = 7 + layout;
    run_case(c, KernelKind::flash);
  }
}

// A soak case (outliers, D = 5, additive mask, packed QKV) whose errors set the naive bar.
TEST(Flash, SoakRegressionOutliersSmallD) {
  Config c;
  c.Sq = c.Sk = 97; c.D = c.Dv = 5; c.causal = true; c.align = Alignment::top_left; c.mask = 2;
  c.outliers = true; c.layout = 2; c.partial_nan = true; c.seed = 7474264122529961047ull;
  const Stats s = run_case(c, KernelKind::flash);
  std::printf("fast error %.3g, naive error %.3g\n", s.err, s.naive_err);
}

TEST(Flash, DISABLED_Soak) {
  const char* e = std::getenv("QKV_SOAK_N");
  const int n = e ? std::atoi(e) : 2000;
  // Thousands of configurations include cases of a few rows with +-20 sigma outliers where the
  // error is set by the rounding of scores of size ~100 and the ratio of two such roundings
  // exceeds 2 now and then: the soak bound is 4 x naive, and it reports how many exceed 2.
  run_random_grid(n, 987654321, 6e6, false, 4.0);
}

// fp16 inputs whose raw product exceeds the fp16 range: q.k = 80000, scale 0.5.
TEST(Flash, Fp16ProductBeyondHalfRange) {
  for (detail::Isa isa : test_isas(DType::f16)) {
    IsaCap cap(isa);
    Tensor q(DType::f16, {1, 1, 1, 2}), k(DType::f16, {1, 1, 2, 2}), v(DType::f16, {1, 1, 2, 2});
    const float kv[] = {200, 200, 200, 199.875f};
    const float vv[] = {1, -1, 3, 5};
    for (int x = 0; x < 2; ++x) q.data_as<std::uint16_t>()[x] = float_to_half(200);
    for (int x = 0; x < 4; ++x) {
      k.data_as<std::uint16_t>()[x] = float_to_half(kv[x]);
      v.data_as<std::uint16_t>()[x] = float_to_half(vv[x]);
    }
    Tensor out(DType::f32, {1, 1, 1, 2}), lse(DType::f32, {1, 1, 1});
    AttentionParams p;
    p.scale = 0.5;
    p.kernel = KernelKind::flash;
    attention(q, k, v, out, p, lse.view());
    // Scores 40000 and 39987.5: weights 1/(1+e^-12.5) and e^-12.5/(1+e^-12.5).
    const double w1 = std::exp(-12.5) / (1 + std::exp(-12.5)), w0 = 1 - w1;
    EXPECT_NEAR(out.data_as<float>()[0], w0 * 1 + w1 * 3, 1e-6) << detail::isa_name(isa);
    EXPECT_NEAR(out.data_as<float>()[1], w0 * -1 + w1 * 5, 1e-6) << detail::isa_name(isa);
    EXPECT_NEAR(lse.data_as<float>()[0], 40000 + std::log1p(std::exp(-12.5)), 40000 * 1e-7);
  }
}

// fp16 inputs, Sk = 4096, all scores equal: the weights are exactly uniform, lse = s + ln 4096.
TEST(Flash, Fp16LongRowUniform) {
  const std::int64_t Sk = 4096, D = 64;
  Tensor q(DType::f16, {1, 1, 3, D}), k(DType::f16, {1, 1, Sk, D}), v(DType::f16, {1, 1, Sk, D});
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> krow(D);
  for (auto& x : krow) x = nd(rng);
  for (std::int64_t x = 0; x < 3 * D; ++x) q.data_as<std::uint16_t>()[x] = float_to_half(nd(rng));
  for (std::int64_t j = 0; j < Sk; ++j)
    for (std::int64_t d = 0; d < D; ++d) {
      k.data_as<std::uint16_t>()[j * D + d] = float_to_half(krow[d]);
      v.data_as<std::uint16_t>()[j * D + d] = float_to_half(nd(rng));
    }
  Tensor ref(DType::f64, {1, 1, 3, D}), ref_lse(DType::f64, {1, 1, 3});
  reference::attention(q, k, v, ref, {}, ref_lse.view());
  for (detail::Isa isa : test_isas(DType::f16))
    for (KernelKind kind : {KernelKind::flash, KernelKind::decode}) {
      IsaCap cap(isa);
      Tensor out(DType::f32, {1, 1, 3, D}), lse(DType::f32, {1, 1, 3});
      AttentionParams p;
      p.kernel = kind;
      attention(q, k, v, out, p, lse.view());
      for (std::int64_t i = 0; i < 3; ++i) {
        // lse - score = ln 4096 exactly up to the rounding of the score.
        EXPECT_NEAR(lse.data_as<float>()[i], ref_lse.data_as<double>()[i], 2e-6 * (1 + std::abs(ref_lse.data_as<double>()[i])));
        for (std::int64_t d = 0; d < D; ++d)
          EXPECT_NEAR(out.data_as<float>()[i * D + d], ref.data_as<double>()[i * D + d], 2e-6) << detail::isa_name(isa);
      }
      double s0 = 0;
      for (std::int64_t d = 0; d < D; ++d)
        s0 += double(half_to_float(q.data_as<std::uint16_t>()[d])) * double(half_to_float(float_to_half(krow[d])));
      EXPECT_NEAR(ref_lse.data_as<double>()[0], s0 / 8.0 + std::log(4096.0), 1e-9);
    }
}

// Query blocks are processed in groups of up to 4 that share each K/V tile (process_group); a
// row's result must not depend on its group: the first 64 rows of Sq = 128 (block 0 grouped
// with block 1) and of Sq = 256 (block 0 last in a group of 4) equal, bitwise, the same rows
// computed with Sq = 64 (a block alone), with top-left causal and window masks, in fp32 and
// bf16, on every ISA.
TEST(Flash, GroupedBlocksEqualSingleBlocks) {
  const std::int64_t Sk = 300, D = 64, S = 256;
  for (DType dt : {DType::f32, DType::bf16})
    for (detail::Isa isa : test_isas(dt))
      for (int opt = 0; opt < 3; ++opt) {
        IsaCap cap(isa);
        Tensor q(dt, {1, 2, S, D}), k(dt, {1, 2, Sk, D}), v(dt, {1, 2, Sk, D});
        std::mt19937 rng(11 + opt);
        std::normal_distribution<float> nd;
        auto fill = [&](Tensor& t) {
          for (std::int64_t x = 0; x < t.numel(); ++x) {
            if (dt == DType::f32) t.data_as<float>()[x] = nd(rng);
            else t.data_as<std::uint16_t>()[x] = float_to_bf16(nd(rng));
          }
        };
        fill(q); fill(k); fill(v);
        AttentionParams p;
        p.kernel = KernelKind::flash;
        p.align = Alignment::top_left;
        p.causal = opt == 1;
        if (opt == 2) { p.window_left = 40; p.window_right = 7; }
        auto first_rows = [&](std::int64_t sq) {  // rows 0..63 of a call on the first sq queries
          const TensorView qs(q.data(), dt, {1, 2, sq, D}, {2 * S * D, S * D, D, 1});
          Tensor out(DType::f32, {1, 2, sq, D});
          attention(qs, k, v, out, p);
          std::vector<float> rows(2 * 64 * D);
          for (std::int64_t h = 0; h < 2; ++h)
            std::memcpy(rows.data() + h * 64 * D, out.data_as<float>() + h * sq * D, 64 * D * sizeof(float));
          return rows;
        };
        const std::vector<float> alone = first_rows(64);
        for (std::int64_t sq : {128, 256})
          EXPECT_EQ(0, std::memcmp(first_rows(sq).data(), alone.data(), alone.size() * sizeof(float)))
              << detail::isa_name(isa) << " dtype " << static_cast<int>(dt) << " option " << opt << " Sq " << sq;
      }
}

TEST(Flash, DispatchExplains) {
  Tensor q(DType::f32, {1, 2, 64, 16}), k(DType::f32, {1, 2, 64, 16}), v(DType::f32, {1, 2, 64, 16});
  Tensor out(DType::f32, {1, 2, 64, 16}), probs(DType::f32, {1, 2, 64, 64});
  const std::string e = explain_dispatch(q, k, v, out);
  EXPECT_NE(e.find("decode: refused (Sq = 64 > 16"), std::string::npos) << e;
  EXPECT_NE(e.find("flash: chosen"), std::string::npos) << e;
  const std::string ep = explain_dispatch(q, k, v, out, {}, std::nullopt, probs.view());
  EXPECT_NE(ep.find("flash: chosen"), std::string::npos) << ep;
  EXPECT_NE(ep.find("probs: the fast kernels never form"), std::string::npos) << ep;
  Tensor q1(DType::f32, {1, 2, 1, 16}), o1(DType::f32, {1, 2, 1, 16});
  EXPECT_NE(explain_dispatch(q1, k, v, o1).find("decode: chosen"), std::string::npos);
  Tensor q64(DType::f64, {1, 2, 64, 16}), k64(DType::f64, {1, 2, 64, 16}), v64(DType::f64, {1, 2, 64, 16});
  EXPECT_NE(explain_dispatch(q64, k64, v64, out).find("flash: refused (float64 inputs"), std::string::npos);
}

// Asking for the weights changes neither O nor softmax_lse: the fast kernel computes them and
// the reference fills probs in a second pass.
TEST(Flash, ProbsDoNotChangeTheOutput) {
  const std::int64_t B = 1, H = 2, S = 70, D = 24;
  Tensor q(DType::f32, {B, H, S, D}), k(DType::f32, {B, H, S, D}), v(DType::f32, {B, H, S, D});
  for (Tensor* t : {&q, &k, &v})
    for (std::int64_t x = 0; x < t->numel(); ++x)
      t->data_as<float>()[x] = static_cast<float>(std::sin(0.37 * static_cast<double>(x) + (t == &k ? 1.0 : t == &v ? 2.0 : 0.0)));
  AttentionParams p;
  p.causal = true;
  p.kernel = KernelKind::flash;
  Tensor o1(DType::f32, {B, H, S, D}), o2(DType::f32, {B, H, S, D}), l1(DType::f32, {B, H, S}), l2(DType::f32, {B, H, S});
  Tensor pr(DType::f64, {B, H, S, S}), ref_pr(DType::f64, {B, H, S, S}), ref_o(DType::f32, {B, H, S, D});
  attention(q, k, v, o1, p, l1.view());
  attention(q, k, v, o2, p, l2.view(), pr.view());
  EXPECT_EQ(0, std::memcmp(o1.data(), o2.data(), o1.nbytes()));
  EXPECT_EQ(0, std::memcmp(l1.data(), l2.data(), l1.nbytes()));
  reference::attention(q, k, v, ref_o, p, std::nullopt, ref_pr.view());
  EXPECT_EQ(0, std::memcmp(pr.data(), ref_pr.data(), pr.nbytes()));
}

// Every fast kernel is deterministic across runs.
TEST(Flash, RepeatableAcrossRuns) {
  Config c;
  c.Hq = 4; c.Hkv = 2; c.Sq = 200; c.Sk = 300; c.D = c.Dv = 64; c.causal = true;
  Tensor q(DType::f32, {1, 4, 200, 64}), k(DType::f32, {1, 2, 300, 64}), v(DType::f32, {1, 2, 300, 64});
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  for (auto* t : {&q, &k, &v})
    for (std::int64_t x = 0; x < t->numel(); ++x) t->data_as<float>()[x] = nd(rng);
  Tensor a(DType::f32, {1, 4, 200, 64}), b(DType::f32, {1, 4, 200, 64});
  AttentionParams p;
  p.causal = true;
  attention(q, k, v, a, p);
  for (int r = 0; r < 3; ++r) {
    attention(q, k, v, b, p);
    ASSERT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes()));
  }
}

// The query blocks of a group share one converted (fp16/bf16, or a Dv tail) or bf16-repacked
// copy of each K/V tile. A window makes the blocks of a group start at different tiles, and a
// second call with new K/V contents at the same addresses must not see the first call's tiles.
TEST(Flash, SharedTileBuffersFollowTheInputs) {
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    Config c;
    c.Hq = 2; c.Hkv = 1; c.Sq = c.Sk = 517; c.D = 64; c.Dv = 72; c.dtype = dt; c.wl = 100; c.wr = 0;
    c.seed = 31;
    run_case(c, KernelKind::flash);
  }
  for (DType dt : {DType::f32, DType::f16, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    // One head, one group, one key tile: the second call's first tile is the first call's last.
    const Shape qs{1, 1, 100, 64}, ks{1, 1, 60, 64}, vs{1, 1, 60, 72};
    Tensor q(dt, qs), k(dt, ks), v(dt, vs), k2(dt, ks), v2(dt, vs);
    std::mt19937 rng(5);
    std::normal_distribution<double> nd;
    auto fill = [&](Tensor& t) {
      for (std::int64_t x = 0; x < t.numel(); ++x) {
        const double r = nd(rng);
        if (dt == DType::f32) t.data_as<float>()[x] = static_cast<float>(r);
        else if (dt == DType::f16) t.data_as<std::uint16_t>()[x] = float_to_half(static_cast<float>(r));
        else t.data_as<std::uint16_t>()[x] = float_to_bf16(static_cast<float>(r));
      }
    };
    for (Tensor* t : {&q, &k, &v, &k2, &v2}) fill(*t);
    AttentionParams p;
    p.kernel = KernelKind::flash;
    p.num_threads = 1;  // both calls on this thread's workspace
    Tensor a(DType::f32, {1, 1, 100, 72}), b(DType::f32, {1, 1, 100, 72});
    attention(q, k, v, a, p);
    std::memcpy(k.data(), k2.data(), k.nbytes());  // new contents, same addresses
    std::memcpy(v.data(), v2.data(), v.nbytes());
    attention(q, k, v, a, p);
    attention(q, k2, v2, b, p);
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes()));
  }
}

// Scores with an additive mask are rounded as written: fl(fl(q.k * scale) + mask), never one
// fused multiply-add (whether the compiler fused them used to depend on how it inlined the
// kernel, so unrelated changes moved results by an ulp). q.k * scale = 1 + 2^-22 + 2^-46, whose
// fp32 rounding 1 + 2^-22 the mask cancels exactly: the score, and with one key the lse, is 0;
// a fused multiply-add would give 2^-46.
TEST(Flash, MaskedScoreRoundedAsWritten) {
  const float one_ulp = std::ldexp(1.0f, -23);
  for (KernelKind kind : {KernelKind::flash, KernelKind::decode}) {
    Tensor q(DType::f32, {1, 1, 1, 1}), k(DType::f32, {1, 1, 1, 1}), v(DType::f32, {1, 1, 1, 1});
    Tensor m(DType::f32, {1, 1}), o(DType::f32, {1, 1, 1, 1}), lse(DType::f32, {1, 1, 1});
    q.data_as<float>()[0] = 1.0f + one_ulp;
    k.data_as<float>()[0] = 1.0f;
    v.data_as<float>()[0] = 3.0f;
    m.data_as<float>()[0] = -(1.0f + 2.0f * one_ulp);
    AttentionParams p;
    p.kernel = kind;
    p.scale = 1.0 + std::ldexp(1.0, -23);
    p.mask = m.view();
    attention(q, k, v, o, p, lse.view());
    EXPECT_EQ(o.data_as<float>()[0], 3.0f);
    EXPECT_EQ(lse.data_as<float>()[0], 0.0f) << "kernel " << static_cast<int>(kind);
  }
}

// The vector exp of each ISA: max relative error against double exp over the softmax's range
// [-87, 0] (arguments s - max <= 0), exact 0 for -inf, (almost) 0 below the normal range, NaN kept.
TEST(Flash, VectorExp) {
  std::vector<float> x;
  for (double t = -87.0; t <= 0.0; t += 1.0 / 4096) x.push_back(static_cast<float>(t));
  for (float t : {1.0f, 10.0f, 80.0f}) x.push_back(t);
  const float inf = std::numeric_limits<float>::infinity();
  // Edge arguments: -inf and those below every ISA's subnormal range give exactly 0; -100 gives 0
  // or a subnormal from libm; NaN stays NaN; huge ones give inf, or a clamped finite (avx2).
  const std::vector<float> zero = {-inf, -104.0f, -1e30f}, huge = {100.0f, 1e10f, inf};
  const auto exp_of = [](const std::vector<float>& in) {
    std::vector<float> out(in.size());
    bool dot = false;
    detail::active_isa_kernels(dot).exp_array(in.data(), out.data(), static_cast<std::int64_t>(in.size()));
    return out;
  };
  for (detail::Isa isa : test_isas(DType::f32)) {
    IsaCap cap(isa);
    const std::vector<float> y = exp_of(x);
    double worst = 0;
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double e = std::exp(static_cast<double>(x[i]));
      worst = std::max(worst, std::abs(y[i] - e) / e);
    }
    std::printf("%s exp: max relative error %.3g over [-87, 0] and 1, 10, 80\n", detail::isa_name(isa), worst);
    EXPECT_LT(worst, 2.5e-7) << detail::isa_name(isa);
    const std::vector<float> z = exp_of(zero), h = exp_of(huge);
    for (std::size_t i = 0; i < zero.size(); ++i) EXPECT_EQ(z[i], 0.0f) << zero[i];
    EXPECT_LT(exp_of({-100.0f})[0], 1e-37f);
    EXPECT_TRUE(std::isnan(exp_of({std::numeric_limits<float>::quiet_NaN()})[0]));
    for (std::size_t i = 0; i < huge.size(); ++i) EXPECT_GT(h[i], 1e38f) << huge[i];
  }
}

// Outputs stored as bfloat16, float16 and float64 (conversion on store), lse as float64.
TEST(Flash, OutputDtypes) {
  Tensor q(DType::f32, {1, 2, 70, 24}), k(DType::f32, {1, 2, 90, 24}), v(DType::f32, {1, 2, 90, 24});
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (auto* t : {&q, &k, &v})
    for (std::int64_t x = 0; x < t->numel(); ++x) t->data_as<float>()[x] = nd(rng);
  Tensor ref(DType::f64, {1, 2, 70, 24}), ref_lse(DType::f64, {1, 2, 70});
  AttentionParams p;
  p.causal = true;
  reference::attention(q, k, v, ref, p, ref_lse.view());
  for (KernelKind kind : {KernelKind::flash, KernelKind::decode}) {
    for (DType odt : {DType::bf16, DType::f16, DType::f64}) {
      Tensor out(odt, {1, 2, 70, 24}), lse(DType::f64, {1, 2, 70});
      p.kernel = kind;
      if (kind == KernelKind::decode) {  // decode takes Sq <= 16: the last 16 rows
        TensorView qv(q.data_as<float>() + 54 * 24, DType::f32, {1, 2, 16, 24}, {2 * 70 * 24, 70 * 24, 24, 1});
        Tensor o16(odt, {1, 2, 16, 24}), l16(DType::f64, {1, 2, 16});
        attention(qv, k, v, o16, p, l16.view());
        for (std::int64_t h = 0; h < 2; ++h)
          for (std::int64_t i = 0; i < 16; ++i) {
            const std::int64_t ri = (h * 70 + 54 + i);
            EXPECT_NEAR(l16.data_as<double>()[h * 16 + i], ref_lse.data_as<double>()[ri], 1e-5);
            for (std::int64_t d = 0; d < 24; ++d)
              EXPECT_NEAR(load_as_double(o16.data(), odt, (h * 16 + i) * 24 + d), ref.data_as<double>()[ri * 24 + d],
                          odt == DType::f64 ? 1e-5 : odt == DType::f16 ? 2e-3 : 1.6e-2);
          }
        continue;
      }
      attention(q, k, v, out, p, lse.view());
      for (std::int64_t x = 0; x < ref.numel(); ++x)
        EXPECT_NEAR(load_as_double(out.data(), odt, x), ref.data_as<double>()[x],
                    odt == DType::f64 ? 1e-5 : odt == DType::f16 ? 2e-3 : 1.6e-2);
      for (std::int64_t x = 0; x < ref_lse.numel(); ++x)
        EXPECT_NEAR(lse.data_as<double>()[x], ref_lse.data_as<double>()[x], 1e-5);
    }
  }
}

// QKV_ISA (read once per process) caps the level reported active by `qkv info`.
TEST(Flash, IsaEnvironmentVariable) {
  const std::string cmd = std::string("QKV_ISA=scalar ") + QKV_BINARY_DIR + "/qkv info 2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  ASSERT_NE(f, nullptr);
  std::string outp;
  char buf[512];
  while (std::fgets(buf, sizeof buf, f)) outp += buf;
  pclose(f);
  EXPECT_NE(outp.find("scalar (active)"), std::string::npos) << outp;
}
