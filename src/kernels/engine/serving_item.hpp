#pragma once
// One work item of the serving kernel (kernels/serving.cpp drives them and merges the splits) on
// an ISA's vectors: the query rows of tokens t0 .. t0 + nt - 1 of one sequence and the query
// heads of one KV head, against the keys of one split [c P, (c + 1) P), P = kServingSplit.
//
// For each row the item writes the split's partial: m = max_j s_j, l = sum_j e^(s_j - m) and the
// unnormalised O = sum_j e^(s_j - m) v_j over the row's admitted keys of the split, in fp32: its
// window's [lo, hi), and with window_keep_first the first keys [s0, fhi) of the split, before
// them, with the keys between excluded (score_rule.hpp: the rule's position terms, their bias
// too).
// Batch invariance rests on every number of a row depending only on its query, its key range and
// the keys' values, never on the item's other rows or on where a key is stored:
//   - s_j = q . k_j: W partial sums along D (fused multiply-adds, d ascending), reduced by
//     Ops::hsum_w, whose lane i equals hsum of vector i bit for bit; on avx512bf16, bf16 queries
//     and keys use the bf16 dot product instead (lane i sums the exact products of the pairs
//     (d, d + 1) with d = 2 i mod 2 W, pair vectors ascending), read in place for any item size;
//   - the softmax visits the row's keys in groups of W aligned at absolute key positions, so key
//     j always sits in lane j mod W; keys outside the row's range are -inf (a select, so a NaN
//     stored there never enters) and add exact zeros to the lane sums;
//   - O accumulates p_j v_j over exactly the row's keys, ascending, one fused multiply-add each
//     (keep-first's keys first, in a pass of their own: the gap's keys are never read there).
// Where the row is whole vectors and the item has at most 8 rows per KV head (decode), keys and
// values are read in place and converted in registers (fp16 and bf16 widened; q8_0: one fp32
// product per element, tensor/kv_codec.hpp; int8 and fp8: their codes as fp32); otherwise each
// group of W keys is decoded once into the workspace (the same fp32 values; int8 and fp8: their
// codes, the row's scale kept beside) and shared by the rows.
// Either way the fp32 values are the same, so the bits are too. The one scale of an int8 or fp8
// row multiplies that key's score after the dot product, s_j = sc_j (q . c_j), and its weight,
// (p_j sc_j) c_j, on every path alike (any head_dim).
// On avx512amx (Score::tiles), the scores of bf16 queries and keys are tile products instead
// (Ops::qk_bf16_groups: S^T = K Q^T, groups of 16 keys read in place, two to a product, or,
// where 16 keys are not one stride apart in memory, copied as they are): score (j, r) is one
// element of a tile product, so it depends on k_j and q_r alone, whatever the other rows and keys
// of the tile.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/varlen_problem.hpp"
#include "kernels/engine/isa_ops.hpp"
#include "kernels/engine/online_softmax.hpp"
#include "kernels/engine/score_rule.hpp"
#include "kernels/engine/serving_rows.hpp"
#include "kernels/serving.hpp"

namespace qkv::detail::QKV_ENGINE_NS {

template <IsaOps Ops>
struct ServingItemBody : ServingRows<Ops> {
  // What the item uses of its building blocks (dependent base: named here once).
  using Base = ServingRows<Ops>;
  using typename Base::V, typename Base::Src, typename Base::RowRef, typename Base::Score;
  using Base::W, Base::P, Base::SP, Base::kSplitPv;
  using Base::row_scaled, Base::is_staged, Base::src_of, Base::with_src, Base::round_up, Base::row_offsets;
  using Base::stage_row, Base::group_scores_dp, Base::tile_scores;  // and, named Base::template, its templates

