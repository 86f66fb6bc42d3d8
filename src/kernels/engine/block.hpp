#pragma once
// The block processor: one block of up to Ops::kBq query rows against the admissible keys, in
// tiles of Ops::kBk keys, with the online softmax. This is the body of the outer loop of
// FlashAttention-2 (Dao 2023, Algorithm 1) for one Q_i: start m_i = -inf, l_i = 0, O_i = 0
// (begin), then for each key tile S = Q_i K_j^T, the running max and sum, O_i rescaled plus P V
// (step), and at the end O_i / l_i and L_i = m_i + log(l_i) (finish). flash runs whole blocks;
// decode runs one chunk of keys per call and merges the chunks (forward_schedule.hpp).
//
// Online softmax per tile: m' = max(m, max_j s_j), alpha = exp(m - m'), p_j = exp(s_j - m'),
// l = alpha l + sum_j p_j, O = alpha O + P V; after the last tile O /= l (the division of each
// element by l, once, at the end: one rounding) and softmax_lse = m + log(l).
//
// Masks. Key tiles outside the union of the rows' [lo, hi) (causal, window, kv_lens) are never
// read; with keep-first the tiles of its first keys [0, first_kb) are read too, before the
// window's (Block::first_kb), the gap between them never. A tile is "full" when every row of the
// block admits every key of it and no explicit mask is given; otherwise excluded scores are set
// to -inf (select, never add, so NaN computed from an excluded K row is discarded) and the PV
// product skips zero weights, so NaN or inf stored in an excluded V row never meets a 0 weight
// (0 * NaN). Causal, window and kv_lens edges take a vector select per query vector; so do
// keep-first's first keys (one more select) and ALiBi's bias (per lane, full tiles too). Softcap
// and explicit masks take a scalar pass (tanh from libm), with the position terms where they are
// combined with one of those. The scores come from the call's score rule
// (score_rule.hpp), a template parameter of the block's functions. An attention sink joins the
// row once, at the end (finish).
//
// bf16 inputs with the AVX512_BF16 dot product (Ops::kHasDpbf16 and bf16_dot): QK^T uses
// vdpbf16ps on (d, d+1) pairs of Q (packed) and K (read in place); PV converts P to bf16 and
// uses vdpbf16ps with V repacked as (key, key+1) pairs. Partially masked tiles use the fp32 PV
// with V converted, for the zero-weight skip.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/problem.hpp"
#include "kernels/engine/isa_ops.hpp"
#include "kernels/engine/microkernels.hpp"
#include "kernels/engine/online_softmax.hpp"
#include "kernels/engine/score_rule.hpp"
#include "kernels/engine/workspace.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail::QKV_ENGINE_NS {

/// A block of rows (in Ws::rows) and the keys it is to see.
struct Block {
  i64 b, hk;       // batch, KV head
  int n;           // rows
  i64 ka, kb;      // key range to process (already intersected with the rows' union)
  i64 max_lo, min_hi;
  i64 first_kb = 0;  // keep-first: keys [0, first_kb) processed too, before [ka, kb) (first_kb < ka)
};

template <IsaOps Ops>
struct BlockProcessor {
  using V = typename Ops::V;
  using Mk = Microkernels<Ops>;
  using Wsp = Workspace<Ops>;
  using Sm = OnlineSoftmax<Ops>;
  static constexpr int W = Ops::W;
  static constexpr int BQ = Ops::kBq;
  static constexpr int BK = Ops::kBk;
  // Blocks of at most this many rows use the dot-product form of QK^T (vector ISAs only).
  static constexpr int kFewRows = W >= 8 ? 4 : 0;
  // Query blocks per flash work item (process_group).
  static constexpr int kGroup = 4;

  // Rows of `blk` against keys [blk.ka, blk.kb): leaves the unnormalised O, m and l in `w`.
  template <Elt E, bool DP, class Rule>
  static void process(const Problem& p, const Block& blk, const Ws& w) {
    begin<E, DP>(p, blk, w);
    if constexpr (Rule::kHasPosition)
      for (i64 t0 = 0; t0 < blk.first_kb; t0 += BK) step<E, DP, Rule>(p, blk, w, t0, true);
    for (i64 t0 = blk.ka; t0 < blk.kb; t0 += BK) step<E, DP, Rule>(p, blk, w, t0, true);
  }

