#pragma once
// The drivers: the whole problem cut into work items for the threads (OpenMP).
//
// flash: the outer loop of FlashAttention-2 (Dao 2023, Algorithm 1), one work item per (batch,
// head, group of up to kGroup query blocks), dynamically scheduled, head-major (the threads
// share one head's K/V in cache), within a head largest causal blocks first; the blocks of a
// group go through the same K/V tiles in lockstep (BlockProcessor::process_group), so each K/V
// tile is fetched from L3/DRAM once per group.
//
// decode: flash-decoding (Dao, Haziza, Massa, Sizov 2023): one item per (batch, KV head, row
// block, key chunk), where the rows are all query heads of one KV head times Sq (K and V read
// once per KV head) and the chunk size depends only on the problem; each item leaves its
// unnormalised O_c, m_c, l_c, and the chunk partials of each row are merged by log-sum-exp in
// chunk order (merge_partials_lse, lse_merge.hpp).
//
// No result depends on the number of threads or on the schedule.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/problem.hpp"
#include "kernels/engine/block.hpp"
#include "kernels/engine/decode_fast.hpp"
#include "kernels/engine/isa_ops.hpp"
#include "kernels/engine/lse_merge.hpp"
#include "kernels/engine/workspace.hpp"
#include "platform/team.hpp"

namespace qkv::detail::QKV_ENGINE_NS {

template <IsaOps Ops>
struct Drivers {
  using Bp = BlockProcessor<Ops>;
  using Fast = DecodeFast<Ops>;
  using Wsp = Workspace<Ops>;
  static constexpr int BQ = Ops::kBq;
  static constexpr int BK = Ops::kBk;
  static constexpr int kGroup = Bp::kGroup;

  // ---- flash: the whole problem --------------------------------------------------------------
  static std::size_t flash_ws(const Problem& p, int threads) { return kGroup * Wsp::ws_bytes(p) * threads; }

  template <Elt E, bool DP, class Rule>
  static void flash_impl(const Problem& p, char* ws, int threads) {
    const i64 nqb = (p.Sq + BQ - 1) / BQ;
    const i64 ngroup = (nqb + kGroup - 1) / kGroup;
    const i64 items = ngroup * p.B * p.Hq;
    const std::size_t wsb = Wsp::ws_bytes(p);
    run_team(threads, [&](const TeamLoops& team) {
      char* mine = ws + kGroup * wsb * team.thread();
      Ws w[kGroup];
      for (int x = 0; x < kGroup; ++x) w[x] = Wsp::carve(p, mine + x * wsb);
      // The blocks of a group read the same K/V tiles: one converted or repacked copy of each.
      for (int x = 1; x < kGroup; ++x) {
        w[x].kbuf = w[0].kbuf;
        w[x].vbuf = w[0].vbuf;
        w[x].vp = w[0].vp;
        w[x].tags = w[0].tags;
      }
      team.dynamic(items, [&](i64 it) {
        // One item: a group of adjacent query blocks (process_group). Head-major: consecutive
        // items, on every thread, share one head's K and V, which then stay in L2/L3 instead
        // of cycling through all heads' K/V. Within a head, last query blocks first: under causal
        // masks they see the most keys, and the small blocks at the end even out the threads.
        const i64 gq = it % ngroup, bh = it / ngroup;
        const i64 b = bh / p.Hq, h = bh % p.Hq;
        Block blk[kGroup];
        int g = 0;
        for (i64 qb = nqb - 1 - kGroup * gq; g < kGroup && qb >= 0; --qb, ++g) blk[g] = make_block(p, b, h, qb, w[g]);
        Bp::template process_group<E, DP, Rule>(p, blk, w, g);
        for (int x = 0; x < g; ++x) Bp::finish(p, w[x], blk[x].n);
      });
    });
  }

