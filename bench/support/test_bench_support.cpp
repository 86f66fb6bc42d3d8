// Tests of the benchmark support code: the naive baselines (forward and backward) against the
// float64 reference, the FLOP and byte counts the reports divide by, the SGEMM rate's count and
// the CPU description. (Timings are never asserted.)
#include <gtest/gtest.h>
#include <omp.h>

#include <chrono>
#include <cmath>
#include <string>
#include <thread>
#include <tuple>

#include "qkv/backward.hpp"
#include "qkv/reference.hpp"
#include "bench_support.hpp"

namespace {

using qkv::bench::BenchShape;

double max_abs_diff(const qkv::Tensor& a, const qkv::Tensor& b) {
  double m = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i)
    m = std::max(m, std::fabs(double(a.data_as<float>()[i]) - double(b.data_as<float>()[i])));
  return m;
}

struct Case {
  BenchShape s;
  bool causal;
  int threads;
};

class BaselineVsReference : public ::testing::TestWithParam<Case> {};

TEST_P(BaselineVsReference, MatchesWithinFp32Tolerance) {
  const Case c = GetParam();
  const qkv::bench::Inputs in = qkv::bench::make_inputs(c.s, qkv::DType::f32, 7);
  qkv::Tensor want(qkv::DType::f32, {c.s.B, c.s.Hq, c.s.Sq, c.s.D});
  qkv::AttentionParams p;
  p.causal = c.causal;
  qkv::reference::attention(in.q, in.k, in.v, want, p);
  qkv::bench::NaiveBaseline base(c.s, c.threads);
  base.run(in.q, in.k, in.v, in.out, c.causal);
  // |q.k| <= D for inputs in [-1, 1]; fp32 sgemm and softmax stay within a few ulps of 1 per
  // element of the output (a convex combination of values in [-1, 1]).
  EXPECT_LT(max_abs_diff(in.out, want), 2e-5) << qkv::bench::shape_label(c.s) << " causal " << c.causal;
  EXPECT_EQ(base.workspace_bytes(), std::size_t(c.threads) * c.s.Sq * c.s.Sk * sizeof(float));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, BaselineVsReference,
    ::testing::Values(Case{{1, 2, 2, 17, 17, 8}, false, 1}, Case{{1, 2, 2, 17, 17, 8}, true, 2},
                      Case{{2, 4, 2, 5, 33, 16}, true, 2},    // GQA, Sq < Sk: bottom-right diagonal
                      Case{{1, 4, 1, 33, 9, 64}, true, 2},    // Sq > Sk: leading rows see no key
                      Case{{1, 8, 2, 1, 300, 128}, false, 2}, // decode shape with GQA
                      Case{{1, 3, 3, 64, 64, 59}, false, 1}),
    [](const ::testing::TestParamInfo<Case>& i) {
      const BenchShape& s = i.param.s;
      return "B" + std::to_string(s.B) + "_Hq" + std::to_string(s.Hq) + "_Hkv" + std::to_string(s.Hkv) + "_Sq" +
             std::to_string(s.Sq) + "_Sk" + std::to_string(s.Sk) + "_D" + std::to_string(s.D) +
             (i.param.causal ? "_causal" : "") + "_t" + std::to_string(i.param.threads);
    });

double max_abs(const qkv::Tensor& a) {
  double m = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(double(a.data_as<float>()[i])));
  return m;
}

class BackwardBaselineVsReference : public ::testing::TestWithParam<Case> {};