  // The next tile of a block after the one at t0: keep-first's tiles [0, first_kb) lead to ka.
  template <class Rule>
  static i64 next_tile(const Block& blk, i64 t0) {
    if constexpr (Rule::kHasPosition)
      if (t0 < blk.first_kb) return t0 + BK < blk.first_kb ? t0 + BK : blk.ka;
    return t0 + BK;
  }
  // The first tile of a block.
  template <class Rule>
  static i64 first_tile(const Block& blk) {
    if constexpr (Rule::kHasPosition)
      if (blk.first_kb > 0) return 0;
    return blk.ka;
  }

  // Up to kGroup query blocks of one (batch, head), tile by tile in lockstep: the later blocks
  // read each K/V tile from L1/L2 just after the first, so K and V stream from L3 or DRAM once per
  // group instead of once per block (long rows: Sq = Sk = 16384, D = 128). Each block sees its
  // own tiles in its own order, exactly as process() would: grouping changes no result.
  template <Elt E, bool DP, class Rule>
  static void process_group(const Problem& p, const Block* blk, const Ws* w, int g) {
    i64 t[kGroup];
    for (int x = 0; x < g; ++x) {
      begin<E, DP>(p, blk[x], w[x]);
      t[x] = first_tile<Rule>(blk[x]);
    }
    for (bool more = g > 0; more;) {
      more = false;
      bool prefetch = true;  // the first block with a tile left requests the next rows
      for (int x = 0; x < g; ++x) {
        if (t[x] >= blk[x].kb) continue;
        step<E, DP, Rule>(p, blk[x], w[x], t[x], prefetch);
        prefetch = false;
        t[x] = next_tile<Rule>(blk[x], t[x]);
        more = more || t[x] < blk[x].kb;
      }
    }
  }

  // A few rows: dot-product form (vectors along D) instead of outer products over queries.
  static bool few_rows(int n) { return n <= kFewRows; }

  // Starts a block: running max and sum, zero accumulator, packed queries, row ranges.
  template <Elt E, bool DP>
  static void begin(const Problem& p, const Block& blk, const Ws& w) {
    const int n = blk.n;
    const int nqv = (n + W - 1) / W;
    const int sp = nqv * W;
    const i64 D = p.D, Dvp = Wsp::dvp(p);

    Sm::begin(w.m, w.l, BQ);
    for (i64 x = 0; x < n * Dvp; ++x) w.o[x] = 0.0f;
    for (int x = 0; x < 3; ++x) w.tags[x].kt = 0;  // the inputs may have changed since the last call
    if (blk.ka >= blk.kb) return;

    const bool few = few_rows(n);
    // Pack Q: transposed fp32 (or bf16 pairs for the dot-product path), padded rows zero.
    if constexpr (DP) {
      pack_qp(p, w, n, sp);
    } else if (few) {
      for (int r = 0; r < n; ++r) Mk::template to_f32<E>(p.q.data, w.rows[r].q_off, w.qr + r * D, D);
    } else {
      pack_qt<E>(p, w, n, sp);
    }

    // Row ranges as floats for the vector select (exact while key indices stay below 2^24).
    if (vec_ranges(blk))
      for (int r = 0; r < sp; ++r) {
        w.lo_f[r] = r < n ? static_cast<float>(w.rows[r].lo) : -1e30f;
        w.hi_f[r] = r < n ? static_cast<float>(w.rows[r].hi) : 1e30f;
      }
    // The position terms too (padded rows: no keep-first, slope 0).
    if (has_position(p) && vec_position(p, blk))
      for (int r = 0; r < sp; ++r)
        ScoreRule<>::position_lanes(r < n ? w.rows[r].pos : Position{}, w.pos_f[r], w.pos_f[BQ + r],
                                    w.pos_f[2 * BQ + r]);
  }

  static bool vec_ranges(const Block& blk) { return blk.kb < (i64{1} << 24); }
  static bool vec_position(const Problem& p, const Block& blk) {
    return vec_ranges(blk) && ScoreRule<false, false, true>::position_exact(p);
  }

