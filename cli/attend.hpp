#pragma once
// The options of `qkv attend`, shared by the one-process run (attend.cpp) and the distributed
// run (attend_dist.cpp).
#include <cstdint>
#include <optional>
#include <string>

#include "qkv/attention.hpp"
#include "qkv/npy.hpp"

namespace qkv::cli {

struct AttendOptions {
  std::string q, k, v, out, lse, probs, mask, kv_lens, layout = "bhsd", align = "bottom-right", window;
  bool layout_given = false;  // --layout on the command line, even as the default bhsd
  std::string grad_out, grad_q, grad_k, grad_v, cu_q, cu_k;
  // Score options (AttentionParams::sinks, alibi_slopes, window_keep_first) and dL/dz.
  std::string sinks, alibi_slopes, grad_sinks;
  std::int64_t keep_first = 0;
  std::optional<double> scale;
  double softcap = 0.0;
  bool causal = false, reference = false;
  bool explain = false;  // print each pass's kernel choice before running
  int threads = 0;
  // Context parallelism.
  bool distributed = false, decode = false;
  int simulate_ranks = 0, bench = 0;
  std::string placement = "auto", progress = "poll";
  std::int64_t tile_rows = 64;
};

/// --sinks and --alibi-slopes read into `files` (kept alive for the call) and set in p, with
/// --keep-first; the library checks their dtype, shape and values.
struct ScoreFiles {
  NpyArray sinks, slopes;
};
void read_score_options(const AttendOptions& o, AttentionParams& p, ScoreFiles& files);

/// Reads a 4-D .npy input; errors name the flag.
NpyArray read_input(const std::string& flag, const std::string& path);

/// `attend --distributed` (under mpirun) or `--simulate-ranks P` (one process).
void run_attend_distributed(const AttendOptions& o);

}  // namespace qkv::cli
