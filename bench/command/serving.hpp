#pragma once
// The serving batch of `qkv bench --serving` (bench/command/serving.cpp), which `--report` times
// too: 32 sequences of one new token each over bf16 keys and values, packed and paged.
#include <cstdint>
#include <vector>

#include "qkv/tensor.hpp"
#include "rows.hpp"

namespace qkv::cli::benchcmd {

/// Key lengths spread evenly over [lo, hi] (quick: 256..4096, else 1024..32768) in shuffled
/// order, Hq 32, Hkv 4, D 128, bf16 K and V of N(0, 1) entries; the same keys packed
/// ([total keys, Hkv, D]) and on 16-key blocks of a pool at random places (a block table).
class ServingBatch {
public:
  explicit ServingBatch(bool quick);

  /// Three paths over the same keys, each the median of o's timed runs: attention_varlen (the
  /// serving kernel, packed), attention_paged (the same kernel on the pool), and the tiled kernel
  /// per sequence as the baseline (kernel = decode when every sequence has one query row, else
  /// flash; not batch invariant). qlens: query rows per sequence (all 1: decode).
  struct Paths {
    Timing packed, paged, tiled;
  };
  Paths time_paths(const std::vector<std::int64_t>& qlens, const BenchOptions& o, int threads) const;

  static constexpr std::int64_t kSequences = 32, kHq = 32, kHkv = 4, kD = 128, kBlock = 16;
  std::int64_t lo = 0, hi = 0, total_keys = 0;
  double kv_bytes = 0;  ///< K and V of every sequence, read once per call
  std::vector<std::int64_t> klens;

private:
  Tensor k_, v_, k_pool_, v_pool_, table_, lens_;
};

}  // namespace qkv::cli::benchcmd
