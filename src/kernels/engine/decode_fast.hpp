#pragma once
// The decode fast path: a few query rows, no explicit mask, no softcap (the position terms
// taken, through the score rule: ScoreRule<false, false, kPosition>). One chunk of keys of
// flash-decoding (Dao, Haziza, Massa, Sizov 2023) for the rows of one (batch, KV head) group (G
// query heads x Sq, at most kFastRows), with the rows as plain arrays instead of the padded
// kBq-row block of BlockProcessor::process; the same FlashAttention-2 inner loop (Dao 2023,
// Algorithm 1: scores, running max and sum, rescaled accumulator), leaving O, m and l of the
// chunk for the log-sum-exp merge (forward_schedule.hpp):
//   scores: D-vectorised FMAs into one accumulator per (row, key). Groups of kQkRows = 4 rows
//           take W / 4 keys at a time (4 on AVX-512), and the W accumulators are reduced
//           together by one transpose-and-add tree that pairs the lanes as Ops::hsum does, so
//           the same bits (Ops::hsum_w; on AVX-512 45 operations for 16 scores instead of 16
//           horizontal sums of 8 each). Fewer rows, and keys past the last full group, take one
//           key at a time with one horizontal sum per score (Ops::hsum);
//   softmax: per row, over the tile's scores as vectors (vector exp); with position terms each
//           score first goes through the rule's scalar form (scale, the position terms' bias, the key range
//           with keep-first);
//   PV: output rows in registers, broadcast(p_j) * v_j FMAs.
// bf16/fp16 K and V are converted in registers (Ops::load_bf16 / f16), never through a buffer.
// Keys admitted by only some rows of the group get -inf scores by select (NaN from an
// excluded K row is discarded) and weight-0 FMAs are skipped (masked) in PV. With keep-first the
// tiles of the block's first keys [0, first_kb) come before those of [ka, kb) (Block::first_kb),
// the gap between never read.
#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

#include "core/problem.hpp"
#include "kernels/engine/block.hpp"
#include "kernels/engine/isa_ops.hpp"
#include "kernels/engine/microkernels.hpp"
#include "kernels/engine/online_softmax.hpp"
#include "kernels/engine/score_rule.hpp"
#include "kernels/engine/size_switch.hpp"
#include "kernels/engine/workspace.hpp"

namespace qkv::detail::QKV_ENGINE_NS {

template <IsaOps Ops>
struct DecodeFast {
  using V = typename Ops::V;
  using Mk = Microkernels<Ops>;
  using Wsp = Workspace<Ops>;
  using Sm = OnlineSoftmax<Ops>;
  using Bp = BlockProcessor<Ops>;
  static constexpr int W = Ops::W;
  static constexpr int BQ = Ops::kBq;
  static constexpr int BK = Ops::kBk;

  static constexpr int kFastRows = BQ < 16 ? BQ : 16;
  // Keys per step of the single-row pipelined pass (process_fast_stream).
  static constexpr int kFastStep = BK < 32 ? BK : 32;
  // Rows per score call (one accumulator each, sharing every K load).
  static constexpr int kQkRows = 4;
  // Largest D / W for which the one-row pass keeps q and the output row in registers (2 N of
  // them, with room for the loads and the score).
  static constexpr int kStreamRegs = Ops::kAccRegs / 3 < 8 ? Ops::kAccRegs / 3 : 8;

  // Whether the fast path takes the call (its rule: no mask, no softcap; position terms or not).
  static bool decode_fast_ok(const Problem& p) {
    return p.mask.data == nullptr && p.softcap <= 0.0 && p.group() * p.Sq <= kFastRows &&
           p.D % W == 0 && p.Dv % W == 0 && p.q.dtype != DType::f64;
  }

