// `qkv bench`: the rows as a table (printed as they are measured), as Markdown and as JSON
// (docs/performance.md, "Columns and fields").
#include <cstdio>
#include <nlohmann/json.hpp>

#include "rows.hpp"
#include "qkv/info.hpp"
#include "qkv/version.hpp"

namespace qkv::cli::benchcmd {
namespace {

using nlohmann::json;

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
  if (r.plain_seconds) {
    j["option"] = r.option;
    j["plain_seconds"] = *r.plain_seconds;
    j["ratio_vs_plain"] = r.seconds / *r.plain_seconds;
  }
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
          {"bf16_gflops", p.bf16_gflops}, {"amx_gflops", p.amx_gflops}, {"read_gbps", p.read_gbps}, {"read_mib", p.read_mib}};
}

}  // namespace

void print_header(FILE* out, int kind_width) {
  std::fprintf(out, "%-*s %-34s %-6s %-5s %-22s %3s %11s %14s %11s %8s %6s %-10s %9s\n", kind_width, "kind", "shape",
               "causal", "dtype", "kernel", "thr", "seconds", "rate", "base_s", "x_base", "peak%", "(of)", "maxdiff");
}

void print_row(FILE* out, const Row& r, int kind_width) {
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
  std::fprintf(out, "%-*s %-34s %-6s %-5s %-22s %3d %11.4g %14s %11s %8s %6.1f %-10s %9s\n", kind_width,
               r.kind.c_str(), bench::shape_label(r.shape).c_str(), r.causal ? "yes" : "no",
               dtype_short(r.dtype).c_str(), r.kernel.c_str(), r.threads, r.seconds, rate, base, ratio,
               100.0 * r.peak_fraction, of, diff);
  if (r.plain_seconds)
    std::fprintf(out, "%-*s   with %s: %.4g s against the plain row's %.4g s: ratio %.3f\n", kind_width, "",
                 r.option.c_str(), r.seconds, *r.plain_seconds, r.seconds / *r.plain_seconds);
  if (r.seconds_1thread)
    std::fprintf(out, "%-*s   1 thread %.4g s, %d threads %.4g s: speedup %.2fx\n", kind_width, "",
                 *r.seconds_1thread, r.threads, r.seconds, *r.seconds_1thread / r.seconds);
  if (r.mem)
    std::fprintf(out, "%-*s   resident after %s %.1f MiB, peak %.1f MiB, added by the call %.1f MiB\n", kind_width,
                 "", r.backward() ? "inputs, output, softmax_lse, dO and gradients" : "inputs",
                 r.mem->rss_inputs_mib, r.mem->hwm_mib, r.mem->extra_mib);
  if (const auto f = r.adjacent_fraction())
    std::fprintf(out, "%-*s   peak measured next to this row: %.1f; this row %.1f%% of it\n", kind_width, "",
                 *r.adjacent_peak, 100.0 * *f);
  if (r.kv_read_gbps && *r.kv_read_gbps > 0)
    std::fprintf(out, "%-*s   K and V read as two streams of this size: %.1f GB/s; this row %.1f%% of it\n",
                 kind_width, "", *r.kv_read_gbps, 100.0 * r.gbps / *r.kv_read_gbps);
  std::fflush(out);
}

std::string markdown(const std::vector<Row>& rows, const std::map<int, bench::Peaks>& peaks, int threads,
                     double load_start, double load_end) {
  std::string md;
  char buf[512];
  std::snprintf(buf, sizeof buf, "qkv %s, %d threads, %s; load average %.1f at the start, %.1f at the end.\n\n",
                qkv::version(), threads, bench::blas_env_note().c_str(), load_start, load_end);
  md += buf;
  for (const Row& r : rows)
    if (r.backward()) {
      md += std::string("Backward rows: ") + kBackwardFlopsNote + "; x baseline against the naive BLAS backward.\n\n";
      break;
    }
  md += "| threads | fp32 FMA GFLOP/s | bf16 dot GFLOP/s | AMX bf16 GFLOP/s | read GB/s (buffer) |\n"
        "|---:|---:|---:|---:|---:|\n";
  for (const auto& [t, p] : peaks) {
    std::snprintf(buf, sizeof buf, "| %d | %.0f (%s) | %.0f | %.0f | %.1f (%.0f MiB) |\n", t, p.fma_gflops,
                  p.fma_isa.c_str(), p.bf16_gflops, p.amx_gflops, p.read_gbps, p.read_mib);
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
    if (r.plain_seconds) {
      std::snprintf(buf, sizeof buf, " + %s (%.3fx the plain row)", r.option.c_str(), r.seconds / *r.plain_seconds);
      kind += buf;
    }
    if (r.seconds_1thread) {
      std::snprintf(buf, sizeof buf, " (1 thread %.4g s: %.2fx)", *r.seconds_1thread, *r.seconds_1thread / r.seconds);
      kind += buf;
    }
    if (r.mem) {
      std::snprintf(buf, sizeof buf, " (peak RSS %.1f MiB, %.1f MiB above %s)", r.mem->hwm_mib, r.mem->extra_mib,
                    r.backward() ? "inputs+output+gradients" : "inputs+output");
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

std::string json_document(const std::vector<Row>& rows, PeakTable& peaks, int threads, double load_start,
                          double load_end) {
  json pk = json::object();
  for (const auto& [t, p] : peaks.all()) pk[std::to_string(t)] = peaks_json(p);
  json reads = json::array(), kv_reads = json::array();
  for (const auto& [key, gbps] : peaks.reads())
    reads.push_back({{"threads", key.first}, {"mib", key.second}, {"read_gbps", gbps}});
  for (const auto& [key, gbps] : peaks.kv_reads())
    kv_reads.push_back({{"threads", key.first}, {"mib", key.second}, {"kv_read_gbps", gbps}});
  json doc = {{"qkv_version", qkv::version()},
              {"cpu_features", qkv::cpu_features_string()},
              {"openblas_core", bench::blas_core_name()},
              {"openblas_note", bench::blas_env_note()},
              {"kernel_isa", qkv::active_isa_string()},
              {"bf16_dot_used", qkv::bf16_dot_used()},
              {"bf16_dot", qkv::bf16_dot_string()},
              {"threads", threads},
              {"load_average_start", load_start},
              {"load_average_end", load_end},
              {"peaks", pk},
              {"read_bandwidth_by_size", reads},
              {"kv_read_bandwidth_by_size", kv_reads},
              {"backward_flops_factor", 2.5},
              {"rows", json::array()}};
  for (const Row& r : rows) doc["rows"].push_back(row_json(r));
  return doc.dump(2) + "\n";
}

}  // namespace qkv::cli::benchcmd
