// `qkv bench`: speed of qkv::attention() on the benchmark grid, each shape beside the naive
// unfused baseline (bench/baseline.cpp) run in the same process, and as a fraction of the
// machine's peaks measured at the start of the run. See docs/performance.md.
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "commands.hpp"
#include "io/atomic_file.hpp"
#include "qkv/error.hpp"
#include "qkv/info.hpp"
#include "qkv/version.hpp"
#include "qkv_bench.hpp"

namespace qkv::cli {
namespace {

using bench::BenchShape;
using nlohmann::json;

struct BenchOptions {
  bool quick = false, scaling = false, memory = false, no_baseline = false, reference = false;
  std::string shapes = "all", dtype = "all", causal = "both", json_path, markdown_path, blas_core;
  std::vector<std::int64_t> head_dims, seqlens, decode_seqlens;
  int repeats = 0, threads = 0;
  std::int64_t scaling_seqlen = 4096, memory_seqlen = 32768;
  double budget = 30.0, min_time = -1, adjacent_seconds = 0.1, peak_seconds = 0.25, read_mib = 512;
};

// One measured line of the report.
struct Row {
  std::string kind;  // forward | decode | scaling | memory
  BenchShape shape;
  bool causal = false;
  DType dtype = DType::f32;
  std::string kernel;
  int threads = 1;
  int repeats = 0;
  double seconds = 0, gflops = 0, gbps = 0;
  std::optional<double> baseline_seconds, max_abs_diff, seconds_1thread;
  double peak_fraction = 0;
  std::string peak_name;  // which peak peak_fraction divides by
  double peak_value = 0;  // its value (GFLOP/s or GB/s)
  std::optional<bench::MemoryUse> mem;
  std::optional<double> kv_read_gbps;  // decode: two-stream (K and V) read bandwidth of this size
  // The same peak (peak_name) measured just before and just after this row's timed runs, the
  // higher of the two: the machine's speed in the phase the row ran in.
  std::optional<double> adjacent_peak;

  // The figure the row is judged by: GB/s for decode, GFLOP/s otherwise.
  double rate() const { return kind == "decode" ? gbps : gflops; }
  // rate() / adjacent_peak; nullopt when not measured.
  std::optional<double> adjacent_fraction() const {
    if (!adjacent_peak || *adjacent_peak <= 0) return std::nullopt;
    return rate() / *adjacent_peak;
  }
};

// The machine's peaks, measured once per thread count used.
class PeakTable {
public:
  PeakTable(double seconds, double read_mib) : seconds_(seconds), read_mib_(read_mib) {}
  const bench::Peaks& at(int threads) {
    auto it = peaks_.find(threads);
    if (it == peaks_.end()) it = peaks_.emplace(threads, bench::measure_peaks(threads, seconds_, read_mib_)).first;
    return it->second;
  }
  // Read bandwidth over a buffer of `bytes` (rounded to MiB), measured once per size; kv: the
  // same bytes as two buffers read in alternating tiles (bench::measure_kv_read_bandwidth).
  double read_gbps(int threads, double bytes, bool kv = false) {
    auto& table = kv ? kv_reads_ : reads_;
    const auto key = std::make_pair(threads, whole_mib(bytes));
    auto it = table.find(key);
    if (it == table.end()) {
      const double b = whole_mib_bytes(bytes);
      it = table.emplace(key, kv ? bench::measure_kv_read_bandwidth(threads, b, seconds_)
                                 : bench::measure_read_bandwidth(threads, b, seconds_)).first;
    }
    return it->second;
  }
  // A read figure's buffer size: `bytes` rounded up to whole MiB, in MiB.
  static std::int64_t whole_mib(double bytes) { return static_cast<std::int64_t>(std::ceil(bytes / 1048576.0)); }
  // The same size in bytes: the buffer that is read.
  static double whole_mib_bytes(double bytes) { return double(whole_mib(bytes)) * 1048576.0; }
  const std::map<int, bench::Peaks>& all() const { return peaks_; }
  const std::map<std::pair<int, std::int64_t>, double>& reads() const { return reads_; }
  const std::map<std::pair<int, std::int64_t>, double>& kv_reads() const { return kv_reads_; }

private:
  double seconds_, read_mib_;
  std::map<int, bench::Peaks> peaks_;
  std::map<std::pair<int, std::int64_t>, double> reads_;
  std::map<std::pair<int, std::int64_t>, double> kv_reads_;
};

std::string dtype_short(DType d) { return d == DType::f32 ? "f32" : d == DType::bf16 ? "bf16" : "f16"; }

// Largest |a - b| over two float32 tensors of the same size.
double max_abs_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  const float* x = a.data_as<float>();
  const float* y = b.data_as<float>();
  for (std::int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(double(x[i]) - double(y[i])));
  return m;
}

double physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0 ? double(pages) * double(size) : 0.0;
}