  // The tiles of a block, BK keys each from Bp::first_tile: [ka, kb), and with a rule with
  // position terms keep-first's [0, first_kb) before them. The end of the tile at t0, and the
  // start of the one after the tile ending at t1 (t1 itself but at the end of the first keys).
  template <class Rule>
  [[gnu::always_inline]] static i64 tile_end(const Block& blk, i64 t0) {
    if constexpr (Rule::kHasPosition)
      if (t0 < blk.first_kb) return std::min<i64>(t0 + BK, blk.first_kb);
    return std::min<i64>(t0 + BK, blk.kb);
  }
  template <class Rule>
  [[gnu::always_inline]] static i64 after(const Block& blk, i64 t1) {
    if constexpr (Rule::kHasPosition)
      if (t1 == blk.first_kb) return blk.ka;
    return t1;
  }

  // The products below take the caller's score rule R only so that each rule has its own copies:
  // GCC inlines a function called from one place, and shared by the rules with and without
  // position terms they were left out of line, 7% slower decode without them (Hq 32, Hkv 8, bf16,
  // Sk 32768, one thread).
  // s[r * BK] = q_r . k for the key row at koff, rows r < MR.
  template <Elt E, int MR, class R>
  static void fast_qk_mk(const float* qr, i64 D, const void* k, i64 koff, float* s) {
    V acc[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) acc[r] = Ops::zero();
    for (i64 d = 0; d < D; d += W) {
      const V kv = Mk::template load_elt<E>(k, koff + d);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) acc[r] = Ops::fma(Ops::load(qr + r * D + d), kv, acc[r]);
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) s[r * BK] = Ops::hsum(acc[r]);
  }

  // s[r * BK + x] = q_r . k_x for kQkRows = 4 rows and W / 4 key rows from koff: the W scores'
  // partial sums reduced together by one transpose-and-add tree (Ops::hsum_w).
  template <Elt E>
  [[gnu::always_inline]] static void fast_qk_4w(const float* qr, i64 D, const void* k, i64 koff, i64 ks, float* s) {
    static_assert(kQkRows * (W / kQkRows) == W, "one accumulator per lane of the tree");
    constexpr int KX = W / kQkRows;
    V acc[W];
#pragma GCC unroll 16
    for (int i = 0; i < W; ++i) acc[i] = Ops::zero();
#pragma GCC unroll 2
    for (i64 d = 0; d < D; d += W) {
      V kv[KX];
#pragma GCC unroll 4
      for (int x = 0; x < KX; ++x) kv[x] = Mk::template load_elt<E>(k, koff + x * ks + d);
#pragma GCC unroll 4
      for (int r = 0; r < kQkRows; ++r) {
        const V qv = Ops::load(qr + r * D + d);
#pragma GCC unroll 4
        for (int x = 0; x < KX; ++x) acc[r * KX + x] = Ops::fma(qv, kv[x], acc[r * KX + x]);
      }
    }
    Ops::store_quarters(s, BK, Ops::hsum_w(acc));
  }

  // `pf` (the tile's V rows) advances by one row per key.
  template <Elt E, int MR, class R>
  static void fast_qk_rows(const float* qr, i64 D, const void* k, i64 koff, i64 ks, int kt, float* s,
                           Prefetch& pf) {
    int j0 = 0;
    if constexpr (MR == kQkRows && W >= kQkRows) {
      constexpr int KX = W / kQkRows;
      for (; j0 + KX <= kt; j0 += KX) {
        fast_qk_4w<E>(qr, D, k, koff + j0 * ks, ks, s + j0);
        pf.step(KX);
      }
    }
    for (int j = j0; j < kt; ++j) {
      fast_qk_mk<E, MR, R>(qr, D, k, koff + j * ks, s + j);
      pf.step(1);
    }
  }

  template <Elt E, class R>
  static void fast_qk(const float* qr, int n, i64 D, const void* k, i64 koff, i64 ks, int kt, float* s,
                      Prefetch& pf) {
    int r = 0;
    for (; r + kQkRows <= n; r += kQkRows) fast_qk_rows<E, kQkRows, R>(qr + r * D, D, k, koff, ks, kt, s + r * BK, pf);
    with_int<1, kQkRows - 1>(n - r, [&]<int MR>() __attribute__((always_inline)) {
      fast_qk_rows<E, MR, R>(qr + r * D, D, k, koff, ks, kt, s + r * BK, pf);
    });
    pf.rest();
  }

