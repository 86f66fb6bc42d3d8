// Attention dropout: the Philox 4x32-10 generator against Random123's known answers, the keep
// decisions' statistics and their independence from the traversal, the float64 reference with
// dropout (against a transcription of the formula, in expectation over seeds, p = 0 bit for bit,
// its backward against central finite differences with the other options), the dispatch of
// dropout calls to the reference, and the errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "core/dropout.hpp"
#include "qkv/backward.hpp"
#include "qkv/dropout.hpp"
#include "qkv/error.hpp"
#include "qkv/reference.hpp"
#include "qkv/varlen.hpp"

namespace qkv::test {
namespace {

using i64 = std::int64_t;
using detail::Dropout;
using detail::philox4x32;

double* f64(const Tensor& t) { return static_cast<double*>(t.data()); }

Tensor random_f64(const Shape& s, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1.5, 1.5);
  Tensor t(DType::f64, s);
  for (i64 e = 0; e < t.numel(); ++e) f64(t)[e] = u(rng);
  return t;
}

// ---- Philox 4x32-10 ------------------------------------------------------------------------------

// Random123's kat_vectors for philox4x32 with 10 rounds: counter (4 words), key (2 words), result.
TEST(Philox, KnownAnswers) {
  struct Kat { detail::Philox4x32 ctr; std::uint32_t k0, k1; detail::Philox4x32 want; };
  const Kat kats[] = {
      {{0, 0, 0, 0}, 0, 0, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, 0xffffffff, 0xffffffff,
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, 0xa4093822, 0x299f31d0,
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) EXPECT_EQ(philox4x32(k.ctr, k.k0, k.k1), k.want);
  static_assert(philox4x32({0, 0, 0, 0}, 0, 0)[0] == 0x6627e8d5, "usable in constant expressions");
}

// The mapping of docs/semantics.md, "Dropout", spelled out word by word.
TEST(DropoutRule, WordsAndThresholdAsDocumented) {
  const std::uint64_t seed = 0x0123456789abcdefull, offset = 0xfffffffffffffff0ull;
  const Dropout d = Dropout::make(0.3, seed, offset, 5);
  EXPECT_EQ(d.threshold, static_cast<std::uint64_t>(std::floor(0.3 * 4294967296.0 + 0.5)));
  EXPECT_EQ(d.rescale, 1.0 / (1.0 - 0.3));
  const i64 b = 2, h = 3, i = 7;
  const std::uint64_t n = offset + 2 * 5 + 3;  // wraps past 2^64
  for (i64 j = 0; j < 12; ++j) {
    const auto w = philox4x32({static_cast<std::uint32_t>(j / 4), static_cast<std::uint32_t>(i),
                               static_cast<std::uint32_t>(n), static_cast<std::uint32_t>(n >> 32)},
                              0x89abcdefu, 0x01234567u);
    EXPECT_EQ(d.keep(b, h, i, j), w[j % 4] >= d.threshold) << j;
  }
  EXPECT_EQ(Dropout::make(0.0, 1, 2, 3).threshold, 0u);
  EXPECT_EQ(Dropout::make(0.5, 1, 2, 3).threshold, 1ull << 31);
  // Just below 1: the threshold rounds to 2^32 and no word reaches it.
  EXPECT_EQ(Dropout::make(std::nextafter(1.0, 0.0), 1, 2, 3).threshold, 1ull << 32);
}

// Over 10^7 decisions the kept fraction lies within 5 standard deviations sqrt(p (1 - p) / n)
// of 1 - p.
TEST(DropoutRule, KeptFractionIsOneMinusP) {
  for (double p : {0.1, 0.5, 0.9}) {
    const Dropout d = Dropout::make(p, 0x5eed + static_cast<std::uint64_t>(p * 10), 17, 4);
    const i64 Sk = 2500, n = 10'000'000;  // 4 heads x 1000 rows x 2500 keys
    i64 kept = 0;
    for (i64 h = 0; h < 4; ++h)
      for (i64 i = 0; i < 1000; ++i)
        for (i64 j = 0; j < Sk; j += 4) {
          const auto w = d.words(0, h, i, j / 4);
          for (std::uint32_t u : w) kept += d.keep_word(u);
        }
    const double frac = static_cast<double>(kept) / static_cast<double>(n);
    const double sd = std::sqrt(p * (1 - p) / static_cast<double>(n));
    EXPECT_NEAR(frac, 1.0 - p, 5 * sd) << "p = " << p;
  }
}

// Neighbours (i, j), (i, j + 1) and (i, j), (i + 1, j): the 2x2 table of their decisions over
// 10^6 disjoint pairs each, against the counts independence predicts (n p_a p_b): Pearson's
// chi-square with 3 degrees of freedom stays below 35 (P(chi2_3 > 35) ~ 1.2e-7). Along j, even
// rows pair (2m, 2m + 1), within one Philox call, odd rows (2m + 1, 2m + 2), across two calls
// when 2m + 1 = 3 mod 4.
TEST(DropoutRule, NeighboursAreUncorrelated) {
  for (double p : {0.1, 0.5, 0.9}) {
    const Dropout d = Dropout::make(p, 42, 0, 1);
    for (int dir = 0; dir < 2; ++dir) {
      double count[2][2] = {};
      i64 n = 0;
      for (i64 i = 0; i < 2000; i += 1 + dir)
        for (i64 j = dir == 0 ? i % 2 : 0; j < 1000 - 1; j += 2 - dir) {
          const bool a = d.keep(0, 0, i, j), c = dir == 0 ? d.keep(0, 0, i, j + 1) : d.keep(0, 0, i + 1, j);
          count[a][c] += 1;
          ++n;
        }
      const double pk[2] = {p, 1 - p};  // P(dropped), P(kept)
      double chi2 = 0;
      for (int a = 0; a < 2; ++a)
        for (int c = 0; c < 2; ++c) {
          const double e = static_cast<double>(n) * pk[a] * pk[c];
          chi2 += (count[a][c] - e) * (count[a][c] - e) / e;
        }
      EXPECT_GT(n, 990'000);
      EXPECT_LT(chi2, 35.0) << "p = " << p << (dir == 0 ? " along j" : " along i");
    }
  }
}

// The decisions are a function of (b, h, i, j) alone: a traversal in tiles, in reverse and in a
// random order gives dropout_keep_mask's decisions.
TEST(DropoutRule, SameDecisionsInAnyTraversal) {
  const i64 B = 2, H = 3, Sq = 13, Sk = 37;
  const Tensor mask = dropout_keep_mask(99, 7, 0.4, B, H, Sq, Sk);
  ASSERT_EQ(mask.dtype(), DType::u8);
  ASSERT_EQ(mask.shape(), (Shape{B, H, Sq, Sk}));
  const std::uint8_t* z = static_cast<const std::uint8_t*>(mask.data());
  const Dropout d = Dropout::make(0.4, 99, 7, H);
  std::vector<i64> order(static_cast<std::size_t>(mask.numel()));
  std::iota(order.begin(), order.end(), 0);
  std::reverse(order.begin(), order.end());
  const auto check = [&](i64 e) {
    const i64 j = e % Sk, i = e / Sk % Sq, h = e / (Sk * Sq) % H, b = e / (Sk * Sq * H);
    ASSERT_EQ(d.keep(b, h, i, j), z[e] != 0) << e;
  };
  for (i64 e : order) check(e);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(3));
  for (i64 e : order) check(e);
  // Tiles of 4 rows x 8 keys, a whole Philox call at a time: what a SIMD kernel will do.
  for (i64 b = 0; b < B; ++b)
    for (i64 h = 0; h < H; ++h)
      for (i64 i0 = 0; i0 < Sq; i0 += 4)
        for (i64 j0 = 0; j0 < Sk; j0 += 8)
          for (i64 i = i0; i < std::min(Sq, i0 + 4); ++i)
            for (i64 m = j0 / 4; m * 4 < std::min(Sk, j0 + 8); ++m) {
              const auto w = d.words(b, h, i, m);
              for (i64 r = 0; r < 4 && m * 4 + r < Sk; ++r)
                ASSERT_EQ(d.keep_word(w[static_cast<std::size_t>(r)]), z[((b * H + h) * Sq + i) * Sk + m * 4 + r] != 0);
            }
  // The offset moves the (b, h) streams: offset + H gives batch b + 1's decisions at batch b.
  const Tensor shifted = dropout_keep_mask(99, 7 + H, 0.4, 1, H, Sq, Sk);
  EXPECT_EQ(std::memcmp(shifted.data(), z + H * Sq * Sk, static_cast<std::size_t>(H * Sq * Sk)), 0);
  // p = 0 keeps everything.
  const Tensor all = dropout_keep_mask(99, 7, 0.0, 1, 2, 3, 5);
  for (i64 e = 0; e < all.numel(); ++e) EXPECT_EQ(static_cast<const std::uint8_t*>(all.data())[e], 1);
}

// ---- the float64 reference -----------------------------------------------------------------------

struct Case {
  i64 B = 1, Hq = 2, Hkv = 2, Sq = 5, Sk = 7, D = 4, Dv = 3;
  Tensor q, k, v, dout;
  AttentionParams p;
  Case(i64 b, i64 hq, i64 hkv, i64 sq, i64 sk, i64 d, i64 dv, std::uint64_t seed = 5)
      : B(b), Hq(hq), Hkv(hkv), Sq(sq), Sk(sk), D(d), Dv(dv) {
    std::mt19937_64 rng(seed);
    q = random_f64({B, Hq, Sq, D}, rng);
    k = random_f64({B, Hkv, Sk, D}, rng);
    v = random_f64({B, Hkv, Sk, Dv}, rng);
    dout = random_f64({B, Hq, Sq, Dv}, rng);
  }
  Tensor forward(const AttentionParams& params, Tensor* lse = nullptr, Tensor* probs = nullptr) const {
    Tensor out(DType::f64, {B, Hq, Sq, Dv});
    std::optional<TensorView> l, pr;
    if (lse) l = lse->view();
    if (probs) pr = probs->view();
    reference::attention(q.view(), k.view(), v.view(), out.view(), params, l, pr);
    return out;
  }
};

// O = (P o Z / (1 - p)) V with P the weights before dropout (the reference's own probs) and Z
// dropout_keep_mask's decisions; softmax_lse and probs are those without dropout.
TEST(DropoutReference, TranscriptionOfTheFormula) {
  Case c(2, 4, 2, 6, 11, 5, 3);
  c.p.causal = true;
  c.p.dropout_p = 0.35;
  c.p.dropout_seed = 1234;
  c.p.dropout_offset = 99;
  Tensor lse(DType::f64, {c.B, c.Hq, c.Sq}), probs(DType::f64, {c.B, c.Hq, c.Sq, c.Sk});
  Tensor lse0(DType::f64, {c.B, c.Hq, c.Sq}), probs0(DType::f64, {c.B, c.Hq, c.Sq, c.Sk});
  const Tensor out = c.forward(c.p, &lse, &probs);
  AttentionParams plain = c.p;
  plain.dropout_p = 0;
  c.forward(plain, &lse0, &probs0);
  EXPECT_EQ(std::memcmp(lse.data(), lse0.data(), lse.nbytes()), 0);
  EXPECT_EQ(std::memcmp(probs.data(), probs0.data(), probs.nbytes()), 0);
  const Tensor z = dropout_keep_mask(1234, 99, 0.35, c.B, c.Hq, c.Sq, c.Sk);
  const std::uint8_t* zk = static_cast<const std::uint8_t*>(z.data());
  i64 dropped = 0;
  for (i64 b = 0; b < c.B; ++b)
    for (i64 h = 0; h < c.Hq; ++h)
      for (i64 i = 0; i < c.Sq; ++i)
        for (i64 x = 0; x < c.Dv; ++x) {
          double o = 0;
          for (i64 j = 0; j < c.Sk; ++j) {
            const i64 e = ((b * c.Hq + h) * c.Sq + i) * c.Sk + j;
            dropped += x == 0 && !zk[e];
            o += f64(probs)[e] * (zk[e] ? 1.0 / (1.0 - 0.35) : 0.0) * f64(c.v)[((b * c.Hkv + h / 2) * c.Sk + j) * c.Dv + x];
          }
          EXPECT_NEAR(f64(out)[((b * c.Hq + h) * c.Sq + i) * c.Dv + x], o, 1e-14);
        }
  EXPECT_GT(dropped, 0);
}

// p = 0 (with any seed and offset) gives exactly the bits of a call without dropout, in the
// reference and in the fast kernels (which take p = 0).
TEST(DropoutReference, ZeroPIsNoDropoutBitForBit) {
  Case c(2, 2, 1, 7, 9, 8, 8);
  AttentionParams zero;
  zero.dropout_seed = 77;
  zero.dropout_offset = 5;
  const Tensor a = c.forward({}), b = c.forward(zero);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.nbytes()), 0);
  Tensor fa(DType::f32, {1, 2, 7, 8}), fb(DType::f32, {1, 2, 7, 8});
  std::mt19937_64 rng(1);
  Tensor q(DType::f32, {1, 2, 7, 8}), k(DType::f32, {1, 2, 9, 8}), v(DType::f32, {1, 2, 9, 8});
  for (Tensor* t : {&q, &k, &v})
    for (i64 e = 0; e < t->numel(); ++e) static_cast<float*>(t->data())[e] = static_cast<float>(rng() % 1000) / 500.0f - 1.0f;
  attention(q.view(), k.view(), v.view(), fa.view());
  attention(q.view(), k.view(), v.view(), fb.view(), zero);
  EXPECT_EQ(std::memcmp(fa.data(), fb.data(), fa.nbytes()), 0);
  EXPECT_EQ(explain_dispatch(q.view(), k.view(), v.view(), fa.view(), zero).find("dropout"), std::string::npos);
}

