#pragma once
// `qkv bench --report FILE.md` in parts: the walk over the row groups (report.cpp), the Markdown
// (report_markdown.cpp) and PyTorch's rows, run by the embedded bench/torch_sdpa.py (torch_rows.cpp).
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bench_support.hpp"
#include "rows.hpp"

namespace qkv::cli::benchcmd {

// One line of a report table. A row without `seconds` was not measured (PyTorch not importable):
// its figures print as "-" and `note` says why.
struct ReportRow {
  std::string label;   // the shape or path, e.g. "D 128, S 1024, causal"
  std::string dtype;   // "f32", "bf16", "int8", ...
  std::string kernel;  // what ran it: the dispatched kernel, the path, torch's backend
  std::optional<double> seconds;
  double rate = 0;      // GFLOP/s (compute rows) or GB/s (memory rows)
  bool memory = false;  // judged against the DRAM read rather than a compute peak
  std::string bound;    // compute rows: bench::compute_peak_name() of the dtype
  std::optional<double> adjacent_fraction;  // rate / the same bound measured next to the row
  std::optional<double> x_naive, x_torch;   // naive BLAS time / this; PyTorch's time / this
  std::string note;
};

struct ReportSection {
  std::string title;  // "Forward", ...
  std::string about;  // the shapes, what the rate counts, what the ratios compare
  std::vector<ReportRow> rows;
};

struct ReportDoc {
  std::string date, commit;
  int threads = 1;
  bool quick = false;
  double wall_seconds = 0, load_start = 0, load_end = 0;
  BenchOptions options;  // as run (repeats, min_time, budget, peak_seconds, read_mib, ...)
  bench::CpuDescription cpu;
  bench::Peaks peaks;
  bench::SgemmRate sgemm;
  std::string torch;  // "torch 2.13.0+cpu, CPU capability AVX512, 2 threads", or why there is none
  std::vector<ReportSection> sections;
};

// The report as Markdown: the machine, the bounds, one table per section, how each figure is
// measured.
std::string report_markdown(const ReportDoc& doc);

// PyTorch's scaled_dot_product_attention on B = 1, H = 8 and every (D, S, causal, dtype) of the
// arguments (float32 and bfloat16, causal and not), from bench/torch_sdpa.py as embedded in the
// binary, run as `python -c` in a child process (its table goes to stderr).
struct TorchRow {
  std::int64_t D = 0, S = 0;
  bool causal = false;
  std::string dtype;  // "float32" or "bfloat16"
  std::string backend;
  double forward_seconds = 0, forward_backward_seconds = 0;
};
struct TorchRun {
  std::string error;  // empty when it ran; else e.g. "torch not importable: ModuleNotFoundError: ..."
  std::string version, capability;
  int threads = 0;
  std::vector<TorchRow> rows;
  const TorchRow* find(std::int64_t D, std::int64_t S, bool causal, const std::string& dtype) const;
};
TorchRun run_torch_sdpa(const std::string& python, std::int64_t D, const std::vector<std::int64_t>& seqlens,
                        int threads, int repeats);

}  // namespace qkv::cli::benchcmd