// dQ, dK, dV of the naive backward baseline against qkv::reference::attention_backward (float64),
// given the reference's forward output O.
TEST_P(BackwardBaselineVsReference, MatchesWithinFp32Tolerance) {
  const Case c = GetParam();
  const BenchShape& s = c.s;
  qkv::AttentionParams p;
  p.causal = c.causal;
  p.kernel = qkv::KernelKind::reference;
  const qkv::bench::BackwardInputs b = qkv::bench::make_backward_inputs(s, qkv::DType::f32, qkv::DType::f32, p, 11);
  qkv::Tensor wq(qkv::DType::f32, {s.B, s.Hq, s.Sq, s.D}), wk(qkv::DType::f32, {s.B, s.Hkv, s.Sk, s.D}),
      wv(qkv::DType::f32, {s.B, s.Hkv, s.Sk, s.D});
  qkv::reference::attention_backward(b.in.q, b.in.k, b.in.v, b.in.out, b.lse, b.grad_out, wq, wk, wv, p);
  qkv::bench::NaiveBackwardBaseline base(s, c.threads);
  base.run(b.in.q, b.in.k, b.in.v, b.in.out, b.grad_out, b.grad_q, b.grad_k, b.grad_v, c.causal);
  const std::string what = qkv::bench::shape_label(s) + (c.causal ? " causal" : "");
  for (auto [got, want, name] : {std::tuple{&b.grad_q, &wq, "dQ"}, std::tuple{&b.grad_k, &wk, "dK"},
                                 std::tuple{&b.grad_v, &wv, "dV"}}) {
    const double scale = std::max(max_abs(*want), 1e-30);
    EXPECT_GT(max_abs(*want), 0.0) << name << " " << what;
    EXPECT_LT(max_abs_diff(*got, *want) / scale, 1e-4) << name << " " << what;
  }
  EXPECT_EQ(base.workspace_bytes(), std::size_t(c.threads) * (2 * s.Sq * s.Sk + s.Sq) * sizeof(float));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, BackwardBaselineVsReference,
    ::testing::Values(Case{{1, 2, 2, 17, 17, 8}, false, 1}, Case{{1, 2, 2, 17, 17, 8}, true, 2},
                      Case{{2, 4, 2, 19, 23, 16}, false, 2},  // GQA 2, Sq < Sk
                      Case{{2, 4, 2, 19, 23, 16}, true, 2},   // GQA 2, bottom-right diagonal
                      Case{{1, 4, 2, 33, 9, 64}, true, 1},    // GQA 2, Sq > Sk: leading rows see no key
                      Case{{1, 2, 1, 64, 64, 59}, true, 2}),  // GQA 2, odd D
    [](const ::testing::TestParamInfo<Case>& i) {
      const BenchShape& s = i.param.s;
      return "B" + std::to_string(s.B) + "_Hq" + std::to_string(s.Hq) + "_Hkv" + std::to_string(s.Hkv) + "_Sq" +
             std::to_string(s.Sq) + "_Sk" + std::to_string(s.Sk) + "_D" + std::to_string(s.D) +
             (i.param.causal ? "_causal" : "") + "_t" + std::to_string(i.param.threads);
    });

TEST(Counts, BackwardIsTwoAndAHalfForwards) {
  EXPECT_EQ(qkv::bench::backward_flops({1, 8, 8, 1024, 1024, 128}, false), 10.0 * 8 * 1024 * 1024 * 128);
  EXPECT_EQ(qkv::bench::backward_flops({2, 8, 8, 4, 4, 64}, true), 2.5 * 4.0 * 2 * 8 * 64 * 10);
}

// The backward inputs hold the forward's output and softmax_lse, and dO in every dtype the same
// values; the gradients are the dtype asked for.
TEST(Inputs, BackwardInputs) {
  const BenchShape s{1, 2, 1, 3, 5, 8};
  qkv::AttentionParams p;
  p.causal = true;
  const auto f = qkv::bench::make_backward_inputs(s, qkv::DType::f32, qkv::DType::f32, p, 3);
  const auto h = qkv::bench::make_backward_inputs(s, qkv::DType::bf16, qkv::DType::bf16, p, 3);
  EXPECT_EQ(h.grad_q.dtype(), qkv::DType::bf16);
  EXPECT_EQ(f.lse.shape(), (qkv::Shape{1, 2, 3}));
  for (std::int64_t i = 0; i < f.grad_out.numel(); ++i)
    EXPECT_EQ(f.grad_out.data_as<float>()[i], qkv::bf16_to_float(h.grad_out.data_as<std::uint16_t>()[i]));
  qkv::Tensor want(qkv::DType::f32, {s.B, s.Hq, s.Sq, s.D});
  qkv::reference::attention(f.in.q, f.in.k, f.in.v, want, p);
  EXPECT_LT(max_abs_diff(f.in.out, want), 1e-5);
  for (std::int64_t i = 0; i < f.lse.numel(); ++i) EXPECT_TRUE(std::isfinite(f.lse.data_as<float>()[i]));
  const std::string kernel = qkv::bench::dispatched_backward_kernel(f, p);
  EXPECT_EQ(kernel.rfind("flash (", 0), 0u) << kernel;
  p.kernel = qkv::KernelKind::reference;
  EXPECT_EQ(qkv::bench::dispatched_backward_kernel(f, p), "reference");
}

TEST(Counts, UnmaskedPairsAndFlops) {
  // Sq == Sk: the causal triangle including the diagonal.
  EXPECT_EQ(qkv::bench::unmasked_pairs({1, 8, 8, 4, 4, 64}, true), 10.0);
  EXPECT_EQ(qkv::bench::unmasked_pairs({1, 8, 8, 4, 4, 64}, false), 16.0);
  // Sq < Sk, bottom-right: query i sees keys 0..i+Sk-Sq: 3 + 4 = 7 of 2 x 4.
  EXPECT_EQ(qkv::bench::unmasked_pairs({1, 1, 1, 2, 4, 1}, true), 7.0);
  // Sq > Sk: the first Sq-Sk rows see nothing: 0 + 1 + 2 = 3.
  EXPECT_EQ(qkv::bench::unmasked_pairs({1, 1, 1, 3, 2, 1}, true), 3.0);
  EXPECT_EQ(qkv::bench::forward_flops({1, 8, 8, 1024, 1024, 128}, false), 4.0 * 8 * 1024 * 1024 * 128);
  EXPECT_EQ(qkv::bench::forward_flops({2, 8, 8, 4, 4, 64}, true), 4.0 * 2 * 8 * 64 * 10);
}

