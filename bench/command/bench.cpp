// `qkv bench`: speed of qkv::attention() and qkv::attention_backward() on the benchmark grid,
// each shape beside the naive unfused baselines (bench/support/baseline.cpp, bench/support/baseline_backward.cpp)
// run in the same process, and as a fraction of the machine's peaks measured at the start of the
// run. See docs/performance.md. This file: the options and the walk over the grid; measuring a
// row is in measure.cpp, the table, Markdown and JSON in output.cpp; --serving, --kv-quant,
// --kv-accuracy and --report have a file each.
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "rows.hpp"
#include "commands.hpp"
#include "io/atomic_file.hpp"
#include "qkv/error.hpp"
#include "qkv/info.hpp"
#include "qkv/version.hpp"

namespace qkv::cli {
namespace benchcmd {
namespace {

std::vector<DType> selected_dtypes(const std::string& d) {
  if (d == "all") return {DType::f32, DType::bf16};
  if (d == "f32" || d == "float32") return {DType::f32};
  if (d == "bf16" || d == "bfloat16") return {DType::bf16};
  return {DType::f16};
}

void run_bench(BenchOptions o) {
  bench::reexec_with_clean_blas_env(bench::self_cmdline(), o.blas_core);
  if (!o.report_path.empty()) return run_bench_report(o);
  if (o.serving) return run_bench_serving(o);
  if (o.kv_quant) return run_bench_kv_quant(o);
  if (o.kv_accuracy) return run_bench_kv_accuracy(o);
  const bool to_stdout = o.json_path == "-";
  // Fail before minutes of measuring, not after.
  check_output_path("--json", o.json_path);
  check_output_path("--markdown", o.markdown_path);
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
  const int threads = run_threads(o);
  const auto dtypes = selected_dtypes(o.dtype);
  std::vector<bool> causals;
  if (o.causal != "on") causals.push_back(false);
  if (o.causal != "off") causals.push_back(true);
  const bool backward = o.backward_rows();
  const int kind_width = backward && (o.scaling || o.memory) ? 16 : 8;

  // The memory rows run in a forked child, before this process starts any OpenMP thread: a
  // child forked from a process with a thread pool cannot use OpenMP safely.
  std::optional<bench::MemoryUse> memory_use, backward_memory_use;
  const BenchShape memory_shape{1, 8, 8, o.memory_seqlen, o.memory_seqlen, 128};
  if (o.memory && o.forward_extra_rows() && !skip_reference(out, o, memory_shape, false, DType::f32, threads))
    memory_use = bench::measure_memory(memory_shape, DType::f32, false, threads);
  if (o.memory && backward && !skip_reference_backward(out, o, memory_shape, false, DType::f32))
    backward_memory_use = bench::measure_backward_memory(memory_shape, DType::f32, false, threads);

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
    if (p.amx_gflops > 0) std::fprintf(out, "  AMX bf16 tiles %.1f GFLOP/s\n", p.amx_gflops);
  }
  if (backward) std::fprintf(out, "%s\n", kBackwardFlopsNote);
  print_header(out, kind_width);

