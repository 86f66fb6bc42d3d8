#pragma once
// `qkv bench` in parts: its options, the measured rows, the machine's peaks and the runner that
// measures a row (bench/command/measure.cpp), and the three outputs of the rows: the table, Markdown
// and JSON (bench/command/output.cpp). bench/command/bench.cpp declares the options and walks the grid.
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/kv_quant.hpp"
#include "qkv/tensor.hpp"
#include "bench_support.hpp"

namespace qkv::cli::benchcmd {

using bench::BenchShape;

struct BenchOptions {
  bool quick = false, scaling = false, memory = false, no_baseline = false, reference = false, backward = false;
  bool serving = false, kv_quant = false, kv_accuracy = false;
  std::string shapes = "all", dtype = "all", causal = "both", json_path, markdown_path, blas_core;
  std::string report_path, python = "python3";  // --report FILE.md; the interpreter of its PyTorch rows
  std::vector<std::int64_t> head_dims, seqlens, decode_seqlens;
  int repeats = 0, threads = 0;
  std::int64_t scaling_seqlen = 4096, memory_seqlen = 32768;
  // Score options: --window for every forward and backward row; --sinks, --alibi, --keep-first
  // each add a row beside the plain one of the same shape (its cost: option/plain, medians).
  bool sinks = false, alibi = false;
  std::int64_t window = -1, keep_first = 0;
  double budget = 30.0, min_time = -1, adjacent_seconds = 0.1, peak_seconds = 0.25, read_mib = 512;

  // Which row groups run: forward (and the forward's scaling and memory rows) unless --shapes
  // decode or backward; decode unless --shapes forward or backward; backward with --shapes
  // backward or --backward.
  bool forward_rows() const { return shapes == "all" || shapes == "forward"; }
  bool decode_rows() const { return shapes == "all" || shapes == "decode"; }
  bool forward_extra_rows() const { return shapes != "backward"; }
  bool backward_rows() const { return backward || shapes == "backward"; }
  // The option rows of each forward and backward shape: "sinks", "alibi", "keep-first".
  std::vector<std::string> row_options() const;
};

// One measured line of the report.
struct Row {
  // forward | decode | scaling | memory | backward | backward-scaling | backward-memory
  std::string kind;
  BenchShape shape;
  bool causal = false;
  DType dtype = DType::f32;
  std::string kernel;
  // A score option the row adds to the plain row of its shape ("sinks", "alibi", "keep-first";
  // empty: the plain row), and that row's seconds.
  std::string option;
  std::optional<double> plain_seconds;
  int threads = 1;
  int repeats = 0;
  double seconds = 0, gflops = 0, gbps = 0;
  // Backward rows: maxdiff is that of dQ.
  std::optional<double> baseline_seconds, max_abs_diff, seconds_1thread;
  double peak_fraction = 0;
  std::string peak_name;  // which peak peak_fraction divides by
  double peak_value = 0;  // its value (GFLOP/s or GB/s)
  std::optional<bench::MemoryUse> mem;
  std::optional<double> kv_read_gbps;  // decode: two-stream (K and V) read bandwidth of this size
  // The same peak (peak_name) measured just before and just after this row's timed runs, the
  // higher of the two: the machine's speed in the phase the row ran in.
  std::optional<double> adjacent_peak;

  bool backward() const { return kind.rfind("backward", 0) == 0; }
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
  const bench::Peaks& at(int threads);
  // Read bandwidth over a buffer of `bytes` (rounded to MiB), measured once per size; kv: the
  // same bytes as two buffers read in alternating tiles (bench::measure_kv_read_bandwidth).
  double read_gbps(int threads, double bytes, bool kv = false);
  // A read figure's buffer size: `bytes` rounded up to whole MiB, in MiB.
  static std::int64_t whole_mib(double bytes);
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

// The float64 reference kernel runs at well under 1 GFLOP/s: when it is what would be timed (no
// fast kernel compiled in or usable) and was not asked for, shapes beyond 2e10 FLOP (forward, or
// backward counted as 2.5 forwards) are skipped with a note on `out` rather than running for
// hours. The backward check runs a small single-threaded call (no OpenMP team is started).
bool skip_reference(FILE* out, const BenchOptions& o, const BenchShape& s, bool causal, DType dtype, int threads);
bool skip_reference_backward(FILE* out, const BenchOptions& o, const BenchShape& s, bool causal, DType dtype);

// Measures rows: qkv and the naive baselines on one shape, timed as the options say, against
// the machine's peaks.
class Runner {
public:
  explicit Runner(const BenchOptions& o) : o_(o), peaks_(o.peak_seconds, o.read_mib) {}

  // Times qkv::attention() on `dtype` inputs (f32_inputs itself when dtype is float32) and, if
  // with_baseline, the baseline on f32_inputs.
  Row measure(const std::string& kind, const BenchShape& s, bool causal, DType dtype, int threads,
              const bench::Inputs* f32_inputs, bool with_baseline = true, bool with_adjacent = true);
  // Times qkv::attention_backward() on `dtype` inputs (gradients in the same dtype; f32_inputs
  // itself when dtype is float32) and, if with_baseline, the naive backward baseline on
  // f32_inputs; maxdiff compares dQ.
  Row measure_backward(const std::string& kind, const BenchShape& s, bool causal, DType dtype, int threads,
                       const bench::BackwardInputs* f32_inputs, bool with_baseline = true, bool with_adjacent = true);
  // The same row with a score option added (row_options), on its own inputs of the same values,
  // without the baseline (which has no options); `plain`: the row it is compared with.
  Row measure_option(const Row& plain, const std::string& option);
  // A memory row (kind "memory" or "backward-memory") from a child's measurement.
  Row memory_row(const std::string& kind, const BenchShape& s, DType dtype, int threads, const bench::MemoryUse& m);