  static constexpr int fast_nc(int mr) {
    int nc = Ops::kAccRegs / mr;
    nc = nc > 8 ? 8 : nc;
    int p2 = 1;
    while (p2 * 2 <= nc) p2 *= 2;
    return p2;
  }

  // o[r][c*W..] = alpha[r] o[r][c*W..] + sum_j p[r][j] v_j[c*W..], MR rows, NC vectors.
  // `pf` (the next tile's K rows) advances by one row per key.
  template <Elt E, int MR, int NC, bool SKIP, class R>
  static void fast_pv_mk(const float* s, const void* v, i64 voff, i64 vs, int kt, float* o, i64 os,
                         const float* alpha, Prefetch& pf) {
    V acc[MR][NC];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) {
      const V a = Ops::set1(alpha[r]);
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) acc[r][c] = Ops::mul(Ops::load(o + r * os + c * W), a);
    }
    for (int j = 0; j < kt; ++j) {
      V vv[NC];
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) vv[c] = Mk::template load_elt<E>(v, voff + j * vs + c * W);
      pf.step(1);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const float pj = s[r * BK + j];
        const V pb = Ops::set1(pj);
        if constexpr (SKIP && Ops::kMaskedFma) {
          const auto k = Ops::nonzero(pb);
#pragma GCC unroll 8
          for (int c = 0; c < NC; ++c) acc[r][c] = Ops::fma_mask(pb, vv[c], acc[r][c], k);
        } else {
          if constexpr (SKIP) {
            if (pj == 0.0f) continue;
          }
#pragma GCC unroll 8
          for (int c = 0; c < NC; ++c) acc[r][c] = Ops::fma(pb, vv[c], acc[r][c]);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) Ops::store(o + r * os + c * W, acc[r][c]);
  }

  template <Elt E, int MR, bool SKIP, class R>
  static void fast_pv_rows(const float* s, const void* v, i64 voff, i64 vs, int kt, float* o, i64 os,
                           const float* alpha, int nvec, Prefetch& pf) {
    constexpr int NC = fast_nc(MR);
    int c = 0;
    for (; c + NC <= nvec; c += NC)
      fast_pv_mk<E, MR, NC, SKIP, R>(s, v, voff + c * W, vs, kt, o + c * W, os, alpha, pf);
    for (; c < nvec; ++c) fast_pv_mk<E, MR, 1, SKIP, R>(s, v, voff + c * W, vs, kt, o + c * W, os, alpha, pf);
  }

  template <Elt E, bool SKIP, class R>
  static void fast_pv(const float* s, int n, const void* v, i64 voff, i64 vs, int kt, float* o, i64 os,
                      const float* alpha, int nvec, Prefetch& pf) {
    int r = 0;
    for (; r + 4 <= n; r += 4)
      fast_pv_rows<E, 4, SKIP, R>(s + r * BK, v, voff, vs, kt, o + r * os, os, alpha + r, nvec, pf);
    with_int<1, 3>(n - r, [&]<int MR>() __attribute__((always_inline)) {
      fast_pv_rows<E, MR, SKIP, R>(s + r * BK, v, voff, vs, kt, o + r * os, os, alpha + r, nvec, pf);
    });
    pf.rest();
  }

  // Online softmax of one tile's scores s[r * BK + j] (keys t0 + j, j < kt) for n rows: scales,
  // excludes keys outside each row's [lo, hi), and leaves the weights in s and the accumulator
  // rescale factor in w.alpha. Returns whether any key of the tile was excluded for some row.
  // A rule with position terms forms each score by its scalar form from the row's Position
  // (w.rows[r].pos): their bias, keep-first's keys admitted.
  template <class Rule>
  static bool fast_softmax(const Ws& w, int n, float* s, i64 t0, int kt, const Rule& rule) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    [[maybe_unused]] const i64 t1 = t0 + kt;
    const int ktp = static_cast<int>(round_up(kt, W));
    bool partial = false;
    for (int r = 0; r < n; ++r) {
      float* sr = s + r * BK;
      const Row& row = w.rows[r];
      if constexpr (Rule::kHasPosition) {
        for (int j = 0; j < kt; ++j) {
          sr[j] = rule.score(sr[j], t0 + j, row.lo, row.hi, 0, row.pos);
          partial = partial || sr[j] == neg_inf;
        }
      } else {
        for (int j = 0; j < ktp; j += W) Ops::store(sr + j, rule.template scale_v<Ops>(Ops::load(sr + j)));
        if (t0 < row.lo || t1 > row.hi) {
          partial = true;
          for (int j = 0; j < kt; ++j)
            if (!Rule::in_range(t0 + j, row.lo, row.hi)) sr[j] = neg_inf;
        }
      }
      for (int j = kt; j < ktp; ++j) sr[j] = neg_inf;
      V mx = Ops::set1(neg_inf);
      for (int j = 0; j < ktp; j += W) mx = Ops::max(mx, Ops::load(sr + j));
      const typename Sm::Row st = Sm::Row::rescale(w.m[r], Sm::row_max(mx));
      const V vms = Ops::set1(st.shift);
      V sum = Ops::zero();
      for (int j = 0; j < ktp; j += W) {
        const V pj = Ops::exp(Ops::sub(Ops::load(sr + j), vms));
        Ops::store(sr + j, pj);
        sum = Ops::add(sum, pj);
      }
      w.l[r] = st.add(w.l[r], Ops::hsum(sum));
      w.m[r] = st.m_new;
      w.alpha[r] = st.alpha;
    }
    return partial;
  }

  // Rows of `blk` (w.rows, at most kFastRows) against keys [blk.ka, blk.kb), tile by tile: QK^T of
  // a tile, its softmax, then its PV product.
  template <Elt E, class Rule>
  static void process_fast_tiles(const Problem& p, const Block& blk, const Ws& w) {
    const int n = blk.n;
    const i64 D = p.D, Dvp = Wsp::dvp(p);
    const int nvec = static_cast<int>(Dvp / W);
    const Rule rule(p);
    Sm::begin(w.m, w.l, n);
    for (i64 x = 0; x < n * Dvp; ++x) w.o[x] = 0.0f;
    if (blk.ka >= blk.kb) return;
    for (int r = 0; r < n; ++r) Mk::template to_f32<E>(p.q.data, w.rows[r].q_off, w.qr + r * D, D);
    const i64 k_base = blk.b * p.k.sb + blk.hk * p.k.sh;
    const i64 v_base = blk.b * p.v.sb + blk.hk * p.v.sh;
    float* s = w.s;  // [n][BK] scores, then weights
    constexpr int esize = E == Elt::f32 ? 4 : 2;
    for (i64 t0 = Bp::template first_tile<Rule>(blk); t0 < blk.kb;
         t0 = Bp::template next_tile<Rule>(blk, t0)) {
      const i64 t1 = tile_end<Rule>(blk, t0), tn = after<Rule>(blk, t1);
      const int kt = static_cast<int>(t1 - t0);
      // As in BlockProcessor::step: this tile's V rows during QK^T, the next tile's K rows during PV.
      Prefetch pf_v(p.v.data, v_base + t0 * p.v.ss, p.v.ss, kt, p.Dv, esize);
      Prefetch pf_k(p.k.data, k_base + tn * p.k.ss, p.k.ss, static_cast<int>(std::min<i64>(BK, blk.kb - tn)), D,
                    esize);
      fast_qk<E, Rule>(w.qr, n, D, p.k.data, k_base + t0 * p.k.ss, p.k.ss, kt, s, pf_v);
      const bool partial = fast_softmax(w, n, s, t0, kt, rule);
      if (partial)
        fast_pv<E, true, Rule>(s, n, p.v.data, v_base + t0 * p.v.ss, p.v.ss, kt, w.o, Dvp, w.alpha, nvec, pf_k);
      else
        fast_pv<E, false, Rule>(s, n, p.v.data, v_base + t0 * p.v.ss, p.v.ss, kt, w.o, Dvp, w.alpha, nvec, pf_k);
    }
  }

  // One row (n = 1: MHA decode, one query per KV head) against keys [blk.ka, blk.kb), software-
  // pipelined over tiles: the scores of tile t + 1 are computed in the same pass as the PV product
  // of tile t, kFastStep keys at a time, so the K and V streams are read side by side and the
  // reads of both stay in flight together; with one row there is too little arithmetic per byte
  // to hide the switch between whole K and V tiles. With 2 or 4 rows (GQA) a pipelined pass
  // measured slower than tile by tile (process_fast_tiles), so it serves one row only
  // (`qkv bench --shapes decode`). Same arithmetic in the same order as process_fast_tiles, so the same
  // result bit for bit: each score is formed alone and each FMA chain runs in key order (the
  // accumulator is rescaled once per tile, then multiplied by 1 between steps).
  template <Elt E, class Rule>
  static void process_fast_stream(const Problem& p, const Block& blk, const Ws& w) {
    const i64 D = p.D, Dvp = Wsp::dvp(p);
    const int nvec = static_cast<int>(Dvp / W);
    const Rule rule(p);
    Sm::begin(w.m, w.l, 1);
    for (i64 x = 0; x < Dvp; ++x) w.o[x] = 0.0f;
    if (blk.ka >= blk.kb) return;
    Mk::template to_f32<E>(p.q.data, w.rows[0].q_off, w.qr, D);
    const i64 k_base = blk.b * p.k.sb + blk.hk * p.k.sh;
    const i64 v_base = blk.b * p.v.sb + blk.hk * p.v.sh;
    const i64 ks = p.k.ss, vs = p.v.ss;
    static constexpr float kOne[1] = {1.0f};
    float* s_cur = w.s;  // [BK] scores of the current tile, then its weights
    float* s_nxt = w.s + BK;
    Prefetch none;
    i64 t0 = Bp::template first_tile<Rule>(blk);
    int kt = static_cast<int>(tile_end<Rule>(blk, t0) - t0);
    for (int j = 0; j < kt; ++j) fast_qk_mk<E, 1, Rule>(w.qr, D, p.k.data, k_base + (t0 + j) * ks, s_cur + j);
    while (kt > 0) {
      const i64 t1 = after<Rule>(blk, t0 + kt);  // the next tile
      const int ktn = static_cast<int>(tile_end<Rule>(blk, t1) - t1);
      const bool partial = fast_softmax(w, 1, s_cur, t0, kt, rule);
      const int steps = std::max(kt, ktn);
      for (int j = 0; j < steps; j += kFastStep) {
        for (int jj = j; jj < std::min(j + kFastStep, ktn); ++jj)
          fast_qk_mk<E, 1, Rule>(w.qr, D, p.k.data, k_base + (t1 + jj) * ks, s_nxt + jj);
        if (j < kt) {
          const int cnt = std::min(kFastStep, kt - j);
          const float* alpha = j == 0 ? w.alpha : kOne;
          const i64 voff = v_base + (t0 + j) * vs;
          if (partial) fast_pv_rows<E, 1, true, Rule>(s_cur + j, p.v.data, voff, vs, cnt, w.o, Dvp, alpha, nvec, none);
          else fast_pv_rows<E, 1, false, Rule>(s_cur + j, p.v.data, voff, vs, cnt, w.o, Dvp, alpha, nvec, none);
        }
      }
      std::swap(s_cur, s_nxt);
      t0 = t1;
      kt = ktn;
    }
  }

  // process_fast_stream with q and the output row in registers (D = Dv = N vectors, N at most
  // kStreamRegs): key by key, the score of key j of the next tile, then the PV update of key j of
  // this one, so the two streams advance together at the finest grain and no output row goes
  // through memory between steps. The same operations in the same order as
  // process_fast_stream, so the same result bit for bit.
  template <Elt E, int N, bool SKIP, class R>
  static void stream_keys(const V* q, V* acc, const float* sc, int kt, const void* v, i64 voff, i64 vs,
                          float* sn, int ktn, const void* k, i64 koff, i64 ks) {
    const int steps = std::max(kt, ktn);
    for (int j = 0; j < steps; ++j) {
      if (j < ktn) {
        V a = Ops::zero();
#pragma GCC unroll 8
        for (int d = 0; d < N; ++d) a = Ops::fma(q[d], Mk::template load_elt<E>(k, koff + j * ks + d * W), a);
        sn[j] = Ops::hsum(a);
      }
      if (j < kt) {
        const float pj = sc[j];
        const V pb = Ops::set1(pj);
        if constexpr (SKIP && Ops::kMaskedFma) {
          const auto m = Ops::nonzero(pb);
#pragma GCC unroll 8
          for (int c = 0; c < N; ++c) acc[c] = Ops::fma_mask(pb, Mk::template load_elt<E>(v, voff + j * vs + c * W), acc[c], m);
        } else {
          if constexpr (SKIP) {
            if (pj == 0.0f) continue;
          }
#pragma GCC unroll 8
          for (int c = 0; c < N; ++c) acc[c] = Ops::fma(pb, Mk::template load_elt<E>(v, voff + j * vs + c * W), acc[c]);
        }
      }
    }
  }

  template <Elt E, class Rule, int N>
  static void process_fast_stream_regs(const Problem& p, const Block& blk, const Ws& w) {
    const Rule rule(p);
    Sm::begin(w.m, w.l, 1);
    V acc[N], q[N];
    for (int c = 0; c < N; ++c) acc[c] = Ops::zero();
    if (blk.ka < blk.kb) {
      Mk::template to_f32<E>(p.q.data, w.rows[0].q_off, w.qr, p.D);  // p.D == N * W
      for (int d = 0; d < N; ++d) q[d] = Ops::load(w.qr + d * W);
      const i64 k_base = blk.b * p.k.sb + blk.hk * p.k.sh;
      const i64 v_base = blk.b * p.v.sb + blk.hk * p.v.sh;
      const i64 ks = p.k.ss, vs = p.v.ss;
      float* s_cur = w.s;
      float* s_nxt = w.s + BK;
      i64 t0 = Bp::template first_tile<Rule>(blk);
      int kt = static_cast<int>(tile_end<Rule>(blk, t0) - t0);
      stream_keys<E, N, false, Rule>(q, acc, s_cur, 0, p.v.data, 0, vs, s_cur, kt, p.k.data, k_base + t0 * ks, ks);
      while (kt > 0) {
        const i64 t1 = after<Rule>(blk, t0 + kt);  // the next tile
        const int ktn = static_cast<int>(tile_end<Rule>(blk, t1) - t1);
        const bool partial = fast_softmax(w, 1, s_cur, t0, kt, rule);
        const V a = Ops::set1(w.alpha[0]);
        for (int c = 0; c < N; ++c) acc[c] = Ops::mul(acc[c], a);
        if (partial)
          stream_keys<E, N, true, Rule>(q, acc, s_cur, kt, p.v.data, v_base + t0 * vs, vs, s_nxt, ktn, p.k.data, k_base + t1 * ks, ks);
        else
          stream_keys<E, N, false, Rule>(q, acc, s_cur, kt, p.v.data, v_base + t0 * vs, vs, s_nxt, ktn, p.k.data, k_base + t1 * ks, ks);
        std::swap(s_cur, s_nxt);
        t0 = t1;
        kt = ktn;
      }
    }
    for (int c = 0; c < N; ++c) Ops::store(w.o + c * W, acc[c]);
  }

  // Rows of `blk` (w.rows, at most kFastRows) against keys [blk.ka, blk.kb): leaves the
  // unnormalised O, m and l in `w`, as BlockProcessor::process does.
  template <Elt E, class Rule>
  static void process_fast(const Problem& p, const Block& blk, const Ws& w) {
    static_assert(!Rule::kHasMask && !Rule::kHasSoftcap, "decode_fast_ok");
    if (blk.n == 1) {
      // q and the output row in registers when they fit: D = Dv = N vectors, N <= kStreamRegs.
      const auto in_regs = [&]<int N>() __attribute__((always_inline)) {
        process_fast_stream_regs<E, Rule, N>(p, blk, w);
      };
      if (p.D == p.Dv && with_int<1, kStreamRegs>(p.D / W, in_regs)) return;
      return process_fast_stream<E, Rule>(p, blk, w);
    }
    process_fast_tiles<E, Rule>(p, blk, w);
  }
};

}  // namespace qkv::detail::QKV_ENGINE_NS