// Dropout is unbiased: the mean of O over N = 4000 seeds approaches the output without dropout,
// each element within 5 standard errors (the sample standard deviation over sqrt(N)).
TEST(DropoutReference, MeanOverSeedsIsTheOutputWithoutDropout) {
  Case c(1, 2, 1, 4, 9, 4, 3);
  c.p.causal = true;
  const Tensor want = c.forward(c.p);
  const i64 N = 4000, n = want.numel();
  for (double p : {0.2, 0.7}) {
    std::vector<double> sum(static_cast<std::size_t>(n)), sum2(static_cast<std::size_t>(n));
    AttentionParams dp = c.p;
    dp.dropout_p = p;
    for (i64 s = 0; s < N; ++s) {
      dp.dropout_seed = static_cast<std::uint64_t>(s) * 0x9E3779B97F4A7C15ull;
      const Tensor o = c.forward(dp);
      for (i64 e = 0; e < n; ++e) {
        sum[e] += f64(o)[e];
        sum2[e] += f64(o)[e] * f64(o)[e];
      }
    }
    for (i64 e = 0; e < n; ++e) {
      const double mean = sum[e] / N, var = std::max(0.0, sum2[e] / N - mean * mean);
      EXPECT_NEAR(mean, f64(want)[e], 5 * std::sqrt(var / N) + 1e-12) << "p = " << p << " element " << e;
    }
  }
}

