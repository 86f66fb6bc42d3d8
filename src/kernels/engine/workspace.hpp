#pragma once
// The engine's per-thread workspace: the on-chip memory of FlashAttention-2 (Dao 2023,
// Algorithm 1), where a block of query rows Q_i, one tile of scores S_i^(j) and the running
// statistics m_i, l_i and accumulator O_i live while the key tiles K_j, V_j stream past. On a CPU
// "on chip" means the L1/L2 caches: one block's buffers take about 210 KiB at D = Dv = 128 with
// the AVX-512 tiles, less for smaller heads.
//
// Per block (BQ = Ops::kBq query rows, BK = Ops::kBk keys per tile), in the thread's workspace:
//   qt  [D][SP]      the block's queries transposed (SP = rows rounded up to the vector width);
//                    bf16 dot path: qp [ceil(D/2)][SP] bf16 pairs
//   s   [BK][SP]     scores of one tile, transposed (key-major): the vectors run over queries,
//                    so the row max and row sum of the online softmax are vertical operations
//   o   [BQ][Dvp]    the unnormalised output accumulator (Dvp = Dv rounded up to the width)
//   m, l, alpha      running max, running sum, rescale factor per row (fp32)
//   kbuf, vbuf       K/V tiles converted to fp32 (only for fp16/bf16 inputs or a Dv tail);
//                    with vp (V repacked as bf16 pairs) shared by the blocks of a group, each
//                    tile converted once per group (TileTag)
// Also here: the types every part shares (Row, Prefetch, the element types).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "core/problem.hpp"
#include "kernels/engine/isa_ops.hpp"

#ifndef QKV_ENGINE_NS
#error "define QKV_ENGINE_NS before including kernels/engine/workspace.hpp"
#endif

namespace qkv::detail::QKV_ENGINE_NS {

using i64 = std::int64_t;

enum class Elt { f32, bf16, f16 };

inline constexpr std::size_t kAlign = 64;
inline std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
inline i64 round_up(i64 n, i64 m) { return (n + m - 1) / m * m; }

/// The position terms of one query row (a score rule with kPosition, score_rule.hpp): the first
/// keys [0, first_hi) that window_keep_first admits besides [lo, hi), and ALiBi's slope and the
/// row's diagonal key (bias -slope |diag - j|; slope 0 without ALiBi).
struct Position {
  i64 first_hi = 0;
  i64 diag = 0;
  float slope = 0.0f;
};

/// One query row of a block: where it comes from, what it may attend, where it goes.
struct Row {
  i64 q_off;          // element offset of the row in q
  i64 lo, hi;         // admissible key range (causal, window, kv_lens)
  Position pos;       // keep-first range and ALiBi (read by rules with kPosition only)
  float sink;         // the head's sink logit z_h (-inf without sinks)
  i64 mask_off;       // element offset of (b, h, i, 0) in the mask
  i64 out_off;        // element offset of (b, h, i, 0) in out
  i64 lse_off;        // element offset of (b, h, i) in softmax_lse
};

/// The explicit mask at element offset `mo`: whether it admits the key (bool true, or an
/// additive term other than -inf), and the additive term in `add` (left as is for a bool mask).
[[gnu::always_inline]] inline bool mask_admits(const MaskOperand& m, i64 mo, float& add) {
  if (m.dtype == DType::b8) return static_cast<const std::uint8_t*>(m.data)[mo] != 0;
  add = m.dtype == DType::f32 ? static_cast<const float*>(m.data)[mo]
                              : static_cast<float>(static_cast<const double*>(m.data)[mo]);
  return add != -std::numeric_limits<float>::infinity();
}

/// Software prefetch of a tile of K or V rows, a few rows per call of step(), so that the
/// prefetches spread between the microkernel calls of one phase and the rows are in cache when
/// the next phase reads them: while QK^T of a tile runs, the tile's V rows are requested; while
/// PV runs, the next tile's K rows. On rows longer than L2 holds (Sk in the thousands, D = 128)
/// the hardware prefetchers alone leave the microkernels waiting on L3 or DRAM
/// (docs/performance.md, "What the kernels do for memory"). A prefetch never faults, and rows
/// past the tile are never requested.
struct Prefetch {
  const char* base = nullptr;  // first row
  i64 stride = 0;              // bytes between rows
  int rows = 0;                // rows in the tile
  int lines = 0;               // 64-byte lines per row
  int next = 0;                // first row not yet requested

