#pragma once
// The tiled attention engine shared by the `flash` and `decode` kernels. ISA-independent: it is
// included by one translation unit per ISA (src/kernels/simd/<isa>/engine_<isa>.cpp), which
// first defines QKV_ENGINE_NS (a namespace private to that ISA, so that no inline function is
// shared between translation units compiled with different instruction sets) and a struct
// `Ops` giving the vector type, its width, the tile sizes (the per-ISA constexpr traits) and
// the vector primitives (load, store, fma, max, exp, ...).
//
// Algorithm: FlashAttention-2 forward, Dao 2023, "FlashAttention-2: Faster Attention with Better
// Parallelism and Work Partitioning", Algorithm 1; the decode split is flash-decoding (Dao,
// Haziza, Massa, Sizov 2023), partial results merged by their log-sum-exp.
//
// Tiling. A block of up to Ops::kBq query rows is processed against the admissible keys in
// tiles of Ops::kBk keys; flash takes up to 4 adjacent blocks at a time through the same tiles
// in lockstep (process_group), so each K/V tile is fetched from L3/DRAM once per group. Per
// block, in the thread's workspace:
//   qt  [D][SP]      the block's queries transposed (SP = rows rounded up to the vector width);
//                    bf16 dot path: qp [ceil(D/2)][SP] bf16 pairs
//   s   [kBk][SP]    scores of one tile, transposed (key-major): the vectors run over queries,
//                    so the row max and row sum of the online softmax are vertical operations
//   o   [kBq][Dvp]   the unnormalised output accumulator (Dvp = Dv rounded up to the width)
//   m, l, alpha      running max, running sum, rescale factor per row (fp32)
//   kbuf, vbuf       K/V tiles converted to fp32 (only for fp16/bf16 inputs or a Dv tail);
//                    with vp (V repacked as bf16 pairs) shared by the blocks of a group, each
//                    tile converted once per group (TileTag)
// QK^T: outer products over d (broadcast one K element, FMA with a vector of queries), MR keys x
// NQV query vectors of accumulators in registers. PV: MR query rows x NC vectors of Dv in
// registers, rescaled by alpha on load, accumulating over the tile's keys.
// Online softmax per tile: m' = max(m, max_j s_j), alpha = exp(m - m'), p_j = exp(s_j - m'),
// l = alpha l + sum_j p_j, O = alpha O + P V; after the last tile O /= l (one reciprocal per row)
// and softmax_lse = m + log(l) (the division of each element by l, once, at the end: one rounding).
// Accumulation is fp32 throughout.
//
// Prefetch. While QK^T of a tile runs, the tile's V rows are prefetched; while PV runs, the next
// tile's K rows (struct Prefetch), so long rows whose K/V live in L3 or DRAM do not stall.
//
// Masks. Key tiles outside the union of the rows' [lo, hi) (causal, window, kv_lens) are never
// read. A tile is "full" when every row of the block admits every key of it and no explicit mask
// is given; otherwise a scalar pass sets excluded scores to -inf (select, never add, so NaN
// computed from an excluded K row is discarded) and the PV product skips zero weights, so NaN or
// inf stored in an excluded V row never meets a 0 weight (0 * NaN). Softcap and explicit masks
// go through the same scalar pass (tanh from libm).
//
// bf16 inputs with the AVX512_BF16 dot product (Ops::kHasDpbf16 and bf16_dot): QK^T uses
// vdpbf16ps on (d, d+1) pairs of Q (packed) and K (read in place); PV converts P to bf16 and
// uses vdpbf16ps with V repacked as (key, key+1) pairs. Partially masked tiles use the fp32 PV
// with V converted, for the zero-weight skip.
//
// Threads (OpenMP): flash: one work item per (batch, head, group of query blocks), dynamically scheduled,
// head-major (the threads share one head's K/V in cache), within a head largest causal blocks
// first; decode: one item per (batch, KV head, row block, key chunk), where
// the rows are all query heads of one KV head times Sq (K and V read once per KV head) and the
// chunk size depends only on the problem; the chunk partials are merged in chunk order. No result
// depends on the number of threads or on the schedule.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/problem.hpp"

#ifndef QKV_ENGINE_NS
#error "define QKV_ENGINE_NS before including attention_engine.hpp"
#endif