// Central differences of L = sum(dO * O) with the decisions fixed by the seed (so L is smooth in
// q, k, v and the sinks) against the float64 backward, with dropout and every other option.
struct FdCase {
  std::string name;
  i64 B, Hq, Hkv, Sq, Sk, D, Dv;
  bool causal = false;
  i64 wl = -1, wr = -1;
  double softcap = 0;
  bool sinks = false, alibi = false;
};

void PrintTo(const FdCase& c, std::ostream* os) { *os << c.name; }

class DropoutBackward : public ::testing::TestWithParam<FdCase> {};

TEST_P(DropoutBackward, MatchesFiniteDifferences) {
  const FdCase& fc = GetParam();
  Case c(fc.B, fc.Hq, fc.Hkv, fc.Sq, fc.Sk, fc.D, fc.Dv, 11);
  c.p.causal = fc.causal;
  c.p.window_left = fc.wl;
  c.p.window_right = fc.wr;
  c.p.softcap = fc.softcap;
  c.p.dropout_p = 0.4;
  c.p.dropout_seed = 2024;
  c.p.dropout_offset = 3;
  Tensor sinks(DType::f32, {fc.Hq}), slopes(DType::f32, {fc.Hq});
  for (i64 h = 0; h < fc.Hq; ++h) {
    static_cast<float*>(sinks.data())[h] = 0.25f * static_cast<float>(h) - 0.5f;
    static_cast<float*>(slopes.data())[h] = 0.125f * static_cast<float>(h + 1);
  }
  if (fc.sinks) c.p.sinks = sinks.view();
  if (fc.alibi) c.p.alibi_slopes = slopes.view();
  const auto loss = [&] {
    const Tensor o = c.forward(c.p);
    double l = 0;
    for (i64 e = 0; e < o.numel(); ++e) l += f64(o)[e] * f64(c.dout)[e];
    return l;
  };
  Tensor lse(DType::f64, {c.B, c.Hq, c.Sq});
  const Tensor out = c.forward(c.p, &lse);
  Tensor dq(DType::f64, c.q.shape()), dk(DType::f64, c.k.shape()), dv(DType::f64, c.v.shape()), dz(DType::f32, {fc.Hq});
  if (fc.sinks)
    reference::attention_backward(c.q.view(), c.k.view(), c.v.view(), out.view(), lse.view(), c.dout.view(), dq.view(),
                                  dk.view(), dv.view(), dz.view(), c.p);
  else
    reference::attention_backward(c.q.view(), c.k.view(), c.v.view(), out.view(), lse.view(), c.dout.view(), dq.view(),
                                  dk.view(), dv.view(), c.p);
  // (L(x + h) - L(x - h)) / 2h, x moved in place and restored.
  const auto central = [&](auto& x, std::remove_reference_t<decltype(x)> h) {
    const auto x0 = x;
    x = x0 + h;
    const double lp = loss();
    x = x0 - h;
    const double lm = loss();
    x = x0;
    return (lp - lm) / (2.0 * h);
  };
  for (auto [x, g, what] : {std::tuple{&c.q, &dq, "dq"}, std::tuple{&c.k, &dk, "dk"}, std::tuple{&c.v, &dv, "dv"}}) {
    bool nonzero = false;
    for (i64 e = 0; e < x->numel(); ++e) {
      const double fd = central(f64(*x)[e], 1e-6);
      nonzero |= f64(*g)[e] != 0;
      EXPECT_NEAR(f64(*g)[e], fd, 1e-7 + 1e-6 * std::abs(fd)) << fc.name << ": " << what << "[" << e << "]";
    }
    EXPECT_TRUE(nonzero) << what;
  }
  if (fc.sinks)  // dL/dz: float32 sinks moved by 2^-10 (exact), so a looser bound (h^2 terms)
    for (i64 hh = 0; hh < fc.Hq; ++hh) {
      const double fd = central(static_cast<float*>(sinks.data())[hh], 1.0f / 1024);
      EXPECT_NEAR(static_cast<const float*>(dz.data())[hh], fd, 1e-5 + 1e-4 * std::abs(fd)) << fc.name << ": dz[" << hh << "]";
    }
}