// The float64 reference kernel runs at well under 1 GFLOP/s: when it is what would be timed (no
// fast kernel compiled in or usable) and was not asked for, shapes beyond 2e10 FLOP are skipped
// with a note rather than running for hours.
bool skip_reference(FILE* out, const BenchOptions& o, const BenchShape& s, bool causal, DType dtype, int threads) {
  if (o.reference || bench::forward_flops(s, causal) <= 2e10) return false;
  const bench::Inputs probe = bench::make_inputs({s.B, s.Hq, s.Hkv, 1, 1, s.D}, dtype);
  AttentionParams p;
  p.causal = causal;
  p.num_threads = threads;
  if (bench::dispatched_kernel(probe, p).rfind("reference", 0) != 0) return false;
  std::fprintf(out, "%-8s %s %s %s: skipped, only the float64 reference kernel would run it (%.0f GFLOP)\n", "",
               bench::shape_label(s).c_str(), causal ? "causal" : "not causal",
               std::string(dtype_name(dtype)).c_str(), bench::forward_flops(s, causal) * 1e-9);
  return true;
}

class Runner {
public:
  explicit Runner(const BenchOptions& o) : o_(o), peaks_(o.peak_seconds, o.read_mib) {}

  // The float32 baseline on the same values as every dtype (see make_inputs), timed once per
  // (shape, causal, threads) in this run; nullopt when skipped.
  struct BaselineResult {
    double seconds = 0;
    std::shared_ptr<Tensor> out;
  };
  std::optional<BaselineResult> baseline(const BenchShape& s, bool causal, int threads,
                                         const bench::Inputs& f32) {
    if (o_.no_baseline) return std::nullopt;
    const auto key = std::make_tuple(s.B, s.Hq, s.Hkv, s.Sq, s.Sk, s.D, causal, threads);
    if (auto it = cache_.find(key); it != cache_.end()) return it->second;
    // Scores of one head per thread must fit in half the memory, with room for the rest.
    const double ws = double(threads) * double(s.Sq) * double(s.Sk) * 4.0;
    const double phys = physical_memory_bytes();
    if (phys > 0 && ws > 0.5 * phys) {
      std::fprintf(stderr, "qkv bench: baseline skipped for %s: its %.1f GiB of scores exceed half the memory\n",
                   bench::shape_label(s).c_str(), ws / (1 << 30));
      return std::nullopt;
    }
    bench::NaiveBaseline base(s, threads);
    auto out = std::make_shared<Tensor>(DType::f32, Shape{s.B, s.Hq, s.Sq, s.D});
    const auto t = bench::time_runs([&] { base.run(f32.q, f32.k, f32.v, *out, causal); }, o_.repeats, o_.budget, o_.min_time);
    BaselineResult r{bench::median(t), out};
    cache_.emplace(key, r);
    return r;
  }

