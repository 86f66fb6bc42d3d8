#pragma once
// The lowered form of one attention_varlen, attention_varlen_backward or attention_paged call
// (validate_varlen.cpp), read by the serving kernel (src/kernels/serving.cpp) and the registry's
// other paths of packed calls (src/dispatch/packed.cpp). Plain data, strides in elements.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/problem.hpp"
#include "tensor/kv_codec.hpp"

namespace qkv::detail {

struct VarlenProblem {
  /// The packed operands as one B = 1 problem: q and out [1, Hq, total_q, X] (sh = the head
  /// stride, ss = the token stride), lse [1, Hq, total_q]; k and v: packed [1, Hkv, total_k, X], or
  /// for a paged call the pools, with sb = the block stride, sh = the head stride, ss = the slot
  /// stride. Options (scale, softcap, effective window, align, num_threads) as lowered there;
  /// Sq = total_q, Sk = total_k (paged: num_blocks * block_size).
  Problem p;
  std::vector<std::int64_t> cu_q;   // batch + 1 prefix sums of the query tokens
  std::vector<std::int64_t> cu_k;   // packed: batch + 1 prefix sums of the keys; paged: empty
  std::vector<std::int64_t> seq_k;  // keys of each sequence
  // Paged: sequence b's table row at block_table + b * bt_stride (int32).
  bool paged = false;
  std::int64_t block_size = 0;
  const std::int32_t* block_table = nullptr;
  std::int64_t bt_stride = 0, bt_col_stride = 1;
  // Quantized keys / values (int8, q8_0, fp8): p.k / p.v hold the codes (int8 or uint8), these
  // say how to decode a row. Float K and V leave the default (format f32, no scales) and are read
  // by their dtype.
  KVCodec kc, vc;

  std::int64_t batch() const noexcept { return static_cast<std::int64_t>(seq_k.size()); }
  std::int64_t seq_q(std::int64_t b) const noexcept { return cu_q[b + 1] - cu_q[b]; }
  /// Element offset of key j (position in sequence b) of KV head hk in k (in v: pass v's strides).
  std::int64_t key_off(const Operand& x, std::int64_t b, std::int64_t hk, std::int64_t j) const noexcept {
    if (!paged) return (cu_k[b] + j) * x.ss + hk * x.sh;
    const std::int64_t blk = block_table[b * bt_stride + (j / block_size) * bt_col_stride];
    return blk * x.sb + hk * x.sh + (j % block_size) * x.ss;
  }
  /// Key position of query i of sequence b's diagonal.
  [[gnu::always_inline]] std::int64_t diag(std::int64_t b, std::int64_t i) const noexcept {
    return p.align == Alignment::bottom_right ? i + seq_k[b] - seq_q(b) : i;
  }
  /// With window_keep_first: the first keys [0, first_hi) that query i of sequence b admits
  /// besides key_range's, those below the window's right bound and the sequence's key count (as
  /// Problem::key_ranges; 0 without keep-first).
  [[gnu::always_inline]] std::int64_t first_hi(std::int64_t b, std::int64_t i) const noexcept {
    const std::int64_t len = seq_k[b];
    const std::int64_t right =
        p.window_right < 0 ? len : std::min<std::int64_t>(len, diag(b, i) + p.window_right + 1);
    return std::max<std::int64_t>(0, std::min(p.keep_first, right));
  }
  /// Half-open range [lo, hi) of the keys that causal and window admit for query i of sequence b.
  void key_range(std::int64_t b, std::int64_t i, std::int64_t& lo, std::int64_t& hi) const noexcept {
    const std::int64_t len = seq_k[b];
    const std::int64_t d = p.align == Alignment::bottom_right ? i + len - seq_q(b) : i;
    lo = p.window_left < 0 ? 0 : std::max<std::int64_t>(0, d - p.window_left);
    hi = p.window_right < 0 ? len : std::min<std::int64_t>(len, d + p.window_right + 1);
    if (hi < lo) hi = lo;
  }
};

/// The lowered form of one attention_varlen_backward call: the forward's packed operands and
/// options, and each sequence as the B = 1 backward call qkv::attention_backward would lower
/// on [1, H, len, X] views of the packed tensors.
struct VarlenBackwardProblem {
  VarlenProblem vp;
  std::vector<BackwardProblem> seqs;  // each without dsinks: the sequences' dz are summed in order
  OutOperand dsinks;                  // dL/dz [Hq] when asked for (grad_sinks)
};

}  // namespace qkv::detail
