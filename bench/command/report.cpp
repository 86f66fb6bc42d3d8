// `qkv bench --report FILE.md`: in one run, this machine's bounds (the FMA peak, the bf16 dot or
// AMX tile peak, the DRAM read of a 512 MiB buffer, OpenBLAS's SGEMM rate) and the standard rows
// of every kind, each judged against the bound that applies, beside the naive BLAS baselines and
// PyTorch's SDPA; written whole (temporary file and rename) as Markdown. The rows are measured by
// the code of the other modes: Runner (measure.cpp), ServingBatch (serving.cpp),
// measure_kv_quant_decode (kv_quant.cpp), bench/torch_sdpa.py (torch_rows.cpp).
#include <chrono>
#include <cstdio>
#include <ctime>
#include <map>
#include <string>
#include <vector>

#include "build_info.hpp"
#include "io/atomic_file.hpp"
#include "report.hpp"
#include "serving.hpp"

namespace qkv::cli::benchcmd {
namespace {

using i64 = std::int64_t;
using Clock = std::chrono::steady_clock;

std::string local_date() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M %Z", &tm);
  return buf;
}

std::string shape_label(i64 D, i64 S, bool causal) {
  return "D " + std::to_string(D) + ", S " + std::to_string(S) + (causal ? ", causal" : "");
}

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.0f MiB", bytes / 1048576.0);
  return buf;
}

// A row of the grid (forward, backward, decode), as the report shows it.
ReportRow from_row(const Row& r, const std::string& label) {
  ReportRow x;
  x.label = label;
  x.dtype = dtype_short(r.dtype);
  x.kernel = r.kernel;
  x.seconds = r.seconds;
  if (r.baseline_seconds) x.x_naive = *r.baseline_seconds / r.seconds;
  if (r.kind == "decode") {
    // Judged against the 512 MiB read; the grid's own reference, a buffer of the row's K+V size
    // (which the caches may partly hold), goes in the note.
    x.memory = true;
    x.rate = r.gbps;
    char note[128];
    std::snprintf(note, sizeof note, "%.1f%% of the read of a K+V-size buffer (%s, %.1f GB/s)",
                  100.0 * r.peak_fraction, mib(PeakTable::whole_mib_bytes(bench::kv_bytes(r.shape, r.dtype))).c_str(),
                  r.peak_value);
    x.note = note;
  } else {
    x.rate = r.gflops;
    x.bound = r.peak_name;
    x.adjacent_fraction = r.adjacent_fraction();
  }
  return x;
}

class Progress {
public:
  Progress() : start_(Clock::now()) {}
  double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  void note(const std::string& what) const {
    std::fprintf(stderr, "[%4.0f s] %s\n", seconds(), what.c_str());
    std::fflush(stderr);
  }
  void row(const std::string& section, const ReportRow& r) const {
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s | %s | %s | %s | %.4g ms | %.1f %s", section.c_str(), r.label.c_str(),
                  r.dtype.c_str(), r.kernel.c_str(), r.seconds.value_or(0) * 1e3, r.rate, r.memory ? "GB/s" : "GFLOP/s");
    note(buf);
  }

private:
  Clock::time_point start_;
};

}  // namespace