std::vector<FdCase> fd_grid() {
  return {
      {"plain", 1, 2, 2, 5, 7, 4, 3},
      {"causal_gqa", 2, 4, 2, 6, 6, 3, 3, true},
      {"causal_sq_lt_sk_mqa", 1, 3, 1, 4, 9, 3, 4, true},
      {"window", 1, 2, 1, 7, 9, 4, 3, false, 2, 1},
      {"softcap", 1, 2, 2, 5, 6, 4, 4, false, -1, -1, 1.5},
      {"sinks", 1, 2, 2, 5, 7, 3, 3, true, -1, -1, 0, true},
      {"alibi_window", 1, 2, 1, 6, 8, 3, 3, false, 3, 0, 0, false, true},
      {"everything", 2, 4, 2, 5, 8, 3, 2, true, 4, -1, 2.0, true, true},
  };
}

INSTANTIATE_TEST_SUITE_P(Options, DropoutBackward, ::testing::ValuesIn(fd_grid()),
                         [](const auto& info) { return info.param.name; });

// ---- dispatch, packed calls and errors -----------------------------------------------------------

// qkv::attention and attention_backward with dropout run the reference (every fast kernel says
// why not) and give its bits; a packed call gives each sequence the decisions of its batch index,
// as the dense call with the same seed does.
TEST(DropoutDispatch, RunsTheReference) {
  Case c(2, 2, 1, 5, 5, 4, 4);
  c.p.dropout_p = 0.25;
  c.p.dropout_seed = 8;
  c.p.dropout_offset = 1;
  Tensor lse(DType::f64, {2, 2, 5});
  const Tensor want = c.forward(c.p, &lse);
  Tensor out(DType::f64, {2, 2, 5, 4}), lse2(DType::f64, {2, 2, 5});
  const std::string why = explain_dispatch(c.q.view(), c.k.view(), c.v.view(), out.view(), c.p);
  EXPECT_NE(why.find("decode: refused (dropout_p = 0.250000: no fast kernel applies dropout yet"), std::string::npos) << why;
  EXPECT_NE(why.find("flash: refused (dropout_p"), std::string::npos) << why;
  EXPECT_NE(why.find("reference: chosen"), std::string::npos) << why;
  attention(c.q.view(), c.k.view(), c.v.view(), out.view(), c.p, lse2.view());
  EXPECT_EQ(std::memcmp(out.data(), want.data(), out.nbytes()), 0);

  Tensor dq(DType::f64, c.q.shape()), dk(DType::f64, c.k.shape()), dv(DType::f64, c.v.shape());
  Tensor rq(DType::f64, c.q.shape()), rk(DType::f64, c.k.shape()), rv(DType::f64, c.v.shape());
  attention_backward(c.q.view(), c.k.view(), c.v.view(), out.view(), lse.view(), c.dout.view(), dq.view(), dk.view(),
                     dv.view(), c.p);
  reference::attention_backward(c.q.view(), c.k.view(), c.v.view(), out.view(), lse.view(), c.dout.view(), rq.view(),
                                rk.view(), rv.view(), c.p);
  for (auto [a, b] : {std::pair{&dq, &rq}, std::pair{&dk, &rk}, std::pair{&dv, &rv}})
    EXPECT_EQ(std::memcmp(a->data(), b->data(), a->nbytes()), 0);
  const std::string bwhy = explain_dispatch(c.q.view(), c.k.view(), c.v.view(), out.view(), lse.view(), c.dout.view(),
                                            dq.view(), dk.view(), dv.view(), c.p);
  EXPECT_NE(bwhy.find("flash: refused (dropout_p = 0.250000"), std::string::npos) << bwhy;
  AttentionParams forced = c.p;
  forced.kernel = KernelKind::flash;
  EXPECT_THROW(attention(c.q.view(), c.k.view(), c.v.view(), out.view(), forced), Error);

  // The same problem packed: [total, H, X] rows of both sequences, back to back.
  const auto pack = [](const Tensor& t) {
    const i64 B = t.shape()[0], H = t.shape()[1], S = t.shape()[2], X = t.shape()[3];
    Tensor p(DType::f64, {B * S, H, X});
    for (i64 b = 0; b < B; ++b)
      for (i64 h = 0; h < H; ++h)
        for (i64 s = 0; s < S; ++s)
          for (i64 x = 0; x < X; ++x) f64(p)[((b * S + s) * H + h) * X + x] = f64(t)[((b * H + h) * S + s) * X + x];
    return p;
  };
  const Tensor pq = pack(c.q), pk = pack(c.k), pv = pack(c.v), pdo = pack(c.dout), pwant = pack(want);
  const std::int32_t cu[] = {0, 5, 10};
  const TensorView cuv(const_cast<std::int32_t*>(cu), DType::i32, {3});
  Tensor pout(DType::f64, {10, 2, 4}), plse(DType::f64, {2, 10});
  attention_varlen(pq.view(), pk.view(), pv.view(), pout.view(), cuv, cuv, c.p, plse.view());
  EXPECT_EQ(std::memcmp(pout.data(), pwant.data(), pout.nbytes()), 0);
  Tensor gq(DType::f64, pq.shape()), gk(DType::f64, pk.shape()), gv(DType::f64, pv.shape());
  attention_varlen_backward(pq.view(), pk.view(), pv.view(), pout.view(), plse.view(), pdo.view(), gq.view(), gk.view(),
                            gv.view(), cuv, cuv, c.p);
  for (auto [a, b] : {std::pair{&gq, &rq}, std::pair{&gk, &rk}, std::pair{&gv, &rv}}) {
    const Tensor pb = pack(*b);
    EXPECT_EQ(std::memcmp(a->data(), pb.data(), a->nbytes()), 0);
  }
}

