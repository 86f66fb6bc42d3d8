// The score options sinks, alibi_slopes and window_keep_first on the fast kernels: the tiled
// forward (flash), the backward and decode (its fast path and its tiles; serving's:
// tests/test_score_options_serving.cpp) against the float64 reference on a randomized grid (every ISA
// level, 1 and 2 threads, GQA, odd sizes, Sq != Sk, both alignments, with window, softcap, masks
// and key lengths; the errors within 2 x those of a naive fp32 attention, dL/dz too); the
// results bitwise invariant to threads and to batch composition; explain_dispatch names the
// kernel that takes them.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention_diff.hpp"
#include "backward_diff.hpp"
#include "qkv/backward.hpp"
#include "qkv/varlen.hpp"

namespace qkv::test {
namespace {

using i64 = std::int64_t;

// A float32 tensor of N(0, 1) entries.
Tensor normal_f32(std::mt19937_64& rng, const Shape& s) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  Tensor t(DType::f32, s);
  for (i64 x = 0; x < t.numel(); ++x) t.data_as<float>()[x] = nd(rng);
  return t;
}

// The options drawn on top of a configuration: at least one of sinks, ALiBi and keep-first;
// keep-first with a window (without one every key is admitted already).
template <class C>
void draw_options(std::mt19937_64& rng, C& c) {
  do {
    c.sinks = rng() % 2;
    c.alibi = static_cast<int>(rng() % 3);
    c.keep_first = rng() % 2 ? static_cast<i64>(1 + rng() % 20) : 0;
  } while (!c.sinks && !c.alibi && !c.keep_first);
  if (c.keep_first && c.wl < 0) {
    c.causal = rng() % 2;
    c.wl = static_cast<i64>(rng() % 30);
  }
}

TEST(ScoreOptionsFlash, RandomizedGrid) {
  std::mt19937_64 rng(20261205);
  for (int n = 0; n < 40; ++n) {
    Config c = random_config(rng, n % 4 == 0, 4e6);
    draw_options(rng, c);
    run_case(c, KernelKind::flash);
    if (HasFatalFailure() || HasFailure()) return;
  }
}

// decode takes sinks (one more partial of its chunk merge): decode shapes, long rows of several
// chunks, every other option.
TEST(ScoreOptionsDecode, SinksRandomizedGrid) {
  std::mt19937_64 rng(4242);
  for (int n = 0; n < 25; ++n) {
    Config c = random_config(rng, true, 4e6);
    c.sinks = true;
    run_case(c, KernelKind::decode);
    if (HasFailure()) return;
  }
}

// decode takes ALiBi and keep-first too (its fast path: no mask, no softcap, D whole vectors;
// the tile engine otherwise): decode shapes, long rows of several chunks, every other option.
TEST(ScoreOptionsDecode, PositionRandomizedGrid) {
  std::mt19937_64 rng(9191);
  for (int n = 0; n < 40; ++n) {
    Config c = random_config(rng, true, 4e6);
    draw_options(rng, c);
    if (!c.alibi && !c.keep_first) c.alibi = 1 + static_cast<int>(rng() % 2);
    run_case(c, KernelKind::decode);
    if (HasFailure()) return;
  }
}

// decode's chunks (4096 keys) with keep-first: the first keys in the first chunk apart from the
// window (a range of their own), keep-first reaching into a later chunk (beside the window's
// keys, the gap excluded), keep_first 0 or past Sk, GQA groups on the fast path (D = 16) and
// off it (odd D, softcap).
TEST(ScoreOptionsDecode, KeepFirstAcrossChunks) {
  Config c;
  c.Hq = 4;
  c.Hkv = 2;
  c.D = c.Dv = 16;
  c.Sq = 2;
  c.Sk = 9000;
  c.causal = true;
  c.wl = 10;
  c.keep_first = 5000;  // chunks 0 and 1; the window in chunk 2
  c.sinks = true;
  run_case(c, KernelKind::decode);
  c.Sk = 6000;  // chunk 1: keys [4096, 5000) and the window near 6000
  c.Hq = 2;
  c.Sq = 1;
  run_case(c, KernelKind::decode);
  c.alibi = 2;
  c.B = 2;
  c.keep_first = 7;
  c.Sk = 4200;
  run_case(c, KernelKind::decode);
  c.keep_first = 0;  // ALiBi alone
  c.align = Alignment::top_left;
  c.Sq = 5;
  run_case(c, KernelKind::decode);
  c.keep_first = 9000;  // past Sk: every key up to the window's right bound
  c.wl = 3;
  c.wr = 2;
  c.causal = false;
  run_case(c, KernelKind::decode);
  c.D = c.Dv = 17;  // the tile engine
  c.softcap = 5.0;
  c.Sk = 300;
  c.keep_first = 40;
  c.align = Alignment::bottom_right;
  c.kv_lens = true;
  run_case(c, KernelKind::decode);
  c.dtype = DType::bf16;
  c.D = c.Dv = 64;
  c.softcap = 0.0;
  c.Hq = 8;
  c.Hkv = 1;
  c.Sq = 2;
  run_case(c, KernelKind::decode);
}

// Rows whose window is empty but whose first keys stay admitted, rows empty altogether (a sink
// gives O = 0, lse = z), keep-first reaching past the window's left bound, long rows whose
// first keys lie tiles away from the window (the gap never read).
TEST(ScoreOptionsFlash, EdgeRows) {
  Config c;
  c.Hq = 2;
  c.Hkv = 1;
  c.D = c.Dv = 17;
  c.Sq = 5;
  c.Sk = 300;
  c.causal = true;
  c.wl = 3;
  c.align = Alignment::top_left;  // the first rows' windows start at key 0: keep-first overlaps
  c.keep_first = 4;
  c.sinks = true;
  c.alibi = 1;
  run_case(c, KernelKind::flash);
  c.align = Alignment::bottom_right;  // windows near key 300: the first keys are a separate range
  run_case(c, KernelKind::flash);
  c.kv_lens = true;  // some rows empty: O = 0 and lse = the sink's logit
  c.B = 3;
  c.seed = 7;
  run_case(c, KernelKind::flash);
  c.Sq = 130;
  c.Sk = 1000;
  c.wl = 10;
  c.keep_first = 70;
  c.kv_lens = false;
  c.B = 1;
  c.dtype = DType::bf16;
  run_case(c, KernelKind::flash);
  c.dtype = DType::f16;
  c.mask = 2;
  run_case(c, KernelKind::flash);
}

TEST(ScoreOptionsBackward, RandomizedGrid) {
  std::mt19937_64 rng(7781);
  const i64 Ds[] = {1, 8, 59, 64};
  const i64 lens[] = {1, 2, 17, 64, 97, 130};
  for (int n = 0; n < 30; ++n) {
    BwConfig c;
    c.seed = 900 + n;
    c.Hkv = 1 + static_cast<i64>(rng() % 2);
    c.Hq = c.Hkv * (1 + static_cast<i64>(rng() % 2));
    c.B = 1 + static_cast<i64>(rng() % 2);
    c.Sq = lens[rng() % 6];
    c.Sk = rng() % 3 == 0 ? c.Sq : lens[rng() % 6];
    c.D = Ds[rng() % 4];
    c.Dv = rng() % 3 == 0 ? Ds[rng() % 4] : c.D;
    const DType dts[] = {DType::f32, DType::f32, DType::bf16, DType::f16};
    c.dtype = dts[rng() % 4];
    c.dout = rng() % 3 == 0 ? c.dtype : DType::f32;
    c.causal = rng() % 2;
    c.align = rng() % 2 ? Alignment::top_left : Alignment::bottom_right;
    if (rng() % 3 == 0) c.wl = static_cast<i64>(rng() % 40);
    c.mask = static_cast<int>(rng() % 5 == 0 ? 1 + rng() % 2 : 0);
    c.kv_lens = rng() % 5 == 0;
    c.softcap = rng() % 5 == 0 ? 3.0 : 0.0;
    c.bshd = rng() % 3 == 0;
    draw_options(rng, c);
    run_backward_case(c);
    if (HasFailure()) return;
  }
}

TEST(ScoreOptionsBackward, KeepFirstFarFromTheWindow) {
  BwConfig c;
  c.Hq = 2;
  c.Sq = 70;
  c.Sk = 400;
  c.D = c.Dv = 16;
  c.causal = true;
  c.wl = 8;
  c.keep_first = 5;
  c.sinks = true;
  c.alibi = 2;
  c.B = 2;
  run_backward_case(c);
  c.kv_lens = true;  // rows past their key length: empty windows, first keys only or nothing
  run_backward_case(c);
}

// The position terms' vector form (score_rule.hpp: ALiBi's bias per lane, keep-first's select)
// on the shapes that reach each of its paths: full and partial tiles (Sk past the 64-key tile),
// the few-rows dot-product form (Sq <= 4), odd D, GQA, causal in both alignments, a window with
// keep-first, softcap with ALiBi (the scalar form), every ISA level, 1 and 2 threads.
TEST(ScoreOptionsKernels, PositionTermsVectorForm) {
  for (const Alignment align : {Alignment::bottom_right, Alignment::top_left}) {
    Config c;
    c.B = 2;
    c.Hq = 4;
    c.Hkv = 2;
    c.Sq = 200;
    c.Sk = 230;
    c.D = c.Dv = 33;
    c.causal = true;
    c.align = align;
    c.alibi = 1;
    run_case(c, KernelKind::flash);
    c.Sq = 3;  // the few-rows form
    c.alibi = 2;
    run_case(c, KernelKind::flash);
    c.Sq = 150;
    c.wl = 70;  // window + keep-first: the first keys tiles away, and overlapping for early rows
    c.keep_first = 6;
    run_case(c, KernelKind::flash);
    c.keep_first = 0;
    c.wl = -1;
    c.softcap = 5.0;
    run_case(c, KernelKind::flash);
    if (HasFailure()) return;

    BwConfig b;
    b.B = 2;
    b.Hq = 4;
    b.Hkv = 2;
    b.Sq = 150;
    b.Sk = 170;
    b.D = b.Dv = 33;
    b.causal = true;
    b.align = align;
    b.alibi = 1;
    run_backward_case(b);
    b.wl = 70;
    b.keep_first = 6;
    b.alibi = 0;
    run_backward_case(b);
    b.keep_first = 0;
    b.wl = -1;
    b.alibi = 2;
    b.softcap = 5.0;
    run_backward_case(b);
    if (HasFailure()) return;
  }
}

// Bitwise identities of the position terms' vector form, every ISA level, 1 and 2 threads:
//  - ALiBi with zero slopes, and keep-first within every row's range, are the plain call's bits,
//    forward and backward (the vector form adds exactly 0 and selects the same keys; full tiles
//    stay full);
//  - ALiBi's forward is bit for bit that of an additive float mask holding the same bias
//    -(slope |diag - j|) (the scalar form's rounding: a product, then a difference).
TEST(ScoreOptionsKernels, PositionTermsBitwise) {
  const i64 B = 1, Hq = 4, Hkv = 2, Sq = 150, Sk = 170, D = 33;
  std::mt19937_64 rng(99);
  auto rnd = [&](Shape s) { return normal_f32(rng, s); };
  const Tensor q = rnd({B, Hq, Sq, D}), k = rnd({B, Hkv, Sk, D}), v = rnd({B, Hkv, Sk, D}), dout = rnd({B, Hq, Sq, D});
  struct Result {
    Tensor out, lse, dq, dk, dv;
  };
  auto run = [&](const AttentionParams& p, bool backward) {
    Result r{Tensor(DType::f32, q.shape()), Tensor(DType::f32, {B, Hq, Sq}), Tensor(DType::f32, q.shape()),
             Tensor(DType::f32, k.shape()), Tensor(DType::f32, v.shape())};
    attention(q, k, v, r.out, p, r.lse.view());
    if (backward) attention_backward(q, k, v, r.out, r.lse, dout, r.dq, r.dk, r.dv, p);
    return r;
  };
  auto same = [](const Tensor& a, const Tensor& b) { return std::memcmp(a.data(), b.data(), a.nbytes()) == 0; };
  // Slopes that are no powers of two (the standard ones for 4 heads are): their products with
  // distances round, so a fused multiply-add would show.
  std::vector<float> zeros(Hq, 0.0f), slopes(Hq);
  for (i64 h = 0; h < Hq; ++h) slopes[h] = 0.0371f * static_cast<float>(h + 1);
  for (const Alignment align : {Alignment::bottom_right, Alignment::top_left})
    for (detail::Isa isa : test_isas(DType::f32)) {
      IsaCap cap(isa);
      SCOPED_TRACE(std::string(detail::isa_name(isa)) + (align == Alignment::top_left ? " top_left" : " bottom_right"));
      for (int threads : {1, 2}) {
        AttentionParams p;
        p.causal = true;
        p.align = align;
        p.kernel = KernelKind::flash;
        p.num_threads = threads;
        const Result plain = run(p, true);
        AttentionParams z = p;
        z.alibi_slopes = TensorView(zeros.data(), DType::f32, {Hq});
        z.window_keep_first = 5;  // no window: keys 0..4 are in every causal row's range already
        const Result zr = run(z, true);
        EXPECT_TRUE(same(plain.out, zr.out) && same(plain.lse, zr.lse)) << "forward, " << threads << " threads";
        EXPECT_TRUE(same(plain.dq, zr.dq) && same(plain.dk, zr.dk) && same(plain.dv, zr.dv))
            << "backward, " << threads << " threads";

        AttentionParams a = p;
        a.alibi_slopes = TensorView(slopes.data(), DType::f32, {Hq});
        const Result ar = run(a, false);
        Tensor bias(DType::f32, {1, Hq, Sq, Sk});
        const i64 offset = align == Alignment::bottom_right ? Sk - Sq : 0;
        for (i64 h = 0; h < Hq; ++h)
          for (i64 i = 0; i < Sq; ++i)
            for (i64 j = 0; j < Sk; ++j)
              bias.data_as<float>()[(h * Sq + i) * Sk + j] =
                  -(slopes[h] * static_cast<float>(std::abs(i + offset - j)));
        AttentionParams m = p;
        m.mask = bias.view();
        const Result mr = run(m, false);
        EXPECT_TRUE(same(ar.out, mr.out) && same(ar.lse, mr.lse)) << "ALiBi against its mask, " << threads << " threads";
      }
      if (HasFailure()) return;
    }
}

// Each batch element computed alone gives the bits it has in the batch (per-batch slopes
// sliced), forward and backward, with every option; decode's too (its chunks: 4096 keys).
void batch_composition(KernelKind kind, i64 Sq, i64 Sk, i64 D) {
  const i64 B = 3, Hq = 4, Hkv = 2;
  std::mt19937_64 rng(5);
  auto rnd = [&](Shape s) { return normal_f32(rng, s); };
  Tensor q = rnd({B, Hq, Sq, D}), k = rnd({B, Hkv, Sk, D}), v = rnd({B, Hkv, Sk, D}), dout = rnd({B, Hq, Sq, D});
  Tensor sinks = rnd({Hq}), slopes(DType::f32, {B, Hq});
  for (i64 x = 0; x < slopes.numel(); ++x) slopes.data_as<float>()[x] = 0.05f * static_cast<float>(x + 1);
  AttentionParams p;
  p.causal = true;
  p.window_left = 11;
  p.window_keep_first = 3;
  p.sinks = sinks.view();
  p.alibi_slopes = slopes.view();
  p.kernel = kind;
  Tensor out(DType::f32, {B, Hq, Sq, D}), lse(DType::f32, {B, Hq, Sq});
  attention(q, k, v, out, p, lse.view());
  Tensor dq(DType::f32, q.shape()), dk(DType::f32, k.shape()), dv(DType::f32, v.shape()), dz(DType::f32, {Hq});
  const bool backward = kind == KernelKind::flash;  // (decode: a forward kernel)
  if (backward) attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p);
  for (i64 b = 0; b < B; ++b) {
    SCOPED_TRACE(b);
    auto one = [&](const Tensor& t) {
      Shape s = t.shape();
      s[0] = 1;
      Tensor r(DType::f32, s);
      std::memcpy(r.data(), t.data_as<float>() + b * (t.numel() / B), r.nbytes());
      return r;
    };
    Tensor q1 = one(q), k1 = one(k), v1 = one(v), d1 = one(dout);
    Tensor s1(DType::f32, {Hq});
    std::memcpy(s1.data(), slopes.data_as<float>() + b * Hq, s1.nbytes());
    AttentionParams p1 = p;
    p1.alibi_slopes = s1.view();
    Tensor o1(DType::f32, q1.shape()), l1(DType::f32, {1, Hq, Sq});
    for (int threads : {1, 2}) {
      p1.num_threads = threads;
      attention(q1, k1, v1, o1, p1, l1.view());
      EXPECT_EQ(std::memcmp(o1.data(), out.data_as<float>() + b * o1.numel(), o1.nbytes()), 0);
      EXPECT_EQ(std::memcmp(l1.data(), lse.data_as<float>() + b * l1.numel(), l1.nbytes()), 0);
      if (!backward) continue;
      Tensor gq(DType::f32, q1.shape()), gk(DType::f32, k1.shape()), gv(DType::f32, v1.shape());
      attention_backward(q1, k1, v1, o1, l1, d1, gq, gk, gv, p1);
      EXPECT_EQ(std::memcmp(gq.data(), dq.data_as<float>() + b * gq.numel(), gq.nbytes()), 0);
      EXPECT_EQ(std::memcmp(gk.data(), dk.data_as<float>() + b * gk.numel(), gk.nbytes()), 0);
      EXPECT_EQ(std::memcmp(gv.data(), dv.data_as<float>() + b * gv.numel(), gv.nbytes()), 0);
    }
  }
  if (!backward) return;
  // dz: the same bits for any thread count.
  Tensor z1(DType::f32, {Hq}), z2(DType::f32, {Hq});
  p.num_threads = 1;
  attention_backward(q, k, v, out, lse, dout, dq, dk, dv, z1, p);
  p.num_threads = 2;
  attention_backward(q, k, v, out, lse, dout, dq, dk, dv, z2, p);
  EXPECT_EQ(std::memcmp(z1.data(), z2.data(), z1.nbytes()), 0);
}

