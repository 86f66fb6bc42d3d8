// Google Benchmark program for qkv::attention() and the naive baseline on the benchmark grid:
// forward B=1, Hq=Hkv=8, D in {64,128}, Sq=Sk in {256,1024,4096,16384}, causal and not, fp32 and
// bf16; decode Sq=1, Sk in {4096,32768}, Hq=8, Hkv in {8,2}, D=128; backward (attention_backward
// and the naive BLAS backward) fp32, D=128, S=1024, causal and not. Counters: GFLOP/s (forward,
// unmasked scores only; backward counted as 2.5x the forward, FlashAttention's convention) and
// GB/s (K and V bytes once per KV head), plus the fraction of the measured peaks (context lines at
// the top of the report).
//
// Select shapes with --benchmark_filter (e.g. 'forward/.*/S:1024/'), or cap the sequence lengths
// with --max_seqlen=N; --blas_core=NAME runs the baseline with OPENBLAS_CORETYPE=NAME (both
// removed before Google Benchmark parses the rest).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/info.hpp"
#include "bench_support.hpp"

namespace {

using qkv::bench::BenchShape;

qkv::bench::Peaks g_peaks;

// Counters from the measured total time: GFLOP/s (unmasked scores only), GB/s (K and V once per
// KV head) and the fraction of the peak (fp32 FMA, bf16 dot product, or for decode the read
// bandwidth over a buffer the size of K and V).
void set_counters(benchmark::State& state, const BenchShape& s, bool causal, qkv::DType dtype, bool decode,
                  double seconds, bool backward = false) {
  if (seconds <= 0) return;
  const double iters = static_cast<double>(state.iterations());
  const double flops = backward ? qkv::bench::backward_flops(s, causal) : qkv::bench::forward_flops(s, causal);
  const double gflops = flops * iters / seconds * 1e-9;
  const double gbps = qkv::bench::kv_bytes(s, dtype) * iters / seconds * 1e-9;
  state.counters["GFLOP/s"] = gflops;
  state.counters["GB/s"] = gbps;
  double peak = qkv::bench::compute_peak_value(g_peaks, qkv::bench::compute_peak_name(dtype));
  if (decode) peak = qkv::bench::measure_read_bandwidth(g_peaks.threads, qkv::bench::kv_bytes(s, dtype));
  if (peak > 0) state.counters["peak_frac"] = (decode ? gbps : gflops) / peak;
}

using Clock = std::chrono::steady_clock;

void bm_qkv(benchmark::State& state, BenchShape s, bool causal, qkv::DType dtype, bool decode, int threads) {
  const qkv::bench::Inputs in = qkv::bench::make_inputs(s, dtype);
  qkv::AttentionParams p;
  p.causal = causal;
  p.num_threads = threads;
  const std::string kernel = qkv::bench::dispatched_kernel(in, p);
  state.SetLabel(kernel);
  // The float64 reference runs well under 1 GFLOP/s: large shapes would take hours.
  if (kernel.rfind("reference", 0) == 0 && qkv::bench::forward_flops(s, causal) > 2e10) {
    state.SkipWithError("skipped: only the float64 reference kernel would run this shape");
    for (auto _ : state) {
    }
    return;
  }
  double total = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    qkv::attention(in.q, in.k, in.v, in.out, p);
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(dt);
    total += dt;
  }
  set_counters(state, s, causal, dtype, decode, total);
}

void bm_baseline(benchmark::State& state, BenchShape s, bool causal, bool decode, int threads) {
  const qkv::bench::Inputs in = qkv::bench::make_inputs(s, qkv::DType::f32);
  qkv::bench::NaiveBaseline base(s, threads);
  state.SetLabel("naive sgemm+softmax+sgemm");
  double total = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    base.run(in.q, in.k, in.v, in.out, causal);
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(dt);
    total += dt;
  }
  set_counters(state, s, causal, qkv::DType::f32, decode, total);
}

// attention_backward() with the forward's out and softmax_lse computed once beforehand;
// gradients in float32.
void bm_qkv_backward(benchmark::State& state, BenchShape s, bool causal, int threads) {
  qkv::AttentionParams p;
  p.causal = causal;
  p.num_threads = threads;
  const qkv::bench::BackwardInputs in = qkv::bench::make_backward_inputs(s, qkv::DType::f32, qkv::DType::f32, p);
  const std::string kernel = qkv::bench::dispatched_backward_kernel(in, p);
  state.SetLabel(kernel);
  if (kernel == "reference" && qkv::bench::backward_flops(s, causal) > 2e10) {
    state.SkipWithError("skipped: only the float64 reference kernel would run this shape");
    for (auto _ : state) {
    }
    return;
  }
  double total = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    qkv::bench::run_backward(in, p);
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(dt);
    total += dt;
  }
  set_counters(state, s, causal, qkv::DType::f32, false, total, true);
}

