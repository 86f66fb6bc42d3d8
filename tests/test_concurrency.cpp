// Concurrency: qkv::attention and qkv::reference::attention called from 8 application threads at
// once, 200 mixed calls each (shapes, options, dtypes, forced kernels, num_threads), every thread
// writing its own outputs while all read the same inputs. Every result must be bitwise identical
// to a single-threaded run of the same call. Runs under ThreadSanitizer too (label "threads",
// scripts/test.sh); docs/threads.md states the guarantees.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/error.hpp"
#include "qkv/npy.hpp"
#include "qkv/reference.hpp"
#include "qkv/tensor.hpp"

namespace {

using qkv::DType;
using qkv::Tensor;
using qkv::TensorView;

constexpr int kThreads = 8;
constexpr int kCalls = 200;

// One call: read-only inputs shared by every thread, and the options.
struct Spec {
  std::int64_t B, Hq, Hkv, Sq, Sk, D, Dv;
  DType in, out;
  std::optional<DType> lse, probs;
  qkv::AttentionParams params;
  bool reference_api = false;
  Tensor q, k, v, mask, lens;
  std::string describe() const {
    std::ostringstream s;
    s << "B" << B << " Hq" << Hq << " Hkv" << Hkv << " Sq" << Sq << " Sk" << Sk << " D" << D << " Dv" << Dv
      << " in=" << qkv::dtype_name(in) << " out=" << qkv::dtype_name(out) << " causal=" << params.causal
      << " window=" << params.window_left << "," << params.window_right << " softcap=" << params.softcap
      << " mask=" << params.mask.has_value() << " kv_lens=" << params.kv_lens.has_value()
      << " kernel=" << int(params.kernel) << " threads=" << params.num_threads << " ref_api=" << reference_api;
    return s.str();
  }
};

// Outputs of one call, owned by the thread that makes it.
struct Result {
  Tensor out, lse, probs;
  std::string error;  // what() of a qkv::Error, if the call was refused
};

Tensor random_tensor(std::mt19937& rng, DType dt, const qkv::Shape& shape) {
  Tensor f(DType::f32, shape);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (std::int64_t i = 0; i < f.numel(); ++i) f.data_as<float>()[i] = n(rng);
  return dt == DType::f32 ? std::move(f) : qkv::to_contiguous(f, dt);
}

std::vector<Spec> make_specs(unsigned seed) {
  std::mt19937 rng(seed);
  const auto pick = [&](auto... xs) {
    const std::vector<std::common_type_t<decltype(xs)...>> v{xs...};
    return v[std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(rng)];
  };
  const auto upto = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  std::vector<Spec> specs(kCalls);
  for (Spec& s : specs) {
    s.B = upto(1, 2);
    s.Hkv = upto(1, 2);
    s.Hq = s.Hkv * upto(1, 3);
    s.Sq = pick(1, 1, 2, 7, 16, 24);
    s.Sk = pick(0, 1, 5, 16, 33, 40);
    s.D = pick(1, 4, 8, 16, 32, 64);
    s.Dv = pick(1, 8, 16);
    s.in = pick(DType::f32, DType::f32, DType::f64, DType::f16, DType::bf16);
    s.out = pick(DType::f32, DType::f32, DType::f64, DType::bf16, DType::f16);
    if (upto(0, 1)) s.lse = pick(DType::f32, DType::f64);
    if (upto(0, 3) == 0) s.probs = pick(DType::f32, DType::f64);
    qkv::AttentionParams& p = s.params;
    p.causal = upto(0, 1);
    p.align = upto(0, 1) ? qkv::Alignment::bottom_right : qkv::Alignment::top_left;
    if (upto(0, 3) == 0) {
      p.window_left = upto(-1, 8);
      p.window_right = upto(-1, 4);
    }
    if (upto(0, 3) == 0) p.softcap = pick(5.0, 30.0);
    if (upto(0, 2) == 0) p.scale = pick(0.0, 0.3, 1.0, 4.0);
    s.q = random_tensor(rng, s.in, {s.B, s.Hq, s.Sq, s.D});
    s.k = random_tensor(rng, s.in, {s.B, s.Hkv, s.Sk, s.D});
    s.v = random_tensor(rng, s.in, {s.B, s.Hkv, s.Sk, s.Dv});
    switch (upto(0, 3)) {
      case 0: {  // bool [Sq, Sk]
        s.mask = Tensor(DType::b8, {s.Sq, s.Sk});
        for (std::int64_t i = 0; i < s.mask.numel(); ++i) s.mask.data_as<std::uint8_t>()[i] = upto(0, 3) != 0;
        p.mask = s.mask.view();
        break;
      }
      case 1: {  // additive float32 [B, 1, Sq, Sk] with some -inf
        s.mask = Tensor(DType::f32, {s.B, 1, s.Sq, s.Sk});
        for (std::int64_t i = 0; i < s.mask.numel(); ++i)
          s.mask.data_as<float>()[i] = upto(0, 4) == 0 ? -INFINITY : 0.1f * float(upto(-10, 10));
        p.mask = s.mask.view();
        break;
      }
      default: break;
    }
    if (upto(0, 3) == 0) {
      const DType lt = pick(DType::i32, DType::i64);
      s.lens = Tensor(lt, {s.B});
      for (std::int64_t b = 0; b < s.B; ++b) {
        const int len = upto(0, static_cast<int>(s.Sk));
        if (lt == DType::i32) s.lens.data_as<std::int32_t>()[b] = len;
        else s.lens.data_as<std::int64_t>()[b] = len;
      }
      p.kv_lens = s.lens.view();
    }
    s.reference_api = upto(0, 4) == 0;
    p.kernel = pick(qkv::KernelKind::automatic, qkv::KernelKind::automatic, qkv::KernelKind::reference,
                    qkv::KernelKind::flash, qkv::KernelKind::decode);
    p.num_threads = pick(0, 1, 2);
  }
  return specs;
}

Result run(const Spec& s) {
  Result r;
  r.out = Tensor(s.out, {s.B, s.Hq, s.Sq, s.Dv});
  std::optional<TensorView> lse, probs;
  if (s.lse) lse = (r.lse = Tensor(*s.lse, {s.B, s.Hq, s.Sq})).view();
  if (s.probs) probs = (r.probs = Tensor(*s.probs, {s.B, s.Hq, s.Sq, s.Sk})).view();
  try {
    if (s.reference_api) qkv::reference::attention(s.q, s.k, s.v, r.out, s.params, lse, probs);
    else qkv::attention(s.q, s.k, s.v, r.out, s.params, lse, probs);
  } catch (const qkv::Error& e) {
    r.error = e.what();  // a forced kernel that cannot run this call: the refusal must repeat too
  }
  return r;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && (a.nbytes() == 0 || std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
}

TEST(Concurrency, ManyThreadsMatchASingleThreadBitwise) {
  const std::vector<Spec> specs = make_specs(20240601);
  std::vector<Result> expected;
  expected.reserve(specs.size());
  int refused = 0;
  for (const Spec& s : specs) {
    expected.push_back(run(s));
    refused += !expected.back().error.empty();
  }
  // Most calls must actually compute (a forced kernel that is not compiled is refused).
  EXPECT_LT(refused, kCalls / 2);

  std::atomic<int> mismatches{0};
  std::vector<std::string> first_error(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int c = 0; c < kCalls; ++c) {
        const int i = (c + t * (kCalls / kThreads)) % kCalls;  // threads start at different calls
        const Result r = run(specs[i]);
        const Result& e = expected[i];
        if (r.error != e.error || !same_bits(r.out, e.out) || !same_bits(r.lse, e.lse) ||
            !same_bits(r.probs, e.probs)) {
          if (mismatches.fetch_add(1) == 0 || first_error[t].empty())
            first_error[t] = "call " + std::to_string(i) + " (" + specs[i].describe() + ") error '" + r.error +
                             "' vs '" + e.error + "'";
        }
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
  for (const std::string& s : first_error)
    if (!s.empty()) ADD_FAILURE() << "first mismatch in a thread: " << s;
}

// The library's own thread count does not change any result: 1, 2 and 3 threads are bitwise equal.
TEST(Concurrency, ResultsDoNotDependOnNumThreads) {
  std::vector<Spec> specs = make_specs(77);
  for (Spec& s : specs) {
    s.params.num_threads = 1;
    const Result one = run(s);
    for (int n : {2, 3}) {
      s.params.num_threads = n;
      const Result r = run(s);
      EXPECT_EQ(r.error, one.error) << s.describe();
      EXPECT_TRUE(same_bits(r.out, one.out) && same_bits(r.lse, one.lse) && same_bits(r.probs, one.probs))
          << s.describe() << " num_threads " << n;
    }
  }
}

// The backward from 4 application threads at once (each call itself on 1 or 2 OpenMP threads),
// every gradient bitwise equal to a single-threaded call's: the dQ chunk buffers and the dK/dV
// writes of the kernel's own threads must not race (ThreadSanitizer runs this test too).
TEST(Concurrency, BackwardFromManyThreadsMatchesBitwise) {
  const std::int64_t B = 1, Hq = 4, Hkv = 2, S = 150, D = 32;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  auto rnd = [&](std::int64_t H) {
    Tensor t(DType::f32, {B, H, S, D});
    for (std::int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = nd(rng);
    return t;
  };
  const Tensor q = rnd(Hq), k = rnd(Hkv), v = rnd(Hkv), dout = rnd(Hq);
  Tensor out(DType::f32, {B, Hq, S, D}), lse(DType::f32, {B, Hq, S});
  qkv::AttentionParams p;
  p.causal = true;
  qkv::attention(q, k, v, out, p, lse.view());
  struct Grads {
    Tensor dq{DType::f32, {B, Hq, S, D}}, dk{DType::f32, {B, Hkv, S, D}}, dv{DType::f32, {B, Hkv, S, D}};
  };
  auto run = [&](Grads& g, int threads) {
    qkv::AttentionParams pp = p;
    pp.num_threads = threads;
    qkv::attention_backward(q, k, v, out, lse.view(), dout, g.dq, g.dk, g.dv, pp);
  };
  Grads want;
  run(want, 1);
  std::vector<Grads> got(4);
  std::vector<std::thread> ts;
  for (int t = 0; t < 4; ++t) ts.emplace_back([&, t] { for (int r = 0; r < 3; ++r) run(got[t], 1 + (t + r) % 2); });
  for (auto& t : ts) t.join();
  for (const Grads& g : got) {
    EXPECT_EQ(std::memcmp(g.dq.data(), want.dq.data(), want.dq.nbytes()), 0);
    EXPECT_EQ(std::memcmp(g.dk.data(), want.dk.data(), want.dk.nbytes()), 0);
    EXPECT_EQ(std::memcmp(g.dv.data(), want.dv.data(), want.dv.nbytes()), 0);
  }
}

}  // namespace