  // Query block qb of (b, h): its rows into w.rows, its key range.
  static Block make_block(const Problem& p, i64 b, i64 h, i64 qb, const Ws& w) {
    const i64 i0 = qb * BQ;
    Block blk;
    blk.b = b;
    blk.hk = p.kv_head(h);
    blk.n = static_cast<int>(std::min<i64>(BQ, p.Sq - i0));
    for (int r = 0; r < blk.n; ++r) w.rows[r] = Bp::make_row(p, b, h, i0 + r);
    Bp::block_range(w, blk.n, blk.ka, blk.kb, blk.max_lo, blk.min_hi);
    Bp::keep_first(w, blk);
    return blk;
  }

  // ---- decode: flash-decoding ------------------------------------------------------------------
  // Rows of one (b, KV head): r = g * Sq + i for the G query heads g of the group.
  static i64 decode_rows(const Problem& p) { return p.group() * p.Sq; }
  // Keys per chunk, fixed by the problem alone (never by the thread count): at most 64 chunks per
  // (b, KV head), at least kDecodeMinChunk keys each, partials bounded to about 16 MiB. Long
  // chunks let each thread read K and V in long contiguous runs, which streams faster than
  // 256-key chunks did (`qkv bench --shapes decode`). The price: fewer items to share out,
  // B x Hkv x ceil(Sk / 4096) of them.
  static constexpr i64 kDecodeMinChunk = 4096;
  static i64 decode_chunk(const Problem& p) {
    const i64 per_chunk_bytes = p.B * p.Hq * p.Sq * (Wsp::dvp(p) + 2) * 4;
    const i64 max_chunks = std::clamp<i64>((i64{16} << 20) / std::max<i64>(per_chunk_bytes, 1), 1, 64);
    const i64 c = std::max<i64>((p.Sk + max_chunks - 1) / max_chunks, kDecodeMinChunk);
    return round_up(c, BK);
  }
  static i64 decode_nchunks(const Problem& p) {
    return std::max<i64>(1, (p.Sk + decode_chunk(p) - 1) / decode_chunk(p));
  }
  static std::size_t decode_ws(const Problem& p, int threads) {
    const i64 parts = p.B * p.Hq * p.Sq * decode_nchunks(p);
    return Wsp::ws_bytes(p) * threads + align_up(parts * (Wsp::dvp(p) + 2) * sizeof(float));
  }

  template <Elt E, bool DP, class Rule>
  static void decode_impl(const Problem& p, char* ws, int threads) {
    const i64 R = decode_rows(p);
    const i64 nrb = (R + BQ - 1) / BQ;
    const i64 C = decode_chunk(p), NC = decode_nchunks(p);
    const i64 Dvp = Wsp::dvp(p);
    const std::size_t wsb = Wsp::ws_bytes(p);
    // partials: [b][hk][chunk][R] rows of (Dvp accumulators, m, l)
    float* parts = reinterpret_cast<float*>(ws + wsb * threads);
    const i64 row_f = Dvp + 2;
    const i64 items = p.B * p.Hkv * nrb * NC;
    const i64 G = p.group();
    const bool fast = Fast::decode_fast_ok(p);
    run_team(threads, [&](const TeamLoops& team) {
      const Ws w = Wsp::carve(p, ws + wsb * team.thread());
      team.dynamic(items, [&](i64 it) {
        const i64 c = it % NC;
        const i64 rb = (it / NC) % nrb;
        const i64 bhk = it / (NC * nrb);
        const i64 b = bhk / p.Hkv, hk = bhk % p.Hkv;
        const i64 r0 = rb * BQ;
        const int n = static_cast<int>(std::min<i64>(BQ, R - r0));
        for (int r = 0; r < n; ++r) {
          const i64 rr = r0 + r;
          w.rows[r] = Bp::make_row(p, b, hk * G + rr / p.Sq, rr % p.Sq);
        }
        Block blk;
        blk.b = b;
        blk.hk = hk;
        blk.n = n;
        i64 lo, hi;
        Bp::block_range(w, n, lo, hi, blk.max_lo, blk.min_hi);
        blk.ka = std::max(lo, c * C);
        blk.kb = std::min(hi, (c + 1) * C);
        if constexpr (Rule::kHasPosition) chunk_keep_first(w, blk, c * C, (c + 1) * C);
        if constexpr (!Rule::kHasMask && !Rule::kHasSoftcap) {
          if (fast) Fast::template process_fast<E, Rule>(p, blk, w);
          else Bp::template process<E, DP, Rule>(p, blk, w);
        } else {
          Bp::template process<E, DP, Rule>(p, blk, w);
        }
        float* dst = parts + ((bhk * NC + c) * R + r0) * row_f;
        for (int r = 0; r < n; ++r) {
          std::memcpy(dst + r * row_f, w.o + r * Dvp, Dvp * sizeof(float));
          dst[r * row_f + Dvp] = w.m[r];
          dst[r * row_f + Dvp + 1] = w.l[r];
        }
      });
      // Merge the chunk partials of each row in chunk order (independent of the schedule).
      team.fixed(p.B * p.Hkv * R, [&](i64 x) { merge_partials_lse(p, parts, NC, R, Dvp, G, x, w); });
    });
  }