void bm_baseline_backward(benchmark::State& state, BenchShape s, bool causal, int threads) {
  qkv::AttentionParams p;
  p.causal = causal;
  p.num_threads = threads;
  const qkv::bench::BackwardInputs in = qkv::bench::make_backward_inputs(s, qkv::DType::f32, qkv::DType::f32, p);
  qkv::bench::NaiveBackwardBaseline base(s, threads);
  state.SetLabel("naive sgemm+softmax, five sgemm");
  double total = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    base.run(in.in.q, in.in.k, in.in.v, in.in.out, in.grad_out, in.grad_q, in.grad_k, in.grad_v, causal);
    const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(dt);
    total += dt;
  }
  set_counters(state, s, causal, qkv::DType::f32, false, total, true);
}

void register_all(std::int64_t max_seqlen, int threads) {
  for (std::int64_t D : {64, 128})
    for (std::int64_t S : {256, 1024, 4096, 16384}) {
      if (S > max_seqlen) continue;
      const BenchShape s{1, 8, 8, S, S, D};
      for (bool causal : {false, true}) {
        const std::string tail = "/D:" + std::to_string(D) + "/S:" + std::to_string(S) + "/causal:" +
                                 (causal ? "1" : "0");
        for (auto [dtype, name] : {std::pair{qkv::DType::f32, "f32"}, std::pair{qkv::DType::bf16, "bf16"}})
          benchmark::RegisterBenchmark(("forward/qkv/" + std::string(name) + tail).c_str(), bm_qkv, s, causal,
                                       dtype, false, threads)
              ->UseManualTime()
              ->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark(("forward/baseline/f32" + tail).c_str(), bm_baseline, s, causal, false, threads)
            ->UseManualTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  for (std::int64_t Sk : {4096, 32768}) {
    if (Sk > max_seqlen) continue;
    for (std::int64_t Hkv : {8, 2}) {
      const BenchShape s{1, 8, Hkv, 1, Sk, 128};
      const std::string tail = "/Hkv:" + std::to_string(Hkv) + "/Sk:" + std::to_string(Sk);
      for (auto [dtype, name] : {std::pair{qkv::DType::f32, "f32"}, std::pair{qkv::DType::bf16, "bf16"}})
        benchmark::RegisterBenchmark(("decode/qkv/" + std::string(name) + tail).c_str(), bm_qkv, s, false, dtype,
                                     true, threads)
            ->UseManualTime()
            ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("decode/baseline/f32" + tail).c_str(), bm_baseline, s, false, true, threads)
          ->UseManualTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
  for (std::int64_t S : {1024}) {
    if (S > max_seqlen) continue;
    const BenchShape s{1, 8, 8, S, S, 128};
    for (bool causal : {false, true}) {
      const std::string tail = "/f32/D:128/S:" + std::to_string(S) + "/causal:" + (causal ? "1" : "0");
      benchmark::RegisterBenchmark(("backward/qkv" + tail).c_str(), bm_qkv_backward, s, causal, threads)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("backward/baseline" + tail).c_str(), bm_baseline_backward, s, causal, threads)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  // The baseline must run on OpenBLAS's own choice of kernels: drop OPENBLAS_CORETYPE and
  // OPENBLAS_L2_SIZE (read when the library loads) by re-executing once without them.
  // --blas_core=NAME sets OPENBLAS_CORETYPE=NAME instead.
  std::int64_t max_seqlen = 1 << 30;
  std::string blas_core;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--max_seqlen=", 13) == 0)
      max_seqlen = std::atoll(argv[i] + 13);
    else if (std::strncmp(argv[i], "--blas_core=", 12) == 0)
      blas_core = argv[i] + 12;
    else
      args.push_back(argv[i]);
  }
  qkv::bench::reexec_with_clean_blas_env(std::vector<std::string>(argv, argv + argc), blas_core);
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;

  const int threads = omp_get_max_threads();
  g_peaks = qkv::bench::measure_peaks(threads);
  benchmark::AddCustomContext("openblas", qkv::bench::blas_env_note());
  benchmark::AddCustomContext("threads", std::to_string(threads));
  benchmark::AddCustomContext("peak_fma_gflops", std::to_string(g_peaks.fma_gflops) + " (" + g_peaks.fma_isa + ")");
  benchmark::AddCustomContext("peak_bf16_gflops", std::to_string(g_peaks.bf16_gflops));
  benchmark::AddCustomContext("peak_amx_gflops", std::to_string(g_peaks.amx_gflops));
  benchmark::AddCustomContext("peak_read_gbps", std::to_string(g_peaks.read_gbps));

  register_all(max_seqlen, threads);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
