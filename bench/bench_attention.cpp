// Google Benchmark program for qkv::attention() and the naive baseline on the benchmark grid:
// forward B=1, Hq=Hkv=8, D in {64,128}, Sq=Sk in {256,1024,4096,16384}, causal and not, fp32 and
// bf16; decode Sq=1, Sk in {4096,32768}, Hq=8, Hkv in {8,2}, D=128. Counters: GFLOP/s (forward,
// unmasked scores only) and GB/s (K and V bytes once per KV head), plus the fraction of the
// measured peaks (context lines at the top of the report).
//
// Select shapes with --benchmark_filter (e.g. 'forward/.*/S:1024/'), or cap the sequence lengths
// with --max_seqlen=N (removed before Google Benchmark parses the rest).
#include <benchmark/benchmark.h>
#include <omp.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv_bench.hpp"

namespace {

using qkv::bench::BenchShape;

qkv::bench::Peaks g_peaks;

void set_counters(benchmark::State& state, const BenchShape& s, bool causal, qkv::DType dtype, bool decode) {
  const double flops = qkv::bench::forward_flops(s, causal);
  const double bytes = qkv::bench::kv_bytes(s, dtype);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GB/s"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  // Fraction of peak: work per iteration over the peak rate, as a rate (i.e. divided by the time).
  const double peak = decode ? g_peaks.read_gbps * 1e9
                             : (dtype != qkv::DType::f32 && g_peaks.bf16_gflops > 0 ? g_peaks.bf16_gflops
                                                                                    : g_peaks.fma_gflops) * 1e9;
  if (peak > 0)
    state.counters["peak_frac"] =
        benchmark::Counter((decode ? bytes : flops) / peak, benchmark::Counter::kIsIterationInvariantRate);
}

void bm_qkv(benchmark::State& state, BenchShape s, bool causal, qkv::DType dtype, bool decode, int threads) {
  const qkv::bench::Inputs in = qkv::bench::make_inputs(s, dtype);
  qkv::AttentionParams p;
  p.causal = causal;
  p.num_threads = threads;
  state.SetLabel(qkv::bench::dispatched_kernel(in, p));
  for (auto _ : state) {
    qkv::attention(in.q, in.k, in.v, in.out, p);
    benchmark::ClobberMemory();
  }
  set_counters(state, s, causal, dtype, decode);
}

void bm_baseline(benchmark::State& state, BenchShape s, bool causal, bool decode, int threads) {
  const qkv::bench::Inputs in = qkv::bench::make_inputs(s, qkv::DType::f32);
  qkv::bench::NaiveBaseline base(s, threads);
  state.SetLabel("naive sgemm+softmax+sgemm");
  for (auto _ : state) {
    base.run(in.q, in.k, in.v, in.out, causal);
    benchmark::ClobberMemory();
  }
  set_counters(state, s, causal, qkv::DType::f32, decode);
}

void register_all(std::int64_t max_seqlen, int threads) {
  for (std::int64_t D : {64, 128})
    for (std::int64_t S : {256, 1024, 4096, 16384}) {
      if (S > max_seqlen) continue;
      const BenchShape s{1, 8, 8, S, S, D};
      for (bool causal : {false, true}) {
        const std::string tail = "/D:" + std::to_string(D) + "/S:" + std::to_string(S) + "/causal:" +
                                 (causal ? "1" : "0") + "/";
        for (auto [dtype, name] : {std::pair{qkv::DType::f32, "f32"}, std::pair{qkv::DType::bf16, "bf16"}})
          benchmark::RegisterBenchmark(("forward/qkv/" + std::string(name) + tail).c_str(), bm_qkv, s, causal,
                                       dtype, false, threads)
              ->UseRealTime()
              ->Unit(benchmark::kMillisecond);
        benchmark::RegisterBenchmark(("forward/baseline/f32" + tail).c_str(), bm_baseline, s, causal, false, threads)
            ->UseRealTime()
            ->Unit(benchmark::kMillisecond);
      }
    }
  for (std::int64_t Sk : {4096, 32768}) {
    if (Sk > max_seqlen) continue;
    for (std::int64_t Hkv : {8, 2}) {
      const BenchShape s{1, 8, Hkv, 1, Sk, 128};
      const std::string tail = "/Hkv:" + std::to_string(Hkv) + "/Sk:" + std::to_string(Sk) + "/";
      for (auto [dtype, name] : {std::pair{qkv::DType::f32, "f32"}, std::pair{qkv::DType::bf16, "bf16"}})
        benchmark::RegisterBenchmark(("decode/qkv/" + std::string(name) + tail).c_str(), bm_qkv, s, false, dtype,
                                     true, threads)
            ->UseRealTime()
            ->Unit(benchmark::kMicrosecond);
      benchmark::RegisterBenchmark(("decode/baseline/f32" + tail).c_str(), bm_baseline, s, false, true, threads)
          ->UseRealTime()
          ->Unit(benchmark::kMicrosecond);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  // The baseline must run on OpenBLAS's own choice of kernels: drop OPENBLAS_CORETYPE and
  // OPENBLAS_L2_SIZE (read when the library loads) by re-executing once without them.
  qkv::bench::reexec_with_clean_blas_env(std::vector<std::string>(argv, argv + argc));

  std::int64_t max_seqlen = 1 << 30;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--max_seqlen=", 13) == 0)
      max_seqlen = std::atoll(argv[i] + 13);
    else
      args.push_back(argv[i]);
  }
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;

  const int threads = omp_get_max_threads();
  g_peaks = qkv::bench::measure_peaks(threads);
  benchmark::AddCustomContext("openblas", qkv::bench::blas_env_note());
  benchmark::AddCustomContext("threads", std::to_string(threads));
  benchmark::AddCustomContext("peak_fma_gflops", std::to_string(g_peaks.fma_gflops) + " (" + g_peaks.fma_isa + ")");
  benchmark::AddCustomContext("peak_bf16_gflops", std::to_string(g_peaks.bf16_gflops));
  benchmark::AddCustomContext("peak_read_gbps", std::to_string(g_peaks.read_gbps));

  register_all(max_seqlen, threads);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