  // Parameters of a timed call (with --window), and with a score option added for Hq heads.
  AttentionParams params(bool causal, int threads) const;
  AttentionParams params(bool causal, int threads, const std::string& option, std::int64_t Hq);
  PeakTable& peaks() { return peaks_; }
  // Drops the cached baseline outputs (call when moving to the next shape).
  void clear_baselines() {
    cache_.clear();
    backward_cache_.clear();
  }

private:
  struct BaselineResult {
    double seconds = 0;
    std::shared_ptr<Tensor> out;  // forward: O; backward: dQ
  };
  using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, bool, int>;
  // The float32 baselines on the same values as every dtype (see make_inputs), timed once per
  // (shape, causal, threads) in this run; nullopt when skipped.
  std::optional<BaselineResult> baseline(const BenchShape& s, bool causal, int threads, const bench::Inputs& f32);
  std::optional<BaselineResult> backward_baseline(const BenchShape& s, bool causal, int threads,
                                                  const bench::BackwardInputs& f32);
  // Times `call` into r (seconds, repeats, the adjacent peak), then sets the rates from `flops`
  // and the peak fraction.
  void time_row(Row& r, const std::function<void()>& call, double flops, bool with_adjacent);

  const BenchOptions& o_;
  PeakTable peaks_;
  std::map<Key, BaselineResult> cache_, backward_cache_;
  std::vector<float> sinks_, slopes_;  // the option rows' sinks and ALiBi slopes (params)
};

std::string dtype_short(DType d);

// The median of fn's timed runs as the options say (bench::time_runs with --repeats, --budget and
// --min-time), and how many runs it is of.
struct Timing {
  double seconds = 0;
  int runs = 0;
};
Timing time_median(const std::function<void()>& fn, const BenchOptions& o);

// o with the mode's --repeats and --min-time where they were not given (0 and a negative time
// mean not given); the threads of a run: --threads, else OpenMP's default.
BenchOptions with_defaults(BenchOptions o, int repeats, double min_time);
int run_threads(const BenchOptions& o);

// The 1-minute load average (/proc/loadavg; 0 where unreadable): how busy the machine was.
double load_average();

// Throws qkv::Error unless `path` can be written by a rename into its directory (the directory
// exists and `path` is not a directory): checked before minutes of measuring. "-" and "" pass.
void check_output_path(const char* flag, const std::string& path);

// The table (stdout, or stderr when the JSON goes to stdout). kind_width: the kind column.
void print_header(FILE* out, int kind_width);
/// `qkv bench --serving` (bench/command/serving.cpp): packed and paged decode, a prefill + decode mix,
/// batched generation; a table on stdout.
struct BenchOptions;
void run_bench_serving(const BenchOptions& o);
/// `qkv bench --kv-quant` (bench/command/kv_quant.cpp): decode and prefill over quantized KV caches.
void run_bench_kv_quant(const BenchOptions& o);
/// Its decode: Sq 1 over one sequence of Sk keys, Hq 8 (kKvQuantHq), D 128 (kKvQuantD), K and V
/// of N(0, 1) entries both stored in format f. warm: every call on the same cache; cold: each
/// call on the next of copies that together hold twice --read-mib, so every call reads DRAM.
inline constexpr std::int64_t kKvQuantHq = 8, kKvQuantD = 128;
struct KvQuantDecode {
  double bytes = 0;  // of the cache read by one call: codes and scales
  Timing warm, cold;
};
KvQuantDecode measure_kv_quant_decode(KVFormat f, std::int64_t Sk, std::int64_t Hkv, const BenchOptions& o,
                                      int threads);
/// `qkv bench --report FILE.md` (bench/command/report.cpp): this machine's bounds and the standard
/// rows of every kind, written as one Markdown report.
void run_bench_report(const BenchOptions& o);
/// `qkv bench --kv-accuracy` (bench/command/kv_accuracy.cpp): the accuracy table of docs/accuracy.md.
void run_bench_kv_accuracy(const BenchOptions& o);
void print_row(FILE* out, const Row& r, int kind_width);
// The results as a Markdown table (docs/performance.md), with the run's machine figures above it.
std::string markdown(const std::vector<Row>& rows, const std::map<int, bench::Peaks>& peaks, int threads,
                     double load_start, double load_end);
// The JSON document (docs/performance.md, "Columns and fields").
std::string json_document(const std::vector<Row>& rows, PeakTable& peaks, int threads, double load_start,
                          double load_end);

// A sentence on how backward rows count FLOPs, for the table, the Markdown and the help text.
inline constexpr const char* kBackwardFlopsNote =
    "backward GFLOP/s count 2.5x the forward's FLOPs (FlashAttention's convention: five matrix products "
    "per score against the forward's two; causal: unmasked scores only)";

}  // namespace qkv::cli::benchcmd