  // Times qkv on `dtype` inputs (f32_inputs itself when dtype is float32) and, if with_baseline,
  // the baseline on f32_inputs.
  Row measure(const std::string& kind, const BenchShape& s, bool causal, DType dtype, int threads,
              const bench::Inputs* f32_inputs, bool with_baseline = true, bool with_adjacent = true) {
    Row r;
    r.kind = kind;
    r.shape = s;
    r.causal = causal;
    r.dtype = dtype;
    r.threads = threads;
    const bench::Inputs owned = dtype == DType::f32 && f32_inputs ? bench::Inputs{} : bench::make_inputs(s, dtype);
    const bench::Inputs& in = dtype == DType::f32 && f32_inputs ? *f32_inputs : owned;
    AttentionParams p;
    p.causal = causal;
    p.num_threads = threads;
    if (o_.reference) p.kernel = KernelKind::reference;
    r.kernel = bench::dispatched_kernel(in, p);
    // The peak the row is judged against (compute, or for decode the read bandwidth of a buffer of
    // its K+V size, whole MiB as in PeakTable::read_gbps), measured again by the same
    // microbenchmark right before and right after the timed runs.
    const bool bf16_peak = dtype == DType::bf16 && peaks_.at(threads).bf16_gflops > 0;
    const auto adjacent = [&] {
      if (kind == "decode")
        return bench::measure_read_bandwidth(threads, PeakTable::whole_mib_bytes(bench::kv_bytes(s, dtype)),
                                             o_.adjacent_seconds);
      const bench::Peaks c = bench::measure_compute_peaks(threads, o_.adjacent_seconds, !bf16_peak, bf16_peak);
      return bf16_peak ? c.bf16_gflops : c.fma_gflops;
    };
    const bool adj = with_adjacent && o_.adjacent_seconds > 0;
    const double before = adj ? adjacent() : 0.0;
    const auto t = bench::time_runs([&] { attention(in.q, in.k, in.v, in.out, p); }, o_.repeats, o_.budget, o_.min_time);
    if (adj) r.adjacent_peak = std::max(before, adjacent());
    r.repeats = static_cast<int>(t.size());
    r.seconds = bench::median(t);
    r.gflops = bench::forward_flops(s, causal) / r.seconds * 1e-9;
    r.gbps = bench::kv_bytes(s, dtype) / r.seconds * 1e-9;
    const bench::Peaks& pk = peaks_.at(threads);
    if (kind == "decode") {
      r.peak_name = "read_gbps";
      r.peak_value = peaks_.read_gbps(threads, bench::kv_bytes(s, dtype));
      r.kv_read_gbps = peaks_.read_gbps(threads, bench::kv_bytes(s, dtype), true);
    } else if (dtype == DType::bf16 && pk.bf16_gflops > 0) {
      r.peak_name = "bf16_gflops";
      r.peak_value = pk.bf16_gflops;
    } else {
      r.peak_name = "fma_gflops";
      r.peak_value = pk.fma_gflops;
    }
    r.peak_fraction = r.peak_value > 0 ? r.rate() / r.peak_value : 0;
    if (f32_inputs && with_baseline) {
      if (auto b = baseline(s, causal, threads, *f32_inputs)) {
        r.baseline_seconds = b->seconds;
        r.max_abs_diff = max_abs_diff(in.out, *b->out);
      }
    }
    return r;
  }

  PeakTable& peaks() { return peaks_; }
  // Drops the cached baseline outputs (call when moving to the next shape).
  void clear_baselines() { cache_.clear(); }

private:
  const BenchOptions& o_;
  PeakTable peaks_;
  std::map<std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, bool, int>,
           BaselineResult>
      cache_;
};

json shape_json(const BenchShape& s) {
  return {{"B", s.B}, {"Hq", s.Hq}, {"Hkv", s.Hkv}, {"Sq", s.Sq}, {"Sk", s.Sk}, {"D", s.D}};
}

template <class T>
json opt(const std::optional<T>& v) {
  return v ? json(*v) : json(nullptr);
}

