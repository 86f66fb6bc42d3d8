#pragma once
// The lowered form of one attention call: validated once at the public boundary
// (src/core/validate.cpp, called by src/api), then read by every kernel. Plain data, no ownership of tensors,
// strides in elements, the last dimension of every operand contiguous.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/dropout.hpp"
#include "qkv/attention.hpp"

namespace qkv::detail {

/// A [B, H, S, X] operand with a contiguous last dimension.
struct Operand {
  const void* data = nullptr;
  DType dtype = DType::f32;
  std::int64_t sb = 0, sh = 0, ss = 0;  // strides of B, H, S in elements
};

/// A writable [B, H, S, X] or [B, H, S] operand (ss/sx: strides of the last two axes).
struct OutOperand {
  void* data = nullptr;  // nullptr: not requested
  DType dtype = DType::f32;
  std::int64_t sb = 0, sh = 0, ss = 0, sx = 1;
};

/// An explicit mask broadcast to [B, Hq, Sq, Sk]: broadcast axes have stride 0.
struct MaskOperand {
  const void* data = nullptr;  // nullptr: no mask
  DType dtype = DType::b8;     // b8 (true = attend), f32 or f64 (additive)
  std::int64_t sb = 0, sh = 0, sq = 0, sk = 0;
};

struct Problem {
  std::int64_t B = 0, Hq = 0, Hkv = 0, Sq = 0, Sk = 0, D = 0, Dv = 0;
  Operand q, k, v;
  OutOperand out, lse, probs;
  MaskOperand mask;
  double scale = 1.0;
  double softcap = 0.0;                    // 0 = off
  std::int64_t window_left = -1;           // effective window, -1 = unbounded
  std::int64_t window_right = -1;
  Alignment align = Alignment::bottom_right;
  std::vector<std::int64_t> kv_lens;       // empty = Sk for every batch
  int num_threads = 0;                     // 0 = OpenMP default
  // Score options that only the reference takes yet (the fast kernels' gates refuse them).
  std::vector<double> sinks;               // [Hq] sink logits z_h; empty = none
  std::vector<double> alibi;               // ALiBi slopes, slope(b, h) = alibi[b * alibi_sb + h]; empty = none
  std::int64_t alibi_sb = 0;               // 0 ([Hq] slopes) or Hq ([B, Hq])
  std::int64_t keep_first = 0;             // StreamingLLM: keys [0, keep_first) join every window
  // Added to the diagonal in ALiBi's bias only (- slope |diag + shift - j|), never to the key
  // ranges: a block of a longer sequence (src/dist) whose window is re-expressed in the block's
  // coordinates but whose bias is that of the global positions. 0 for every public call.
  std::int64_t alibi_diag_shift = 0;
  Dropout dropout;                         // attention dropout (core/dropout.hpp); off by default

  bool has_score_options() const noexcept { return !sinks.empty() || !alibi.empty() || keep_first > 0; }
  double slope(std::int64_t b, std::int64_t h) const noexcept {
    return alibi[static_cast<std::size_t>(b * alibi_sb + h)];
  }

  std::int64_t group() const noexcept { return Hkv ? Hq / Hkv : 1; }
  std::int64_t kv_head(std::int64_t h) const noexcept { return h / group(); }
  std::int64_t key_len(std::int64_t b) const noexcept {
    return kv_lens.empty() ? Sk : kv_lens[static_cast<std::size_t>(b)];
  }
  /// Key position of query row i's diagonal.
  std::int64_t diag(std::int64_t b, std::int64_t i) const noexcept {
    return align == Alignment::bottom_right ? i + key_len(b) - Sq : i;
  }
  /// Half-open range [lo, hi) of keys that causal, window and key lengths admit for row (b, i);
  /// an explicit mask may exclude more. lo >= hi means the row is empty.
  void key_range(std::int64_t b, std::int64_t i, std::int64_t& lo, std::int64_t& hi) const noexcept {
    const std::int64_t len = key_len(b), d = diag(b, i);
    lo = window_left < 0 ? 0 : std::max<std::int64_t>(0, d - window_left);
    hi = window_right < 0 ? len : std::min<std::int64_t>(len, d + window_right + 1);
    if (hi < lo) hi = lo;
  }
  /// key_range's [lo, hi) and, with keep_first, the first keys [0, first_hi) that row (b, i)
  /// admits too: those below the right bound and the key length (first_hi <= hi unless hi = lo).
  void key_ranges(std::int64_t b, std::int64_t i, std::int64_t& lo, std::int64_t& hi,
                  std::int64_t& first_hi) const noexcept {
    const std::int64_t len = key_len(b), d = diag(b, i);
    const std::int64_t right = window_right < 0 ? len : std::min<std::int64_t>(len, d + window_right + 1);
    first_hi = std::max<std::int64_t>(0, std::min(keep_first, right));
    key_range(b, i, lo, hi);
  }
};

/// The lowered form of one backward call (validate.cpp, lower_attention_backward). `fwd` holds
/// q, k, v and the options as the forward's Problem does; its `out` and `lse` are the forward's
/// O [B,Hq,Sq,Dv] and softmax_lse [B,Hq,Sq], here read, not written; `probs` is unused.
struct BackwardProblem {
  Problem fwd;
  Operand dout;              // dO [B,Hq,Sq,Dv]
  OutOperand dq, dk, dv;     // [B,Hq,Sq,D], [B,Hkv,Sk,D], [B,Hkv,Sk,Dv]
  OutOperand dsinks;         // dL/dz [Hq] (sx: its stride), written when data is set
};

}  // namespace qkv::detail
