// `qkv bench --report`: the Markdown of the report (the machine, the bounds, one table per
// section, how each figure is measured).
#include <cstdarg>
#include <cstdio>
#include <string>

#include "qkv/info.hpp"
#include "qkv/version.hpp"
#include "report.hpp"

namespace qkv::cli::benchcmd {
namespace {

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  return buf;
}

std::string time_text(double s) {
  if (s >= 1.0) return format("%.3g s", s);
  if (s >= 1e-3) return format("%.3g ms", s * 1e3);
  return format("%.3g us", s * 1e6);
}

std::string ratio(const std::optional<double>& x) { return x ? format("%.2f", *x) : "-"; }

std::string bound_short(const std::string& name) {
  if (name == "amx_gflops") return "AMX";
  if (name == "bf16_gflops") return "bf16 dot";
  if (name == "fma_gflops") return "FMA";
  return "DRAM";
}

double bound_value(const ReportDoc& doc, const ReportRow& r) {
  return r.memory ? doc.peaks.read_gbps : bench::compute_peak_value(doc.peaks, r.bound);
}

std::string row_line(const ReportDoc& doc, const ReportRow& r) {
  std::string time = "-", rate = "-", bound = "-", of_bound = "-", of_sgemm = "-";
  if (r.seconds) {
    time = time_text(*r.seconds);
    rate = format("%.1f %s", r.rate, r.memory ? "GB/s" : "GFLOP/s");
    bound = r.memory ? "DRAM" : bound_short(r.bound);
    const double b = bound_value(doc, r);
    if (b > 0) of_bound = format("%.1f%%", 100.0 * r.rate / b);
    if (r.adjacent_fraction) of_bound += format(" (%.1f%%)", 100.0 * *r.adjacent_fraction);
    if (!r.memory && doc.sgemm.gflops > 0) of_sgemm = format("%.1f%%", 100.0 * r.rate / doc.sgemm.gflops);
  }
  return "| " + r.label + " | " + r.dtype + " | " + r.kernel + " | " + time + " | " + rate + " | " + bound + " | " +
         of_bound + " | " + of_sgemm + " | " + ratio(r.x_naive) + " | " + ratio(r.x_torch) + " | " +
         (r.note.empty() ? "-" : r.note) + " |\n";
}

std::string machine(const ReportDoc& doc) {
  const bench::CpuDescription& c = doc.cpu;
  std::string md = "## Machine\n\n| | |\n|---|---|\n";
  md += "| CPU | " + (c.model.empty() ? std::string("unknown") : c.model) + " |\n";
  md += format("| logical CPUs | %d (%d cores, %d socket%s)%s; this run: %d threads |\n", c.logical_cpus, c.cores,
               c.sockets, c.sockets == 1 ? "" : "s", c.hypervisor ? ", a virtual machine (hypervisor flag)" : "",
               doc.threads);
  md += "| caches (cpu0) | " + bench::cache_summary(c) + " |\n";
  md += "| ISA level qkv uses | " + qkv::active_isa_string() + " |\n";
  md += "| bf16 products | " + qkv::bf16_dot_string() + " |\n";
  md += "| CPU features | " + qkv::cpu_features_string() + " |\n";
  md += "| OpenBLAS | " + bench::blas_env_note() + " |\n";
  md += format("| qkv | %s, commit %s |\n", qkv::version(), doc.commit.c_str());
  md += format("| load average | %.1f at the start, %.1f at the end |\n\n", doc.load_start, doc.load_end);
  return md;
}

std::string bounds(const ReportDoc& doc) {
  const bench::Peaks& p = doc.peaks;
  const std::string bf16 = bench::compute_peak_name(DType::bf16);
  std::string md = format("## Bounds (%d threads)\n\n| bound | value | judges |\n|---|---:|---|\n", doc.threads);
  md += format("| fp32 FMA peak (%s) | %.1f GFLOP/s | float32 compute rows%s |\n", p.fma_isa.c_str(), p.fma_gflops,
               bf16 == "fma_gflops" ? ", and bf16 ones (widened to fp32 here)" : "");
  md += p.bf16_gflops > 0 ? format("| bf16 dot-product peak (vdpbf16ps) | %.1f GFLOP/s | %s |\n", p.bf16_gflops,
                                   bf16 == "bf16_gflops" ? "bf16 compute rows" : "none here (qkv does not use it)")
                          : "| bf16 dot-product peak | - | not on this CPU |\n";
  md += p.amx_gflops > 0 ? format("| AMX bf16 tile peak (tdpbf16ps) | %.1f GFLOP/s | %s |\n", p.amx_gflops,
                                  bf16 == "amx_gflops" ? "bf16 compute rows" : "none here (qkv does not use it)")
                         : "| AMX bf16 tile peak | - | not on this CPU |\n";
  md += format("| DRAM read (a %.0f MiB buffer) | %.1f GB/s | memory rows (decode, serving, quantized decode) |\n",
               p.read_mib, p.read_gbps);
  md += format("| OpenBLAS SGEMM, n = %d | %.1f GFLOP/s (%.1f%% of the FMA peak) | every compute row, second "
               "column |\n\n",
               doc.sgemm.n, doc.sgemm.gflops, p.fma_gflops > 0 ? 100.0 * doc.sgemm.gflops / p.fma_gflops : 0.0);
  return md;
}

std::string how_measured(const ReportDoc& doc) {
  const BenchOptions& o = doc.options;
  std::int64_t l3 = 0;
  for (const bench::CpuCache& c : doc.cpu.caches)
    if (c.level == 3) l3 = c.bytes;
  std::string md = "## How each figure is measured\n\n";
  md += format("- **time**: wall time of one call (steady clock), the median of the timed calls that follow one "
               "warm-up call: %d, or more until they add up to %.2g s, or fewer if they would take more than %.3g s.\n",
               o.repeats, o.min_time, o.budget);
  md += format("- **FMA, bf16 dot and AMX peaks**: %d threads started together behind a barrier run independent "
               "chains of `vfmadd231ps` (2 FLOP per lane), `vdpbf16ps` (4 FLOP per fp32 lane) or four "
               "`tdpbf16ps` tile products (2 x 16 x 16 x 32 FLOP each), timed by the slowest thread; the best of "
               "runs of about 2 ms over %.2g s (bench/support/peak.cpp). No kernel that loads data reaches them.\n",
               doc.threads, o.peak_seconds);
  md += format("- **DRAM read**: each thread streams its own part of a %.0f MiB buffer (first touched by that "
               "thread) with 512-bit loads (256-bit without AVX-512); the best pass over %.2g s.",
               doc.peaks.read_mib, o.peak_seconds);
  if (l3 > 0 && 2 * l3 > static_cast<std::int64_t>(doc.peaks.read_mib * 1048576.0))
    md += format(" This CPU's L3 (%lld MiB, shared with whatever else runs) holds half the buffer or more: part of "
                 "it may be read from there, and memory rows that fit in the L3 can exceed 100%%.",
                 static_cast<long long>(l3 >> 20));
  md += "\n";
  md += format("- **SGEMM**: `cblas_sgemm` of the OpenBLAS qkv links, C = A B on n x n float32 matrices "
               "(row-major), %d OpenBLAS threads; the median of %d calls after a warm-up; 2 n^3 FLOP.\n",
               doc.sgemm.threads, doc.sgemm.runs);
  md += "- **of bound**: the row's rate / its bound above (in parentheses: / the same peak measured right before "
        "and after the row's calls, the higher of the two, for compute rows); **of SGEMM**: rate / the SGEMM rate.\n";
  md += "- **x naive BLAS**: the naive unfused baseline's median time / the row's, in the same run: per head "
        "S = scale Q K^T and O = P V with single-threaded `cblas_sgemm` (heads over the threads), a vectorised row "
        "softmax between (masked scores computed too), float32; the backward's has five sgemm per head "
        "(bench/support/baseline*.cpp). bf16 rows are compared with the float32 baseline on the same values.\n";
  md += format("- **x PyTorch**: bench/torch_sdpa.py (embedded in the binary, run by `%s -c`), "
               "`torch.set_num_threads(%d)`, median of %d calls after one warm-up, inputs uniform in [-1, 1]; "
               "PyTorch's bf16 output is bf16, qkv's float32. qkv's rows and PyTorch's run one after the other, "
               "never at once.\n",
               o.python.c_str(), doc.threads, o.repeats);
  md += "- Every rate of a row comes from the same run as the bounds; on a shared machine compare the fractions "
        "and ratios, which move less than the times.\n";
  return md;
}

}  // namespace