TEST(ScoreOptionsKernels, BatchCompositionInvariance) { batch_composition(KernelKind::flash, 37, 90, 24); }
TEST(ScoreOptionsDecode, BatchCompositionInvariance) {
  for (detail::Isa isa : test_isas(DType::f32)) {
    IsaCap cap(isa);
    SCOPED_TRACE(detail::isa_name(isa));
    batch_composition(KernelKind::decode, 3, 4500, 32);  // the fast path
    batch_composition(KernelKind::decode, 2, 200, 20);   // the tile engine
  }
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(ScoreOptionsKernels, ExplainNamesTheFastKernel) {
  const i64 Hq = 2, D = 8;
  Tensor q(DType::f32, {1, Hq, 1, D}), k(DType::f32, {1, Hq, 40, D}), v(DType::f32, {1, Hq, 40, D});
  Tensor sinks(DType::f32, {Hq}), slopes(DType::f32, {Hq}), out(DType::f32, {1, Hq, 1, D}), lse(DType::f32, {1, Hq, 1});
  AttentionParams p;
  p.sinks = sinks.view();
  // One query row: decode takes sinks, ALiBi and keep-first.
  EXPECT_TRUE(contains(explain_dispatch(q, k, v, out, p, lse.view()), "decode: chosen"));
  p.alibi_slopes = slopes.view();
  p.window_left = 4;
  p.window_keep_first = 2;
  const std::string e = explain_dispatch(q, k, v, out, p, lse.view());
  EXPECT_TRUE(contains(e, "decode: chosen")) << e;
  EXPECT_TRUE(contains(e, "flash: usable, lower priority")) << e;
  Tensor dq(DType::f32, q.shape()), dk(DType::f32, k.shape()), dv(DType::f32, v.shape()), dz(DType::f32, {Hq});
  const std::string eb = explain_dispatch(q, k, v, out, lse, out, dq, dk, dv, dz, p);
  EXPECT_TRUE(contains(eb, "flash: chosen")) << eb;
}

}  // namespace
}  // namespace qkv::test