TEST(Counts, KvBytesOncePerKvHead) {
  EXPECT_EQ(qkv::bench::kv_bytes({1, 8, 2, 1, 32768, 128}, qkv::DType::f32), 2.0 * 2 * 32768 * 128 * 4);
  EXPECT_EQ(qkv::bench::kv_bytes({1, 8, 8, 1, 4096, 128}, qkv::DType::bf16), 2.0 * 8 * 4096 * 128 * 2);
}

TEST(Inputs, SameValuesForEveryDtype) {
  const BenchShape s{1, 2, 1, 3, 5, 7};
  const auto f = qkv::bench::make_inputs(s, qkv::DType::f32, 3);
  const auto b = qkv::bench::make_inputs(s, qkv::DType::bf16, 3);
  for (std::int64_t i = 0; i < f.k.numel(); ++i)
    EXPECT_EQ(f.k.data_as<float>()[i], qkv::bf16_to_float(b.k.data_as<std::uint16_t>()[i]));
}

TEST(Timing, MedianAndRunCount) {
  EXPECT_EQ(qkv::bench::median({3, 1, 2}), 2.0);
  EXPECT_EQ(qkv::bench::median({4, 1, 2, 3}), 2.5);
  int calls = 0;
  const auto t = qkv::bench::time_runs([&] { ++calls; }, 4, 10.0);
  EXPECT_EQ(t.size(), 4u);
  EXPECT_EQ(calls, 5);  // one warm-up
}

// Calls shorter than min_s / repeats run as many times as fill min_s; the budget still caps them.
TEST(Timing, MinimumTimeAddsRuns) {
  int calls = 0;
  const auto slow = [&] { ++calls; std::this_thread::sleep_for(std::chrono::milliseconds(2)); };
  const auto t = qkv::bench::time_runs(slow, 2, 10.0, 0.05);
  EXPECT_GT(t.size(), 2u);
  EXPECT_LE(t.size(), 25u);  // at most 0.05 s / 2 ms
  EXPECT_EQ(calls, static_cast<int>(t.size()) + 1);
  calls = 0;
  EXPECT_EQ(qkv::bench::time_runs(slow, 2, 0.001, 0.05).size(), 1u);  // budget wins: one run
  // A slow first call (thread start, fresh memory) does not cut the timed runs short of min_s.
  calls = 0;
  const auto first_slow = [&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(++calls == 1 ? 40 : 1));
  };
  const auto u = qkv::bench::time_runs(first_slow, 2, 10.0, 0.05);
  double total = 0;
  for (double x : u) total += x;
  EXPECT_GE(total, 0.05);
}

}  // namespace

namespace {

// The SGEMM rate counts 2 n^3 FLOP per call, leaves OpenBLAS's and OpenMP's thread counts as it
// found them, and says how many runs its median is of.
TEST(Sgemm, CountsAndRestoresThreads) {
  const int omp_before = omp_get_max_threads();
  const qkv::bench::SgemmRate r = qkv::bench::measure_sgemm(2, 64, 3);
  EXPECT_EQ(r.n, 64);
  EXPECT_EQ(r.threads, 2);
  EXPECT_GE(r.runs, 3);
  ASSERT_GT(r.seconds, 0);
  EXPECT_NEAR(r.gflops * r.seconds * 1e9, 2.0 * 64 * 64 * 64, 1e-6 * 2.0 * 64 * 64 * 64);
  EXPECT_EQ(omp_get_max_threads(), omp_before);
}

// The CPU as Linux describes it: every Linux machine has /proc/cpuinfo.
TEST(Machine, DescribesTheCpu) {
  const qkv::bench::CpuDescription cpu = qkv::bench::describe_cpu();
  EXPECT_GE(cpu.logical_cpus, 1);
  qkv::bench::CpuDescription c;
  EXPECT_EQ(qkv::bench::cache_summary(c), "unknown");
  c.caches = {{1, "Data", 48 << 10, 1}, {1, "Instruction", 32 << 10, 1}, {3, "Unified", 480 << 20, 2}};
  EXPECT_EQ(qkv::bench::cache_summary(c), "L1d 48 KiB, L1i 32 KiB, L3 480 MiB (shared by 2 CPUs)");
}

}  // namespace