json row_json(const Row& r) {
  json j = {{"kind", r.kind},
            {"shape", shape_json(r.shape)},
            {"causal", r.causal},
            {"dtype", std::string(dtype_name(r.dtype))},
            {"kernel", r.kernel},
            {"threads", r.threads},
            {"repeats", r.repeats},
            {"seconds", r.seconds},
            {"gflops", r.gflops},
            {"gbps", r.gbps},
            {"baseline_seconds", opt(r.baseline_seconds)},
            {"speedup_vs_baseline", r.baseline_seconds ? json(*r.baseline_seconds / r.seconds) : json(nullptr)},
            {"max_abs_diff_vs_baseline", opt(r.max_abs_diff)},
            {"peak_fraction", r.peak_fraction},
            {"peak", r.peak_name},
            {"peak_value", r.peak_value}};
  if (r.seconds_1thread) {
    j["seconds_1thread"] = *r.seconds_1thread;
    j["speedup_vs_1thread"] = *r.seconds_1thread / r.seconds;
  }
  if (r.adjacent_peak) {
    j["adjacent_peak_value"] = *r.adjacent_peak;
    j["adjacent_peak_fraction"] = r.adjacent_fraction().value_or(0.0);
  }
  if (r.kv_read_gbps) {
    j["kv_read_gbps"] = *r.kv_read_gbps;
    j["kv_read_fraction"] = *r.kv_read_gbps > 0 ? r.gbps / *r.kv_read_gbps : 0.0;
  }
  if (r.mem) {
    j["rss_inputs_mib"] = r.mem->rss_inputs_mib;
    j["peak_rss_mib"] = r.mem->hwm_mib;
    j["extra_rss_mib"] = r.mem->extra_mib;
  }
  return j;
}

json peaks_json(const bench::Peaks& p) {
  return {{"threads", p.threads}, {"fma_isa", p.fma_isa}, {"fma_gflops", p.fma_gflops},
          {"bf16_gflops", p.bf16_gflops}, {"read_gbps", p.read_gbps}, {"read_mib", p.read_mib}};
}


void print_header(FILE* out) {
  std::fprintf(out, "%-8s %-34s %-6s %-5s %-22s %3s %11s %14s %11s %8s %6s %-10s %9s\n", "kind", "shape",
               "causal", "dtype", "kernel", "thr", "seconds", "rate", "base_s", "x_base", "peak%", "(of)", "maxdiff");
}

void print_row(FILE* out, const Row& r) {
  char rate[32], base[32] = "-", ratio[32] = "-", diff[32] = "-";
  if (r.kind == "decode")
    std::snprintf(rate, sizeof rate, "%.2f GB/s", r.gbps);
  else
    std::snprintf(rate, sizeof rate, "%.2f GFLOP/s", r.gflops);
  if (r.baseline_seconds) {
    std::snprintf(base, sizeof base, "%.4g", *r.baseline_seconds);
    std::snprintf(ratio, sizeof ratio, "%.2f", *r.baseline_seconds / r.seconds);
  }
  if (r.max_abs_diff) std::snprintf(diff, sizeof diff, "%.1e", *r.max_abs_diff);
  char of[32];
  std::snprintf(of, sizeof of, "(%.0f)", r.peak_value);
  std::fprintf(out, "%-8s %-34s %-6s %-5s %-22s %3d %11.4g %14s %11s %8s %6.1f %-10s %9s\n", r.kind.c_str(),
               bench::shape_label(r.shape).c_str(), r.causal ? "yes" : "no", dtype_short(r.dtype).c_str(),
               r.kernel.c_str(), r.threads, r.seconds, rate, base, ratio, 100.0 * r.peak_fraction, of, diff);
  if (r.seconds_1thread)
    std::fprintf(out, "%-8s   1 thread %.4g s, %d threads %.4g s: speedup %.2fx\n", "", *r.seconds_1thread,
                 r.threads, r.seconds, *r.seconds_1thread / r.seconds);
  if (r.mem)
    std::fprintf(out, "%-8s   resident after inputs %.1f MiB, peak %.1f MiB, added by the call %.1f MiB\n", "",
                 r.mem->rss_inputs_mib, r.mem->hwm_mib, r.mem->extra_mib);
  if (const auto f = r.adjacent_fraction())
    std::fprintf(out, "%-8s   peak measured next to this row: %.1f; this row %.1f%% of it\n", "", *r.adjacent_peak,
                 100.0 * *f);
  if (r.kv_read_gbps && *r.kv_read_gbps > 0)
    std::fprintf(out, "%-8s   K and V read as two streams of this size: %.1f GB/s; this row %.1f%% of it\n", "",
                 *r.kv_read_gbps, 100.0 * r.gbps / *r.kv_read_gbps);
  std::fflush(out);
}