  // w.qt[d * sp + r] = q_r[d] (fp32), rows r >= n zero; bf16/f16 rows are converted into w.qr
  // first.
  template <Elt E>
  static void pack_qt(const Problem& p, const Ws& w, int n, int sp) {
    const i64 D = p.D;
    const char* src[BQ];
    for (int r = 0; r < n; ++r) {
      if constexpr (E == Elt::f32) {
        src[r] = reinterpret_cast<const char*>(static_cast<const float*>(p.q.data) + w.rows[r].q_off);
      } else {
        Mk::template to_f32<E>(p.q.data, w.rows[r].q_off, w.qr + r * D, D);
        src[r] = reinterpret_cast<const char*>(w.qr + r * D);
      }
    }
    Mk::transpose_words(src, n, D, w.qt, sp);
  }

  // bf16 pairs for vdpbf16ps: qp[dp * sp + r] = (q_r[2 dp], q_r[2 dp + 1]) (Mk::pack_pairs).
  static void pack_qp(const Problem& p, const Ws& w, int n, int sp) {
    const char* src[BQ];
    for (int r = 0; r < n; ++r)
      src[r] = reinterpret_cast<const char*>(static_cast<const std::uint16_t*>(p.q.data) + w.rows[r].q_off);
    Mk::pack_pairs(src, n, p.D, reinterpret_cast<std::uint32_t*>(w.qt), sp);
  }

