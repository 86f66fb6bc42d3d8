// The float64 backward specification (src/reference/backward.cpp) against central finite
// differences of the float64 forward, for every option; its edge cases; the backward's errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "qkv/backward.hpp"
#include "qkv/error.hpp"
#include "qkv/reference.hpp"

namespace qkv::test {
namespace {

struct Opts {
  std::string name;
  std::int64_t B = 1, Hq = 2, Hkv = 2, Sq = 5, Sk = 7, D = 4, Dv = 3;
  bool causal = false;
  Alignment align = Alignment::bottom_right;
  std::int64_t wl = -1, wr = -1;
  double softcap = 0.0;
  double scale = 0.0;  // 0: default
  int mask = 0;        // 1: bool [Sq, Sk]; 2: additive [B, 1, Sq, Sk] with some -inf
  bool kv_lens = false;
  bool bshd = false;
};

void PrintTo(const Opts& o, std::ostream* os) { *os << o.name; }

struct Problem64 {
  Opts o;
  Tensor q, k, v, dout, mask, lens;
  AttentionParams p;

  explicit Problem64(const Opts& opts, std::uint64_t seed = 7) : o(opts) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> u(-1.5, 1.5);
    auto make = [&](std::int64_t H, std::int64_t S, std::int64_t X) {
      Tensor t(DType::f64, o.bshd ? Shape{o.B, S, H, X} : Shape{o.B, H, S, X});
      for (std::int64_t i = 0; i < t.numel(); ++i) static_cast<double*>(t.data())[i] = u(rng);
      return t;
    };
    q = make(o.Hq, o.Sq, o.D);
    k = make(o.Hkv, o.Sk, o.D);
    v = make(o.Hkv, o.Sk, o.Dv);
    dout = make(o.Hq, o.Sq, o.Dv);
    p.causal = o.causal;
    p.align = o.align;
    p.window_left = o.wl;
    p.window_right = o.wr;
    p.softcap = o.softcap;
    if (o.scale != 0.0) p.scale = o.scale;
    if (o.mask == 1) {
      mask = Tensor(DType::b8, {o.Sq, o.Sk});
      for (std::int64_t i = 0; i < mask.numel(); ++i) static_cast<std::uint8_t*>(mask.data())[i] = rng() % 4 != 0;
      p.mask = mask.view();
    } else if (o.mask == 2) {
      mask = Tensor(DType::f64, {o.B, 1, o.Sq, o.Sk});
      for (std::int64_t i = 0; i < mask.numel(); ++i)
        static_cast<double*>(mask.data())[i] = rng() % 5 == 0 ? -std::numeric_limits<double>::infinity() : u(rng);
      p.mask = mask.view();
    }
    if (o.kv_lens) {
      lens = Tensor(DType::i64, {o.B});
      for (std::int64_t b = 0; b < o.B; ++b) static_cast<std::int64_t*>(lens.data())[b] = o.Sk - (b % 3) - 1;
      p.kv_lens = lens.view();
    }
  }
  TensorView view(const Tensor& t) const { return o.bshd ? t.view().permute({0, 2, 1, 3}) : t.view(); }
  Tensor like(std::int64_t H, std::int64_t S, std::int64_t X, DType dt = DType::f64) const {
    return Tensor(dt, o.bshd ? Shape{o.B, S, H, X} : Shape{o.B, H, S, X});
  }
  // L = sum(dO * O) with O from the float64 forward.
  double loss() const {
    Tensor out = like(o.Hq, o.Sq, o.Dv);
    reference::attention(view(q), view(k), view(v), view(out), p);
    double l = 0.0;
    for (std::int64_t i = 0; i < out.numel(); ++i)
      l += static_cast<const double*>(out.data())[i] * static_cast<const double*>(dout.data())[i];
    return l;
  }
  struct Grads { Tensor dq, dk, dv; };
  Grads backward(DType gdt = DType::f64) const {
    Tensor out = like(o.Hq, o.Sq, o.Dv), lse(DType::f64, {o.B, o.Hq, o.Sq});
    reference::attention(view(q), view(k), view(v), view(out), p, lse.view());
    Grads g{like(o.Hq, o.Sq, o.D, gdt), like(o.Hkv, o.Sk, o.D, gdt), like(o.Hkv, o.Sk, o.Dv, gdt)};
    reference::attention_backward(view(q), view(k), view(v), view(out), lse.view(), view(dout), view(g.dq),
                                  view(g.dk), view(g.dv), p);
    return g;
  }
};

// Central differences of the loss for every element of `x`, compared with `grad` (same layout).
void check_fd(Problem64& pr, Tensor& x, const Tensor& grad, const char* what) {
  constexpr double h = 1e-6;
  double* d = static_cast<double*>(x.data());
  const double* g = static_cast<const double*>(grad.data());
  for (std::int64_t i = 0; i < x.numel(); ++i) {
    const double x0 = d[i];
    d[i] = x0 + h;
    const double lp = pr.loss();
    d[i] = x0 - h;
    const double lm = pr.loss();
    d[i] = x0;
    const double fd = (lp - lm) / (2 * h);
    EXPECT_NEAR(g[i], fd, 1e-7 + 1e-6 * std::abs(fd)) << pr.o.name << ": " << what << "[" << i << "]";
  }
}

std::vector<Opts> grid() {
  std::vector<Opts> g;
  g.push_back({"plain"});
  g.push_back({"square_causal", 1, 2, 2, 6, 6, 4, 4, true});
  g.push_back({"causal_bottom_right_sq_lt_sk", 1, 2, 1, 4, 9, 3, 5, true});
  g.push_back({"causal_bottom_right_sq_gt_sk", 1, 2, 2, 8, 5, 3, 3, true});  // empty rows
  g.push_back({"causal_top_left_sq_lt_sk", 1, 2, 2, 4, 9, 3, 3, true, Alignment::top_left});
  g.push_back({"causal_top_left_sq_gt_sk", 1, 2, 2, 8, 5, 3, 3, true, Alignment::top_left});
  g.push_back({"window", 1, 2, 2, 7, 9, 4, 4, false, Alignment::bottom_right, 2, 1});
  g.push_back({"window_top_left", 1, 2, 2, 7, 5, 4, 4, false, Alignment::top_left, 1, 2});
  g.push_back({"softcap", 1, 2, 2, 5, 6, 4, 4, false, Alignment::bottom_right, -1, -1, 1.5, 2.0});
  g.push_back({"softcap_causal", 1, 1, 1, 5, 5, 3, 3, true, Alignment::bottom_right, -1, -1, 0.7});
  g.push_back({"bool_mask", 1, 2, 2, 5, 6, 3, 4, false, Alignment::bottom_right, -1, -1, 0.0, 0.0, 1});
  g.push_back({"additive_mask", 2, 2, 1, 4, 6, 3, 3, true, Alignment::bottom_right, -1, -1, 0.0, 0.0, 2});
  g.push_back({"kv_lens", 3, 2, 2, 3, 6, 4, 4, true, Alignment::bottom_right, -1, -1, 0.0, 0.0, 0, true});
  g.push_back({"gqa2", 1, 4, 2, 4, 5, 3, 3});
  g.push_back({"mqa", 1, 3, 1, 4, 5, 3, 2, true});
  g.push_back({"bshd", 2, 2, 1, 3, 4, 5, 3, false, Alignment::bottom_right, -1, -1, 0.0, 0.0, 0, false, true});
  g.push_back({"d1", 1, 1, 1, 4, 6, 1, 1});
  g.push_back({"sk1", 1, 2, 2, 3, 1, 4, 4});
  g.push_back({"large_scale", 1, 1, 1, 4, 5, 3, 3, false, Alignment::bottom_right, -1, -1, 0.0, 3.0});
  return g;
}

class BackwardReference : public ::testing::TestWithParam<Opts> {};

TEST_P(BackwardReference, MatchesFiniteDifferences) {
  Problem64 pr(GetParam());
  const auto g = pr.backward();
  check_fd(pr, pr.q, g.dq, "dq");
  check_fd(pr, pr.k, g.dk, "dk");
  check_fd(pr, pr.v, g.dv, "dv");
}

INSTANTIATE_TEST_SUITE_P(Options, BackwardReference, ::testing::ValuesIn(grid()),
                         [](const auto& info) { return info.param.name; });

// Rows with no admissible key (bottom-right causal with Sq > Sk) give dQ = 0 exactly.
TEST(BackwardReferenceEdges, EmptyRowsGiveZeroDq) {
  Problem64 pr({"empty", 1, 1, 1, 6, 3, 2, 2, true});
  const auto g = pr.backward();
  const double* dq = static_cast<const double*>(g.dq.data());
  for (std::int64_t i = 0; i < 3; ++i)  // rows 0..2 sit left of key 0
    for (std::int64_t x = 0; x < 2; ++x) EXPECT_EQ(dq[i * 2 + x], 0.0) << "row " << i;
}

// NaN stored at keys no row admits (beyond kv_lens, or right of every causal row) never reaches
// a gradient; those keys' own dK and dV are 0.
TEST(BackwardReferenceEdges, ExcludedKeysAreNeverRead) {
  Problem64 pr({"nan", 1, 2, 1, 3, 8, 3, 3, false, Alignment::bottom_right, -1, -1, 0.0, 0.0, 0, true});
  const double nan = std::numeric_limits<double>::quiet_NaN();
  // kv_lens[0] = Sk - 1 = 7: key 7 is excluded.
  for (std::int64_t x = 0; x < 3; ++x) {
    static_cast<double*>(pr.k.data())[7 * 3 + x] = nan;
    static_cast<double*>(pr.v.data())[7 * 3 + x] = nan;
  }
  const auto g = pr.backward();
  for (const Tensor* t : {&g.dq, &g.dk, &g.dv})
    for (std::int64_t i = 0; i < t->numel(); ++i) EXPECT_FALSE(std::isnan(static_cast<const double*>(t->data())[i]));
  for (std::int64_t x = 0; x < 3; ++x) {
    EXPECT_EQ(static_cast<const double*>(g.dk.data())[7 * 3 + x], 0.0);
    EXPECT_EQ(static_cast<const double*>(g.dv.data())[7 * 3 + x], 0.0);
  }
}

// Gradients may be written as float32 (each element rounded once from float64).
TEST(BackwardReferenceEdges, Float32GradientsAreRoundedFloat64) {
  Problem64 pr({"f32", 1, 2, 2, 4, 5, 3, 3, true});
  const auto g64 = pr.backward();
  const auto g32 = pr.backward(DType::f32);
  for (auto [a, b] : {std::pair{&g64.dq, &g32.dq}, std::pair{&g64.dk, &g32.dk}, std::pair{&g64.dv, &g32.dv}})
    for (std::int64_t i = 0; i < a->numel(); ++i)
      EXPECT_EQ(static_cast<float>(static_cast<const double*>(a->data())[i]), static_cast<const float*>(b->data())[i]);
}

// The GQA gradient of a KV head is the sum over its query heads: it equals the gradient with
// K and V repeated to Hq heads, summed over each group.
TEST(BackwardReferenceEdges, GqaSumsOverTheGroup) {
  Problem64 gqa({"gqa", 1, 4, 2, 3, 5, 3, 3, true});
  Problem64 mha({"mha", 1, 4, 4, 3, 5, 3, 3, true});
  std::memcpy(mha.q.data(), gqa.q.data(), mha.q.nbytes());
  std::memcpy(mha.dout.data(), gqa.dout.data(), mha.dout.nbytes());
  for (std::int64_t h = 0; h < 4; ++h)
    for (std::int64_t e = 0; e < 15; ++e) {
      static_cast<double*>(mha.k.data())[h * 15 + e] = static_cast<const double*>(gqa.k.data())[(h / 2) * 15 + e];
      static_cast<double*>(mha.v.data())[h * 15 + e] = static_cast<const double*>(gqa.v.data())[(h / 2) * 15 + e];
    }
  const auto a = gqa.backward(), b = mha.backward();
  for (std::int64_t hk = 0; hk < 2; ++hk)
    for (std::int64_t e = 0; e < 15; ++e) {
      const double* bk = static_cast<const double*>(b.dk.data());
      const double* bv = static_cast<const double*>(b.dv.data());
      EXPECT_NEAR(static_cast<const double*>(a.dk.data())[hk * 15 + e], bk[2 * hk * 15 + e] + bk[(2 * hk + 1) * 15 + e], 1e-14);
      EXPECT_NEAR(static_cast<const double*>(a.dv.data())[hk * 15 + e], bv[2 * hk * 15 + e] + bv[(2 * hk + 1) * 15 + e], 1e-14);
    }
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(BackwardErrors, NameTheArgumentAndTheShape) {
  Problem64 pr({"err", 1, 2, 2, 3, 4, 3, 3});
  Tensor out = pr.like(2, 3, 3), lse(DType::f64, {1, 2, 3});
  Tensor dq = pr.like(2, 3, 3), dk = pr.like(2, 4, 3), dv = pr.like(2, 4, 3);
  auto run = [&](const TensorView& dout, const TensorView& gq, const TensorView& gk, const TensorView& gv,
                 const TensorView& l) { attention_backward(pr.q, pr.k, pr.v, out, l, dout, gq, gk, gv, pr.p); };
  Tensor bad_dout = pr.like(2, 3, 2);
  EXPECT_NE(error_of([&] { run(bad_dout, dq, dk, dv, lse); }).find("grad_out: expected the shape of out"), std::string::npos);
  Tensor bad_dk = pr.like(2, 5, 3);
  EXPECT_NE(error_of([&] { run(pr.dout, dq, bad_dk, dv, lse); }).find("grad_k: expected shape [B,Hkv,Sk,D] = [1,2,4,3], got [1,2,5,3]"),
            std::string::npos);
  Tensor f16_dv = pr.like(2, 4, 3, DType::f16);
  EXPECT_NE(error_of([&] { run(pr.dout, dq, dk, f16_dv, lse); }).find("grad_v: expected dtype float32 or float64, got float16"),
            std::string::npos);
  Tensor bad_lse(DType::f64, {1, 2, 4});
  EXPECT_NE(error_of([&] { run(pr.dout, dq, dk, dv, bad_lse); }).find("softmax_lse: expected shape [B,Hq,Sq]"), std::string::npos);
  EXPECT_NE(error_of([&] { run(pr.dout, dq, dk, dk, lse); }).find("grad_v: expected memory disjoint from grad_k"), std::string::npos);
  EXPECT_NE(error_of([&] { run(pr.dout, pr.q, dk, dv, lse); }).find("grad_q: expected memory disjoint from q"), std::string::npos);
}

}  // namespace
}  // namespace qkv::test