TEST(DropoutErrors, BadProbabilityIsNamed) {
  Case c(1, 1, 1, 2, 3, 2, 2);
  for (double p : {-0.1, 1.0, 1.5, std::numeric_limits<double>::quiet_NaN(), -std::numeric_limits<double>::infinity()}) {
    AttentionParams params;
    params.dropout_p = p;
    Tensor out(DType::f64, {1, 1, 2, 2});
    try {
      attention(c.q.view(), c.k.view(), c.v.view(), out.view(), params);
      ADD_FAILURE() << "no error for p = " << p;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("dropout_p: expected a probability in [0, 1), got "), std::string::npos)
          << e.what();
    }
    EXPECT_THROW(dropout_keep_mask(1, 2, p, 1, 1, 1, 1), Error);
  }
  try {
    AttentionParams params;
    params.dropout_p = std::nextafter(1.0, 2.0);  // "1" with 6 digits: the message keeps them all
    Tensor out(DType::f64, {1, 1, 2, 2});
    attention(c.q.view(), c.k.view(), c.v.view(), out.view(), params);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("got 1.0000000000000002"), std::string::npos) << e.what();
  }
  EXPECT_THROW(dropout_keep_mask(1, 2, 0.5, 1, -1, 1, 1), Error);
  EXPECT_THROW(dropout_keep_mask(1, 2, 0.5, 1 << 30, 1 << 30, 1 << 30, 1 << 30), Error);
}

}  // namespace
}  // namespace qkv::test