// The results as a Markdown table (docs/performance.md), with the run's machine figures above it.
std::string markdown(const std::vector<Row>& rows, const std::map<int, bench::Peaks>& peaks, int threads,
                     double load_start, double load_end) {
  std::string md;
  char buf[512];
  std::snprintf(buf, sizeof buf, "qkv %s, %d threads, %s; load average %.1f at the start, %.1f at the end.\n\n",
                qkv::version(), threads, bench::blas_env_note().c_str(), load_start, load_end);
  md += buf;
  md += "| threads | fp32 FMA GFLOP/s | bf16 dot GFLOP/s | read GB/s (buffer) |\n|---:|---:|---:|---:|\n";
  for (const auto& [t, p] : peaks) {
    std::snprintf(buf, sizeof buf, "| %d | %.0f (%s) | %.0f | %.1f (%.0f MiB) |\n", t, p.fma_gflops, p.fma_isa.c_str(),
                  p.bf16_gflops, p.read_gbps, p.read_mib);
    md += buf;
  }
  md += "\n| kind | B,Hq,Hkv,Sq,Sk,D | causal | dtype | kernel | thr | seconds | rate | baseline s | x baseline | % of peak "
        "| % of adjacent peak |\n";
  md += "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const Row& r : rows) {
    const BenchShape& s = r.shape;
    char shape[96], rate[48], base[32] = "-", ratio[32] = "-";
    std::snprintf(shape, sizeof shape, "%lld,%lld,%lld,%lld,%lld,%lld", (long long)s.B, (long long)s.Hq,
                  (long long)s.Hkv, (long long)s.Sq, (long long)s.Sk, (long long)s.D);
    if (r.kind == "decode")
      std::snprintf(rate, sizeof rate, "%.2f GB/s", r.gbps);
    else
      std::snprintf(rate, sizeof rate, "%.2f GFLOP/s", r.gflops);
    if (r.baseline_seconds) {
      std::snprintf(base, sizeof base, "%.4g", *r.baseline_seconds);
      std::snprintf(ratio, sizeof ratio, "%.2f", *r.baseline_seconds / r.seconds);
    }
    std::string kind = r.kind;
    if (r.seconds_1thread) {
      std::snprintf(buf, sizeof buf, " (1 thread %.4g s: %.2fx)", *r.seconds_1thread, *r.seconds_1thread / r.seconds);
      kind += buf;
    }
    if (r.mem) {
      std::snprintf(buf, sizeof buf, " (peak RSS %.1f MiB, %.1f MiB above inputs+output)", r.mem->hwm_mib,
                    r.mem->extra_mib);
      kind += buf;
    }
    if (r.kv_read_gbps && *r.kv_read_gbps > 0) {
      std::snprintf(buf, sizeof buf, " (two-stream K/V read %.1f GB/s: %.0f%%)", *r.kv_read_gbps,
                    100.0 * r.gbps / *r.kv_read_gbps);
      kind += buf;
    }
    char adj[48] = "-";
    if (const auto f = r.adjacent_fraction()) std::snprintf(adj, sizeof adj, "%.1f%% of %.0f", 100.0 * *f, *r.adjacent_peak);
    std::snprintf(buf, sizeof buf, "| %s | %s | %s | %s | %s | %d | %.4g | %s | %s | %s | %.1f%% of %.0f | %s |\n",
                  kind.c_str(), shape, r.causal ? "yes" : "no", dtype_short(r.dtype).c_str(), r.kernel.c_str(),
                  r.threads, r.seconds, rate, base, ratio, 100.0 * r.peak_fraction, r.peak_value, adj);
    md += buf;
  }
  return md;
}

double load_average() {
  double l = 0;
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &l) != 1) l = 0;
    std::fclose(f);
  }
  return l;
}