  Prefetch() = default;
  Prefetch(const void* data, i64 elem_off, i64 row_stride, int nrows, i64 row_elems, int esize)
      : base(static_cast<const char*>(data) + elem_off * esize), stride(row_stride * esize),
        rows(nrows), lines(static_cast<int>((row_elems * esize + 63) / 64)) {}
  [[gnu::always_inline]] void step(int n) {
    const int end = std::min(rows, next + n);
    for (; next < end; ++next)
      for (int x = 0; x < lines; ++x) __builtin_prefetch(base + next * stride + x * 64, 0, 2);
  }
  void rest() { step(rows - next); }
};

/// Which K or V rows a converted or repacked tile buffer holds, so that the blocks of a group,
/// which share these buffers, convert or repack each tile once (BlockProcessor::process_group).
struct TileTag {
  const void* data;
  i64 off;  // element offset of the tile's first row
  int kt;   // rows; 0: holds nothing
  bool holds(const void* d, i64 o, int k) const { return kt == k && data == d && off == o; }
  void set(const void* d, i64 o, int k) { data = d; off = o; kt = k; }
};

/// One block's buffers, carved from the workspace (Workspace::carve).
struct Ws {
  float* qt;          // [D][SP] fp32, or bf16 pairs [ceil(D/2)][SP] (as uint32)
  float* qr;          // [BQ][D] fp32 query rows (dot-product form for a few rows; bf16/f16
                      // rows converted before packing Q)
  float* s;           // [BK][BQ]
  float* o;           // [BQ][Dvp]
  float* m;           // [BQ]
  float* l;           // [BQ]
  float* alpha;       // [BQ]
  float* lo_f;        // [BQ] admissible key range per row, as floats
  float* hi_f;        // [BQ]
  float* pos_f;       // [3][BQ] position terms per row as floats: first_hi, diag, slope
  float* kbuf;        // [BK][Dp] fp32 (converted K rows)
  float* vbuf;        // [BK][Dvp] fp32
  std::uint32_t* pp;  // [BK/2][BQ] bf16 pairs of P
  std::uint32_t* vp;  // [BK/2][Dvp] bf16 pairs of V
  Row* rows;          // [BQ]
  TileTag* tags;      // [3]: what kbuf, vbuf and vp hold
};
enum { kTagK, kTagV, kTagVp };

/// The sizes of one block's buffers for an ISA's tile traits.
template <IsaOps Ops>
struct Workspace {
  static constexpr int W = Ops::W;
  static constexpr int BQ = Ops::kBq;
  static constexpr int BK = Ops::kBk;

  static i64 dvp(const Problem& p) { return round_up(p.Dv, W); }
  static i64 dp(const Problem& p) { return round_up(p.D, 2); }

  static std::size_t ws_bytes(const Problem& p) {
    const std::size_t f = sizeof(float);
    return 2 * align_up(dp(p) * BQ * f) + align_up(BK * (BQ + W) * f) + align_up(BQ * dvp(p) * f) +
           5 * align_up(BQ * f) + align_up(3 * BQ * f) + align_up(BK * dp(p) * f) + align_up(BK * dvp(p) * f) +
           align_up(BK / 2 * BQ * 4) + align_up(BK / 2 * dvp(p) * 4) + align_up(BQ * sizeof(Row)) +
           align_up(3 * sizeof(TileTag));
  }

  static Ws carve(const Problem& p, char* base) {
    Ws w;
    const std::size_t f = sizeof(float);
    auto take = [&](std::size_t n) { char* r = base; base += align_up(n); return r; };
    w.qt = reinterpret_cast<float*>(take(dp(p) * BQ * f));
    w.qr = reinterpret_cast<float*>(take(dp(p) * BQ * f));
    w.s = reinterpret_cast<float*>(take(BK * (BQ + W) * f));
    w.o = reinterpret_cast<float*>(take(BQ * dvp(p) * f));
    w.m = reinterpret_cast<float*>(take(BQ * f));
    w.l = reinterpret_cast<float*>(take(BQ * f));
    w.alpha = reinterpret_cast<float*>(take(BQ * f));
    w.lo_f = reinterpret_cast<float*>(take(BQ * f));
    w.hi_f = reinterpret_cast<float*>(take(BQ * f));
    w.pos_f = reinterpret_cast<float*>(take(3 * BQ * f));
    w.kbuf = reinterpret_cast<float*>(take(BK * dp(p) * f));
    w.vbuf = reinterpret_cast<float*>(take(BK * dvp(p) * f));
    w.pp = reinterpret_cast<std::uint32_t*>(take(BK / 2 * BQ * 4));
    w.vp = reinterpret_cast<std::uint32_t*>(take(BK / 2 * dvp(p) * 4));
    w.rows = reinterpret_cast<Row*>(take(BQ * sizeof(Row)));
    w.tags = reinterpret_cast<TileTag*>(take(3 * sizeof(TileTag)));
    return w;
  }
};

}  // namespace qkv::detail::QKV_ENGINE_NS