std::string report_markdown(const ReportDoc& doc) {
  std::string md = "# qkv performance report\n\n";
  md += format("Written by `qkv bench --report%s` on %s, in %.0f s of measuring on %d threads.%s\n\n",
               doc.quick ? " --quick" : "", doc.date.c_str(), doc.wall_seconds, doc.threads,
               doc.quick ? " --quick: small shapes, to check the report's form; not figures to quote." : "");
  md += machine(doc) + bounds(doc);
  md += "## Rows\n\n"
        "time: median of one call; rate: GFLOP/s (compute rows) or GB/s (memory rows); of bound: rate / the "
        "row's bound (FMA, bf16 dot, AMX or DRAM), in parentheses against the same peak measured next to the row; "
        "of SGEMM: rate / OpenBLAS's SGEMM rate; x naive BLAS and x PyTorch: their time / the row's (> 1: the row "
        "is faster).\n\n";
  for (const ReportSection& s : doc.sections) {
    md += "### " + s.title + "\n\n" + s.about + "\n\n";
    md += "| row | dtype | kernel | time | rate | bound | of bound | of SGEMM | x naive BLAS | x PyTorch | note |\n"
          "|---|---|---|---:|---:|---|---:|---:|---:|---:|---|\n";
    for (const ReportRow& r : s.rows) md += row_line(doc, r);
    md += "\n";
  }
  md += how_measured(doc);
  return md;
}

}  // namespace qkv::cli::benchcmd