std::vector<DType> selected_dtypes(const std::string& d) {
  if (d == "all") return {DType::f32, DType::bf16};
  if (d == "f32" || d == "float32") return {DType::f32};
  if (d == "bf16" || d == "bfloat16") return {DType::bf16};
  return {DType::f16};
}

void run_bench(BenchOptions o) {
  bench::reexec_with_clean_blas_env(bench::self_cmdline(), o.blas_core);
  const bool to_stdout = o.json_path == "-";
  // Fail before minutes of measuring, not after.
  for (const auto& [flag, path] : {std::pair{"--json", o.json_path}, std::pair{"--markdown", o.markdown_path}}) {
    if (path.empty() || path == "-") continue;
    const std::filesystem::path dir = std::filesystem::absolute(path).parent_path();
    if (!std::filesystem::is_directory(dir))
      throw Error(std::string(flag) + ": directory '" + dir.string() + "' does not exist");
    if (std::filesystem::is_directory(path)) throw Error(std::string(flag) + ": '" + path + "' is a directory");
  }
  const double load_start = load_average();
  FILE* const out = to_stdout ? stderr : stdout;  // the table; stdout carries the JSON when asked

  if (o.quick) {
    if (o.head_dims.empty()) o.head_dims = {64};
    if (o.seqlens.empty()) o.seqlens = {256};
    if (o.decode_seqlens.empty()) o.decode_seqlens = {4096};
    if (o.repeats == 0) o.repeats = 3;
    if (o.min_time < 0) o.min_time = 0;
  }
  if (o.min_time < 0) o.min_time = 0.5;
  if (o.head_dims.empty()) o.head_dims = {64, 128};
  if (o.seqlens.empty()) o.seqlens = {256, 1024, 4096, 16384};
  if (o.decode_seqlens.empty()) o.decode_seqlens = {4096, 32768};
  if (o.repeats == 0) o.repeats = 5;
  const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
  const auto dtypes = selected_dtypes(o.dtype);
  std::vector<bool> causals;
  if (o.causal != "on") causals.push_back(false);
  if (o.causal != "off") causals.push_back(true);
  const bool forward = o.shapes != "decode", decode = o.shapes != "forward";

  // The memory row runs in a forked child, before this process starts any OpenMP thread: a
  // child forked from a process with a thread pool cannot use OpenMP safely.
  std::optional<bench::MemoryUse> memory_use;
  const BenchShape memory_shape{1, 8, 8, o.memory_seqlen, o.memory_seqlen, 128};
  if (o.memory && !skip_reference(out, o, memory_shape, false, DType::f32, threads))
    memory_use = bench::measure_memory(memory_shape, DType::f32, false, threads);

  std::fprintf(out, "qkv %s bench: %d threads, medians of %d runs or of as many as fill %.2g s, at most %.3g s per shape\n",
               qkv::version(), threads, o.repeats, o.min_time, o.budget);
  std::fprintf(out, "cpu features: %s\n", qkv::cpu_features_string().c_str());
  std::fprintf(out, "%s\n", bench::blas_env_note().c_str());
  Runner run(o);
  std::vector<int> peak_threads{1};
  if (threads != 1) peak_threads.push_back(threads);
  for (int t : peak_threads) {
    const bench::Peaks& p = run.peaks().at(t);
    std::fprintf(out,
                 "peak, %d thread%s: fp32 FMA (%s) %.1f GFLOP/s, bf16 dot %.1f GFLOP/s, read %.1f GB/s (%.0f MiB buffer)\n",
                 t, t == 1 ? "" : "s", p.fma_isa.c_str(), p.fma_gflops, p.bf16_gflops, p.read_gbps, p.read_mib);
  }
  print_header(out);

  std::vector<Row> rows;
  auto emit = [&](Row r) {
    print_row(out, r);
    rows.push_back(std::move(r));
  };
  if (forward) {
    for (std::int64_t D : o.head_dims)
      for (std::int64_t S : o.seqlens) {
        const BenchShape s{1, 8, 8, S, S, D};
        run.clear_baselines();
        const bench::Inputs f32 = bench::make_inputs(s, DType::f32);
        for (bool c : causals)
          for (DType d : dtypes)
            if (!skip_reference(out, o, s, c, d, threads)) emit(run.measure("forward", s, c, d, threads, &f32));
      }
  }
  if (decode) {
    for (std::int64_t Sk : o.decode_seqlens)
      for (std::int64_t Hkv : {8, 2}) {
        const BenchShape s{1, 8, Hkv, 1, Sk, 128};
        run.clear_baselines();
        const bench::Inputs f32 = bench::make_inputs(s, DType::f32);
        for (DType d : dtypes)
          if (!skip_reference(out, o, s, false, d, threads)) emit(run.measure("decode", s, false, d, threads, &f32));
      }
  }
  if (o.scaling) {
    // The same shape on 1 thread and on all threads, both without the baseline.
    for (std::int64_t D : o.head_dims)
      for (bool c : causals)
        for (DType d : dtypes) {
          const BenchShape s{1, 8, 8, o.scaling_seqlen, o.scaling_seqlen, D};
          if (skip_reference(out, o, s, c, d, threads)) continue;
          const bench::Inputs in = bench::make_inputs(s, d);
          const bench::Inputs* f32 = d == DType::f32 ? &in : nullptr;
          const Row one = run.measure("scaling", s, c, d, 1, f32, false, false);
          Row all = run.measure("scaling", s, c, d, threads, f32, false);
          all.seconds_1thread = one.seconds;
          emit(std::move(all));
        }
  }
  if (memory_use) {
    const BenchShape s{1, 8, 8, o.memory_seqlen, o.memory_seqlen, 128};
    const bench::MemoryUse& m = *memory_use;
    Row r;
    r.kind = "memory";
    r.shape = s;
    r.kernel = m.kernel;
    r.threads = threads;
    r.repeats = 1;
    r.seconds = m.seconds;
    r.gflops = bench::forward_flops(s, false) / m.seconds * 1e-9;
    r.gbps = bench::kv_bytes(s, DType::f32) / m.seconds * 1e-9;
    r.peak_name = "fma_gflops";
    r.peak_value = run.peaks().at(threads).fma_gflops;
    r.peak_fraction = r.peak_value > 0 ? r.gflops / r.peak_value : 0;
    r.mem = m;
    emit(std::move(r));
  }
  std::fprintf(out, "peak resident memory of this process: %.1f MiB\n", bench::peak_rss_mib());

  if (!o.markdown_path.empty())
    qkv::detail::write_file_atomically(o.markdown_path, markdown(rows, run.peaks().all(), threads, load_start, load_average()));
  if (!o.json_path.empty()) {
    json peaks = json::object();
    for (const auto& [t, p] : run.peaks().all()) peaks[std::to_string(t)] = peaks_json(p);
    json reads = json::array(), kv_reads = json::array();
    for (const auto& [key, gbps] : run.peaks().reads())
      reads.push_back({{"threads", key.first}, {"mib", key.second}, {"read_gbps", gbps}});
    for (const auto& [key, gbps] : run.peaks().kv_reads())
      kv_reads.push_back({{"threads", key.first}, {"mib", key.second}, {"kv_read_gbps", gbps}});
    json doc = {{"qkv_version", qkv::version()},
                {"cpu_features", qkv::cpu_features_string()},
                {"openblas_core", bench::blas_core_name()},
                {"openblas_note", bench::blas_env_note()},
                {"threads", threads},
                {"load_average_start", load_start},
                {"load_average_end", load_average()},
                {"peaks", peaks},
                {"read_bandwidth_by_size", reads},
                {"kv_read_bandwidth_by_size", kv_reads},
                {"rows", json::array()}};
    for (const Row& r : rows) doc["rows"].push_back(row_json(r));
    const std::string text = doc.dump(2) + "\n";
    if (to_stdout) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
    } else {
      qkv::detail::write_file_atomically(o.json_path, text);
    }
  }
}

}  // namespace