  // The item: rows of tokens it.t0 .. it.t0 + it.nt - 1 of sequence it.b, the query heads of KV
  // heads it.hk .. it.hk + it.nh - 1, split it.c; partials to parts (row (t, h) of the sequence
  // at ((t Hq + h) NS + c) (Dvp + 2)). Row r is KV head hk + r / Rh, token t0 + (r % Rh) / G.
  // Score::dp and Score::tiles read keys in place however many rows the item has.
  template <Score SC = Score::fma>
  static void run(const VarlenProblem& vp, const ServingItem& it, const ServingLayout& L, float* parts, i64 NS, char* ws) {
    const Problem& p = vp.p;
    const i64 G = p.group(), D = p.D, Dv = p.Dv, Rh = it.nt * G, R = Rh * it.nh, b = it.b, c = it.c;
    const i64 Dp = round_up(D), Dvp = round_up(Dv), nq = Dp / W, nv = Dvp / W, pf = Dvp + 2;
    auto carve = [&ws](i64 bytes) { char* r = ws; ws += (bytes + 63) / 64 * 64; return r; };
    bool kdp = false;
    if constexpr (SC != Score::fma && Ops::kHasDpbf16)
      kdp = p.q.dtype == DType::bf16 && p.k.dtype == DType::bf16 && !vp.kc.scales && D % (2 * W) == 0;
    const bool tiles = SC == Score::tiles && kdp;
    float* qf = reinterpret_cast<float*>(carve(L.rows * Dp * 4));
    auto* qrow = reinterpret_cast<const std::uint16_t**>(carve(kdp ? L.rows * 8 : 0));
    // Tiles: 16 rows past the item's, where a head's last 16-row block of scores may land.
    float* s = reinterpret_cast<float*>(carve((L.rows + 16) * SP * 4));
    float* kst = reinterpret_cast<float*>(carve(W * Dp * 4));
    float* vst = reinterpret_cast<float*>(carve(W * Dvp * 4));
    float* zero = reinterpret_cast<float*>(carve(std::max(Dp, Dvp) * 4));
    i64* lo = reinterpret_cast<i64*>(carve(L.rows * 8));
    i64* hi = reinterpret_cast<i64*>(carve(L.rows * 8));
    float** orow = reinterpret_cast<float**>(carve(L.rows * 8));  // each row's partial, found once
    // The position terms (score_rule.hpp) of each row, and keep-first's keys of the split,
    // [flo, fhi) = [s0, fhi) (empty: fhi <= s0), disjoint from [lo, hi) and below it.
    const bool pos = has_position(p);
    auto* ps = reinterpret_cast<Position*>(carve(pos ? L.rows * static_cast<i64>(sizeof(Position)) : 0));
    i64* flo = reinterpret_cast<i64*>(carve(pos ? L.rows * 8 : 0));
    i64* fhi = reinterpret_cast<i64*>(carve(pos ? L.rows * 8 : 0));
    const float neg_inf = -std::numeric_limits<float>::infinity();
    std::memset(zero, 0, static_cast<std::size_t>(std::max(Dp, Dvp)) * 4);
    auto head_of = [&](i64 r) { return it.hk + r / Rh; };
    auto part_of = [&](i64 r) {
      const i64 rr = r % Rh;
      return parts + (((it.t0 + rr / G) * p.Hq + head_of(r) * G + rr % G) * NS + c) * pf;
    };

    // The rows' key ranges within the split, and their queries in fp32 (zero past D).
    const i64 s0 = c * P, s1 = s0 + P;
    i64 a = s1, e = s0, fe = s0;  // fe: the end of the rows' keep-first keys in the split
    for (i64 r = 0; r < R; ++r) {
      const i64 rr = r % Rh, t = it.t0 + rr / G, h = head_of(r) * G + rr % G, tok = vp.cu_q[b] + t;
      vp.key_range(b, t, lo[r], hi[r]);
      lo[r] = std::max(lo[r], s0);
      hi[r] = std::min(hi[r], s1);
      if (lo[r] < hi[r]) { a = std::min(a, lo[r]); e = std::max(e, hi[r]); }
      if (pos) {
        ps[r] = ScoreRule<>::position(vp, b, h, t);
        flo[r] = s0;
        fhi[r] = std::min({ps[r].first_hi, s1, lo[r]});
        if (fhi[r] > s0) { a = s0; e = std::max(e, fhi[r]); fe = std::max(fe, fhi[r]); }
      }
      stage_row(p.q, KVCodec{}, h * p.q.sh + tok * p.q.ss, 0, D, Dp, qf + r * Dp);
      if (kdp) qrow[r] = static_cast<const std::uint16_t*>(p.q.data) + h * p.q.sh + tok * p.q.ss;
      float* part = orow[r] = part_of(r);
      std::memset(part, 0, static_cast<std::size_t>(Dvp) * 4);
      part[Dvp] = neg_inf;
      part[Dvp + 1] = 0.0f;
    }
    if (a >= e) return;

    // Up to 8 rows per KV head (decode, GQA groups up to 8): rows read in place, converted in
    // registers (twice per key vector at 8 rows, still cheaper than a store and reload; measured:
    // Hq 32, Hkv 4 decode 2x faster than staged); more rows (prefill): each group of keys
    // decoded once into the workspace and shared by the rows.
    const Src ks = src_of(p.k, vp.kc, D, Dp), vs = src_of(p.v, vp.vc, Dv, Dvp);
    const bool in_place = Rh <= 8;
    auto staged_src = [](Src s) { return row_scaled(s) ? Src::f32s : Src::f32; };
    const Src kread = in_place ? ks : staged_src(ks), vread = in_place ? vs : staged_src(vs);
    const i64 g0 = a / W * W;
    i64 off[W];
    RowRef rows[W];
    const auto* zero16 = reinterpret_cast<const std::uint16_t*>(zero);
    // Quantized rows find their scale by row index off / D (D a power of two: a shift).
    const int d_shift = (D & (D - 1)) == 0 ? std::countr_zero(static_cast<std::uint64_t>(D)) : -1;
    auto row_index = [&](i64 o) { return d_shift >= 0 ? o >> d_shift : o / D; };

    // Rows of keys j0 .. j0 + W - 1 of KV head hk (those outside [a, e) read as zeros): in place
    // or staged.
    auto group_rows = [&](const Operand& x, const KVCodec& codec, Src src, i64 n, i64 np, float* st, i64 hk, i64 j0,
                          bool place) {
      const i64 ja = std::max(j0, a), jb = std::min(j0 + W, e), ia = ja - j0, ib = jb - j0;
      row_offsets(vp, x, b, hk, ja, jb - ja, off + ia);
      for (i64 i = 0; i < ia; ++i) rows[i] = {zero, 0.0f, zero16};
      for (i64 i = ib; i < W; ++i) rows[i] = {zero, 0.0f, zero16};
      const char* data = static_cast<const char*>(x.data);
      const auto* sc32 = static_cast<const float*>(codec.scales);
      // One loop per kind: the per-key work is a pointer and a scale, no branch.
      const Src kind =
          src == Src::staged_codes ? (codec.format == KVFormat::int8 ? Src::i8 : Src::e4m3) : src;  // its scale
      switch (kind) {
        case Src::i8:
          for (i64 i = ia; i < ib; ++i) rows[i] = {data + off[i], sc32[row_index(off[i])], zero16};
          break;
        case Src::q8: {
          const auto* sc16 = static_cast<const std::uint16_t*>(codec.scales);
          for (i64 i = ia; i < ib; ++i) rows[i] = {data + off[i], 0.0f, sc16 + row_index(off[i]) * codec.nb};
          break;
        }
        case Src::e4m3: {
          const float head_scale = sc32[hk * codec.sh];
          for (i64 i = ia; i < ib; ++i) rows[i] = {data + off[i], head_scale, zero16};
          break;
        }
        default: {
          const i64 esz = codec.scales ? 1 : static_cast<i64>(dtype_size(x.dtype));
          for (i64 i = ia; i < ib; ++i) rows[i] = {data + off[i] * esz, 0.0f, zero16};
        }
      }
      if (place && !is_staged(src)) return;
      for (i64 i = ia; i < ib; ++i) {
        float* dst = st + i * np;
        if (is_staged(src)) {
          stage_row(x, codec, off[i], hk, n, np, dst);
        } else {
          with_src(src, [&]<Src S>() {
            for (i64 c = 0; c < np; c += W) Ops::store(dst + c, Base::template load_row<S>(rows[i], c));
          });
        }
        rows[i] = {dst, row_scaled(src) ? rows[i].sc : 0.0f, zero16};
      }
    };

    // Decode (rows read in place): the item streams keys and values from memory, one token's
    // heads side by side (packed) or a head's block of keys (paged). A 4 KiB page holds a few
    // tokens, too few for the hardware prefetcher to follow across pages: rows kAhead keys ahead
    // are requested into L2 (measured: bf16 decode, Hkv 8, 7.6 -> 5.3 ms; Hkv 2 with 4 rows per
    // head, 2.8 -> 1.6 ms). Prefill computes long enough per byte not to need it. Each request
    // holds one of the core's few line fill buffers until its line arrives, so the products
    // (fp32 scores, P V) issue them a line at a time as they read the rows kAhead keys before
    // (spread_ahead); the tile products take a group's requests at once (prefetch_ahead).
    constexpr i64 kAhead = 32;
    const bool stream = in_place;
    auto prefetch = [&](const Operand& x, const KVCodec& codec, i64 n, i64 hk, i64 j0) {
      const i64 ja = std::max(j0, a), jb = std::min(j0 + W, e);
      if (ja >= jb) return;
      const i64 esz = codec.scales ? 1 : static_cast<i64>(dtype_size(x.dtype)), bytes = n * esz;
      if (!vp.paged) {  // rows a fixed stride apart
        const char* row = static_cast<const char*>(x.data) + ((vp.cu_k[b] + ja) * x.ss + hk * x.sh) * esz;
        for (i64 i = 0; i < jb - ja; ++i, row += x.ss * esz)
          for (i64 l = 0; l < bytes; l += 64) __builtin_prefetch(row + l, 0, 1);
        return;
      }
      i64 pf_off[W];
      row_offsets(vp, x, b, hk, ja, jb - ja, pf_off);
      for (i64 i = 0; i < jb - ja; ++i) {
        const char* row = static_cast<const char*>(x.data) + pf_off[i] * esz;
        for (i64 l = 0; l < bytes; l += 64) __builtin_prefetch(row + l, 0, 1);
      }
    };
    // The first group also requests the keys up to kAhead, at once.
    auto warm_up = [&](const Operand& x, const KVCodec& codec, i64 n, i64 hk, i64 j0) {
      if (j0 == g0)
        for (i64 f = W; f < kAhead; f += W) prefetch(x, codec, n, hk, j0 + f);
    };
    auto prefetch_ahead = [&](const Operand& x, const KVCodec& codec, i64 n, i64 hk, i64 j0) {
      if (!stream) return;
      warm_up(x, codec, n, hk, j0);
      prefetch(x, codec, n, hk, j0 + kAhead);
    };
    // The rows whose requests the products spread (group_scores, group_pv), for a source read in
    // place as it is stored (staged rows take prefetch_ahead: the products step over their fp32
    // copies): out[i] is the row of key j0 + kAhead + i, or the zero row where that key is outside
    // [a, e). Returns out, or nullptr where nothing is spread. Measured (`qkv bench --serving`,
    // bf16, Hq 32, Hkv 4): packed decode 76-82 -> 62 ms against a group's requests at once.
    auto spread_ahead = [&](const Operand& x, const KVCodec& codec, Src src, i64 n, i64 hk, i64 j0,
                            const char** out) -> const char** {
      if (!stream) return nullptr;
      if (is_staged(src)) {
        prefetch_ahead(x, codec, n, hk, j0);
        return nullptr;
      }
      warm_up(x, codec, n, hk, j0);
      const i64 j1 = j0 + kAhead, ja = std::max(j1, a), jb = std::min(j1 + W, e);
      const i64 esz = codec.scales ? 1 : static_cast<i64>(dtype_size(x.dtype));
      i64 ro[W];
      if (ja < jb) row_offsets(vp, x, b, hk, ja, jb - ja, ro);
      for (i64 i = 0; i < W; ++i)
        out[i] = j1 + i >= ja && j1 + i < jb ? static_cast<const char*>(x.data) + ro[j1 + i - ja] * esz
                                             : reinterpret_cast<const char*>(zero);
      return out;
    };

    // Scores of every row against every key of [g0, e), a group of W keys at a time, the KV
    // heads in turn (in a packed [T, Hkv, D] cache a token's heads are adjacent: read in order).
    if constexpr (SC == Score::tiles && Ops::kHasDpbf16) {
      if (tiles) tile_scores(vp, it, qrow, Rh, a, e, g0, s0, reinterpret_cast<std::uint16_t*>(kst), ws, s, prefetch_ahead);
    }
    if (!tiles) {
      for (i64 j0 = g0; j0 < e; j0 += W)
        for (i64 x = 0; x < it.nh; ++x) {
          float* sg = s + x * Rh * SP + (j0 - s0);
          if constexpr (SC != Score::fma && Ops::kHasDpbf16 && IsaOpsGroupedScores<Ops>) {
            if (kdp) {
              prefetch_ahead(p.k, vp.kc, D, it.hk + x, j0);
              group_rows(p.k, vp.kc, Src::bf16, D, Dp, kst, it.hk + x, j0, true);
              group_scores_dp(qrow + x * Rh, Rh, rows, D, sg);
              continue;
            }
          }
          const char* ahead[W];
          const char* const* pfk = spread_ahead(p.k, vp.kc, ks, D, it.hk + x, j0, ahead);
          group_rows(p.k, vp.kc, ks, D, Dp, kst, it.hk + x, j0, in_place);
          const float* qh = qf + x * Rh * Dp;
          with_src(kread, [&]<Src S>() {
            Base::template group_scores<S>(qh, Dp, Rh, rows, nq, sg, pfk);
            if constexpr (Base::row_scaled(S)) {  // (Base::: GCC does not see the using-declarations here)
              alignas(64) float sc[Base::W];
              for (int i = 0; i < Base::W; ++i) sc[i] = rows[i].sc;
              const V vsc = Ops::load(sc);
              for (i64 r = 0; r < Rh; ++r) Ops::store(sg + r * Base::SP, Ops::mul(Ops::load(sg + r * Base::SP), vsc));
            }
          });
        }
    }

    // Per row: the scores by the rule (score_rule.hpp: scale, softcap, the key range; with position
    // terms its scalar form, their bias and keep-first's keys too), max, exponentials, their sum.
    alignas(64) static constexpr float kIota[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    static_assert(W <= 16);
    const V iota = Ops::load(kIota);
    with_score_rule<false, true>(p, [&]<class Rule>() {
      const Rule rule(p);
      for (i64 r = 0; r < R; ++r) {
        i64 rlo = lo[r], rhi = hi[r];  // the row's keys of the split: [lo, hi), keep-first's before
        if constexpr (Rule::kHasPosition) {
          if (fhi[r] > s0) {
            rhi = rlo < rhi ? rhi : fhi[r];
            rlo = s0;
          }
        }
        if (rlo >= rhi) continue;
        float* sr = s + r * SP - s0;
        const i64 ga = rlo / W * W;
        V vm = Ops::set1(neg_inf);
        if constexpr (Rule::kHasPosition) {
          // Whole groups of W, each key admitted or -inf by the rule (lo, hi: clipped to the
          // split, which admits the same keys of it).
          const i64 gb = (rhi + Base::W - 1) / Base::W * Base::W;
          for (i64 j = ga; j < gb; ++j) sr[j] = rule.score(sr[j], j, lo[r], hi[r], 0, ps[r]);
          for (i64 j0 = ga; j0 < rhi; j0 += Base::W) vm = Ops::max(vm, Ops::load(sr + j0));
        } else {
          const V vlo = Ops::set1(static_cast<float>(lo[r] - s0)), vhi = Ops::set1(static_cast<float>(hi[r] - s0));
          if constexpr (Rule::kHasSoftcap)
            for (i64 j = lo[r]; j < hi[r]; ++j) sr[j] = rule.scaled(sr[j]);
          for (i64 j0 = ga; j0 < hi[r]; j0 += Base::W) {
            const V x = rule.template vec<Ops>(Ops::load(sr + j0), vlo, vhi,
                                               Ops::add(Ops::set1(static_cast<float>(j0 - s0)), iota));
            Ops::store(sr + j0, x);
            vm = Ops::max(vm, x);
          }
        }
        // The split is the first tile of the row's online softmax (online_softmax.hpp): l = sum.
        const float ms = OnlineSoftmax<Ops>::shift_of(OnlineSoftmax<Ops>::row_max(vm));  // -inf: every weight 0
        const V vms = Ops::set1(ms);
        V vl = Ops::zero();
        for (i64 j0 = ga; j0 < rhi; j0 += W) {
          const V pj = Ops::exp(Ops::sub(Ops::load(sr + j0), vms));
          Ops::store(sr + j0, pj);
          vl = Ops::add(vl, pj);
        }
        float* part = orow[r];
        part[Dvp] = ms;
        part[Dvp + 1] = Ops::hsum(vl);
      }
    });

    // O += p_j v_j over each row's own keys, ascending, a group of W values at a time.
    bool split = false;
    if constexpr (kSplitPv) split = vread == Src::bf16 && nv % 2 == 0;
    const int max_nr = split ? 8 : 4;
    for (i64 j0 = g0; j0 < e; j0 += W)
      for (i64 x = 0; x < it.nh; ++x) {
        const char* ahead[W];
        const char* const* pfv = spread_ahead(p.v, vp.vc, vs, Dv, it.hk + x, j0, ahead);
        group_rows(p.v, vp.vc, vs, Dv, Dvp, vst, it.hk + x, j0, in_place);
        // Rows with the same keys in this group (a token's query heads) share each value read:
        // the rows' keys [lo, hi) of the group, keep-first's [flo, fhi) before them.
        const auto pv_keys = [&](const i64* lo, const i64* hi) __attribute__((always_inline)) {
          for (i64 r = x * Rh; r < (x + 1) * Rh;) {
            const i64 ja = std::max(j0, lo[r]), jb = std::min(j0 + W, hi[r]);
            int nr = 1;
            while (nr < max_nr && r + nr < (x + 1) * Rh && lo[r + nr] == lo[r] && hi[r + nr] == hi[r]) ++nr;
            nr = nr >= 8 ? 8 : nr >= 4 ? 4 : nr >= 2 ? 2 : 1;
            if (ja < jb) {
              const float* pr[8];
              float* o[8];
              for (int y = 0; y < nr; ++y) {
                pr[y] = s + (r + y) * SP + (ja - s0);
                o[y] = orow[r + y];
              }
              const RowRef* vr = rows + (ja - j0);
              const char* const* pfa = pfv ? pfv + (ja - j0) : nullptr;
              if constexpr (kSplitPv) {
                if (split) {
                  for (i64 c = 0; c < nv; c += 2) {
                    if (nr == 8) Base::template group_pv_split<8>(pr, jb - ja, vr, c * W, o, pfa);
                    else if (nr == 4) Base::template group_pv_split<4>(pr, jb - ja, vr, c * W, o, pfa);
                    else if (nr == 2) Base::template group_pv_split<2>(pr, jb - ja, vr, c * W, o, pfa);
                    else Base::template group_pv_split<1>(pr, jb - ja, vr, c * W, o, pfa);
                  }
                  r += nr;
                  continue;
                }
              }
              with_src(vread, [&]<Src S>() {
                if (nr == 4) Base::template pv_rows<S, 4>(pr, jb - ja, vr, nv, o, pfa);
                else if (nr == 2) Base::template pv_rows<S, 2>(pr, jb - ja, vr, nv, o, pfa);
                else Base::template pv_rows<S, 1>(pr, jb - ja, vr, nv, o, pfa);
              });
            }
            r += nr;
          }
        };
        if (j0 < fe) pv_keys(flo, fhi);
        pv_keys(lo, hi);
      }
    if constexpr (kSplitPv) {
      if (split)
        for (i64 r = 0; r < R; ++r)
          if (lo[r] < hi[r] || (pos && fhi[r] > s0))
            for (i64 c = 0; c < nv; c += 2) Ops::unsplit_bf16_order(orow[r] + c * W);
    }
  }
};

}  // namespace qkv::detail::QKV_ENGINE_NS