  std::vector<Row> rows;
  auto emit = [&](Row r) {
    print_row(out, r, kind_width);
    rows.push_back(std::move(r));
  };
  // A forward or backward row, then its option rows (--sinks, --alibi, --keep-first) beside it.
  const std::vector<std::string> options = o.row_options();
  auto emit_with_options = [&](Row plain) {
    const Row p = plain;
    emit(std::move(plain));
    for (const std::string& opt : options) emit(run.measure_option(p, opt));
  };
  if (o.forward_rows()) {
    for (std::int64_t D : o.head_dims)
      for (std::int64_t S : o.seqlens) {
        const BenchShape s{1, 8, 8, S, S, D};
        run.clear_baselines();
        const bench::Inputs f32 = bench::make_inputs(s, DType::f32);
        for (bool c : causals)
          for (DType d : dtypes)
            if (!skip_reference(out, o, s, c, d, threads))
              emit_with_options(run.measure("forward", s, c, d, threads, &f32));
      }
  }
  if (o.decode_rows()) {
    for (std::int64_t Sk : o.decode_seqlens)
      for (std::int64_t Hkv : {8, 2}) {
        const BenchShape s{1, 8, Hkv, 1, Sk, 128};
        run.clear_baselines();
        const bench::Inputs f32 = bench::make_inputs(s, DType::f32);
        for (DType d : dtypes)
          if (!skip_reference(out, o, s, false, d, threads)) emit(run.measure("decode", s, false, d, threads, &f32));
      }
  }
  if (backward) {
    for (std::int64_t D : o.head_dims)
      for (std::int64_t S : o.seqlens) {
        const BenchShape s{1, 8, 8, S, S, D};
        run.clear_baselines();
        for (bool c : causals) {
          std::vector<DType> run_dtypes;
          for (DType d : dtypes)
            if (!skip_reference_backward(out, o, s, c, d)) run_dtypes.push_back(d);
          if (run_dtypes.empty()) continue;
          // The float32 inputs (out and softmax_lse of one forward call) serve the float32 row and
          // the baseline, which checks every dtype's dQ.
          const bench::BackwardInputs f32 = bench::make_backward_inputs(s, DType::f32, DType::f32, run.params(c, threads));
          for (DType d : run_dtypes) emit_with_options(run.measure_backward("backward", s, c, d, threads, &f32));
        }
      }
  }
  if (o.scaling && o.forward_extra_rows()) {
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
  if (o.scaling && backward) {
    // The backward on 1 thread and on all threads, for 8 heads and for one (B = 1, H = 1: what a
    // kernel gains from threads within a head).
    for (std::int64_t D : o.head_dims)
      for (std::int64_t H : {8, 1})
        for (bool c : causals)
          for (DType d : dtypes) {
            const BenchShape s{1, H, H, o.scaling_seqlen, o.scaling_seqlen, D};
            if (skip_reference_backward(out, o, s, c, d)) continue;
            const bench::BackwardInputs in = bench::make_backward_inputs(s, d, d, run.params(c, threads));
            const bench::BackwardInputs* f32 = d == DType::f32 ? &in : nullptr;
            const Row one = run.measure_backward("backward-scaling", s, c, d, 1, f32, false, false);
            Row all = run.measure_backward("backward-scaling", s, c, d, threads, f32, false);
            all.seconds_1thread = one.seconds;
            emit(std::move(all));
          }
  }
  if (memory_use) emit(run.memory_row("memory", memory_shape, DType::f32, threads, *memory_use));
  if (backward_memory_use)
    emit(run.memory_row("backward-memory", memory_shape, DType::f32, threads, *backward_memory_use));
  std::fprintf(out, "peak resident memory of this process: %.1f MiB\n", bench::peak_rss_mib());

  const double load_end = load_average();
  if (!o.markdown_path.empty())
    qkv::detail::write_file_atomically(o.markdown_path, markdown(rows, run.peaks().all(), threads, load_start, load_end));
  if (!o.json_path.empty()) {
    const std::string text = json_document(rows, run.peaks(), threads, load_start, load_end);
    if (to_stdout) {
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
    } else {
      qkv::detail::write_file_atomically(o.json_path, text);
    }
  }
}

}  // namespace
}  // namespace benchcmd

void add_bench(CLI::App& app) {
  auto o = std::make_shared<benchcmd::BenchOptions>();
  auto* cmd = app.add_subcommand(
      "bench",
      "Measure qkv::attention() (and with --backward qkv::attention_backward()) against naive BLAS baselines and "
      "the machine's peaks");
  cmd->add_flag("--serving", o->serving,
                "the serving path instead: packed and paged decode of 32 sequences (1k..32k keys), a prefill + decode "
                "mix, batched generation on stories260K (docs/serving.md)");
  cmd->add_flag("--kv-quant", o->kv_quant,
                "quantized KV caches instead: decode (Sk 32768, Hkv 8 and 2) and prefill per format (f32, bf16, f16, int8, "
                "q8_0, fp8) against the read bandwidth and bf16");
  cmd->add_flag("--kv-accuracy", o->kv_accuracy,
                "the accuracy cost of each KV format (docs/accuracy.md): NMSE against float64 on random data and on "
                "stories260K's keys and values, KL divergence of next-token distributions, greedy continuation");
  cmd->add_flag("--quick", o->quick,
                "small grid (D=64, S=256, decode Sk=4096, 3 repeats, --min-time 0) unless overridden");
  cmd->add_option("--shapes", o->shapes, "which shapes: all (forward and decode), forward, decode, or backward")
      ->check(CLI::IsMember({"all", "forward", "decode", "backward"}));
  cmd->add_flag("--backward", o->backward,
                std::string("also time attention_backward() on the forward grid's shapes (gradients in the inputs' dtype; "
                            "against a naive BLAS backward); ") +
                    benchcmd::kBackwardFlopsNote);
  cmd->add_option("--dtype", o->dtype, "storage dtype of q, k, v")
      ->check(CLI::IsMember({"all", "f32", "float32", "bf16", "bfloat16", "f16", "float16"}));
  cmd->add_option("--causal", o->causal, "forward and backward rows: causal, not causal, or both")
      ->check(CLI::IsMember({"both", "on", "off"}));
  cmd->add_option("--head-dims", o->head_dims, "forward and backward head dims D (default 64,128)")
      ->delimiter(',')->check(CLI::PositiveNumber);
  cmd->add_option("--seqlens", o->seqlens, "forward and backward Sq = Sk (default 256,1024,4096,16384)")
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
  cmd->add_flag("--scaling", o->scaling, "also time the Sq=Sk=--scaling-seqlen shapes on 1 thread vs all threads (backward: also B=1, H=1)");
  cmd->add_option("--scaling-seqlen", o->scaling_seqlen, "sequence length of the scaling rows (default 4096)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--memory", o->memory,
                "also measure peak resident memory of one fp32 call (forward; backward with --backward) at "
                "Sq=Sk=--memory-seqlen, Hq=8, D=128");
  cmd->add_option("--memory-seqlen", o->memory_seqlen, "sequence length of the memory row (default 32768)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--window", o->window,
                  "forward and backward rows (plain and option rows): a sliding window of N keys left of the diagonal "
                  "(window_left N; the baselines, which have none, are skipped; rates still count every causal score)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_flag("--sinks", o->sinks,
                "also a row with attention sinks (one logit per head, 1.0) beside each forward and backward row, and "
                "its time over the plain row's (medians, same run)");
  cmd->add_flag("--alibi", o->alibi,
                "also a row with ALiBi (the standard slopes, qkv::alibi_slopes) beside each forward and backward row, "
                "and its time over the plain row's");
  cmd->add_option("--keep-first", o->keep_first,
                  "also a row with window_keep_first N (StreamingLLM's first keys; with --window, else the first keys "
                  "are in every causal row's range already) beside each forward and backward row, and its time over "
                  "the plain row's")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--no-baseline", o->no_baseline, "skip the naive baseline");
  cmd->add_flag("--reference", o->reference, "benchmark the float64 reference kernel (forward and backward) instead of the dispatched one");
  cmd->add_option("--peak-seconds", o->peak_seconds, "seconds per peak microbenchmark (default 0.25)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--read-mib", o->read_mib, "buffer of the headline read-bandwidth figure, MiB (default 512)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--blas-core", o->blas_core,
                  "run the baseline with OPENBLAS_CORETYPE=NAME (default: unset, OpenBLAS detects the CPU)");
  // An empty path would read as the option not given: the rows measured, nothing written.
  const CLI::Validator file_path(
      [](std::string& s) -> std::string { return s.empty() ? "expected a file path, got ''" : ""; }, "FILE");
  cmd->add_option("--json", o->json_path, "also write the rows as JSON to FILE ('-' = stdout; the table then goes to stderr)")
      ->check(file_path);
  cmd->add_option("--markdown", o->markdown_path, "also write the results as a Markdown table to FILE")
      ->check(file_path);
  auto* report = cmd->add_option(
      "--report", o->report_path,
      "instead: measure this machine's bounds (FMA, bf16/AMX, DRAM read, OpenBLAS SGEMM) and the standard rows of "
      "every kind (forward, backward, decode, serving, quantized decode, PyTorch's SDPA beside them) and write them as "
      "one Markdown report to FILE ('-' = stdout; docs/performance.md); with --quick, the same report on small shapes in "
      "seconds")->check(file_path);
  cmd->add_option("--python", o->python,
                  "--report: the Python interpreter that runs the PyTorch rows (default python3; rows say why when "
                  "it cannot import torch)")
      ->needs(report);
  // The report runs a fixed set of rows: options that choose rows or other outputs do not apply.
  for (const char* name : {"--serving", "--kv-quant", "--kv-accuracy", "--shapes", "--backward", "--dtype", "--causal",
                           "--head-dims", "--seqlens", "--decode-seqlens", "--scaling", "--scaling-seqlen", "--memory",
                           "--memory-seqlen", "--no-baseline", "--reference", "--json", "--markdown", "--window",
                           "--sinks", "--alibi", "--keep-first"})
    report->excludes(cmd->get_option(name));
  cmd->callback([o] { benchcmd::run_bench(*o); });
}

}  // namespace qkv::cli