void add_bench(CLI::App& app) {
  auto o = std::make_shared<BenchOptions>();
  auto* cmd = app.add_subcommand(
      "bench", "Measure qkv::attention() against a naive BLAS baseline and the machine's peaks");
  cmd->add_flag("--quick", o->quick,
                "small grid (D=64, S=256, decode Sk=4096, 3 repeats, --min-time 0) unless overridden");
  cmd->add_option("--shapes", o->shapes, "which shapes")->check(CLI::IsMember({"all", "forward", "decode"}));
  cmd->add_option("--dtype", o->dtype, "storage dtype of q, k, v")
      ->check(CLI::IsMember({"all", "f32", "float32", "bf16", "bfloat16", "f16", "float16"}));
  cmd->add_option("--causal", o->causal, "forward rows: causal, not causal, or both")
      ->check(CLI::IsMember({"both", "on", "off"}));
  cmd->add_option("--head-dims", o->head_dims, "forward head dims D (default 64,128)")
      ->delimiter(',')->check(CLI::PositiveNumber);
  cmd->add_option("--seqlens", o->seqlens, "forward Sq = Sk (default 256,1024,4096,16384)")
      ->delimiter(',')->check(CLI::PositiveNumber);
  cmd->add_option("--decode-seqlens", o->decode_seqlens, "decode Sk (default 4096,32768)")
      ->delimiter(',')->check(CLI::PositiveNumber);
  // Seconds: finite (NaN and inf pass CLI11's number checks), and >= 0 or > 0.
  const auto seconds = [](bool zero_ok) {
    return CLI::Validator(
        [zero_ok](std::string& s) -> std::string {
          double v = 0;
          try { v = std::stod(s); } catch (...) { return "not a number: " + s; }
          if (!std::isfinite(v) || v < 0 || (!zero_ok && v == 0))
            return std::string("expected a finite number of seconds ") + (zero_ok ? ">= 0" : "> 0") + ", got " + s;
          return "";
        },
        zero_ok ? "SECONDS>=0" : "SECONDS>0");
  };
  cmd->add_option("--repeats", o->repeats,
                  "timed runs per shape after one warm-up, at least (more to fill --min-time); the median is shown "
                  "(default 5)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--min-time", o->min_time,
                  "seconds of timed runs per shape at least: short calls run more than --repeats times (default 0.5)")
      ->check(seconds(true));
  cmd->add_option("--adjacent-seconds", o->adjacent_seconds,
                  "seconds of each peak measurement just before and after a row's timed runs (default 0.1; 0: none)")
      ->check(seconds(true));
  cmd->add_option("--budget", o->budget, "seconds of timed runs per shape at most (default 30; at least one run)")
      ->check(seconds(false));
  cmd->add_option("--threads", o->threads, "threads for qkv and the baseline (0 = OpenMP default)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--scaling", o->scaling, "also time the Sq=Sk=--scaling-seqlen shapes on 1 thread vs all threads");
  cmd->add_option("--scaling-seqlen", o->scaling_seqlen, "sequence length of the scaling rows (default 4096)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--memory", o->memory,
                "also measure peak resident memory of one fp32 call at Sq=Sk=--memory-seqlen, Hq=8, D=128");
  cmd->add_option("--memory-seqlen", o->memory_seqlen, "sequence length of the memory row (default 32768)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--no-baseline", o->no_baseline, "skip the naive baseline");
  cmd->add_flag("--reference", o->reference, "benchmark the float64 reference kernel instead of the dispatched one");
  cmd->add_option("--peak-seconds", o->peak_seconds, "seconds per peak microbenchmark (default 0.25)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--read-mib", o->read_mib, "buffer of the headline read-bandwidth figure, MiB (default 512)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--blas-core", o->blas_core,
                  "run the baseline with OPENBLAS_CORETYPE=NAME (default: unset, OpenBLAS detects the CPU)");
  cmd->add_option("--json", o->json_path, "also write the rows as JSON to FILE ('-' = stdout; the table then goes to stderr)");
  cmd->add_option("--markdown", o->markdown_path, "also write the results as a Markdown table to FILE");
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace qkv::cli
