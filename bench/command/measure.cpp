// `qkv bench`: measuring one row. qkv and the naive baselines (bench/support/baseline.cpp,
// bench/support/baseline_backward.cpp) on the same values in the same run, timed as the options say, and
// judged against the machine's peaks (measured once per thread count, and again next to each row).
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "rows.hpp"
#include "qkv/error.hpp"
#include "qkv/info.hpp"

namespace qkv::cli::benchcmd {
namespace {

// Largest |a - b| over two tensors of the same size, float32, bfloat16 or float16.
double max_abs_diff(const Tensor& a, const Tensor& b) {
  const auto at = [](const Tensor& t, std::int64_t i) {
    if (t.dtype() == DType::bf16) return double(bf16_to_float(t.data_as<std::uint16_t>()[i]));
    if (t.dtype() == DType::f16) return double(half_to_float(t.data_as<std::uint16_t>()[i]));
    return double(t.data_as<float>()[i]);
  };
  double m = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(at(a, i) - at(b, i)));
  return m;
}

double physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), size = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && size > 0 ? double(pages) * double(size) : 0.0;
}

// Whether `buffers` score matrices per thread fit in half the memory, with room for the rest;
// a note on stderr when they do not.
bool baseline_fits(const BenchShape& s, int threads, int buffers, const char* which) {
  const double ws = double(threads) * double(buffers) * double(s.Sq) * double(s.Sk) * 4.0;
  const double phys = physical_memory_bytes();
  if (phys > 0 && ws > 0.5 * phys) {
    std::fprintf(stderr, "qkv bench: %s skipped for %s: its %.1f GiB of scores exceed half the memory\n", which,
                 bench::shape_label(s).c_str(), ws / (1 << 30));
    return false;
  }
  return true;
}

void print_skip(FILE* out, const BenchShape& s, bool causal, DType dtype, const char* what, double flops) {
  std::fprintf(out, "%-8s %s %s %s%s: skipped, only the float64 reference kernel would run it (%.0f GFLOP)\n", "",
               bench::shape_label(s).c_str(), causal ? "causal" : "not causal",
               std::string(dtype_name(dtype)).c_str(), what, flops * 1e-9);
}

}  // namespace

const bench::Peaks& PeakTable::at(int threads) {
  auto it = peaks_.find(threads);
  if (it == peaks_.end()) it = peaks_.emplace(threads, bench::measure_peaks(threads, seconds_, read_mib_)).first;
  return it->second;
}