  // Keep-first in chunk [cs, ce): the rows' first keys [0, max first_hi) that lie in the chunk
  // joined to its keys [ka, kb). In the first chunk they are keys [0, first_kb), a leading range
  // of their own while a gap separates them (Block::first_kb, as BlockProcessor::keep_first); in
  // a later one (keep_first longer than a chunk) the block's range runs from the chunk's start,
  // the keys between excluded by the rule. Either way by key positions alone: the same for any
  // thread count.
  static void chunk_keep_first(const Ws& w, Block& blk, i64 cs, i64 ce) {
    i64 first = 0;
    for (int r = 0; r < blk.n; ++r) first = std::max(first, w.rows[r].pos.first_hi);
    first = std::min(first, ce);
    if (first <= cs) return;
    if (blk.ka >= blk.kb) {
      blk.ka = cs;
      blk.kb = first;
    } else if (first >= blk.ka || cs > 0) {
      blk.ka = cs;
      blk.kb = std::max(blk.kb, first);
    } else {
      blk.first_kb = first;
    }
  }

  // Row x = (b Hkv + hk) R + rr of the decode rows: its NC chunk partials (O_c, m_c, l_c) in
  // `parts` ([b][hk][chunk][R] rows of Dvp accumulators, m, l) merged in chunk order (LseMerge,
  // lse_merge.hpp; a sink as one more partial) and written to out and softmax_lse. G: query heads per KV head. Uses w.o and
  // w.vbuf as scratch.
  [[gnu::always_inline]] static void merge_partials_lse(const Problem& p, const float* parts, i64 NC, i64 R,
                                                        i64 Dvp, i64 G, i64 x, const Ws& w) {
    const i64 row_f = Dvp + 2;
    const i64 bhk = x / R, rr = x % R;
    const i64 b = bhk / p.Hkv, hk = bhk % p.Hkv;
    const Row row = Bp::make_row(p, b, hk * G + rr / p.Sq, rr % p.Sq);
    LseMerge merge(reinterpret_cast<double*>(w.o), p.Dv);  // BQ * Dvp floats >= Dv doubles
    merge.run(NC, Dvp, [&](i64 c) { return parts + ((bhk * NC + c) * R + rr) * row_f; }, row.sink);
    float* acc = w.vbuf;  // scratch: vbuf no longer holds a tile
    w.tags[kTagV].kt = 0;
    for (i64 d = 0; d < p.Dv; ++d) acc[d] = merge.out(d);
    Bp::store_out(p, row.out_off, acc, 1.0f, merge.empty(), p.Dv);
    if (p.lse.data) Bp::store_scalar(p.lse.data, p.lse.dtype, row.lse_off, merge.lse());
  }
};

}  // namespace qkv::detail::QKV_ENGINE_NS