  // One key tile [t0, min(t0 + BK, blk.kb)) of a started block: S = QK^T, masks, online softmax,
  // O = alpha O + PV. `prefetch`: request this tile's V and the next tile's K rows.
  template <Elt E, bool DP, class Rule>
  static void step(const Problem& p, const Block& blk, const Ws& w, i64 t0, bool prefetch) {
    const int n = blk.n;
    const int nqv = (n + W - 1) / W;
    const int sp = nqv * W;
    const int ssp = sp + W;  // score pitch off a power of two (L1 set conflicts)
    const i64 D = p.D, Dv = p.Dv, Dvp = Wsp::dvp(p);
    const int nvec = static_cast<int>(Dvp / W);
    const Rule rule(p);
    const bool few = few_rows(n);
    const i64 k_base = blk.b * p.k.sb + blk.hk * p.k.sh;
    const i64 v_base = blk.b * p.v.sb + blk.hk * p.v.sh;
    const bool v_inplace = E == Elt::f32 && Dv % W == 0;
    constexpr int esize = E == Elt::f32 ? 4 : 2;

    i64 end = blk.kb;
    if constexpr (Rule::kHasPosition) end = t0 < blk.first_kb ? blk.first_kb : blk.kb;
    const i64 t1 = std::min<i64>(t0 + BK, end);
    const int kt = static_cast<int>(t1 - t0);
    const bool full = Rule::full(t0, t1, blk.max_lo, blk.min_hi);
    // This tile's V rows are requested during QK^T, the next tile's K rows during PV.
    const int pk = prefetch ? static_cast<int>(std::min<i64>(BK, blk.kb - t1)) : 0;
    Prefetch pf_v(p.v.data, v_base + t0 * p.v.ss, p.v.ss, prefetch ? kt : 0, Dv, esize);
    Prefetch pf_k(p.k.data, k_base + t1 * p.k.ss, p.k.ss, pk, D, esize);

    // S = Q K^T for this tile.
    if constexpr (DP) {
      pf_v.rest();
      Ops::qk_bf16(reinterpret_cast<const std::uint32_t*>(w.qt), nqv,
                   static_cast<const std::uint16_t*>(p.k.data) + k_base + t0 * p.k.ss, p.k.ss, D,
                   kt, w.s, ssp);
    } else {
      const float* kt_ptr;
      i64 kstride;
      if constexpr (E == Elt::f32) {
        kt_ptr = static_cast<const float*>(p.k.data) + k_base + t0 * p.k.ss;
        kstride = p.k.ss;
      } else {
        const i64 koff = k_base + t0 * p.k.ss;
        if (!w.tags[kTagK].holds(p.k.data, koff, kt)) {
          for (int j = 0; j < kt; ++j) Mk::template to_f32<E>(p.k.data, koff + j * p.k.ss, w.kbuf + j * D, D);
          w.tags[kTagK].set(p.k.data, koff, kt);
        }
        kt_ptr = w.kbuf;
        kstride = D;
      }
      if (few) {
        pf_v.rest();
        Mk::qk_dot(w.qr, n, sp, D, kt_ptr, kstride, kt, w.s, ssp);
      } else {
        Mk::qk_tile(w.qt, nqv, kt_ptr, kstride, D, kt, w.s, ssp, pf_v);
      }
    }

    // Scores by the rule (score_rule.hpp): a full tile without options (or with keep-first alone)
    // is only scaled, in the softmax pass (mul); causal/window/kv_lens edges and the position
    // terms take the rule's vector form, a select (and ALiBi's bias) per query vector; a mask or
    // softcap its scalar form.
    float mul = rule.scale;
    bool vec = false;
    bool pass = !full || Rule::kHasSoftcap;  // whether the scores need more than the scale
    if constexpr (Rule::kHasPosition) pass = pass || !p.alibi.empty();
    if constexpr (Rule::kVector) {
      vec = !full && vec_ranges(blk);
      if (vec) {
        mul = 1.0f;
        for (int c = 0; c < nqv; ++c) {
          const V lo = Ops::load(w.lo_f + c * W), hi = Ops::load(w.hi_f + c * W);
          for (int j = 0; j < kt; ++j) {
            float* x = w.s + j * ssp + c * W;
            Ops::store(x, rule.template vec<Ops>(Ops::load(x), lo, hi, Ops::set1(static_cast<float>(t0 + j))));
          }
        }
      }
    } else if constexpr (Rule::kVectorForm) {  // position terms
      vec = pass && vec_position(p, blk);
      if (vec) {
        mul = 1.0f;
        position_scores(rule, w, nqv, ssp, t0, kt, full, t0 < p.keep_first, !p.alibi.empty());
      }
    }
    if (!vec && pass) {
      mul = 1.0f;
      for (int r = 0; r < n; ++r) {
        const Row& row = w.rows[r];
        for (int j = 0; j < kt; ++j) {
          float& x = w.s[j * ssp + r];
          x = rule.score(x, t0 + j, row.lo, row.hi, row.mask_off, row.pos);
        }
      }
      // Padded rows (r >= n) keep their scores of the zero query (0): finite, never stored.
    }

    softmax_tile(w.s, ssp, kt, nqv, mul, w.m, w.l, w.alpha);

    // O = alpha O + P V.
    if constexpr (DP) {
      if (full) {
        pf_k.rest();
        Ops::pack_p_bf16(w.s, ssp, nqv, kt, w.pp);
        const i64 voff = v_base + t0 * p.v.ss;
        if (!w.tags[kTagVp].holds(p.v.data, voff, kt)) {
          Ops::pack_v_bf16(static_cast<const std::uint16_t*>(p.v.data) + voff, p.v.ss, Dv, nvec, kt, w.vp);
          w.tags[kTagVp].set(p.v.data, voff, kt);
        }
        Ops::pv_bf16(w.pp, sp, w.vp, nvec, (kt + 1) / 2, w.o, Dvp, w.alpha, n);
        return;
      }
    }
    const float* vt;
    i64 vs;
    if (v_inplace) {
      vt = static_cast<const float*>(p.v.data) + v_base + t0 * p.v.ss;
      vs = p.v.ss;
    } else {
      const i64 voff = v_base + t0 * p.v.ss;
      if (!w.tags[kTagV].holds(p.v.data, voff, kt)) {
        for (int j = 0; j < kt; ++j) {
          float* dst = w.vbuf + j * Dvp;
          Mk::template to_f32<E>(p.v.data, voff + j * p.v.ss, dst, Dv);
          for (i64 x = Dv; x < Dvp; ++x) dst[x] = 0.0f;
        }
        w.tags[kTagV].set(p.v.data, voff, kt);
      }
      vt = w.vbuf;
      vs = Dvp;
    }
    if (full)
      Mk::template pv_tile<false>(w.s, ssp, vt, vs, kt, w.o, Dvp, w.alpha, n, nvec, pf_k);
    else
      Mk::template pv_tile<true>(w.s, ssp, vt, vs, kt, w.o, Dvp, w.alpha, n, nvec, pf_k);
  }