namespace qkv::detail::QKV_ENGINE_NS {

using i64 = std::int64_t;

enum class Elt { f32, bf16, f16 };

inline constexpr std::size_t kAlign = 64;
inline std::size_t align_up(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
inline i64 round_up(i64 n, i64 m) { return (n + m - 1) / m * m; }

/// One query row of a block: where it comes from, what it may attend, where it goes.
struct Row {
  i64 q_off;          // element offset of the row in q
  i64 lo, hi;         // admissible key range (causal, window, kv_lens)
  i64 mask_off;       // element offset of (b, h, i, 0) in the mask
  i64 out_off;        // element offset of (b, h, i, 0) in out
  i64 lse_off;        // element offset of (b, h, i) in softmax_lse
};

inline float bf16_bits_to_float(std::uint16_t b) {
  const std::uint32_t u = static_cast<std::uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// Software prefetch of a tile of K or V rows, a few rows per call of step(), so that the
/// prefetches spread between the microkernel calls of one phase and the rows are in cache when
/// the next phase reads them. On rows longer than L2 holds (Sk in the thousands, D = 128) the
/// hardware prefetchers alone leave the microkernels waiting on L3 or DRAM (docs/performance.md,
/// "What the kernels do for memory"). A prefetch never faults, and rows past the tile are never
/// requested.
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

template <class Ops>
struct Engine {
  using V = typename Ops::V;
  static constexpr int W = Ops::W;
  static constexpr int BQ = Ops::kBq;
  static constexpr int BK = Ops::kBk;
  static constexpr int NQV_MAX = BQ / W;
  // Blocks of at most this many rows use the dot-product form of QK^T (vector ISAs only).
  static constexpr int kFewRows = W >= 8 ? 4 : 0;
  // Query blocks per flash work item (process_group).
  static constexpr int kGroup = 4;
  static_assert(BQ % W == 0 && BK % 2 == 0);

  // ---- workspace ---------------------------------------------------------------------------
  // Which K or V rows a converted or repacked tile buffer holds, so that the blocks of a group,
  // which share these buffers, convert or repack each tile once (process_group).
  struct TileTag {
    const void* data;
    i64 off;  // element offset of the tile's first row
    int kt;   // rows; 0: holds nothing
    bool holds(const void* d, i64 o, int k) const { return kt == k && data == d && off == o; }
    void set(const void* d, i64 o, int k) { data = d; off = o; kt = k; }
  };

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
    float* kbuf;        // [BK][Dp] fp32 (converted K rows)
    float* vbuf;        // [BK][Dvp] fp32
    std::uint32_t* pp;  // [BK/2][BQ] bf16 pairs of P
    std::uint32_t* vp;  // [BK/2][Dvp] bf16 pairs of V
    Row* rows;          // [BQ]
    TileTag* tags;      // [3]: what kbuf, vbuf and vp hold
  };
  enum { kTagK, kTagV, kTagVp };

  static i64 dvp(const Problem& p) { return round_up(p.Dv, W); }
  static i64 dp(const Problem& p) { return round_up(p.D, 2); }

  static std::size_t ws_bytes(const Problem& p) {
    const std::size_t f = sizeof(float);
    return 2 * align_up(dp(p) * BQ * f) + align_up(BK * (BQ + W) * f) + align_up(BQ * dvp(p) * f) +
           5 * align_up(BQ * f) + align_up(BK * dp(p) * f) + align_up(BK * dvp(p) * f) +
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
    w.kbuf = reinterpret_cast<float*>(take(BK * dp(p) * f));
    w.vbuf = reinterpret_cast<float*>(take(BK * dvp(p) * f));
    w.pp = reinterpret_cast<std::uint32_t*>(take(BK / 2 * BQ * 4));
    w.vp = reinterpret_cast<std::uint32_t*>(take(BK / 2 * dvp(p) * 4));
    w.rows = reinterpret_cast<Row*>(take(BQ * sizeof(Row)));
    w.tags = reinterpret_cast<TileTag*>(take(3 * sizeof(TileTag)));
    return w;
  }

  // ---- conversions -------------------------------------------------------------------------
  template <Elt E>
  static void to_f32(const void* src, i64 off, float* dst, i64 n) {
    if constexpr (E == Elt::f32) {
      std::memcpy(dst, static_cast<const float*>(src) + off, n * sizeof(float));
    } else if constexpr (E == Elt::bf16) {
      const std::uint16_t* s = static_cast<const std::uint16_t*>(src) + off;
      for (i64 x = 0; x < n; ++x) dst[x] = bf16_bits_to_float(s[x]);
    } else {
      Ops::f16_to_f32(static_cast<const std::uint16_t*>(src) + off, dst, n);
    }
  }

  // ---- microkernels (fp32) -----------------------------------------------------------------
  // S[j][c*W..] = sum_d K[j][d] * Qt[d][c*W..] for MR keys j and NQV query vectors c.
  template <int NQV, int MR>
  static void qk_mk(const float* qt, int sp, const float* k, i64 ks, i64 D, float* s, int ssp) {
    V acc[MR][NQV];
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < NQV; ++c) acc[r][c] = Ops::zero();
    for (i64 d = 0; d < D; ++d) {
      V qv[NQV];
#pragma GCC unroll 4
      for (int c = 0; c < NQV; ++c) qv[c] = Ops::load(qt + d * sp + c * W);
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const V kb = Ops::set1(k[r * ks + d]);
#pragma GCC unroll 4
        for (int c = 0; c < NQV; ++c) acc[r][c] = Ops::fma(kb, qv[c], acc[r][c]);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < NQV; ++c) Ops::store(s + r * ssp + c * W, acc[r][c]);
  }

  // `pf` (the tile's V rows) advances by the keys of each microkernel call.
  template <int NQV>
  static void qk_rows(const float* qt, int sp, const float* k, i64 ks, i64 D, int kt, float* s, int ssp,
                      Prefetch& pf) {
    constexpr int MR0 = Ops::kAccRegs / NQV > 16 ? 16 : Ops::kAccRegs / NQV;
    constexpr int MR = MR0 < 1 ? 1 : MR0;
    int j = 0;
    for (; j + MR <= kt; j += MR) {
      qk_mk<NQV, MR>(qt, sp, k + j * ks, ks, D, s + j * ssp, ssp);
      pf.step(MR);
    }
    if constexpr (MR > 4)  // BK = 64 keys are 10 x 6 + 4 with MR = 6: the last 4 in one call
      for (; j + 4 <= kt; j += 4) qk_mk<NQV, 4>(qt, sp, k + j * ks, ks, D, s + j * ssp, ssp);
    for (; j + 2 <= kt; j += 2) qk_mk<NQV, 2>(qt, sp, k + j * ks, ks, D, s + j * ssp, ssp);
    for (; j < kt; ++j) qk_mk<NQV, 1>(qt, sp, k + j * ks, ks, D, s + j * ssp, ssp);
  }

  static void qk_tile(const float* qt, int nqv, const float* k, i64 ks, i64 D, int kt, float* s, int ssp,
                      Prefetch& pf) {
    const int sp = nqv * W;
    static_assert(NQV_MAX <= 8);
    switch (nqv) {
      case 1: qk_rows<1>(qt, sp, k, ks, D, kt, s, ssp, pf); break;
      case 2: if constexpr (NQV_MAX >= 2) qk_rows<2>(qt, sp, k, ks, D, kt, s, ssp, pf); break;
      case 3: if constexpr (NQV_MAX >= 3) qk_rows<3>(qt, sp, k, ks, D, kt, s, ssp, pf); break;
      case 4: if constexpr (NQV_MAX >= 4) qk_rows<4>(qt, sp, k, ks, D, kt, s, ssp, pf); break;
      case 5: if constexpr (NQV_MAX >= 5) qk_rows<5>(qt, sp, k, ks, D, kt, s, ssp, pf); break;
      case 6: if constexpr (NQV_MAX >= 6) qk_rows<6>(qt, sp, k, ks, D, kt, s, ssp, pf); break;
      case 7: if constexpr (NQV_MAX >= 7) qk_rows<7>(qt, sp, k, ks, D, kt, s, ssp, pf); break;
      case 8: if constexpr (NQV_MAX >= 8) qk_rows<8>(qt, sp, k, ks, D, kt, s, ssp, pf); break;
      default: break;
    }
    pf.rest();
  }

  // Few rows (decode): S[j][r] = q_r . k_j as dot products along D (vectors over d, one
  // horizontal sum per score), so a lone query does not waste the vector lanes of qk_tile.
  static void qk_dot(const float* qr, int n, int sp, i64 D, const float* k, i64 ks, int kt, float* s, int ssp) {
    const i64 Dm = D / W * W;
    for (int j = 0; j < kt; ++j) {
      const float* kj = k + j * ks;
      for (int r = 0; r < n; ++r) {
        const float* q = qr + r * D;
        V a0 = Ops::zero(), a1 = Ops::zero();
        i64 d = 0;
        for (; d + 2 * W <= Dm; d += 2 * W) {
          a0 = Ops::fma(Ops::load(q + d), Ops::load(kj + d), a0);
          a1 = Ops::fma(Ops::load(q + d + W), Ops::load(kj + d + W), a1);
        }
        for (; d < Dm; d += W) a0 = Ops::fma(Ops::load(q + d), Ops::load(kj + d), a0);
        float x = Ops::hsum(Ops::add(a0, a1));
        for (; d < D; ++d) x += q[d] * kj[d];
        s[j * ssp + r] = x;
      }
      for (int r = n; r < sp; ++r) s[j * ssp + r] = 0.0f;
    }
  }

  // O[r][c*W..] = alpha[r] O[r][c*W..] + sum_j P[j][r] V[j][c*W..] for MR rows, NC vectors.
  // SKIP: a zero weight adds nothing (so 0 * NaN from an excluded V row never happens).
  template <int MR, int NC, bool SKIP>
  static void pv_mk(const float* s, int sp, const float* v, i64 vs, int kt, float* o, i64 os,
                    const float* alpha) {
    V acc[MR][NC];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const V a = Ops::set1(alpha[r]);
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) acc[r][c] = Ops::mul(Ops::load(o + r * os + c * W), a);
    }
    for (int j = 0; j < kt; ++j) {
      V vv[NC];
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) vv[c] = Ops::load(v + j * vs + c * W);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        const float pj = s[j * sp + r];
        if constexpr (SKIP && Ops::kMaskedFma) {  // branch-free skip: FMA under a mask
          const V pb = Ops::set1(pj);
          const auto k = Ops::nonzero(pb);
#pragma GCC unroll 4
          for (int c = 0; c < NC; ++c) acc[r][c] = Ops::fma_mask(pb, vv[c], acc[r][c], k);
          continue;
        }
        if constexpr (SKIP) {
          if (pj == 0.0f) continue;
        }
        const V pb = Ops::set1(pj);
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) acc[r][c] = Ops::fma(pb, vv[c], acc[r][c]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) Ops::store(o + r * os + c * W, acc[r][c]);
  }

  // Column chunks outermost: one chunk of the V tile (kBk x NC vectors) stays in L1 while every
  // row group of the block streams over it.
  // `pf` (the next tile's K rows) advances by 4 rows per microkernel call.
  template <int NC, bool SKIP>
  static void pv_cols(const float* s, int sp, const float* v, i64 vs, int kt, float* o, i64 os,
                      const float* alpha, int n, Prefetch& pf) {
    constexpr int MR = Ops::kAccRegs / Ops::kPvCols;
    int r = 0;
    for (; r + MR <= n; r += MR) {
      pv_mk<MR, NC, SKIP>(s + r, sp, v, vs, kt, o + r * os, os, alpha + r);
      pf.step(4);
    }
    if constexpr (MR > 4)  // as in qk_rows: 64 rows are 10 x 6 + 4
      for (; r + 4 <= n; r += 4) pv_mk<4, NC, SKIP>(s + r, sp, v, vs, kt, o + r * os, os, alpha + r);
    for (; r + 2 <= n; r += 2) pv_mk<2, NC, SKIP>(s + r, sp, v, vs, kt, o + r * os, os, alpha + r);
    for (; r < n; ++r) pv_mk<1, NC, SKIP>(s + r, sp, v, vs, kt, o + r * os, os, alpha + r);
  }

  template <bool SKIP>
  static void pv_tile(const float* s, int sp, const float* v, i64 vs, int kt, float* o, i64 os,
                      const float* alpha, int n, int nvec, Prefetch& pf) {
    constexpr int NC = Ops::kPvCols;
    int c = 0;
    for (; c + NC <= nvec; c += NC) pv_cols<NC, SKIP>(s, sp, v + c * W, vs, kt, o + c * W, os, alpha, n, pf);
    for (; c < nvec; ++c) pv_cols<1, SKIP>(s, sp, v + c * W, vs, kt, o + c * W, os, alpha, n, pf);
    pf.rest();
  }

  // Online-softmax update of one tile: scores (times `mul`) -> weights, running m and l, alpha.
  static void softmax_tile(float* s, int sp, int kt, int nqv, float mul, float* m, float* l,
                           float* alpha) {
    const V vmul = Ops::set1(mul);
    for (int c = 0; c < nqv; ++c) {
      float* sc = s + c * W;
      // The scaled scores are not stored: the exp pass scales them again (the same products),
      // which is cheaper than a store and a reload. (mul = 1 multiplies exactly.)
      V mx = Ops::set1(-std::numeric_limits<float>::infinity());
      for (int j = 0; j < kt; ++j) mx = Ops::max(mx, Ops::mul(Ops::load(sc + j * sp), vmul));
      const V mo = Ops::load(m + c * W);
      const V mn = Ops::max(mo, mx);
      const V ms = Ops::safe_max(mn);  // -inf (nothing admitted yet) -> 0, so exp(-inf - 0) = 0
      const V a = Ops::exp(Ops::sub(mo, ms));
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
      Ops::store(l + c * W, Ops::fma(Ops::load(l + c * W), a, Ops::add(sum0, sum1)));
      Ops::store(m + c * W, mn);
      Ops::store(alpha + c * W, a);
    }
  }

  // ---- the block processor -----------------------------------------------------------------
  struct Block {
    i64 b, hk;       // batch, KV head
    int n;           // rows
    i64 ka, kb;      // key range to process (already intersected with the rows' union)
    i64 max_lo, min_hi;
  };

  // Rows of `blk` against keys [blk.ka, blk.kb): leaves the unnormalised O, m and l in `w`.
  template <Elt E, bool DP, bool MASK, bool CAP>
  static void process(const Problem& p, const Block& blk, const Ws& w) {
    begin<E, DP>(p, blk, w);
    for (i64 t0 = blk.ka; t0 < blk.kb; t0 += BK) step<E, DP, MASK, CAP>(p, blk, w, t0, true);
  }

  // Up to kGroup query blocks of one (batch, head), tile by tile in lockstep: the later blocks
  // read each K/V tile from L1/L2 just after the first, so K and V stream from L3 or DRAM once per
  // group instead of once per block (long rows: Sq = Sk = 16384, D = 128). Each block sees its
  // own tiles in its own order, exactly as process() would: grouping changes no result.
  template <Elt E, bool DP, bool MASK, bool CAP>
  static void process_group(const Problem& p, const Block* blk, const Ws* w, int g) {
    i64 t[kGroup];
    for (int x = 0; x < g; ++x) {
      begin<E, DP>(p, blk[x], w[x]);
      t[x] = blk[x].ka;
    }
    for (bool more = g > 0; more;) {
      more = false;
      bool prefetch = true;  // the first block with a tile left requests the next rows
      for (int x = 0; x < g; ++x) {
        if (t[x] >= blk[x].kb) continue;
        step<E, DP, MASK, CAP>(p, blk[x], w[x], t[x], prefetch);
        prefetch = false;
        t[x] += BK;
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
    const i64 D = p.D, Dvp = dvp(p);
    const float neg_inf = -std::numeric_limits<float>::infinity();

    for (int r = 0; r < BQ; ++r) { w.m[r] = neg_inf; w.l[r] = 0.0f; }
    for (i64 x = 0; x < n * Dvp; ++x) w.o[x] = 0.0f;
    for (int x = 0; x < 3; ++x) w.tags[x].kt = 0;  // the inputs may have changed since the last call
    if (blk.ka >= blk.kb) return;

    const bool few = few_rows(n);
    // Pack Q: transposed fp32 (or bf16 pairs for the dot-product path), padded rows zero.
    if constexpr (DP) {
      pack_qp(p, w, n, sp);
    } else if (few) {
      for (int r = 0; r < n; ++r) to_f32<E>(p.q.data, w.rows[r].q_off, w.qr + r * D, D);
    } else {
      pack_qt<E>(p, w, n, sp);
    }

    // Row ranges as floats for the vector select (exact while key indices stay below 2^24).
    if (vec_ranges(blk))
      for (int r = 0; r < sp; ++r) {
        w.lo_f[r] = r < n ? static_cast<float>(w.rows[r].lo) : -1e30f;
        w.hi_f[r] = r < n ? static_cast<float>(w.rows[r].hi) : 1e30f;
      }
  }

  static bool vec_ranges(const Block& blk) { return blk.kb < (i64{1} << 24); }

  // dst[c * sp + r] = 32-bit word c of row r (an fp32 value, or a bf16 pair) for c < cols and
  // r < sp, rows r >= n zero: W x W blocks transposed in registers (Ops::transpose, shuffles only:
  // the bits pass unchanged), the last cols % W words one by one. Element by element, with a
  // store to a new cache line each time, packing Q was a visible part of short calls
  // (docs/performance.md).
  static void transpose_words(const char* const* src, int n, i64 cols, float* dst, int sp) {
    alignas(64) static constexpr float kZeros[W] = {};
    const i64 cw = cols / W * W;
    for (int r0 = 0; r0 < sp; r0 += W) {
      const float* rows[W];
      for (i64 c = 0; c < cw; c += W) {
        for (int x = 0; x < W; ++x)
          rows[x] = r0 + x < n ? reinterpret_cast<const float*>(src[r0 + x] + 4 * c) : kZeros;
        Ops::transpose(rows, dst + c * sp + r0, sp);
      }
      for (i64 c = cw; c < cols; ++c)
        for (int x = 0; x < W; ++x) {
          float* d = dst + c * sp + r0 + x;
          if (r0 + x < n) std::memcpy(d, src[r0 + x] + 4 * c, 4);
          else *d = 0.0f;
        }
    }
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
        to_f32<E>(p.q.data, w.rows[r].q_off, w.qr + r * D, D);
        src[r] = reinterpret_cast<const char*>(w.qr + r * D);
      }
    }
    transpose_words(src, n, D, w.qt, sp);
  }

  // bf16 pairs for vdpbf16ps: qp[dp * sp + r] = (q_r[2 dp], q_r[2 dp + 1]) as one 32-bit word
  // (low half first), rows r >= n and the missing partner of an odd D zero. A pair is one
  // little-endian 32-bit word of the row as stored, so whole pairs are the rows' words transposed.
  static void pack_qp(const Problem& p, const Ws& w, int n, int sp) {
    std::uint32_t* qp = reinterpret_cast<std::uint32_t*>(w.qt);
    const i64 D = p.D, D2 = D / 2;  // whole pairs
    const char* src[BQ];
    for (int r = 0; r < n; ++r)
      src[r] = reinterpret_cast<const char*>(static_cast<const std::uint16_t*>(p.q.data) + w.rows[r].q_off);
    transpose_words(src, n, D2, w.qt, sp);
    if (D & 1)
      for (int r = 0; r < sp; ++r) {
        std::uint16_t last = 0;
        if (r < n) std::memcpy(&last, src[r] + 2 * (D - 1), 2);
        qp[D2 * sp + r] = last;
      }
  }

  // One key tile [t0, min(t0 + BK, blk.kb)) of a started block: S = QK^T, masks, online softmax,
  // O = alpha O + PV. `prefetch`: request this tile's V and the next tile's K rows.
  template <Elt E, bool DP, bool MASK, bool CAP>
  static void step(const Problem& p, const Block& blk, const Ws& w, i64 t0, bool prefetch) {
    const int n = blk.n;
    const int nqv = (n + W - 1) / W;
    const int sp = nqv * W;
    const int ssp = sp + W;  // score pitch off a power of two (L1 set conflicts)
    const i64 D = p.D, Dv = p.Dv, Dvp = dvp(p);
    const int nvec = static_cast<int>(Dvp / W);
    const float scale = static_cast<float>(p.scale);
    const float cap = static_cast<float>(p.softcap);
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const bool few = few_rows(n);
    const i64 k_base = blk.b * p.k.sb + blk.hk * p.k.sh;
    const i64 v_base = blk.b * p.v.sb + blk.hk * p.v.sh;
    const bool v_inplace = E == Elt::f32 && Dv % W == 0;
    constexpr int esize = E == Elt::f32 ? 4 : 2;

    const i64 t1 = std::min<i64>(t0 + BK, blk.kb);
    const int kt = static_cast<int>(t1 - t0);
    const bool full = !MASK && t0 >= blk.max_lo && t1 <= blk.min_hi;
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
          for (int j = 0; j < kt; ++j) to_f32<E>(p.k.data, koff + j * p.k.ss, w.kbuf + j * D, D);
          w.tags[kTagK].set(p.k.data, koff, kt);
        }
        kt_ptr = w.kbuf;
        kstride = D;
      }
      if (few) {
        pf_v.rest();
        qk_dot(w.qr, n, sp, D, kt_ptr, kstride, kt, w.s, ssp);
      } else {
        qk_tile(w.qt, nqv, kt_ptr, kstride, D, kt, w.s, ssp, pf_v);
      }
    }

    // Scale, softcap, masks (scalar pass on partially admitted tiles or with options).
    float mul = scale;
    if (!full && !MASK && !CAP && vec_ranges(blk)) {
      // Causal/window/kv_lens edges only: a vector select per query vector.
      mul = 1.0f;
      for (int c = 0; c < nqv; ++c) {
        const V lo = Ops::load(w.lo_f + c * W), hi = Ops::load(w.hi_f + c * W), vs = Ops::set1(scale);
        for (int j = 0; j < kt; ++j) {
          float* x = w.s + j * ssp + c * W;
          Ops::store(x, Ops::range_select(Ops::mul(Ops::load(x), vs), lo, hi, Ops::set1(static_cast<float>(t0 + j))));
        }
      }
    } else if (!full || CAP) {
      mul = 1.0f;
      for (int r = 0; r < n; ++r) {
        const Row& row = w.rows[r];
        for (int j = 0; j < kt; ++j) {
          const i64 g = t0 + j;
          float& x = w.s[j * ssp + r];
          bool ok = g >= row.lo && g < row.hi;
          float add = 0.0f;
          if constexpr (MASK) {
            const i64 mo = row.mask_off + g * p.mask.sk;
            if (p.mask.dtype == DType::b8) {
              ok = ok && static_cast<const std::uint8_t*>(p.mask.data)[mo] != 0;
            } else {
              add = p.mask.dtype == DType::f32 ? static_cast<const float*>(p.mask.data)[mo]
                                               : static_cast<float>(static_cast<const double*>(p.mask.data)[mo]);
              ok = ok && add != neg_inf;
            }
          }
          float y = x * scale;
          if constexpr (CAP) y = cap * std::tanh(y / cap);
          x = ok ? y + add : neg_inf;
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
          to_f32<E>(p.v.data, voff + j * p.v.ss, dst, Dv);
          for (i64 x = Dv; x < Dvp; ++x) dst[x] = 0.0f;
        }
        w.tags[kTagV].set(p.v.data, voff, kt);
      }
      vt = w.vbuf;
      vs = Dvp;
    }
    if (full)
      pv_tile<false>(w.s, ssp, vt, vs, kt, w.o, Dvp, w.alpha, n, nvec, pf_k);
    else
      pv_tile<true>(w.s, ssp, vt, vs, kt, w.o, Dvp, w.alpha, n, nvec, pf_k);
  }

  // ---- decode fast path: a few rows, no explicit mask, no softcap -----------------------------
  // Rows of one (b, KV head) group (G query heads x Sq, at most kFastRows) against a chunk of
  // keys, with the rows as plain arrays instead of the padded kBq-row block of process():
  //   scores: D-vectorised FMAs into one accumulator per (row, key). Groups of kQkRows = 4 rows
  //           take W / 4 keys at a time (4 on AVX-512), and the W accumulators are reduced
  //           together by one transpose-and-add tree that pairs the lanes as Ops::hsum does, so
  //           the same bits (Ops::hsum_w; on AVX-512 45 operations for 16 scores instead of 16
  //           horizontal sums of 8 each). Fewer rows, and keys past the last full group, take one
  //           key at a time with one horizontal sum per score (Ops::hsum);
  //   softmax: per row, over the tile's scores as vectors (vector exp);
  //   PV: output rows in registers, broadcast(p_j) * v_j FMAs.
  // bf16/fp16 K and V are converted in registers (Ops::load_bf16 / f16), never through a buffer.
  // Keys admitted by only some rows of the group get -inf scores by select (NaN from an
  // excluded K row is discarded) and weight-0 FMAs are skipped (masked) in PV.
  static constexpr int kFastRows = BQ < 16 ? BQ : 16;
  // Keys per step of the single-row pipelined pass (process_fast_stream).
  static constexpr int kFastStep = BK < 32 ? BK : 32;
  // Rows per score call (one accumulator each, sharing every K load).
  static constexpr int kQkRows = 4;
  // Largest D / W for which the one-row pass keeps q and the output row in registers (2 N of
  // them, with room for the loads and the score).
  static constexpr int kStreamRegs = Ops::kAccRegs / 3 < 8 ? Ops::kAccRegs / 3 : 8;

  static bool decode_fast_ok(const Problem& p) {
    return p.mask.data == nullptr && p.softcap <= 0.0 && p.group() * p.Sq <= kFastRows &&
           p.D % W == 0 && p.Dv % W == 0 && p.q.dtype != DType::f64;
  }

  template <Elt E>
  static V load_elt(const void* base, i64 off) {
    if constexpr (E == Elt::f32) return Ops::load(static_cast<const float*>(base) + off);
    else if constexpr (E == Elt::bf16) return Ops::load_bf16(static_cast<const std::uint16_t*>(base) + off);
    else return Ops::load_f16(static_cast<const std::uint16_t*>(base) + off);
  }

  // s[r * BK] = q_r . k for the key row at koff, rows r < MR.
  template <Elt E, int MR>
  static void fast_qk_mk(const float* qr, i64 D, const void* k, i64 koff, float* s) {
    V acc[MR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; ++r) acc[r] = Ops::zero();
    for (i64 d = 0; d < D; d += W) {
      const V kv = load_elt<E>(k, koff + d);
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
      for (int x = 0; x < KX; ++x) kv[x] = load_elt<E>(k, koff + x * ks + d);
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
  template <Elt E, int MR>
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
      fast_qk_mk<E, MR>(qr, D, k, koff + j * ks, s + j);
      pf.step(1);
    }
  }

  template <Elt E>
  static void fast_qk(const float* qr, int n, i64 D, const void* k, i64 koff, i64 ks, int kt, float* s,
                      Prefetch& pf) {
    int r = 0;
    for (; r + kQkRows <= n; r += kQkRows) fast_qk_rows<E, kQkRows>(qr + r * D, D, k, koff, ks, kt, s + r * BK, pf);
    switch (n - r) {
      case 1: fast_qk_rows<E, 1>(qr + r * D, D, k, koff, ks, kt, s + r * BK, pf); break;
      case 2: fast_qk_rows<E, 2>(qr + r * D, D, k, koff, ks, kt, s + r * BK, pf); break;
      case 3: fast_qk_rows<E, 3>(qr + r * D, D, k, koff, ks, kt, s + r * BK, pf); break;
      default: break;
    }
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
  template <Elt E, int MR, int NC, bool SKIP>
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
      for (int c = 0; c < NC; ++c) vv[c] = load_elt<E>(v, voff + j * vs + c * W);
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

  template <Elt E, int MR, bool SKIP>
  static void fast_pv_rows(const float* s, const void* v, i64 voff, i64 vs, int kt, float* o, i64 os,
                           const float* alpha, int nvec, Prefetch& pf) {
    constexpr int NC = fast_nc(MR);
    int c = 0;
    for (; c + NC <= nvec; c += NC)
      fast_pv_mk<E, MR, NC, SKIP>(s, v, voff + c * W, vs, kt, o + c * W, os, alpha, pf);
    for (; c < nvec; ++c) fast_pv_mk<E, MR, 1, SKIP>(s, v, voff + c * W, vs, kt, o + c * W, os, alpha, pf);
  }

  template <Elt E, bool SKIP>
  static void fast_pv(const float* s, int n, const void* v, i64 voff, i64 vs, int kt, float* o, i64 os,
                      const float* alpha, int nvec, Prefetch& pf) {
    int r = 0;
    for (; r + 4 <= n; r += 4)
      fast_pv_rows<E, 4, SKIP>(s + r * BK, v, voff, vs, kt, o + r * os, os, alpha + r, nvec, pf);
    switch (n - r) {
      case 1: fast_pv_rows<E, 1, SKIP>(s + r * BK, v, voff, vs, kt, o + r * os, os, alpha + r, nvec, pf); break;
      case 2: fast_pv_rows<E, 2, SKIP>(s + r * BK, v, voff, vs, kt, o + r * os, os, alpha + r, nvec, pf); break;
      case 3: fast_pv_rows<E, 3, SKIP>(s + r * BK, v, voff, vs, kt, o + r * os, os, alpha + r, nvec, pf); break;
      default: break;
    }
    pf.rest();
  }

  // Online softmax of one tile's scores s[r * BK + j] (keys t0 + j, j < kt) for n rows: scales,
  // excludes keys outside each row's [lo, hi), and leaves the weights in s and the accumulator
  // rescale factor in w.alpha. Returns whether any key of the tile was excluded for some row.
  static bool fast_softmax(const Ws& w, int n, float* s, i64 t0, int kt, float scale) {
    const float neg_inf = -std::numeric_limits<float>::infinity();
    const i64 t1 = t0 + kt;
    const int ktp = static_cast<int>(round_up(kt, W));
    const V vscale = Ops::set1(scale);
    bool partial = false;
    for (int r = 0; r < n; ++r) {
      float* sr = s + r * BK;
      const Row& row = w.rows[r];
      for (int j = 0; j < ktp; j += W) Ops::store(sr + j, Ops::mul(Ops::load(sr + j), vscale));
      if (t0 < row.lo || t1 > row.hi) {
        partial = true;
        for (int j = 0; j < kt; ++j)
          if (t0 + j < row.lo || t0 + j >= row.hi) sr[j] = neg_inf;
      }
      for (int j = kt; j < ktp; ++j) sr[j] = neg_inf;
      V mx = Ops::set1(neg_inf);
      for (int j = 0; j < ktp; j += W) mx = Ops::max(mx, Ops::load(sr + j));
      float lanes[W];
      Ops::store(lanes, mx);
      float m_tile = neg_inf;
      for (int x = 0; x < W; ++x) m_tile = lanes[x] > m_tile ? lanes[x] : m_tile;
      const float mo = w.m[r];
      const float mn = mo > m_tile ? mo : m_tile;
      const float ms = mn == neg_inf ? 0.0f : mn;  // nothing admitted yet: exp(-inf - 0) = 0
      const V vms = Ops::set1(ms);
      Ops::store(lanes, Ops::exp(Ops::set1(mo - ms)));
      const float a = lanes[0];
      V sum = Ops::zero();
      for (int j = 0; j < ktp; j += W) {
        const V pj = Ops::exp(Ops::sub(Ops::load(sr + j), vms));
        Ops::store(sr + j, pj);
        sum = Ops::add(sum, pj);
      }
      w.l[r] = w.l[r] * a + Ops::hsum(sum);
      w.m[r] = mn;
      w.alpha[r] = a;
    }
    return partial;
  }

  // Rows of `blk` (w.rows, at most kFastRows) against keys [blk.ka, blk.kb), tile by tile: QK^T of
  // a tile, its softmax, then its PV product.
  template <Elt E>
  static void process_fast_tiles(const Problem& p, const Block& blk, const Ws& w) {
    const int n = blk.n;
    const i64 D = p.D, Dvp = dvp(p);
    const int nvec = static_cast<int>(Dvp / W);
    const float scale = static_cast<float>(p.scale);
    const float neg_inf = -std::numeric_limits<float>::infinity();
    for (int r = 0; r < n; ++r) { w.m[r] = neg_inf; w.l[r] = 0.0f; }
    for (i64 x = 0; x < n * Dvp; ++x) w.o[x] = 0.0f;
    if (blk.ka >= blk.kb) return;
    for (int r = 0; r < n; ++r) to_f32<E>(p.q.data, w.rows[r].q_off, w.qr + r * D, D);
    const i64 k_base = blk.b * p.k.sb + blk.hk * p.k.sh;
    const i64 v_base = blk.b * p.v.sb + blk.hk * p.v.sh;
    float* s = w.s;  // [n][BK] scores, then weights
    constexpr int esize = E == Elt::f32 ? 4 : 2;
    for (i64 t0 = blk.ka; t0 < blk.kb; t0 += BK) {
      const i64 t1 = std::min<i64>(t0 + BK, blk.kb);
      const int kt = static_cast<int>(t1 - t0);
      // As in process(): this tile's V rows during QK^T, the next tile's K rows during PV.
      Prefetch pf_v(p.v.data, v_base + t0 * p.v.ss, p.v.ss, kt, p.Dv, esize);
      Prefetch pf_k(p.k.data, k_base + t1 * p.k.ss, p.k.ss, static_cast<int>(std::min<i64>(BK, blk.kb - t1)), D, esize);
      fast_qk<E>(w.qr, n, D, p.k.data, k_base + t0 * p.k.ss, p.k.ss, kt, s, pf_v);
      const bool partial = fast_softmax(w, n, s, t0, kt, scale);
      if (partial)
        fast_pv<E, true>(s, n, p.v.data, v_base + t0 * p.v.ss, p.v.ss, kt, w.o, Dvp, w.alpha, nvec, pf_k);
      else
        fast_pv<E, false>(s, n, p.v.data, v_base + t0 * p.v.ss, p.v.ss, kt, w.o, Dvp, w.alpha, nvec, pf_k);
    }
  }

  // One row (n = 1: MHA decode, one query per KV head) against keys [blk.ka, blk.kb), software-
  // pipelined over tiles: the scores of tile t + 1 are computed in the same pass as the PV product
  // of tile t, kFastStep keys at a time, so the K and V streams are read side by side and the
  // reads of both stay in flight together; with one row there is too little arithmetic per byte
  // to hide the switch between whole K and V tiles. With 2 or 4 rows (GQA) a pipelined pass
  // measured slower than tile by tile (process_fast_tiles), so it serves one row only
  // (docs/performance.md). Same arithmetic in the same order as process_fast_tiles, so the same
  // result bit for bit: each score is formed alone and each FMA chain runs in key order (the
  // accumulator is rescaled once per tile, then multiplied by 1 between steps).
  template <Elt E>
  static void process_fast_stream(const Problem& p, const Block& blk, const Ws& w) {
    const i64 D = p.D, Dvp = dvp(p);
    const int nvec = static_cast<int>(Dvp / W);
    const float scale = static_cast<float>(p.scale);
    const float neg_inf = -std::numeric_limits<float>::infinity();
    w.m[0] = neg_inf;
    w.l[0] = 0.0f;
    for (i64 x = 0; x < Dvp; ++x) w.o[x] = 0.0f;
    if (blk.ka >= blk.kb) return;
    to_f32<E>(p.q.data, w.rows[0].q_off, w.qr, D);
    const i64 k_base = blk.b * p.k.sb + blk.hk * p.k.sh;
    const i64 v_base = blk.b * p.v.sb + blk.hk * p.v.sh;
    const i64 ks = p.k.ss, vs = p.v.ss;
    static constexpr float kOne[1] = {1.0f};
    float* s_cur = w.s;  // [BK] scores of the current tile, then its weights
    float* s_nxt = w.s + BK;
    Prefetch none;
    i64 t0 = blk.ka;
    int kt = static_cast<int>(std::min<i64>(BK, blk.kb - t0));
    for (int j = 0; j < kt; ++j) fast_qk_mk<E, 1>(w.qr, D, p.k.data, k_base + (t0 + j) * ks, s_cur + j);
    while (kt > 0) {
      const i64 t1 = t0 + kt;
      const int ktn = static_cast<int>(std::min<i64>(BK, blk.kb - t1));
      const bool partial = fast_softmax(w, 1, s_cur, t0, kt, scale);
      const int steps = std::max(kt, ktn);
      for (int j = 0; j < steps; j += kFastStep) {
        for (int jj = j; jj < std::min(j + kFastStep, ktn); ++jj)
          fast_qk_mk<E, 1>(w.qr, D, p.k.data, k_base + (t1 + jj) * ks, s_nxt + jj);
        if (j < kt) {
          const int cnt = std::min(kFastStep, kt - j);
          const float* alpha = j == 0 ? w.alpha : kOne;
          const i64 voff = v_base + (t0 + j) * vs;
          if (partial) fast_pv_rows<E, 1, true>(s_cur + j, p.v.data, voff, vs, cnt, w.o, Dvp, alpha, nvec, none);
          else fast_pv_rows<E, 1, false>(s_cur + j, p.v.data, voff, vs, cnt, w.o, Dvp, alpha, nvec, none);
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
  template <Elt E, int N, bool SKIP>
  static void stream_keys(const V* q, V* acc, const float* sc, int kt, const void* v, i64 voff, i64 vs,
                          float* sn, int ktn, const void* k, i64 koff, i64 ks) {
    const int steps = std::max(kt, ktn);
    for (int j = 0; j < steps; ++j) {
      if (j < ktn) {
        V a = Ops::zero();
#pragma GCC unroll 8
        for (int d = 0; d < N; ++d) a = Ops::fma(q[d], load_elt<E>(k, koff + j * ks + d * W), a);
        sn[j] = Ops::hsum(a);
      }
      if (j < kt) {
        const float pj = sc[j];
        const V pb = Ops::set1(pj);
        if constexpr (SKIP && Ops::kMaskedFma) {
          const auto m = Ops::nonzero(pb);
#pragma GCC unroll 8
          for (int c = 0; c < N; ++c) acc[c] = Ops::fma_mask(pb, load_elt<E>(v, voff + j * vs + c * W), acc[c], m);
        } else {
          if constexpr (SKIP) {
            if (pj == 0.0f) continue;
          }
#pragma GCC unroll 8
          for (int c = 0; c < N; ++c) acc[c] = Ops::fma(pb, load_elt<E>(v, voff + j * vs + c * W), acc[c]);
        }
      }
    }
  }

  template <Elt E, int N>
  static void process_fast_stream_regs(const Problem& p, const Block& blk, const Ws& w) {
    const float scale = static_cast<float>(p.scale);
    const float neg_inf = -std::numeric_limits<float>::infinity();
    w.m[0] = neg_inf;
    w.l[0] = 0.0f;
    V acc[N], q[N];
    for (int c = 0; c < N; ++c) acc[c] = Ops::zero();
    if (blk.ka < blk.kb) {
      to_f32<E>(p.q.data, w.rows[0].q_off, w.qr, p.D);  // p.D == N * W
      for (int d = 0; d < N; ++d) q[d] = Ops::load(w.qr + d * W);
      const i64 k_base = blk.b * p.k.sb + blk.hk * p.k.sh;
      const i64 v_base = blk.b * p.v.sb + blk.hk * p.v.sh;
      const i64 ks = p.k.ss, vs = p.v.ss;
      float* s_cur = w.s;
      float* s_nxt = w.s + BK;
      i64 t0 = blk.ka;
      int kt = static_cast<int>(std::min<i64>(BK, blk.kb - t0));
      stream_keys<E, N, false>(q, acc, s_cur, 0, p.v.data, 0, vs, s_cur, kt, p.k.data, k_base + t0 * ks, ks);
      while (kt > 0) {
        const i64 t1 = t0 + kt;
        const int ktn = static_cast<int>(std::min<i64>(BK, blk.kb - t1));
        const bool partial = fast_softmax(w, 1, s_cur, t0, kt, scale);
        const V a = Ops::set1(w.alpha[0]);
        for (int c = 0; c < N; ++c) acc[c] = Ops::mul(acc[c], a);
        if (partial)
          stream_keys<E, N, true>(q, acc, s_cur, kt, p.v.data, v_base + t0 * vs, vs, s_nxt, ktn, p.k.data, k_base + t1 * ks, ks);
        else
          stream_keys<E, N, false>(q, acc, s_cur, kt, p.v.data, v_base + t0 * vs, vs, s_nxt, ktn, p.k.data, k_base + t1 * ks, ks);
        std::swap(s_cur, s_nxt);
        t0 = t1;
        kt = ktn;
      }
    }
    for (int c = 0; c < N; ++c) Ops::store(w.o + c * W, acc[c]);
  }

  // Rows of `blk` (w.rows, at most kFastRows) against keys [blk.ka, blk.kb): leaves the
  // unnormalised O, m and l in `w`, as process() does.
  template <Elt E>
  static void process_fast(const Problem& p, const Block& blk, const Ws& w) {
    if (blk.n == 1) {
      if (p.D == p.Dv && p.D / W <= kStreamRegs) {
        switch (p.D / W) {
          case 1: return process_fast_stream_regs<E, 1>(p, blk, w);
          case 2: if constexpr (kStreamRegs >= 2) return process_fast_stream_regs<E, 2>(p, blk, w); break;
          case 3: if constexpr (kStreamRegs >= 3) return process_fast_stream_regs<E, 3>(p, blk, w); break;
          case 4: if constexpr (kStreamRegs >= 4) return process_fast_stream_regs<E, 4>(p, blk, w); break;
          case 5: if constexpr (kStreamRegs >= 5) return process_fast_stream_regs<E, 5>(p, blk, w); break;
          case 6: if constexpr (kStreamRegs >= 6) return process_fast_stream_regs<E, 6>(p, blk, w); break;
          case 7: if constexpr (kStreamRegs >= 7) return process_fast_stream_regs<E, 7>(p, blk, w); break;
          case 8: if constexpr (kStreamRegs >= 8) return process_fast_stream_regs<E, 8>(p, blk, w); break;
          default: break;
        }
      }
      return process_fast_stream<E>(p, blk, w);
    }
    process_fast_tiles<E>(p, blk, w);
  }

  // ---- rows and ranges -----------------------------------------------------------------------
  static Row make_row(const Problem& p, i64 b, i64 h, i64 i) {
    Row r;
    r.q_off = b * p.q.sb + h * p.q.sh + i * p.q.ss;
    p.key_range(b, i, r.lo, r.hi);
    r.mask_off = b * p.mask.sb + h * p.mask.sh + i * p.mask.sq;
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

  // Normalises the accumulator and writes out and softmax_lse.
  static void finish(const Problem& p, const Ws& w, int n) {
    const i64 Dv = p.Dv, Dvp = dvp(p);
    for (int r = 0; r < n; ++r) {
      const Row& row = w.rows[r];
      const float* o = w.o + r * Dvp;
      // Empty iff nothing was admitted: l == 0 exactly (a NaN score leaves m = -inf but l = NaN).
      const bool empty = w.l[r] == 0.0f;
      const float l = empty ? 1.0f : w.l[r];
      store_out(p, row.out_off, o, l, empty, Dv);
      if (p.lse.data) {
        const float lse = empty ? -std::numeric_limits<float>::infinity() : w.m[r] + std::log(w.l[r]);
        store_scalar(p.lse.data, p.lse.dtype, row.lse_off, lse);
      }
    }
  }

  static void store_scalar(void* data, DType dt, i64 off, float x) {
    switch (dt) {
      case DType::f32: static_cast<float*>(data)[off] = x; break;
      case DType::f64: static_cast<double*>(data)[off] = x; break;
      case DType::bf16: static_cast<std::uint16_t*>(data)[off] = float_to_bf16(x); break;
      case DType::f16: static_cast<std::uint16_t*>(data)[off] = float_to_half(x); break;
      default: break;
    }
  }

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

  // ---- flash: the whole problem --------------------------------------------------------------
  static std::size_t flash_ws(const Problem& p, int threads) { return kGroup * ws_bytes(p) * threads; }

  template <Elt E, bool DP, bool MASK, bool CAP>
  static void flash_impl(const Problem& p, char* ws, int threads) {
    const i64 nqb = (p.Sq + BQ - 1) / BQ;
    const i64 ngroup = (nqb + kGroup - 1) / kGroup;
    const i64 items = ngroup * p.B * p.Hq;
    const std::size_t wsb = ws_bytes(p);
#pragma omp parallel num_threads(threads)
    {
      char* mine = ws + kGroup * wsb * omp_get_thread_num();
      Ws w[kGroup];
      for (int x = 0; x < kGroup; ++x) w[x] = carve(p, mine + x * wsb);
      // The blocks of a group read the same K/V tiles: one converted or repacked copy of each.
      for (int x = 1; x < kGroup; ++x) {
        w[x].kbuf = w[0].kbuf;
        w[x].vbuf = w[0].vbuf;
        w[x].vp = w[0].vp;
        w[x].tags = w[0].tags;
      }
#pragma omp for schedule(dynamic, 1)
      for (i64 it = 0; it < items; ++it) {
        // One item: a group of adjacent query blocks (process_group). Head-major: consecutive
        // items, on every thread, share one head's K and V, which then stay in L2/L3 instead
        // of cycling through all heads' K/V. Within a head, last query blocks first: under causal
        // masks they see the most keys, and the small blocks at the end even out the threads.
        const i64 gq = it % ngroup, bh = it / ngroup;
        const i64 b = bh / p.Hq, h = bh % p.Hq;
        Block blk[kGroup];
        int g = 0;
        for (i64 qb = nqb - 1 - kGroup * gq; g < kGroup && qb >= 0; --qb, ++g) blk[g] = make_block(p, b, h, qb, w[g]);
        process_group<E, DP, MASK, CAP>(p, blk, w, g);
        for (int x = 0; x < g; ++x) finish(p, w[x], blk[x].n);
      }
    }
  }

  // Query block qb of (b, h): its rows into w.rows, its key range.
  static Block make_block(const Problem& p, i64 b, i64 h, i64 qb, const Ws& w) {
    const i64 i0 = qb * BQ;
    Block blk;
    blk.b = b;
    blk.hk = p.kv_head(h);
    blk.n = static_cast<int>(std::min<i64>(BQ, p.Sq - i0));
    for (int r = 0; r < blk.n; ++r) w.rows[r] = make_row(p, b, h, i0 + r);
    block_range(w, blk.n, blk.ka, blk.kb, blk.max_lo, blk.min_hi);
    return blk;
  }

  // ---- decode: flash-decoding ------------------------------------------------------------------
  // Rows of one (b, KV head): r = g * Sq + i for the G query heads g of the group.
  static i64 decode_rows(const Problem& p) { return p.group() * p.Sq; }
  // Keys per chunk, fixed by the problem alone (never by the thread count): at most 64 chunks per
  // (b, KV head), at least kDecodeMinChunk keys each, partials bounded to about 16 MiB. Long
  // chunks let each thread read K and V in long contiguous runs, which streams faster than
  // 256-key chunks did (docs/performance.md). The price: fewer items to share out,
  // B x Hkv x ceil(Sk / 4096) of them.
  static constexpr i64 kDecodeMinChunk = 4096;
  static i64 decode_chunk(const Problem& p) {
    const i64 per_chunk_bytes = p.B * p.Hq * p.Sq * (dvp(p) + 2) * 4;
    const i64 max_chunks = std::clamp<i64>((i64{16} << 20) / std::max<i64>(per_chunk_bytes, 1), 1, 64);
    const i64 c = std::max<i64>((p.Sk + max_chunks - 1) / max_chunks, kDecodeMinChunk);
    return round_up(c, BK);
  }
  static i64 decode_nchunks(const Problem& p) {
    return std::max<i64>(1, (p.Sk + decode_chunk(p) - 1) / decode_chunk(p));
  }
  static std::size_t decode_ws(const Problem& p, int threads) {
    const i64 parts = p.B * p.Hq * p.Sq * decode_nchunks(p);
    return ws_bytes(p) * threads + align_up(parts * (dvp(p) + 2) * sizeof(float));
  }

  template <Elt E, bool DP, bool MASK, bool CAP>
  static void decode_impl(const Problem& p, char* ws, int threads) {
    const i64 R = decode_rows(p);
    const i64 nrb = (R + BQ - 1) / BQ;
    const i64 C = decode_chunk(p), NC = decode_nchunks(p);
    const i64 Dvp = dvp(p);
    const std::size_t wsb = ws_bytes(p);
    // partials: [b][hk][chunk][R] rows of (Dvp accumulators, m, l)
    float* parts = reinterpret_cast<float*>(ws + wsb * threads);
    const i64 row_f = Dvp + 2;
    const i64 items = p.B * p.Hkv * nrb * NC;
    const i64 G = p.group();
    const bool fast = decode_fast_ok(p);
#pragma omp parallel num_threads(threads)
    {
      const Ws w = carve(p, ws + wsb * omp_get_thread_num());
#pragma omp for schedule(dynamic, 1)
      for (i64 it = 0; it < items; ++it) {
        const i64 c = it % NC;
        const i64 rb = (it / NC) % nrb;
        const i64 bhk = it / (NC * nrb);
        const i64 b = bhk / p.Hkv, hk = bhk % p.Hkv;
        const i64 r0 = rb * BQ;
        const int n = static_cast<int>(std::min<i64>(BQ, R - r0));
        for (int r = 0; r < n; ++r) {
          const i64 rr = r0 + r;
          w.rows[r] = make_row(p, b, hk * G + rr / p.Sq, rr % p.Sq);
        }
        Block blk;
        blk.b = b;
        blk.hk = hk;
        blk.n = n;
        i64 lo, hi;
        block_range(w, n, lo, hi, blk.max_lo, blk.min_hi);
        blk.ka = std::max(lo, c * C);
        blk.kb = std::min(hi, (c + 1) * C);
        if constexpr (!MASK && !CAP) {
          if (fast) process_fast<E>(p, blk, w);
          else process<E, DP, MASK, CAP>(p, blk, w);
        } else {
          process<E, DP, MASK, CAP>(p, blk, w);
        }
        float* dst = parts + ((bhk * NC + c) * R + r0) * row_f;
        for (int r = 0; r < n; ++r) {
          std::memcpy(dst + r * row_f, w.o + r * Dvp, Dvp * sizeof(float));
          dst[r * row_f + Dvp] = w.m[r];
          dst[r * row_f + Dvp + 1] = w.l[r];
        }
      }
      // Merge the chunk partials of each row in chunk order (independent of the schedule).
      const i64 rows_total = p.B * p.Hkv * R;
#pragma omp for schedule(static)
      for (i64 x = 0; x < rows_total; ++x) {
        const i64 bhk = x / R, rr = x % R;
        const i64 b = bhk / p.Hkv, hk = bhk % p.Hkv;
        const float neg_inf = -std::numeric_limits<float>::infinity();
        float mx = neg_inf;
        bool any = false, nan = false;
        for (i64 c = 0; c < NC; ++c) {
          const float* src = parts + ((bhk * NC + c) * R + rr) * row_f;
          if (src[Dvp + 1] == 0.0f) continue;  // a chunk with no admissible key
          any = true;
          nan = nan || std::isnan(src[Dvp + 1]);
          mx = std::max(mx, src[Dvp]);
        }
        // The merge accumulates in float64 (a few Dv-vectors per row: cheap), so it adds no
        // rounding beyond the final one.
        double* accd = reinterpret_cast<double*>(w.o);  // BQ * Dvp floats >= Dvp doubles
        for (i64 d = 0; d < Dvp; ++d) accd[d] = 0.0;
        double lsum = 0.0;
        if (any && !nan) {
          for (i64 c = 0; c < NC; ++c) {
            const float* src = parts + ((bhk * NC + c) * R + rr) * row_f;
            if (src[Dvp + 1] == 0.0f) continue;
            const double a = std::exp(static_cast<double>(src[Dvp]) - static_cast<double>(mx));
            lsum += a * src[Dvp + 1];
            for (i64 d = 0; d < Dvp; ++d) accd[d] += a * src[d];
          }
        }
        float* acc = w.vbuf;  // scratch: vbuf no longer holds a tile
        w.tags[kTagV].kt = 0;
        for (i64 d = 0; d < Dvp; ++d)
          acc[d] = nan ? std::numeric_limits<float>::quiet_NaN() : any ? static_cast<float>(accd[d] / lsum) : 0.0f;
        const Row row = make_row(p, b, hk * G + rr / p.Sq, rr % p.Sq);
        const bool empty = !any;
        store_out(p, row.out_off, acc, 1.0f, empty, p.Dv);
        if (p.lse.data)
          store_scalar(p.lse.data, p.lse.dtype, row.lse_off,
                       empty ? neg_inf : nan ? std::numeric_limits<float>::quiet_NaN()
                                             : static_cast<float>(mx + std::log(lsum)));
      }
    }
  }

  // ---- the one switch from run-time options to template parameters --------------------------
  template <template <Elt, bool, bool, bool> class Fn>
  static void dispatch(const Problem& p, char* ws, int threads, bool bf16_dot) {
    const bool mask = p.mask.data != nullptr, cap = p.softcap > 0.0;
    auto with_opts = [&]<Elt E, bool DP>() {
      if (mask) {
        if (cap) Fn<E, DP, true, true>::run(p, ws, threads);
        else Fn<E, DP, true, false>::run(p, ws, threads);
      } else {
        if (cap) Fn<E, DP, false, true>::run(p, ws, threads);
        else Fn<E, DP, false, false>::run(p, ws, threads);
      }
    };
    switch (p.q.dtype) {
      case DType::bf16:
        if constexpr (Ops::kHasDpbf16) {
          if (bf16_dot) { with_opts.template operator()<Elt::bf16, true>(); break; }
        }
        with_opts.template operator()<Elt::bf16, false>();
        break;
      case DType::f16: with_opts.template operator()<Elt::f16, false>(); break;
      default: with_opts.template operator()<Elt::f32, false>(); break;
    }
  }

  template <Elt E, bool DP, bool MASK, bool CAP>
  struct FlashFn {
    static void run(const Problem& p, char* ws, int t) { flash_impl<E, DP, MASK, CAP>(p, ws, t); }
  };
  template <Elt E, bool DP, bool MASK, bool CAP>
  struct DecodeFn {
    static void run(const Problem& p, char* ws, int t) { decode_impl<E, DP, MASK, CAP>(p, ws, t); }
  };

  /// The engine's vector exp on an array (for its accuracy test).
  static void exp_array(const float* x, float* y, i64 n) {
    i64 i = 0;
    for (; i + W <= n; i += W) Ops::store(y + i, Ops::exp(Ops::load(x + i)));
    if (i < n) {
      float tx[W], ty[W];
      for (int t = 0; t < W; ++t) tx[t] = i + t < n ? x[i + t] : 0.0f;
      Ops::store(ty, Ops::exp(Ops::load(tx)));
      for (int t = 0; i + t < n; ++t) y[i + t] = ty[t];
    }
  }

  static std::size_t flash_workspace(const Problem& p, int threads, bool) { return flash_ws(p, threads); }
  static void flash_forward(const Problem& p, void* ws, int threads, bool bf16_dot) {
    dispatch<FlashFn>(p, static_cast<char*>(ws), threads, bf16_dot);
  }
  static std::size_t decode_workspace(const Problem& p, int threads, bool) { return decode_ws(p, threads); }
  static void decode_forward(const Problem& p, void* ws, int threads, bool bf16_dot) {
    dispatch<DecodeFn>(p, static_cast<char*>(ws), threads, bf16_dot);
  }
};

}  // namespace qkv::detail::QKV_ENGINE_NS