void run_bench_report(const BenchOptions& o_in) {
  check_output_path("--report", o_in.report_path);  // before minutes of measuring
  const BenchOptions o = with_defaults(o_in, o_in.quick ? 3 : 5, o_in.quick ? 0 : 0.5);
  const Progress progress;
  ReportDoc doc;
  doc.date = local_date();
  doc.commit = kBuildCommit;
  doc.load_start = load_average();
  doc.quick = o.quick;
  const int threads = run_threads(o);
  doc.threads = threads;
  // The standard shapes; --quick: the same kinds on small ones.
  const i64 D = o.quick ? 64 : 128, Sk_decode = o.quick ? 4096 : 32768, sgemm_n = o.quick ? 512 : 2048;
  const std::vector<i64> seqlens = o.quick ? std::vector<i64>{256} : std::vector<i64>{1024, 4096};
  const DType dtypes[] = {DType::f32, DType::bf16};

  progress.note("qkv bench --report " + o.report_path + ": " + std::to_string(threads) + " threads" +
                (o.quick ? ", --quick" : ""));
  doc.cpu = bench::describe_cpu();
  Runner run(o);
  doc.peaks = run.peaks().at(threads);
  char buf[1024];
  std::snprintf(buf, sizeof buf, "bounds: FMA %.1f GFLOP/s, bf16 dot %.1f, AMX %.1f, read of %.0f MiB %.1f GB/s",
                doc.peaks.fma_gflops, doc.peaks.bf16_gflops, doc.peaks.amx_gflops, doc.peaks.read_mib, doc.peaks.read_gbps);
  progress.note(buf);
  doc.sgemm = bench::measure_sgemm(threads, static_cast<int>(sgemm_n), o.quick ? 3 : 7);
  std::snprintf(buf, sizeof buf, "OpenBLAS SGEMM n = %d: %.1f GFLOP/s", doc.sgemm.n, doc.sgemm.gflops);
  progress.note(buf);

  // Forward and backward: B 1, Hq = Hkv = 8, Sq = Sk = S.
  std::map<std::tuple<i64, bool, DType>, Row> forward, backward;
  for (i64 S : seqlens) {
    const BenchShape s{1, 8, 8, S, S, D};
    run.clear_baselines();
    const bench::Inputs f32 = bench::make_inputs(s, DType::f32);
    for (bool c : {false, true})
      for (DType d : dtypes) {
        const Row r = run.measure("forward", s, c, d, threads, &f32);
        progress.row("forward", from_row(r, shape_label(D, S, c)));
        forward.emplace(std::tuple{S, c, d}, r);
      }
    for (bool c : {false, true}) {
      const bench::BackwardInputs in = bench::make_backward_inputs(s, DType::f32, DType::f32, run.params(c, threads));
      for (DType d : dtypes) {
        const Row r = run.measure_backward("backward", s, c, d, threads, &in);
        progress.row("backward", from_row(r, shape_label(D, S, c)));
        backward.emplace(std::tuple{S, c, d}, r);
      }
    }
  }

  // Decode: one query row over a long KV cache, Hkv 8 and GQA (Hkv 2).
  ReportSection decode{"Decode", "", {}};
  for (i64 Hkv : {8, 2}) {
    const BenchShape s{1, 8, Hkv, 1, Sk_decode, 128};
    run.clear_baselines();
    const bench::Inputs f32 = bench::make_inputs(s, DType::f32);
    for (DType d : dtypes) {
      const Row r = run.measure("decode", s, false, d, threads, &f32);
      decode.rows.push_back(from_row(r, "Sk " + std::to_string(Sk_decode) + ", Hkv " + std::to_string(Hkv)));
      progress.row("decode", decode.rows.back());
    }
  }

  // Serving: the decode batch of --serving, packed, paged and per sequence.
  ReportSection serving{"Serving", "", {}};
  {
    progress.note("serving: building the batch");
    const ServingBatch batch(o.quick);
    const ServingBatch::Paths t =
        batch.time_paths(std::vector<i64>(static_cast<std::size_t>(batch.kSequences), 1), o, threads);
    const auto add = [&](const char* label, const char* kernel, const Timing& x) {
      ReportRow r;
      r.label = label;
      r.dtype = "bf16";
      r.kernel = kernel;
      r.seconds = x.seconds;
      r.rate = batch.kv_bytes / x.seconds * 1e-9;
      r.memory = true;
      std::snprintf(buf, sizeof buf, "time / packed time %.2f", x.seconds / t.packed.seconds);
      r.note = buf;
      serving.rows.push_back(r);
      progress.row("serving", r);
    };
    add("packed", "serving (attention_varlen)", t.packed);
    add("paged, 16-key blocks", "serving (attention_paged)", t.paged);
    add("per sequence (baseline)", "decode (attention_varlen, kernel = decode)", t.tiled);
    std::snprintf(buf, sizeof buf,
                  "%lld sequences of one new token, keys spread over %lld..%lld (%lld in all, shuffled), Hq %lld, "
                  "Hkv %lld, D %lld, bf16 K and V (%s). GB/s: K and V bytes / time.",
                  static_cast<long long>(batch.kSequences), static_cast<long long>(batch.lo),
                  static_cast<long long>(batch.hi), static_cast<long long>(batch.total_keys),
                  static_cast<long long>(batch.kHq), static_cast<long long>(batch.kHkv),
                  static_cast<long long>(batch.kD), mib(batch.kv_bytes).c_str());
    serving.about = buf;
  }

  // Quantized decode: the decode of --kv-quant, bf16 against int8 and fp8, warm and cold.
  ReportSection quant{"Quantized KV decode", "", {}};
  for (i64 Hkv : {8, 2}) {
    double bf16_warm = 0, bf16_cold = 0;
    for (KVFormat f : {KVFormat::bf16, KVFormat::int8, KVFormat::fp8}) {
      const KvQuantDecode d = measure_kv_quant_decode(f, Sk_decode, Hkv, o, threads);
      if (f == KVFormat::bf16) bf16_warm = d.warm.seconds, bf16_cold = d.cold.seconds;
      for (const bool cold : {false, true}) {
        ReportRow r;
        r.label = "Hkv " + std::to_string(Hkv) + (cold ? ", cold" : ", warm");
        r.dtype = std::string(kv_format_name(f));
        r.kernel = "serving (attention_varlen)";
        r.seconds = (cold ? d.cold : d.warm).seconds;
        r.rate = d.bytes / *r.seconds * 1e-9;
        r.memory = true;
        std::snprintf(buf, sizeof buf, "bf16 time / this %.2f; %s read", (cold ? bf16_cold : bf16_warm) / *r.seconds,
                      mib(d.bytes).c_str());
        r.note = buf;
        quant.rows.push_back(r);
        progress.row("kv-quant", r);
      }
    }
  }

  // PyTorch: the forward and backward shapes, in a child process.
  progress.note("PyTorch: " + o.python + " -c <bench/torch_sdpa.py>");
  const TorchRun torch = run_torch_sdpa(o.python, D, seqlens, threads, o.repeats);
  if (!torch.error.empty()) {
    progress.note(torch.error);
    doc.torch = torch.error;
  } else {
    doc.torch = "torch " + torch.version + ", CPU capability " + torch.capability + ", " +
                std::to_string(torch.threads) + " threads";
  }

  // The sections, with the ratios to PyTorch now that its rows are in.
  const std::string fwd_name = bench::compute_peak_name(DType::bf16);
  ReportSection fwd{"Forward", "", {}}, bwd{"Backward", "", {}}, pt{"PyTorch SDPA", "", {}};
  for (const auto& [key, r] : forward) {
    const auto& [S, c, d] = key;
    ReportRow x = from_row(r, shape_label(D, S, c));
    if (const TorchRow* t = torch.find(D, S, c, std::string(dtype_name(d)))) x.x_torch = t->forward_seconds / r.seconds;
    fwd.rows.push_back(x);
  }
  for (const auto& [key, r] : backward) {
    const auto& [S, c, d] = key;
    ReportRow x = from_row(r, shape_label(D, S, c));
    const TorchRow* t = torch.find(D, S, c, std::string(dtype_name(d)));
    if (t && forward.count(key)) x.x_torch = t->forward_backward_seconds / (forward.at(key).seconds + r.seconds);
    bwd.rows.push_back(x);
  }
  for (i64 S : seqlens)
    for (bool c : {false, true})
      for (DType d : dtypes)
        for (const bool with_backward : {false, true}) {
          ReportRow x;
          x.label = std::string(with_backward ? "forward + backward, " : "forward, ") + shape_label(D, S, c);
          x.dtype = dtype_short(d);
          x.bound = bench::compute_peak_name(d);
          const TorchRow* t = torch.find(D, S, c, std::string(dtype_name(d)));
          if (!t) {
            x.kernel = "-";
            x.note = torch.error.empty() ? "not in PyTorch's output" : torch.error;
            pt.rows.push_back(x);
            continue;
          }
          x.kernel = "SDPA " + t->backend;
          x.seconds = with_backward ? t->forward_backward_seconds : t->forward_seconds;
          const double flops = bench::forward_flops({1, 8, 8, S, S, D}, c) * (with_backward ? 3.5 : 1.0);
          x.rate = flops / *x.seconds * 1e-9;
          const Row& f = forward.at({S, c, d});
          const Row& b = backward.at({S, c, d});
          if (!with_backward && f.baseline_seconds) x.x_naive = *f.baseline_seconds / *x.seconds;
          if (with_backward && f.baseline_seconds && b.baseline_seconds)
            x.x_naive = (*f.baseline_seconds + *b.baseline_seconds) / *x.seconds;
          pt.rows.push_back(x);
        }

  const std::string bf16_bound = fwd_name == "amx_gflops"    ? "the AMX tile peak"
                                 : fwd_name == "bf16_gflops" ? "the bf16 dot-product peak"
                                                             : "the FMA peak (bf16 widened to fp32 here)";
  std::snprintf(buf, sizeof buf,
                "B 1, Hq = Hkv = 8, Sq = Sk = S, q, k and v in the dtype, output float32. GFLOP/s: "
                "4 B Hq D (unmasked score pairs) / time. Bound: the FMA peak for f32, %s for bf16. "
                "x PyTorch: SDPA's forward time / this.",
                bf16_bound.c_str());
  fwd.about = buf;
  bwd.about = "The forward's shapes; out and softmax_lse from one forward call, dO uniform in [-1, 1]; gradients in "
              "the inputs' dtype. GFLOP/s count 2.5x the forward's FLOPs (FlashAttention's convention). "
              "x naive BLAS: the naive backward (five sgemm per head) / this. x PyTorch: SDPA's forward + backward "
              "time / (qkv's forward row + this row).";
  std::snprintf(buf, sizeof buf,
                "Sq 1, Sk %lld, Hq 8, D 128, Hkv 8 and 2 (GQA: 4 query heads per KV head). GB/s: K and V bytes / "
                "time, judged against the DRAM read.",
                static_cast<long long>(Sk_decode));
  decode.about = buf;
  std::snprintf(buf, sizeof buf,
                "One sequence, Sq 1, Sk %lld, Hq 8, D 128, K and V both in the format (codes and scales). warm: the "
                "same cache every call (the caches may hold part of it); cold: each call on the next of copies that "
                "together hold %.0f MiB, so that every call reads DRAM. GB/s: the cache's bytes / time.",
                static_cast<long long>(Sk_decode), 2 * o.read_mib);
  quant.about = buf;
  pt.about = "torch.nn.functional.scaled_dot_product_attention on the forward's shapes (" + doc.torch +
             "): the forward under no_grad, and forward + backward (out.backward(dO)), GFLOP/s counting 3.5x the "
             "forward's FLOPs. x naive BLAS as for qkv's rows.";
  doc.sections = {fwd, bwd, decode, serving, quant, pt};

  doc.options = o;
  doc.load_end = load_average();
  doc.wall_seconds = progress.seconds();
  const std::string md = report_markdown(doc);
  if (o.report_path == "-") {
    std::fwrite(md.data(), 1, md.size(), stdout);
    std::fflush(stdout);
  } else {
    qkv::detail::write_file_atomically(o.report_path, md);
    progress.note("wrote " + o.report_path);
  }
}

}  // namespace qkv::cli::benchcmd