  // The scores of a tile by a rule with position terms, in place, W rows at a time (the rule's
  // vector form): full, scaled and biased; else keys outside each row's range (and keep-first's
  // keys, `first`: the tile starts below keep_first) set to -inf. `alibi`: whether to bias.
  template <class Rule>
  static void position_scores(const Rule& rule, const Ws& w, int nqv, int ssp, i64 t0, int kt, bool full,
                              bool first, bool alibi) {
    for (int c = 0; c < nqv; ++c) {
      const PositionV<Ops> ps =
          PositionV<Ops>::load(w.pos_f + c * W, w.pos_f + BQ + c * W, w.pos_f + 2 * BQ + c * W, alibi);
      float* sc = w.s + c * W;
      if (full) {
        for (int j = 0; j < kt; ++j)
          Ops::store(sc + j * ssp,
                     rule.template vec_full<Ops>(Ops::load(sc + j * ssp), Ops::set1(static_cast<float>(t0 + j)), ps));
        continue;
      }
      const V lo = Ops::load(w.lo_f + c * W), hi = Ops::load(w.hi_f + c * W);
      for (int j = 0; j < kt; ++j)
        Ops::store(sc + j * ssp, rule.template vec<Ops>(Ops::load(sc + j * ssp), lo, hi,
                                                         Ops::set1(static_cast<float>(t0 + j)), ps, first));
    }
  }

  // Online-softmax update of one tile (online_softmax.hpp, rows in lanes): scores (times `mul`)
  // -> weights, running m and l, alpha.
  static void softmax_tile(float* s, int sp, int kt, int nqv, float mul, float* m, float* l,
                           float* alpha) {
    const V vmul = Ops::set1(mul);
    for (int c = 0; c < nqv; ++c) {
      float* sc = s + c * W;
      // The scaled scores are not stored: the exp pass scales them again (the same products),
      // which is cheaper than a store and a reload. (mul = 1 multiplies exactly.)
      V mx = Ops::set1(-std::numeric_limits<float>::infinity());
      for (int j = 0; j < kt; ++j) mx = Ops::max(mx, Ops::mul(Ops::load(sc + j * sp), vmul));
      const typename Sm::Lanes st = Sm::Lanes::rescale(m + c * W, mx);
      const V ms = st.shift;
      V sum0 = Ops::zero(), sum1 = Ops::zero();
      int j = 0;
      for (; j + 2 <= kt; j += 2) {
        const V p0 = Ops::exp(Ops::sub(Ops::mul(Ops::load(sc + j * sp), vmul), ms));
        const V p1 = Ops::exp(Ops::sub(Ops::mul(Ops::load(sc + (j + 1) * sp), vmul), ms));
        Ops::store(sc + j * sp, p0);
        Ops::store(sc + (j + 1) * sp, p1);
        sum0 = Ops::add(sum0, p0);
        sum1 = Ops::add(sum1, p1);
      }
      if (j < kt) {
        const V p0 = Ops::exp(Ops::sub(Ops::mul(Ops::load(sc + j * sp), vmul), ms));
        Ops::store(sc + j * sp, p0);
        sum0 = Ops::add(sum0, p0);
      }
      st.add(m + c * W, l + c * W, alpha + c * W, Ops::add(sum0, sum1));
    }
  }

  // ---- rows and ranges -----------------------------------------------------------------------
  static Row make_row(const Problem& p, i64 b, i64 h, i64 i) {
    Row r;
    r.q_off = b * p.q.sb + h * p.q.sh + i * p.q.ss;
    ScoreRule<>::key_range(p, b, i, r.lo, r.hi);
    r.mask_off = ScoreRule<>::mask_row(p, b, h, i);
    if (has_position(p)) r.pos = ScoreRule<>::position(p, b, h, i);
    r.sink = p.sinks.empty() ? -std::numeric_limits<float>::infinity() : static_cast<float>(p.sinks[static_cast<std::size_t>(h)]);
    r.out_off = b * p.out.sb + h * p.out.sh + i * p.out.ss;
    r.lse_off = b * p.lse.sb + h * p.lse.sh + i * p.lse.ss;
    return r;
  }

