// Machine peaks for the "fraction of peak" columns: FMA throughput, bf16 dot-product throughput
// and read bandwidth, each measured with OpenMP threads started together behind a barrier and
// timed by the slowest thread (the figure is what all threads sustain at once).
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "platform/cpu_features.hpp"
#include "peak_kernels.hpp"
#include "qkv/info.hpp"
#include "bench_support.hpp"

namespace qkv::bench {
namespace {

using Clock = std::chrono::steady_clock;

// Volatile sink so that no loop result is dead.
volatile float g_sink = 0;

float fma_loop_scalar(std::int64_t iters) noexcept {
  float acc[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  for (std::int64_t i = 0; i < iters; ++i)
    for (float& a : acc) a = a * 0.999f + 0.001f;
  float s = 0;
  for (float a : acc) s += a;
  return s;
}

// Runs loop(iters) on `threads` threads at once; returns the wall time of the slowest, seconds.
template <class Loop>
double timed_parallel(int threads, std::int64_t iters, Loop loop) {
  std::vector<double> t(static_cast<std::size_t>(threads), 0.0);
#pragma omp parallel num_threads(threads)
  {
#pragma omp barrier
    const auto t0 = Clock::now();
    const float r = loop(iters);
    const auto t1 = Clock::now();
    g_sink = g_sink + r;
    t[static_cast<std::size_t>(omp_get_thread_num())] = std::chrono::duration<double>(t1 - t0).count();
  }
  return *std::max_element(t.begin(), t.end());
}

// Throughput in GFLOP/s of a loop doing flops_per_iter per iteration on each thread. On a shared
// machine most runs are slowed by other processes; short runs (about 2 ms) have a fair chance of
// running undisturbed, so the figure is the best of as many as fit in `seconds` (at least 10),
// as peak measurements (and STREAM) report the best run.
template <class Loop>
double loop_gflops(int threads, double flops_per_iter, double seconds, Loop loop) {
  std::int64_t iters = 1 << 10;
  double t = timed_parallel(threads, iters, loop);
  while (t < 5e-4) {
    iters *= 2;
    t = timed_parallel(threads, iters, loop);
  }
  iters = std::max<std::int64_t>(1, static_cast<std::int64_t>(iters * 2e-3 / t));
  double best = 0;
  const auto start = Clock::now();
  for (int r = 0; r < 10 || std::chrono::duration<double>(Clock::now() - start).count() < seconds; ++r) {
    const double tr = timed_parallel(threads, iters, loop);
    best = std::max(best, flops_per_iter * static_cast<double>(iters) * threads / tr * 1e-9);
  }
  return best;
}

float read_sum_generic(const float* p, std::size_t n) noexcept {
  float s[16] = {};
  for (std::size_t i = 0; i < n; i += 16)
    for (int j = 0; j < 16; ++j) s[j] += p[i + j];
  float r = 0;
  for (float x : s) r += x;
  return r;
}

}  // namespace

namespace {

// Streaming reads of `streams` buffers that together hold about `bytes_wanted`; each thread reads
// its own contiguous part of every buffer. With 2 buffers a thread alternates tiles of
// kKvTileBytes between them, as the decode kernel alternates K and V tiles. Best pass, GB/s.
double measure_streams(int threads, double bytes_wanted, double seconds, int streams) {
  constexpr std::size_t kKvTileBytes = 64 * 128 * sizeof(float);  // 64 keys of D = 128 fp32
  threads = threads < 1 ? 1 : threads;
#if defined(QKV_BENCH_X86)
  const bool avx512 = qkv::detail::cpu_features().avx512();
#else
  const bool avx512 = false;
#endif
  const std::size_t unit = (streams == 1 ? 64 * sizeof(float) : kKvTileBytes) * static_cast<std::size_t>(threads);
  const std::size_t per = static_cast<std::size_t>(bytes_wanted) / static_cast<std::size_t>(streams);
  const std::size_t bytes = std::max<std::size_t>(unit, per / unit * unit);
  const std::size_t n = bytes / sizeof(float);
  std::vector<std::unique_ptr<float, decltype(&std::free)>> bufs;
  for (int b = 0; b < streams; ++b) {
    bufs.emplace_back(static_cast<float*>(std::aligned_alloc(64, bytes)), &std::free);
    if (!bufs.back()) return 0.0;
  }
  const std::size_t chunk = n / static_cast<std::size_t>(threads);
  // First touch by the thread that later reads the chunk.
#pragma omp parallel num_threads(threads)
  {
    const std::size_t t = static_cast<std::size_t>(omp_get_thread_num());
    for (auto& b : bufs)
      for (std::size_t i = t * chunk; i < (t + 1) * chunk; ++i) b.get()[i] = 1.0f;
  }
  auto sum = [&](const float* p, std::size_t m) -> float {
#if defined(QKV_BENCH_X86)
    if (avx512) return detail::read_sum_avx512(p, m);
#endif
    (void)avx512;
    return read_sum_generic(p, m);
  };
  const std::size_t tile = streams == 1 ? chunk : kKvTileBytes / sizeof(float);
  auto pass = [&](std::int64_t) -> float {
    const std::size_t t = static_cast<std::size_t>(omp_get_thread_num());
    float acc = 0;
    for (std::size_t i = t * chunk; i < (t + 1) * chunk; i += tile)
      for (auto& b : bufs) acc += sum(b.get() + i, tile);
    return acc;
  };
  const double pass_bytes = static_cast<double>(chunk) * sizeof(float) * threads * streams;
  std::vector<double> rates;
  timed_parallel(threads, 1, pass);  // warm-up (page tables, TLB)
  const auto start = Clock::now();
  do {
    rates.push_back(pass_bytes / timed_parallel(threads, 1, pass) * 1e-9);
  } while (rates.size() < 3 || std::chrono::duration<double>(Clock::now() - start).count() < seconds);
  // Best pass, as STREAM reports it: other processes on the machine only ever slow a pass down.
  return *std::max_element(rates.begin(), rates.end());
}

}  // namespace

double measure_read_bandwidth(int threads, double bytes, double seconds) {
  return measure_streams(threads, bytes, seconds, 1);
}

double measure_kv_read_bandwidth(int threads, double bytes, double seconds) {
  return measure_streams(threads, bytes, seconds, 2);
}

Peaks measure_compute_peaks(int threads, double seconds, bool fma, bool bf16) {
  Peaks p;
  p.threads = threads < 1 ? 1 : threads;
  const auto& cpu = qkv::detail::cpu_features();
  (void)cpu;
#if defined(QKV_BENCH_X86)
  if (cpu.avx512()) {
    p.fma_isa = "avx512";
    if (fma) p.fma_gflops = loop_gflops(p.threads, 32.0 * detail::kChains, seconds, detail::fma_loop_avx512);
    if (cpu.avx512bf16 && bf16)
      p.bf16_gflops = loop_gflops(p.threads, 64.0 * detail::kChains, seconds, detail::bf16_loop_avx512);
    if (cpu.amx && bf16) p.amx_gflops = loop_gflops(p.threads, 4.0 * 16 * 16 * 32 * 2, seconds, detail::amx_loop);
  } else if (cpu.avx2_fma()) {
    p.fma_isa = "avx2";
    if (fma) p.fma_gflops = loop_gflops(p.threads, 16.0 * detail::kChainsAvx2, seconds, detail::fma_loop_avx2);
  }
#endif
  if (p.fma_isa.empty()) {
    p.fma_isa = "scalar";
    if (fma) p.fma_gflops = loop_gflops(p.threads, 16.0, seconds, fma_loop_scalar);
  }
  return p;
}

std::string compute_peak_name(DType dtype) {
  if (dtype != DType::bf16) return "fma_gflops";
  if (qkv::active_isa_string() == "avx512amx") return "amx_gflops";
  return qkv::bf16_dot_used() ? "bf16_gflops" : "fma_gflops";
}

double compute_peak_value(const Peaks& p, const std::string& name) {
  if (name == "amx_gflops") return p.amx_gflops;
  if (name == "bf16_gflops") return p.bf16_gflops;
  return p.fma_gflops;
}

Peaks measure_peaks(int threads, double seconds, double read_mib) {
  Peaks p = measure_compute_peaks(threads, seconds);
  p.read_mib = read_mib;
  p.read_gbps = measure_read_bandwidth(p.threads, p.read_mib * 1048576.0, seconds);
  return p;
}

}  // namespace qkv::bench
