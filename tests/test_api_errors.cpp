// Every argument check of the attention entry points (src/core/validate.cpp) and of tensor views:
// each throws qkv::Error whose message names the argument and the expected and actual values.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/error.hpp"
#include "qkv/info.hpp"
#include "qkv/reference.hpp"
#include "qkv/tensor.hpp"

namespace qkv {
namespace {

// Runs f, which must throw qkv::Error, and checks that the message holds every part.
::testing::AssertionResult throws_with(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
  } catch (const Error& e) {
    const std::string m = e.what();
    for (const std::string& p : parts)
      if (m.find(p) == std::string::npos)
        return ::testing::AssertionFailure() << "message \"" << m << "\" lacks \"" << p << "\"";
    if (m.find('\n') != std::string::npos) return ::testing::AssertionFailure() << "message has a newline: " << m;
    return ::testing::AssertionSuccess();
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-qkv exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

// A valid call: B=2, Hq=4, Hkv=2, Sq=3, Sk=5, D=8, Dv=6, float32, all buffers separate.
struct Call {
  std::vector<float> qb = std::vector<float>(2 * 4 * 3 * 8, 0.5f), kb = std::vector<float>(2 * 2 * 5 * 8, 0.25f),
                     vb = std::vector<float>(2 * 2 * 5 * 6, 1.0f), ob = std::vector<float>(2 * 4 * 3 * 6),
                     lb = std::vector<float>(2 * 4 * 3), pb = std::vector<float>(2 * 4 * 3 * 5);
  TensorView q{qb.data(), DType::f32, {2, 4, 3, 8}};
  TensorView k{kb.data(), DType::f32, {2, 2, 5, 8}};
  TensorView v{vb.data(), DType::f32, {2, 2, 5, 6}};
  TensorView out{ob.data(), DType::f32, {2, 4, 3, 6}};
  std::optional<TensorView> lse = TensorView(lb.data(), DType::f32, {2, 4, 3});
  std::optional<TensorView> probs = TensorView(pb.data(), DType::f32, {2, 4, 3, 5});
  AttentionParams params;

  // Both entry points must refuse the same way; checks each.
  ::testing::AssertionResult refused(const std::vector<std::string>& parts) {
    auto r = throws_with([&] { attention(q, k, v, out, params, lse, probs); }, parts);
    if (!r) return r << " (qkv::attention)";
    r = throws_with([&] { reference::attention(q, k, v, out, params, lse, probs); }, parts);
    if (!r) return r << " (qkv::reference::attention)";
    r = throws_with([&] { explain_dispatch(q, k, v, out, params, lse, probs); }, parts);
    if (!r) return r << " (qkv::explain_dispatch)";
    return r;
  }
};

TEST(ApiErrors, TheValidCallRuns) {
  Call c;
  EXPECT_NO_THROW(attention(c.q, c.k, c.v, c.out, c.params, c.lse, c.probs));
  EXPECT_NO_THROW(reference::attention(c.q, c.k, c.v, c.out, c.params, c.lse, c.probs));
  EXPECT_NE(explain_dispatch(c.q, c.k, c.v, c.out).find("chosen"), std::string::npos);
}

TEST(ApiErrors, Rank) {
  for (const char* which : {"q", "k", "v", "out"}) {
    Call c;
    TensorView& t = which[0] == 'q' ? c.q : which[0] == 'k' ? c.k : which[0] == 'v' ? c.v : c.out;
    t = TensorView(t.data(), DType::f32, {2, 4, 24});
    EXPECT_TRUE(c.refused({std::string(which) + ": expected a 4-D tensor", "got rank 3", "[2,4,24]"})) << which;
  }
  Call c;
  c.q = TensorView(c.qb.data(), DType::f32, {1, 2, 4, 3, 8});
  EXPECT_TRUE(c.refused({"q: expected a 4-D tensor [B,Hq,Sq,D]", "got rank 5"}));
}

TEST(ApiErrors, NullData) {
  Call c;
  c.k = TensorView(nullptr, DType::f32, {2, 2, 5, 8});
  EXPECT_TRUE(c.refused({"k: expected a data pointer", "[2,2,5,8]", "got null"}));
  Call d;
  d.lse = TensorView(nullptr, DType::f32, {2, 4, 3});
  EXPECT_TRUE(d.refused({"softmax_lse: expected a data pointer", "got null"}));
  Call e;
  e.probs = TensorView(nullptr, DType::f32, {2, 4, 3, 5});
  EXPECT_TRUE(e.refused({"probs: expected a data pointer", "got null"}));
}

TEST(ApiErrors, ElementCountOverflow) {
  Call c;
  const std::int64_t big = std::int64_t(1) << 40;
  c.q = TensorView(c.qb.data(), DType::f32, {big, big, 1, 8});
  EXPECT_TRUE(c.refused({"q:", "overflows", shape_str({big, big, 1, 8})}));
}

TEST(ApiErrors, NonContiguousLastDimension) {
  Call c;
  c.v = TensorView(c.vb.data(), DType::f32, {2, 2, 5, 3}, {60, 30, 6, 2});
  EXPECT_TRUE(c.refused({"v: expected a contiguous last dimension (stride 1)", "got stride 2"}));
}

TEST(ApiErrors, Dtypes) {
  {
    Call c;
    c.q = TensorView(c.qb.data(), DType::i32, {2, 4, 3, 8});
    EXPECT_TRUE(c.refused({"q: expected dtype float32, float64, float16 or bfloat16", "got int32"}));
  }
  {
    Call c;
    c.k = TensorView(c.kb.data(), DType::f16, {2, 2, 5, 8});
    EXPECT_TRUE(c.refused({"k: expected dtype float32 (the dtype of q)", "got float16"}));
  }
  {
    Call c;
    c.v = TensorView(c.vb.data(), DType::bf16, {2, 2, 5, 6});
    EXPECT_TRUE(c.refused({"v: expected dtype float32 (the dtype of q)", "got bfloat16"}));
  }
  {
    Call c;
    c.out = TensorView(c.ob.data(), DType::b8, {2, 4, 3, 6});
    EXPECT_TRUE(c.refused({"out: expected dtype", "got bool"}));
  }
  {
    Call c;
    c.lse = TensorView(c.lb.data(), DType::f16, {2, 4, 3});
    EXPECT_TRUE(c.refused({"softmax_lse: expected dtype float32 or float64", "got float16"}));
  }
  {
    Call c;
    c.probs = TensorView(c.pb.data(), DType::i32, {2, 4, 3, 5});
    EXPECT_TRUE(c.refused({"probs: expected dtype float32 or float64", "got int32"}));
  }
}

TEST(ApiErrors, MismatchedDimensions) {
  struct Bad {
    const char* which;
    Shape shape;
    std::vector<std::string> parts;
  };
  const std::vector<Bad> bad = {
      {"k", {3, 2, 5, 8}, {"k: expected [B,Hkv,Sk,D] with B == q.B (2), got B = 3", "[3,2,5,8]"}},
      {"k", {2, 2, 5, 7}, {"k: expected [B,Hkv,Sk,D] with D == q.D (8), got D = 7"}},
      {"v", {1, 2, 5, 6}, {"v: expected [B,Hkv,Sk,Dv] with B == q.B (2), got B = 1"}},
      {"v", {2, 1, 5, 6}, {"v: expected [B,Hkv,Sk,Dv] with Hkv == k.Hkv (2), got Hkv = 1"}},
      {"v", {2, 2, 4, 6}, {"v: expected [B,Hkv,Sk,Dv] with Sk == k.Sk (5), got Sk = 4"}},
      {"out", {1, 4, 3, 6}, {"out: expected [B,Hq,Sq,Dv] with B == q.B (2), got B = 1"}},
      {"out", {2, 2, 3, 6}, {"out: expected [B,Hq,Sq,Dv] with Hq == q.Hq (4), got Hq = 2"}},
      {"out", {2, 4, 2, 6}, {"out: expected [B,Hq,Sq,Dv] with Sq == q.Sq (3), got Sq = 2"}},
      {"out", {2, 4, 3, 5}, {"out: expected [B,Hq,Sq,Dv] with Dv == v.Dv (6), got Dv = 5"}},
  };
  for (const Bad& b : bad) {
    Call c;
    TensorView& t = b.which[0] == 'k' ? c.k : b.which[0] == 'v' ? c.v : c.out;
    t = TensorView(t.data(), DType::f32, b.shape);
    EXPECT_TRUE(c.refused(b.parts)) << shape_str(b.shape);
  }
}

TEST(ApiErrors, GroupedQueryRatio) {
  Call c;
  c.q = TensorView(c.qb.data(), DType::f32, {2, 3, 3, 8});
  c.out = TensorView(c.ob.data(), DType::f32, {2, 3, 3, 6});
  c.lse = TensorView(c.lb.data(), DType::f32, {2, 3, 3});
  c.probs = TensorView(c.pb.data(), DType::f32, {2, 3, 3, 5});
  EXPECT_TRUE(c.refused({"k: expected Hq % Hkv == 0", "got Hq = 3, Hkv = 2"}));
  Call z;  // no KV head for four query heads
  z.k = TensorView(z.kb.data(), DType::f32, {2, 0, 5, 8});
  z.v = TensorView(z.vb.data(), DType::f32, {2, 0, 5, 6});
  EXPECT_TRUE(z.refused({"Hq % Hkv == 0", "Hq = 4, Hkv = 0"}));
}

TEST(ApiErrors, DefaultScaleNeedsD) {
  Call c;
  c.q = TensorView(c.qb.data(), DType::f32, {2, 4, 3, 0});
  c.k = TensorView(c.kb.data(), DType::f32, {2, 2, 5, 0});
  EXPECT_TRUE(c.refused({"q: expected D >= 1 for the default scale 1/sqrt(D), got D = 0"}));
  c.params.scale = 1.0;  // with an explicit scale, D = 0 is a valid (all scores 0) call
  EXPECT_NO_THROW(attention(c.q, c.k, c.v, c.out, c.params, c.lse, c.probs));
  EXPECT_FLOAT_EQ(c.ob[0], 1.0f);
}

TEST(ApiErrors, OutputsOverlappingInputs) {
  {
    Call c;
    c.out = TensorView(c.qb.data(), DType::f32, {2, 4, 3, 6});
    EXPECT_TRUE(c.refused({"out: expected memory disjoint from q", "overlapping bytes"}));
  }
  {
    Call c;
    c.out = TensorView(c.kb.data() + 4, DType::f32, {2, 4, 3, 6}, {0, 0, 0, 1});
    // (a broadcast output is refused before the overlap is looked at)
    EXPECT_TRUE(c.refused({"out: expected an output with distinct elements", "[0,0,0,1]"}));
    c.out = TensorView(c.kb.data() + 4, DType::f32, {1, 1, 1, 6});
    c.q = TensorView(c.qb.data(), DType::f32, {1, 4, 3, 8});
    EXPECT_TRUE(throws_with([&] { attention(c.q, c.k, c.v, c.out); }, {"expected"}));
  }
  {
    Call c;
    c.lse = TensorView(c.vb.data(), DType::f32, {2, 4, 3});
    EXPECT_TRUE(c.refused({"softmax_lse: expected memory disjoint from v"}));
  }
  {
    Call c;
    c.probs = TensorView(c.qb.data(), DType::f32, {2, 4, 3, 5});
    EXPECT_TRUE(c.refused({"probs: expected memory disjoint from q"}));
  }
  {
    Call c;
    c.lse = TensorView(c.ob.data() + 10, DType::f32, {2, 4, 3});
    EXPECT_TRUE(c.refused({"softmax_lse: expected memory disjoint from out"}));
  }
  {
    Call c;
    c.probs = TensorView(c.ob.data(), DType::f32, {2, 4, 3, 5});
    EXPECT_TRUE(c.refused({"probs: expected memory disjoint from out"}));
  }
  {
    Call c;
    std::vector<float> shared(2 * 4 * 3 * 5 + 8);
    c.probs = TensorView(shared.data(), DType::f32, {2, 4, 3, 5});
    c.lse = TensorView(shared.data() + 8, DType::f32, {2, 4, 3});
    EXPECT_TRUE(c.refused({"probs: expected memory disjoint from softmax_lse"}));
  }
  {
    Call c;  // an output may not overwrite the mask it is computed from
    c.params.mask = TensorView(c.ob.data(), DType::f32, {5});
    EXPECT_TRUE(c.refused({"out: expected memory disjoint from mask"}));
  }
  {
    Call c;  // inputs may overlap each other (a packed QKV buffer)
    c.k = TensorView(c.qb.data(), DType::f32, {2, 2, 5, 8}, {96, 24, 4, 1});
    EXPECT_NO_THROW(attention(c.q, c.k, c.v, c.out, c.params, c.lse, c.probs));
  }
}

TEST(ApiErrors, StridesBeyondInt64) {
  Call c;
  const std::int64_t huge = std::int64_t(1) << 62;
  c.out = TensorView(c.ob.data(), DType::f32, {2, 4, 3, 6}, {huge, 18, 6, 1});
  EXPECT_TRUE(c.refused({"out: expected strides whose byte extent fits in int64", "[4611686018427387904,18,6,1]"}));
  Call d;
  d.v = TensorView(d.vb.data(), DType::f32, {2, 2, 5, 6}, {-huge, 30, 6, 1});
  EXPECT_TRUE(d.refused({"v: expected strides whose byte extent fits in int64"}));
}

TEST(ApiErrors, BroadcastOutputs) {
  Call c;
  c.lse = TensorView(c.lb.data(), DType::f32, {2, 4, 3}, {0, 3, 1});
  EXPECT_TRUE(c.refused({"softmax_lse: expected an output with distinct elements", "[0,3,1]"}));
  Call d;
  d.probs = TensorView(d.pb.data(), DType::f32, {2, 4, 3, 5}, {60, 15, 0, 1});
  EXPECT_TRUE(d.refused({"probs: expected an output with distinct elements"}));
}

TEST(ApiErrors, OutputShapes) {
  Call c;
  c.lse = TensorView(c.lb.data(), DType::f32, {2, 4, 3, 1});
  EXPECT_TRUE(c.refused({"softmax_lse: expected shape [B,Hq,Sq] = [2,4,3], got [2,4,3,1]"}));
  c.lse = TensorView(c.lb.data(), DType::f32, {2, 4, 2});
  EXPECT_TRUE(c.refused({"softmax_lse: expected shape [B,Hq,Sq] = [2,4,3], got [2,4,2]"}));
  Call d;
  d.probs = TensorView(d.pb.data(), DType::f32, {2, 4, 3, 4});
  EXPECT_TRUE(d.refused({"probs: expected shape [B,Hq,Sq,Sk] = [2,4,3,5], got [2,4,3,4]"}));
  d.probs = TensorView(d.pb.data(), DType::f32, {2, 4, 15});
  EXPECT_TRUE(d.refused({"probs: expected shape [B,Hq,Sq,Sk] = [2,4,3,5], got [2,4,15]"}));
}

TEST(ApiErrors, Scalars) {
  for (double bad : {std::nan(""), std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()}) {
    Call c;
    c.params.scale = bad;
    EXPECT_TRUE(c.refused({"scale: expected a finite number, got"}));
    Call d;
    d.params.softcap = bad;
    EXPECT_TRUE(d.refused({"softcap: expected a finite number >= 0 (0 = off), got"}));
  }
  Call c;
  c.params.softcap = -1.0;
  EXPECT_TRUE(c.refused({"softcap: expected a finite number >= 0", "got -1"}));
  Call w;
  w.params.window_left = -2;
  EXPECT_TRUE(w.refused({"window: expected LEFT,RIGHT >= -1 (-1 = unbounded), got -2,-1"}));
  w.params.window_left = 3;
  w.params.window_right = -5;
  EXPECT_TRUE(w.refused({"window: expected LEFT,RIGHT >= -1", "got 3,-5"}));
  Call t;
  t.params.num_threads = -1;
  EXPECT_TRUE(t.refused({"num_threads: expected >= 0 (0 = OpenMP default), got -1"}));
}

TEST(ApiErrors, Mask) {
  std::vector<float> m(2 * 4 * 3 * 5 * 2);
  {
    Call c;
    c.params.mask = TensorView(m.data(), DType::f32, {});
    EXPECT_TRUE(c.refused({"mask: expected rank 1..4 broadcastable to [B,Hq,Sq,Sk] = [2,4,3,5], got shape []"}));
    c.params.mask = TensorView(m.data(), DType::f32, {1, 2, 4, 3, 5});
    EXPECT_TRUE(c.refused({"mask: expected rank 1..4", "got shape [1,2,4,3,5]"}));
  }
  {
    Call c;
    c.params.mask = TensorView(m.data(), DType::i32, {5});
    EXPECT_TRUE(c.refused({"mask: expected dtype bool (true = attend) or float32/float64 (additive), got int32"}));
    c.params.mask = TensorView(m.data(), DType::f16, {5});
    EXPECT_TRUE(c.refused({"mask: expected dtype", "got float16"}));
  }
  {
    Call c;
    c.params.mask = TensorView(nullptr, DType::b8, {3, 5});
    EXPECT_TRUE(c.refused({"mask: expected a data pointer", "got null"}));
  }
  for (const Shape& s : {Shape{4}, Shape{6}, Shape{2, 5}, Shape{3, 1, 1}, Shape{3, 4, 3, 5}, Shape{2, 2, 3, 5}}) {
    Call c;
    c.params.mask = TensorView(m.data(), DType::b8, s);
    EXPECT_TRUE(c.refused({"mask: shape " + shape_str(s) + " is not broadcastable to [B,Hq,Sq,Sk] = [2,4,3,5]"}));
  }
  for (const Shape& s : {Shape{5}, Shape{1}, Shape{3, 1}, Shape{4, 1, 5}, Shape{2, 1, 1, 1}, Shape{2, 4, 3, 5}}) {
    Call c;
    c.params.mask = TensorView(m.data(), DType::b8, s);
    EXPECT_NO_THROW(attention(c.q, c.k, c.v, c.out, c.params)) << shape_str(s);
  }
}

TEST(ApiErrors, KvLens) {
  std::vector<std::int64_t> l64 = {5, 0, 3};
  std::vector<std::int32_t> l32 = {2, 6};
  std::vector<float> lf = {1, 2};
  {
    Call c;
    c.params.kv_lens = TensorView(l64.data(), DType::i64, {3});
    EXPECT_TRUE(c.refused({"kv_lens: expected shape [B] = [2], got [3]"}));
    c.params.kv_lens = TensorView(l64.data(), DType::i64, {2, 1});
    EXPECT_TRUE(c.refused({"kv_lens: expected shape [B] = [2], got [2,1]"}));
  }
  {
    Call c;
    c.params.kv_lens = TensorView(lf.data(), DType::f32, {2});
    EXPECT_TRUE(c.refused({"kv_lens: expected dtype int32 or int64, got float32"}));
  }
  {
    Call c;
    c.params.kv_lens = TensorView(nullptr, DType::i32, {2});
    EXPECT_TRUE(c.refused({"kv_lens: expected a data pointer", "got null"}));
  }
  {
    Call c;
    c.params.kv_lens = TensorView(l32.data(), DType::i32, {2});
    EXPECT_TRUE(c.refused({"kv_lens: expected each length in [0, Sk] = [0, 5], got 6 at batch 1"}));
    l32 = {-1, 2};
    EXPECT_TRUE(c.refused({"kv_lens: expected each length in [0, Sk] = [0, 5], got -1 at batch 0"}));
    l32 = {0, 5};
    EXPECT_NO_THROW(attention(c.q, c.k, c.v, c.out, c.params));
  }
  {
    Call c;  // a strided view: elements 0 and 2 of {5, 0, 3}
    c.params.kv_lens = TensorView(l64.data(), DType::i64, {2}, {2});
    EXPECT_NO_THROW(attention(c.q, c.k, c.v, c.out, c.params));
    l64 = {5, 0, 9};
    EXPECT_TRUE(c.refused({"kv_lens:", "got 9 at batch 1"}));
  }
}

TEST(ApiErrors, ForcedKernel) {
  Call c;
  c.params.kernel = KernelKind::reference;
  EXPECT_NO_THROW(attention(c.q, c.k, c.v, c.out, c.params, c.lse, c.probs));
  EXPECT_NE(explain_dispatch(c.q, c.k, c.v, c.out, c.params).find("reference: chosen"), std::string::npos);
  // A kernel that is not compiled in (or that refuses this call) is an error when forced.
  for (KernelKind k : {KernelKind::flash, KernelKind::decode}) {
    const char* name = k == KernelKind::flash ? "flash" : "decode";
    bool compiled = false;
    for (const auto& ki : compiled_kernels()) compiled |= ki.name == name;
    c.params.kernel = k;
    if (!compiled) {
      EXPECT_TRUE(throws_with([&] { attention(c.q, c.k, c.v, c.out, c.params); },
                              {"kernel: expected a kernel compiled into this build", "reference", std::string("got '") + name + "'"}));
    } else {
      // float64 inputs with probs: a kernel that cannot run it says why.
      try {
        attention(c.q, c.k, c.v, c.out, c.params, c.lse, c.probs);
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(std::string("kernel: the requested kernel '") + name + "' cannot run this call: "),
                  std::string::npos) << e.what();
      }
    }
  }
}

TEST(ApiErrors, ErrorIsAnInvalidArgument) {
  Call c;
  c.params.scale = std::nan("");
  EXPECT_THROW(attention(c.q, c.k, c.v, c.out, c.params), std::invalid_argument);
}

// --- tensors -----------------------------------------------------------------------------------

TEST(TensorErrors, NegativeDimensions) {
  float x = 0;
  EXPECT_TRUE(throws_with([&] { TensorView(&x, DType::f32, {2, -3}); }, {"tensor: expected non-negative dimensions, got [2,-3]"}));
  EXPECT_TRUE(throws_with([&] { Tensor(DType::f32, {-1}); }, {"tensor: expected non-negative dimensions, got [-1]"}));
}

TEST(TensorErrors, ContiguousStridesOverflow) {
  float x = 0;
  const std::int64_t big = std::int64_t(1) << 40;
  EXPECT_TRUE(throws_with([&] { TensorView(&x, DType::f32, {big, big, big, 1}); },
                          {"tensor: expected a shape whose contiguous strides fit in int64, got [1099511627776,1099511627776,1099511627776,1]"}));
  // The element count may overflow while every stride fits: the view exists and attention()
  // refuses it (ApiErrors.ElementCountOverflow).
  EXPECT_EQ(TensorView(&x, DType::f32, {big, big, 1, 8}).strides(), (Shape{big * 8, 8, 8, 1}));
}

TEST(TensorErrors, StridesOfTheWrongRank) {
  float x = 0;
  EXPECT_TRUE(throws_with([&] { TensorView(&x, DType::f32, {2, 3}, {3}); },
                          {"tensor: expected 2 strides (the rank of shape [2,3]), got [3]"}));
}

TEST(TensorErrors, TensorTooLarge) {
  const std::int64_t big = std::int64_t(1) << 62;
  EXPECT_TRUE(throws_with([&] { Tensor(DType::f32, {big, 4}); }, {"tensor: element count of shape", "overflows int64"}));
  EXPECT_TRUE(throws_with([&] { Tensor(DType::f64, {big}); }, {"tensor: byte size of shape", "overflows size_t"}));
  EXPECT_TRUE(throws_with([&] { checked_numel({3, -1}, 4, "probs"); }, {"probs: expected non-negative dimensions, got [3,-1]"}));
}

TEST(TensorErrors, Permute) {
  float x[6] = {};
  const TensorView t(x, DType::f32, {1, 2, 3});
  EXPECT_TRUE(throws_with([&] { t.permute({0, 1}); }, {"permute: expected 3 axes, got 2"}));
  EXPECT_TRUE(throws_with([&] { t.permute({0, 1, 3}); }, {"permute: expected axes in [0, 3), got axis 3"}));
  EXPECT_TRUE(throws_with([&] { t.permute({0, -1, 2}); }, {"permute: expected axes in [0, 3), got axis -1"}));
  EXPECT_TRUE(throws_with([&] { t.permute({1, 1, 2}); }, {"permute: expected each axis once, got axis 1 twice"}));
}

}  // namespace
}  // namespace qkv