double PeakTable::read_gbps(int threads, double bytes, bool kv) {
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

std::int64_t PeakTable::whole_mib(double bytes) { return static_cast<std::int64_t>(std::ceil(bytes / 1048576.0)); }

bool skip_reference(FILE* out, const BenchOptions& o, const BenchShape& s, bool causal, DType dtype, int threads) {
  if (o.reference || bench::forward_flops(s, causal) <= 2e10) return false;
  const bench::Inputs probe = bench::make_inputs({s.B, s.Hq, s.Hkv, 1, 1, s.D}, dtype);
  AttentionParams p;
  p.causal = causal;
  p.num_threads = threads;
  if (bench::dispatched_kernel(probe, p).rfind("reference", 0) != 0) return false;
  print_skip(out, s, causal, dtype, "", bench::forward_flops(s, causal));
  return true;
}

bool skip_reference_backward(FILE* out, const BenchOptions& o, const BenchShape& s, bool causal, DType dtype) {
  if (o.reference || bench::backward_flops(s, causal) <= 2e10) return false;
  AttentionParams p;
  p.causal = causal;
  p.num_threads = 1;
  const BenchShape small{1, s.Hq, s.Hkv, std::min<std::int64_t>(s.Sq, 64), std::min<std::int64_t>(s.Sk, 64), s.D};
  const bench::BackwardInputs probe = bench::make_backward_inputs(small, dtype, dtype, p);
  if (bench::dispatched_backward_kernel(probe, p).rfind("reference", 0) != 0) return false;
  print_skip(out, s, causal, dtype, " backward", bench::backward_flops(s, causal));
  return true;
}

AttentionParams Runner::params(bool causal, int threads) const {
  AttentionParams p;
  p.causal = causal;
  p.num_threads = threads;
  p.window_left = o_.window;
  if (o_.reference) p.kernel = KernelKind::reference;
  return p;
}

std::vector<std::string> BenchOptions::row_options() const {
  std::vector<std::string> r;
  if (sinks) r.push_back("sinks");
  if (alibi) r.push_back("alibi");
  if (keep_first > 0) r.push_back("keep-first");
  return r;
}

AttentionParams Runner::params(bool causal, int threads, const std::string& option, std::int64_t Hq) {
  AttentionParams p = params(causal, threads);
  if (option == "sinks") {
    sinks_.assign(static_cast<std::size_t>(Hq), 1.0f);  // e^1 of weight in every denominator
    p.sinks = TensorView(sinks_.data(), DType::f32, {Hq});
  } else if (option == "alibi") {
    slopes_ = alibi_slopes(Hq);
    p.alibi_slopes = TensorView(slopes_.data(), DType::f32, {Hq});
  } else if (option == "keep-first") {
    p.window_keep_first = o_.keep_first;
  }
  return p;
}

Row Runner::measure_option(const Row& plain, const std::string& option) {
  Row r = plain;
  r.option = option;
  r.plain_seconds = plain.seconds;
  r.baseline_seconds.reset();
  r.max_abs_diff.reset();
  r.adjacent_peak.reset();
  const BenchShape& s = r.shape;
  const AttentionParams p = params(r.causal, r.threads, option, s.Hq);
  if (r.backward()) {
    const bench::BackwardInputs in = bench::make_backward_inputs(s, r.dtype, r.dtype, p);  // out, lse with the option
    r.kernel = bench::dispatched_backward_kernel(in, p);
    time_row(r, [&] { bench::run_backward(in, p); }, bench::backward_flops(s, r.causal), true);
  } else {
    const bench::Inputs in = bench::make_inputs(s, r.dtype);
    r.kernel = bench::dispatched_kernel(in, p);
    time_row(r, [&] { attention(in.q, in.k, in.v, in.out, p); }, bench::forward_flops(s, r.causal), true);
  }
  return r;
}

std::optional<Runner::BaselineResult> Runner::baseline(const BenchShape& s, bool causal, int threads,
                                                       const bench::Inputs& f32) {
  if (o_.no_baseline || o_.window >= 0) return std::nullopt;  // the baselines have no window
  const Key key{s.B, s.Hq, s.Hkv, s.Sq, s.Sk, s.D, causal, threads};
  if (auto it = cache_.find(key); it != cache_.end()) return it->second;
  if (!baseline_fits(s, threads, 1, "baseline")) return std::nullopt;
  bench::NaiveBaseline base(s, threads);
  auto out = std::make_shared<Tensor>(DType::f32, Shape{s.B, s.Hq, s.Sq, s.D});
  const auto t = bench::time_runs([&] { base.run(f32.q, f32.k, f32.v, *out, causal); }, o_.repeats, o_.budget, o_.min_time);
  BaselineResult r{bench::median(t), out};
  cache_.emplace(key, r);
  return r;
}

std::optional<Runner::BaselineResult> Runner::backward_baseline(const BenchShape& s, bool causal, int threads,
                                                                const bench::BackwardInputs& f32) {
  if (o_.no_baseline || o_.window >= 0) return std::nullopt;  // the baselines have no window
  const Key key{s.B, s.Hq, s.Hkv, s.Sq, s.Sk, s.D, causal, threads};
  if (auto it = backward_cache_.find(key); it != backward_cache_.end()) return it->second;
  if (!baseline_fits(s, threads, 2, "backward baseline")) return std::nullopt;
  bench::NaiveBackwardBaseline base(s, threads);
  auto dq = std::make_shared<Tensor>(DType::f32, Shape{s.B, s.Hq, s.Sq, s.D});
  const Tensor dk(DType::f32, {s.B, s.Hkv, s.Sk, s.D}), dv(DType::f32, {s.B, s.Hkv, s.Sk, s.D});
  const auto t = bench::time_runs(
      [&] { base.run(f32.in.q, f32.in.k, f32.in.v, f32.in.out, f32.grad_out, *dq, dk, dv, causal); }, o_.repeats,
      o_.budget, o_.min_time);
  BaselineResult r{bench::median(t), dq};
  backward_cache_.emplace(key, r);
  return r;
}

void Runner::time_row(Row& r, const std::function<void()>& call, double flops, bool with_adjacent) {
  const BenchShape& s = r.shape;
  const int threads = r.threads;
  // The peak the row is judged against (compute, or for decode the read bandwidth of a buffer of
  // its K+V size, whole MiB as in PeakTable::read_gbps), measured again by the same
  // microbenchmark right before and right after the timed runs.
  const std::string peak_name = bench::compute_peak_name(r.dtype);
  const bool fma_peak = peak_name == "fma_gflops";
  const auto adjacent = [&] {
    if (r.kind == "decode")
      return bench::measure_read_bandwidth(threads, PeakTable::whole_mib_bytes(bench::kv_bytes(s, r.dtype)),
                                           o_.adjacent_seconds);
    const bench::Peaks c = bench::measure_compute_peaks(threads, o_.adjacent_seconds, fma_peak, !fma_peak);
    return bench::compute_peak_value(c, peak_name);
  };
  const bool adj = with_adjacent && o_.adjacent_seconds > 0;
  const double before = adj ? adjacent() : 0.0;
  const auto t = bench::time_runs(call, o_.repeats, o_.budget, o_.min_time);
  if (adj) r.adjacent_peak = std::max(before, adjacent());
  r.repeats = static_cast<int>(t.size());
  r.seconds = bench::median(t);
  r.gflops = flops / r.seconds * 1e-9;
  r.gbps = bench::kv_bytes(s, r.dtype) / r.seconds * 1e-9;
  const bench::Peaks& pk = peaks_.at(threads);
  if (r.kind == "decode") {
    r.peak_name = "read_gbps";
    r.peak_value = peaks_.read_gbps(threads, bench::kv_bytes(s, r.dtype));
    r.kv_read_gbps = peaks_.read_gbps(threads, bench::kv_bytes(s, r.dtype), true);
  } else {
    r.peak_name = peak_name;
    r.peak_value = bench::compute_peak_value(pk, peak_name);
  }
  r.peak_fraction = r.peak_value > 0 ? r.rate() / r.peak_value : 0;
}

Row Runner::measure(const std::string& kind, const BenchShape& s, bool causal, DType dtype, int threads,
                    const bench::Inputs* f32_inputs, bool with_baseline, bool with_adjacent) {
  Row r;
  r.kind = kind;
  r.shape = s;
  r.causal = causal;
  r.dtype = dtype;
  r.threads = threads;
  const bench::Inputs owned = dtype == DType::f32 && f32_inputs ? bench::Inputs{} : bench::make_inputs(s, dtype);
  const bench::Inputs& in = dtype == DType::f32 && f32_inputs ? *f32_inputs : owned;
  const AttentionParams p = params(causal, threads);
  r.kernel = bench::dispatched_kernel(in, p);
  time_row(r, [&] { attention(in.q, in.k, in.v, in.out, p); }, bench::forward_flops(s, causal), with_adjacent);
  if (f32_inputs && with_baseline) {
    if (auto b = baseline(s, causal, threads, *f32_inputs)) {
      r.baseline_seconds = b->seconds;
      r.max_abs_diff = max_abs_diff(in.out, *b->out);
    }
  }
  return r;
}

Row Runner::measure_backward(const std::string& kind, const BenchShape& s, bool causal, DType dtype, int threads,
                             const bench::BackwardInputs* f32_inputs, bool with_baseline, bool with_adjacent) {
  Row r;
  r.kind = kind;
  r.shape = s;
  r.causal = causal;
  r.dtype = dtype;
  r.threads = threads;
  const AttentionParams p = params(causal, threads);
  const bool own = !(dtype == DType::f32 && f32_inputs);
  // out and softmax_lse come from one forward call of this run, made beforehand (not timed).
  const std::optional<bench::BackwardInputs> owned =
      own ? std::optional(bench::make_backward_inputs(s, dtype, dtype, p)) : std::nullopt;
  const bench::BackwardInputs& in = own ? *owned : *f32_inputs;
  r.kernel = bench::dispatched_backward_kernel(in, p);
  time_row(r, [&] { bench::run_backward(in, p); }, bench::backward_flops(s, causal), with_adjacent);
  if (f32_inputs && with_baseline) {
    if (auto b = backward_baseline(s, causal, threads, *f32_inputs)) {
      r.baseline_seconds = b->seconds;
      r.max_abs_diff = max_abs_diff(in.grad_q, *b->out);
    }
  }
  return r;
}

Row Runner::memory_row(const std::string& kind, const BenchShape& s, DType dtype, int threads,
                       const bench::MemoryUse& m) {
  Row r;
  r.kind = kind;
  r.shape = s;
  r.dtype = dtype;
  r.kernel = m.kernel;
  r.threads = threads;
  r.repeats = 1;
  r.seconds = m.seconds;
  const double flops = r.backward() ? bench::backward_flops(s, false) : bench::forward_flops(s, false);
  r.gflops = flops / m.seconds * 1e-9;
  r.gbps = bench::kv_bytes(s, dtype) / m.seconds * 1e-9;
  r.peak_name = "fma_gflops";
  r.peak_value = peaks_.at(threads).fma_gflops;
  r.peak_fraction = r.peak_value > 0 ? r.gflops / r.peak_value : 0;
  r.mem = m;
  return r;
}

BenchOptions with_defaults(BenchOptions o, int repeats, double min_time) {
  if (o.repeats == 0) o.repeats = repeats;
  if (o.min_time < 0) o.min_time = min_time;
  return o;
}

int run_threads(const BenchOptions& o) { return o.threads > 0 ? o.threads : omp_get_max_threads(); }

double load_average() {
  double l = 0;
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &l) != 1) l = 0;
    std::fclose(f);
  }
  return l;
}

Timing time_median(const std::function<void()>& fn, const BenchOptions& o) {
  const std::vector<double> t = bench::time_runs(fn, o.repeats, o.budget, o.min_time);
  return {bench::median(t), static_cast<int>(t.size())};
}

void check_output_path(const char* flag, const std::string& path) {
  if (path.empty() || path == "-") return;
  const std::filesystem::path dir = std::filesystem::absolute(path).parent_path();
  if (!std::filesystem::is_directory(dir))
    throw Error(std::string(flag) + ": directory '" + dir.string() + "' does not exist");
  if (std::filesystem::is_directory(path)) throw Error(std::string(flag) + ": '" + path + "' is a directory");
}

std::string dtype_short(DType d) { return d == DType::f32 ? "f32" : d == DType::bf16 ? "bf16" : "f16"; }

}  // namespace qkv::cli::benchcmd