  static void block_range(const Ws& w, int n, i64& lo_min, i64& hi_max, i64& max_lo, i64& min_hi) {
    lo_min = std::numeric_limits<i64>::max();
    hi_max = std::numeric_limits<i64>::min();
    max_lo = std::numeric_limits<i64>::min();
    min_hi = std::numeric_limits<i64>::max();
    for (int r = 0; r < n; ++r) {
      const Row& row = w.rows[r];
      if (row.lo >= row.hi) continue;  // an empty row constrains nothing
      lo_min = std::min(lo_min, row.lo);
      hi_max = std::max(hi_max, row.hi);
      max_lo = std::max(max_lo, row.lo);
      min_hi = std::min(min_hi, row.hi);
    }
    if (lo_min > hi_max) { lo_min = hi_max = 0; }
    // A tile is full only if every row admits all of it, empty rows included.
    for (int r = 0; r < n; ++r)
      if (w.rows[r].lo >= w.rows[r].hi) { max_lo = std::numeric_limits<i64>::max(); min_hi = 0; }
  }

  // Keep-first: the block's first keys [0, max first_hi) joined to its range [ka, kb), as a
  // leading range of their own while a gap separates them (the window's tiles alone otherwise
  // skip the first keys; the gap between is never read).
  static void keep_first(const Ws& w, Block& blk) {
    i64 first = 0;
    for (int r = 0; r < blk.n; ++r) first = std::max(first, w.rows[r].pos.first_hi);
    if (first == 0) return;
    if (blk.ka >= blk.kb) {
      blk.ka = 0;
      blk.kb = first;
    } else if (first >= blk.ka) {
      blk.ka = 0;
      blk.kb = std::max(blk.kb, first);
    } else {
      blk.first_kb = first;
    }
  }

  // ---- the end of a block --------------------------------------------------------------------
  // Normalises the accumulator and writes out and softmax_lse.
  static void finish(const Problem& p, const Ws& w, int n) {
    const i64 Dv = p.Dv, Dvp = Wsp::dvp(p);
    for (int r = 0; r < n; ++r) {
      const Row& row = w.rows[r];
      const float* o = w.o + r * Dvp;
      // Empty iff nothing was admitted: l == 0 exactly (a NaN score leaves m = -inf but l = NaN).
      const bool empty = Sm::empty(w.l[r]);
      float div = empty ? 1.0f : w.l[r], lse = Sm::lse(w.m[r], w.l[r]);
      if (!p.sinks.empty()) Sm::join_sink(w.m[r], w.l[r], row.sink, div, lse);  // once per row
      store_out(p, row.out_off, o, div, empty, Dv);
      if (p.lse.data) store_scalar(p.lse.data, p.lse.dtype, row.lse_off, lse);
    }
  }

  static void store_scalar(void* data, DType dt, i64 off, float x) { store_from_float(data, dt, off, x); }

  // out row at element offset off = o / l (0 when empty), in the output's dtype.
  static void store_out(const Problem& p, i64 off, const float* o, float l, bool empty, i64 Dv) {
    const i64 sx = p.out.sx;
    if (p.out.dtype == DType::f32) {
      float* dst = static_cast<float*>(p.out.data) + off;
      i64 x = 0;
      if (sx == 1 && !empty) {  // the same divisions, W at a time
        const V vl = Ops::set1(l);
        for (; x + W <= Dv; x += W) Ops::store(dst + x, Ops::div(Ops::load(o + x), vl));
      }
      for (; x < Dv; ++x) dst[x * sx] = empty ? 0.0f : o[x] / l;
    } else {
      for (i64 x = 0; x < Dv; ++x) store_scalar(p.out.data, p.out.dtype, off + x * sx, empty ? 0.0f : o[x] / l);
    }
  }
};

}  // namespace qkv::detail::QKV_ENGINE_NS
