#pragma once
// FlashAttention-2 backward on the CPU (Dao 2023, "FlashAttention-2", Algorithm 2): the
// gradients dQ, dK, dV with P recomputed tile by tile from softmax_lse, never an Sq x Sk buffer.
//
// Per (batch, KV head) the keys are cut into C chunks (fixed by the problem, never by the thread
// count; C > 1 only when there are fewer than kMinItems pairs, so that one long head still uses
// every core) and each chunk is one work item. An item takes its keys kKeyGroup blocks of kBk at a
// time (K, V converted to fp32 once, dK and dV accumulated in fp32 in the thread's workspace)
// and runs every query block of every query head of the group that admits any of them:
//   S   = Q K^T                       (the forward's QK^T microkernel, scores key-major)
//   P   = exp(scale S - lse)          (softcap, masks and excluded keys as the forward; rows with
//                                      lse = -inf and padded rows get P = 0 exactly, never
//                                      exp(0 - lse) of a huge lse)
//   dP  = dO V^T                      (the same microkernel, dO transposed)
//   dS  = scale P (dP - D),  D = rowsum(dO * O)   (softcap: times 1 - tanh^2)
//   dV += P^T dO,  dK += dS^T Q,  dQ += dS K      (the forward's PV microkernel; P and dS
//                                                  transposed in registers for the first two)
// dK and dV of a chunk's keys are complete when the item ends (the item has every query row), so
// they are written once. dQ sums over all keys: each chunk adds into its own fp32 buffer of the
// group's rows, and the C buffers are summed in chunk order after the items, so no atomics and
// a fixed order: the gradients are bitwise the same for any number of threads. GQA is reduced
// inside the item (the query heads of a group in order), with no Hq-expanded copy of K, V, dK or
// dV.
//
// Memory beyond the operands: per thread a workspace of O((kBq + kKeyGroup kBk) (D + Dv)) floats
// (about 1.3 MiB at D = 128 on AVX-512, most of it the K, V, dK, dV tiles of a key group), and the dQ buffers, C x (group rows) x D floats for as
// many (batch, KV head) pairs at a time as fit kPartialBytes (at least one; the pairs go in waves).
// Chunk boundaries balance the admitted (row, key block) pairs, so causal items cost the same.
//
// Excluded keys: a tile is read only if some row of the batch admits its keys (causal, window and
// key lengths; keys outside every row's range are never read and get dK = dV = 0); within a tile,
// an excluded (row, key) gets P = 0 and dS = 0, and the products skip zero weights, so NaN or inf
// in a key or value excluded for a row never reaches that row's gradients.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "core/problem.hpp"
#include "kernels/engine/isa_ops.hpp"
#include "kernels/engine/microkernels.hpp"
#include "kernels/engine/workspace.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail::QKV_ENGINE_NS {

template <IsaOps Ops>
struct Backward {
  using V = typename Ops::V;
  using Mk = Microkernels<Ops>;
  static constexpr int W = Ops::W;
  static constexpr int BQ = Ops::kBq;
  static constexpr int BK = Ops::kBk;
  static constexpr int SP = BQ + W;  // pitch of key-major tiles, off a power of two
  static constexpr int kKeyGroup = 8;
  static constexpr int kMaxChunks = 4;
  static constexpr i64 kMinItems = 8;
  static constexpr i64 kPartialBytes = i64{32} << 20;

  static i64 dp(const Problem& p) { return round_up(std::max<i64>(p.D, 1), W); }
  static i64 dvp(const Problem& p) { return round_up(std::max<i64>(p.Dv, 1), W); }

  // ---- the plan: chunks and waves, from the problem alone -----------------------------------
  struct Plan {
    i64 nkb = 0;             // key blocks of kBk
    i64 C = 1;               // key chunks per (batch, KV head)
    i64 rows = 0;            // query rows per (batch, KV head): G x Sq
    i64 wave = 1;            // (batch, KV head) pairs per wave
    std::vector<i64> lo, hi;     // [B]: union of the rows' admissible keys
    std::vector<i64> bounds;     // [B][C + 1]: first key block of each chunk
  };

  static Plan plan(const Problem& p) {
    Plan pl;
    pl.nkb = (p.Sk + BK - 1) / BK;
    pl.rows = p.group() * p.Sq;
    // Chunks only where (batch, KV head) pairs are too few to share out (fewer than kMinItems):
    // each chunk packs every query block again and adds a dQ buffer. The count depends on the
    // problem alone, never on the threads.
    const i64 chunk_bytes = std::max<i64>(pl.rows * dp(p) * 4, 1);
    const i64 pairs = std::max<i64>(1, p.B * p.Hkv);
    pl.C = std::min<i64>((kMinItems + pairs - 1) / pairs, kMaxChunks);
    pl.C = std::min(pl.C, std::max<i64>(1, kPartialBytes / chunk_bytes));
    pl.C = std::max<i64>(1, std::min(pl.C, pl.nkb));
    pl.wave = std::clamp<i64>(kPartialBytes / (pl.C * chunk_bytes), 1, pairs);
    pl.lo.assign(p.B, 0);
    pl.hi.assign(p.B, 0);
    pl.bounds.assign(p.B * (pl.C + 1), 0);
    std::vector<i64> weight(pl.nkb + 1);
    for (i64 b = 0; b < p.B; ++b) {
      // Work per key block: the query rows that admit any of its keys (the same for every head).
      std::fill(weight.begin(), weight.end(), 0);
      i64 ulo = std::numeric_limits<i64>::max(), uhi = std::numeric_limits<i64>::min();
      for (i64 i = 0; i < p.Sq; ++i) {
        i64 lo, hi;
        p.key_range(b, i, lo, hi);
        if (lo >= hi) continue;
        ulo = std::min(ulo, lo);
        uhi = std::max(uhi, hi);
        weight[lo / BK] += 1;
        weight[(hi - 1) / BK + 1] -= 1;
      }
      if (ulo >= uhi) ulo = uhi = 0;
      pl.lo[b] = ulo;
      pl.hi[b] = uhi;
      i64 total = 0;
      for (i64 j = 0; j < pl.nkb; ++j) {
        if (j) weight[j] += weight[j - 1];
        total += weight[j] + 1;  // + 1: every block costs its conversion
      }
      i64* bd = &pl.bounds[b * (pl.C + 1)];
      i64 c = 1, cum = 0;
      for (i64 j = 0; j < pl.nkb && c < pl.C; ++j) {
        cum += weight[j] + 1;
        while (c < pl.C && cum * pl.C >= total * c) bd[c++] = j + 1;
      }
      for (; c <= pl.C; ++c) bd[c] = pl.nkb;
      bd[0] = 0;
    }
    return pl;
  }

  // ---- workspace ---------------------------------------------------------------------------
  struct BRow {
    i64 lo, hi;      // admissible key range
    i64 mask_off;    // element offset of (b, h, i, 0) in the mask
  };

  struct Ws {
    float* qr;    // [BQ][Dp]   query rows, fp32, zero padded
    float* qt;    // [Dp][BQ]   the same, transposed (QK^T)
    float* dor;   // [BQ][Dvp]  dO rows
    float* dot;   // [Dvp][BQ]  dO transposed (dO V^T)
    float* orows; // [BQ][Dvp]  O rows converted (when not read in place)
    float* ot;    // [Dvp][BQ]  O transposed (for D)
    float* s;     // [BK][SP]   scores, then P (key-major)
    float* dps;   // [BK][SP]   dP, then dS
    float* th;    // [BK][SP]   tanh of the softcapped scores
    float* pt;    // [BQ][BK]   P transposed
    float* dst;   // [BQ][BK]   dS transposed
    float* lse;   // [BQ]       softmax_lse (+inf for empty and padded rows)
    float* di;    // [BQ]       D = rowsum(dO * O)
    float* lo_f;  // [BQ]       key range as floats (vector select)
    float* hi_f;  // [BQ]
    float* ones;  // [max(BQ, BK)]
    float* acc;   // [Dp]       the sum of one row's dQ buffers
    BRow* rows;   // [BQ]
    float* kbuf[kKeyGroup];  // [BK][Dp]   K tiles, fp32
    float* vbuf[kKeyGroup];  // [BK][Dvp]  V tiles, fp32
    float* dk[kKeyGroup];    // [BK][Dp]   dK accumulators
    float* dv[kKeyGroup];    // [BK][Dvp]  dV accumulators
  };

  static std::size_t ws_bytes(const Problem& p) {
    const std::size_t f = sizeof(float), Dp = dp(p), Dvp = dvp(p);
    return 2 * align_up(BQ * Dp * f) + 4 * align_up(BQ * Dvp * f) + 3 * align_up(BK * SP * f) +
           2 * align_up(BQ * BK * f) + 4 * align_up(BQ * f) + align_up(std::max(BQ, BK) * f) + align_up(Dp * f) +
           align_up(BQ * sizeof(BRow)) + kKeyGroup * (2 * align_up(BK * Dp * f) + 2 * align_up(BK * Dvp * f));
  }

  static Ws carve(const Problem& p, char* base) {
    const std::size_t f = sizeof(float), Dp = dp(p), Dvp = dvp(p);
    auto take = [&](std::size_t n) { float* r = reinterpret_cast<float*>(base); base += align_up(n); return r; };
    Ws w;
    w.qr = take(BQ * Dp * f);
    w.qt = take(BQ * Dp * f);
    w.dor = take(BQ * Dvp * f);
    w.dot = take(BQ * Dvp * f);
    w.orows = take(BQ * Dvp * f);
    w.ot = take(BQ * Dvp * f);
    w.s = take(BK * SP * f);
    w.dps = take(BK * SP * f);
    w.th = take(BK * SP * f);
    w.pt = take(BQ * BK * f);
    w.dst = take(BQ * BK * f);
    w.lse = take(BQ * f);
    w.di = take(BQ * f);
    w.lo_f = take(BQ * f);
    w.hi_f = take(BQ * f);
    w.ones = take(std::max(BQ, BK) * f);
    w.acc = take(Dp * f);
    w.rows = reinterpret_cast<BRow*>(take(BQ * sizeof(BRow)));
    for (int x = 0; x < kKeyGroup; ++x) {
      w.kbuf[x] = take(BK * Dp * f);
      w.vbuf[x] = take(BK * Dvp * f);
      w.dk[x] = take(BK * Dp * f);
      w.dv[x] = take(BK * Dvp * f);
    }
    for (int x = 0; x < std::max(BQ, BK); ++x) w.ones[x] = 1.0f;
    return w;
  }

  static std::size_t workspace(const Problem& p, int threads) {
    const Plan pl = plan(p);
    return ws_bytes(p) * threads + align_up(pl.wave * pl.C * pl.rows * dp(p) * sizeof(float));
  }

  // ---- rows in and out ---------------------------------------------------------------------

  // n elements of a row of any float dtype as fp32 (one switch per row, not per element).
  static void row_f32(const void* base, DType dt, i64 off, float* dst, i64 n) {
    switch (dt) {
      case DType::f32: std::memcpy(dst, static_cast<const float*>(base) + off, n * sizeof(float)); break;
      case DType::bf16: Mk::template to_f32<Elt::bf16>(base, off, dst, n); break;
      case DType::f16: Mk::template to_f32<Elt::f16>(base, off, dst, n); break;
      default:
        for (i64 x = 0; x < n; ++x) dst[x] = static_cast<float>(static_cast<const double*>(base)[off + x]);
        break;
    }
  }

  // n fp32 values to a gradient row (f32 or the input dtype), each rounded once.
  static void store_row(const OutOperand& o, i64 off, const float* src, i64 n) {
    if (o.dtype == DType::f32 && o.sx == 1) {
      std::memcpy(static_cast<float*>(o.data) + off, src, n * sizeof(float));
      return;
    }
    for (i64 x = 0; x < n; ++x) {
      const i64 e = off + x * o.sx;
      switch (o.dtype) {
        case DType::f32: static_cast<float*>(o.data)[e] = src[x]; break;
        case DType::f64: static_cast<double*>(o.data)[e] = src[x]; break;
        case DType::bf16: static_cast<std::uint16_t*>(o.data)[e] = float_to_bf16(src[x]); break;
        case DType::f16: static_cast<std::uint16_t*>(o.data)[e] = float_to_half(src[x]); break;
        default: break;
      }
    }
  }

  // dst[c * ld + r] = src[r * pitch + c] for r < rows (rows up to round_up(rows, W) read as 0)
  // and c < cols (a multiple of W; a source row holds at least cols floats): W x W blocks
  // transposed in registers.
  static void transpose(const float* src, i64 pitch, int rows, int cols, float* dst, i64 ld) {
    alignas(64) static constexpr float kZeros[W] = {};
    const float* r[W];
    for (int r0 = 0; r0 < rows; r0 += W)
      for (int c0 = 0; c0 < cols; c0 += W) {
        for (int x = 0; x < W; ++x) r[x] = r0 + x < rows ? src + (r0 + x) * pitch + c0 : kZeros;
        Ops::transpose(r, dst + c0 * ld + r0, ld);
      }
  }

  // A query block: rows i0 .. i0 + n - 1 of query head h, packed for the tiles. Q and dO rows are
  // read in place where they already are fp32 rows of whole vectors (f32, D and Dv multiples of
  // W), else converted into the workspace; `qs`/`ds` point at row 0 with row strides qss/dss.
  struct QBlock {
    int n, nqv;
    i64 lo_min, hi_max, max_lo, min_hi;  // union and intersection of the rows' key ranges
    const float* qs;                     // Q rows (the dK += dS^T Q operand)
    const float* ds;                     // dO rows (the dV += P^T dO operand)
    i64 qss, dss;
  };

  // The rows of a [B,H,S,X] operand for one block: in place (f32 rows of whole vectors, pitch
  // = the S stride), or converted into buf (pitch Xp, padded with zeros).
  static const float* block_rows(const void* data, DType dt, i64 off, i64 ss, int n, i64 X, i64 Xp, float* buf,
                                 i64& pitch) {
    if (dt == DType::f32 && X == Xp) {
      pitch = ss;
      return static_cast<const float*>(data) + off;
    }
    for (int r = 0; r < n; ++r) {
      row_f32(data, dt, off + r * ss, buf + r * Xp, X);
      std::fill(buf + r * Xp + X, buf + (r + 1) * Xp, 0.0f);
    }
    pitch = Xp;
    return buf;
  }

  template <Elt E>
  static QBlock pack_block(const BackwardProblem& bp, const Ws& w, i64 b, i64 h, i64 i0) {
    const Problem& p = bp.fwd;
    const i64 D = p.D, Dv = p.Dv, Dp = dp(p), Dvp = dvp(p);
    QBlock qb;
    qb.n = static_cast<int>(std::min<i64>(BQ, p.Sq - i0));
    qb.nqv = (qb.n + W - 1) / W;
    const int n = qb.n, sp = qb.nqv * W;
    qb.lo_min = std::numeric_limits<i64>::max();
    qb.hi_max = std::numeric_limits<i64>::min();
    qb.max_lo = std::numeric_limits<i64>::min();
    qb.min_hi = std::numeric_limits<i64>::max();
    const float inf = std::numeric_limits<float>::infinity();
    for (int r = 0; r < sp; ++r) {
      if (r >= n) {  // padding: rows whose P is exactly 0 (lse = +inf) and whose D is 0
        w.lse[r] = inf;
        w.lo_f[r] = -1e30f;
        w.hi_f[r] = 1e30f;
        continue;
      }
      const i64 i = i0 + r;
      BRow& row = w.rows[r];
      p.key_range(b, i, row.lo, row.hi);
      row.mask_off = b * p.mask.sb + h * p.mask.sh + i * p.mask.sq;
      if (row.lo < row.hi) {
        qb.lo_min = std::min(qb.lo_min, row.lo);
        qb.hi_max = std::max(qb.hi_max, row.hi);
        qb.max_lo = std::max(qb.max_lo, row.lo);
        qb.min_hi = std::min(qb.min_hi, row.hi);
      } else {  // an empty row makes no tile full
        qb.max_lo = std::numeric_limits<i64>::max();
        qb.min_hi = std::numeric_limits<i64>::min();
      }
      w.lo_f[r] = static_cast<float>(row.lo);
      w.hi_f[r] = static_cast<float>(row.hi);
      const i64 lo = b * p.lse.sb + h * p.lse.sh + i * p.lse.ss;
      const float lse = p.lse.dtype == DType::f64 ? static_cast<float>(static_cast<const double*>(p.lse.data)[lo])
                                                  : static_cast<const float*>(p.lse.data)[lo];
      // A row with no admissible key has lse = -inf: +inf makes every exp(s - lse) exactly 0.
      w.lse[r] = lse == -inf ? inf : lse;
    }
    if (qb.lo_min > qb.hi_max) qb.lo_min = qb.hi_max = 0;

    // Q, dO and O rows, then Q^T and dO^T (the QK^T and dO V^T operands) and O^T.
    const DType qdt = E == Elt::f32 ? DType::f32 : E == Elt::bf16 ? DType::bf16 : DType::f16;
    qb.qs = block_rows(p.q.data, qdt, b * p.q.sb + h * p.q.sh + i0 * p.q.ss, p.q.ss, n, D, Dp, w.qr, qb.qss);
    qb.ds = block_rows(bp.dout.data, bp.dout.dtype, b * bp.dout.sb + h * bp.dout.sh + i0 * bp.dout.ss, bp.dout.ss, n,
                       Dv, Dvp, w.dor, qb.dss);
    i64 oss;
    const float* os = block_rows(p.out.data, p.out.dtype, b * p.out.sb + h * p.out.sh + i0 * p.out.ss, p.out.ss, n, Dv,
                                 Dvp, w.orows, oss);
    transpose(qb.qs, qb.qss, n, static_cast<int>(Dp), w.qt, sp);
    transpose(qb.ds, qb.dss, n, static_cast<int>(Dvp), w.dot, sp);
    transpose(os, oss, n, static_cast<int>(Dvp), w.ot, sp);
    // D = rowsum(dO * O), W rows at a time, one FMA chain over x per row: the order and the
    // roundings of the dP microkernel, so that dP - D cancels exactly where it should (a row
    // whose only key has P = 1).
    for (int c = 0; c < qb.nqv; ++c) {
      V acc = Ops::zero();
      for (i64 x = 0; x < Dv; ++x) acc = Ops::fma(Ops::load(w.dot + x * sp + c * W), Ops::load(w.ot + x * sp + c * W), acc);
      Ops::store(w.di + c * W, acc);
    }
    return qb;
  }

  // ---- one tile: keys [t0, t0 + kt) of key buffer x against a packed query block ------------
  template <bool MASK, bool CAP>
  static void tile(const BackwardProblem& bp, const Ws& w, const QBlock& qb, int x, i64 t0, int kt, float* dq) {
    const Problem& p = bp.fwd;
    const i64 D = p.D, Dv = p.Dv, Dp = dp(p), Dvp = dvp(p);
    const int n = qb.n, nqv = qb.nqv, sp = nqv * W;
    const i64 t1 = t0 + kt;
    const bool full = !MASK && t0 >= qb.max_lo && t1 <= qb.min_hi;
    const bool vec = !MASK && !CAP && t1 < (i64{1} << 24);  // key indices exact as floats
    const float scale = static_cast<float>(p.scale), cap = static_cast<float>(p.softcap);
    Prefetch none;

    // S = Q K^T, then P = exp(scale S - lse) with the tile's exclusions.
    Mk::qk_tile(w.qt, nqv, w.kbuf[x], Dp, D, kt, w.s, SP, none);
    if (vec) {
      const V vs = Ops::set1(scale);
      for (int c = 0; c < nqv; ++c) {
        const V l = Ops::load(w.lse + c * W), lo = Ops::load(w.lo_f + c * W), hi = Ops::load(w.hi_f + c * W);
        for (int j = 0; j < kt; ++j) {
          float* e = w.s + j * SP + c * W;
          V y = Ops::mul(Ops::load(e), vs);
          if (!full) y = Ops::range_select(y, lo, hi, Ops::set1(static_cast<float>(t0 + j)));
          Ops::store(e, Ops::exp(Ops::sub(y, l)));
        }
      }
    } else {
      for (int r = 0; r < sp; ++r)
        for (int j = 0; j < kt; ++j) {
          float& e = w.s[j * SP + r];
          if (r >= n) { e = 0.0f; continue; }
          const BRow& row = w.rows[r];
          const i64 g = t0 + j;
          bool ok = g >= row.lo && g < row.hi;
          float add = 0.0f;
          if constexpr (MASK) ok = ok && mask_admits(p.mask, row.mask_off + g * p.mask.sk, add);
          float y = e * scale;
          if constexpr (CAP) {
            const float t = std::tanh(y / cap);
            w.th[j * SP + r] = t;
            y = cap * t;
          }
          e = ok ? std::exp(y + add - w.lse[r]) : 0.0f;
        }
    }

    // dP = dO V^T, then dS = scale P (dP - D) (softcap: times 1 - tanh^2). An excluded (row,
    // key) has P = 0 and so dS = 0 already unless dP is not finite (NaN or inf in a value or in
    // dO): the sum of a partial tile's dS, kept on the side, says whether the scalar pass that
    // zeroes those must run.
    Mk::qk_tile(w.dot, nqv, w.vbuf[x], Dvp, Dv, kt, w.dps, SP, none);
    const V vs = Ops::set1(scale);
    V check = Ops::zero();
    for (int c = 0; c < nqv; ++c) {
      const V di = Ops::load(w.di + c * W);
      for (int j = 0; j < kt; ++j) {
        float* e = w.dps + j * SP + c * W;
        const V ds = Ops::mul(Ops::mul(Ops::load(w.s + j * SP + c * W), Ops::sub(Ops::load(e), di)), vs);
        Ops::store(e, ds);
        if (!full) check = Ops::add(check, ds);
      }
    }
    if (CAP || (!full && !std::isfinite(Ops::hsum(check))))
      for (int j = 0; j < kt; ++j)
        for (int r = 0; r < sp; ++r) {
          float& e = w.dps[j * SP + r];
          if (w.s[j * SP + r] == 0.0f) {
            e = 0.0f;  // excluded (or a weight that is exactly 0): nothing flows, NaN included
          } else if constexpr (CAP) {
            const float t = w.th[j * SP + r];
            e *= 1.0f - t * t;
          }
        }

    // dV += P^T dO, dK += dS^T Q (over the block's n rows), dQ += dS K (over the tile's keys).
    transpose(w.s, SP, kt, sp, w.pt, BK);
    transpose(w.dps, SP, kt, sp, w.dst, BK);
    const int nvd = static_cast<int>(Dp / W), nvv = static_cast<int>(Dvp / W);
    if (full) {
      Mk::template pv_tile<false>(w.pt, BK, qb.ds, qb.dss, n, w.dv[x], Dvp, w.ones, kt, nvv, none);
      Mk::template pv_tile<false>(w.dst, BK, qb.qs, qb.qss, n, w.dk[x], Dp, w.ones, kt, nvd, none);
      Mk::template pv_tile<false>(w.dps, SP, w.kbuf[x], Dp, kt, dq, Dp, w.ones, n, nvd, none);
    } else {
      Mk::template pv_tile<true>(w.pt, BK, qb.ds, qb.dss, n, w.dv[x], Dvp, w.ones, kt, nvv, none);
      Mk::template pv_tile<true>(w.dst, BK, qb.qs, qb.qss, n, w.dk[x], Dp, w.ones, kt, nvd, none);
      Mk::template pv_tile<true>(w.dps, SP, w.kbuf[x], Dp, kt, dq, Dp, w.ones, n, nvd, none);
    }
  }

  // Whether any row of the query block at i0 admits a key in [g0, g1).
  static bool touches(const Problem& p, i64 b, i64 i0, i64 g0, i64 g1) {
    const i64 n = std::min<i64>(BQ, p.Sq - i0);
    for (i64 r = 0; r < n; ++r) {
      i64 lo, hi;
      p.key_range(b, i0 + r, lo, hi);
      if (lo < hi && lo < g1 && hi > g0) return true;
    }
    return false;
  }

  // ---- one item: chunk c of (b, hk) ----------------------------------------------------------
  template <Elt E, bool MASK, bool CAP>
  static void chunk(const BackwardProblem& bp, const Plan& pl, const Ws& w, i64 b, i64 hk, i64 c, float* dq) {
    const Problem& p = bp.fwd;
    const i64 D = p.D, Dv = p.Dv, Dp = dp(p), Dvp = dvp(p), G = p.group();
    const i64* bd = &pl.bounds[b * (pl.C + 1)];
    const i64 k0 = bd[c] * BK, k1 = std::min(bd[c + 1] * BK, p.Sk);
    const i64 ulo = pl.lo[b], uhi = pl.hi[b];
    const i64 kbase = b * p.k.sb + hk * p.k.sh, vbase = b * p.v.sb + hk * p.v.sh;
    const i64 dkb = b * bp.dk.sb + hk * bp.dk.sh, dvb = b * bp.dv.sb + hk * bp.dv.sh;
    std::memset(dq, 0, static_cast<std::size_t>(pl.rows * Dp) * sizeof(float));

    // Keys no row admits are never read; their gradients are 0.
    std::fill(w.acc, w.acc + Dp, 0.0f);
    for (i64 j = k0; j < k1; ++j)
      if (j < ulo || j >= uhi) {
        store_row(bp.dk, dkb + j * bp.dk.ss, w.acc, D);
        std::fill(w.orows, w.orows + Dvp, 0.0f);
        store_row(bp.dv, dvb + j * bp.dv.ss, w.orows, Dv);
      }

    const i64 a0 = std::max(k0, ulo), a1 = std::min(k1, uhi);
    const i64 span = static_cast<i64>(kKeyGroup) * BK;
    for (i64 g0 = a0; g0 < a1; g0 += span) {
      // This group's tiles: K, V converted once, dK and dV zeroed.
      const i64 g1 = std::min(a1, g0 + span);
      const int ntile = static_cast<int>((g1 - g0 + BK - 1) / BK);
      for (int x = 0; x < ntile; ++x) {
        const i64 t0 = g0 + x * BK;
        const int kt = static_cast<int>(std::min<i64>(BK, g1 - t0));
        for (int j = 0; j < kt; ++j) {
          float* kr = w.kbuf[x] + j * Dp;
          float* vr = w.vbuf[x] + j * Dvp;
          Mk::template to_f32<E>(p.k.data, kbase + (t0 + j) * p.k.ss, kr, D);
          std::fill(kr + D, kr + Dp, 0.0f);
          Mk::template to_f32<E>(p.v.data, vbase + (t0 + j) * p.v.ss, vr, Dv);
          std::fill(vr + Dv, vr + Dvp, 0.0f);
        }
        std::fill(w.dk[x], w.dk[x] + kt * Dp, 0.0f);
        std::fill(w.dv[x], w.dv[x] + kt * Dvp, 0.0f);
      }
      // Every query block of every head of the group that admits any of these keys.
      for (i64 g = 0; g < G; ++g) {
        const i64 h = hk * G + g;
        for (i64 i0 = 0; i0 < p.Sq; i0 += BQ) {
          if (!touches(p, b, i0, g0, g1)) continue;  // before packing: causal skips half
          const QBlock qb = pack_block<E>(bp, w, b, h, i0);
          float* dqb = dq + (g * p.Sq + i0) * Dp;
          for (int x = 0; x < ntile; ++x) {
            const i64 t0 = g0 + x * BK;
            const int kt = static_cast<int>(std::min<i64>(BK, g1 - t0));
            if (qb.lo_min >= t0 + kt || qb.hi_max <= t0) continue;
            tile<MASK, CAP>(bp, w, qb, x, t0, kt, dqb);
          }
        }
      }
      for (int x = 0; x < ntile; ++x) {
        const i64 t0 = g0 + x * BK;
        const int kt = static_cast<int>(std::min<i64>(BK, g1 - t0));
        for (int j = 0; j < kt; ++j) {
          store_row(bp.dk, dkb + (t0 + j) * bp.dk.ss, w.dk[x] + j * Dp, D);
          store_row(bp.dv, dvb + (t0 + j) * bp.dv.ss, w.dv[x] + j * Dvp, Dv);
        }
      }
    }
  }

  // ---- the whole problem ---------------------------------------------------------------------
  template <Elt E, bool MASK, bool CAP>
  static void run(const BackwardProblem& bp, char* ws, int threads) {
    const Problem& p = bp.fwd;
    const Plan pl = plan(p);
    const std::size_t wsb = ws_bytes(p);
    const i64 Dp = dp(p), head = pl.rows * Dp;  // floats of one chunk's dQ buffer
    float* partial = reinterpret_cast<float*>(ws + wsb * threads);
    const i64 pairs = p.B * p.Hkv;
#pragma omp parallel num_threads(threads)
    {
      const Ws w = carve(p, ws + wsb * omp_get_thread_num());
      for (i64 p0 = 0; p0 < pairs; p0 += pl.wave) {
        const i64 np = std::min(pl.wave, pairs - p0);
#pragma omp for schedule(dynamic, 1)
        for (i64 it = 0; it < np * pl.C; ++it) {
          const i64 pr = p0 + it / pl.C;
          chunk<E, MASK, CAP>(bp, pl, w, pr / p.Hkv, pr % p.Hkv, it % pl.C, partial + it * head);
        }
        // dQ of each row: its chunks' buffers summed in chunk order, rounded once.
#pragma omp for schedule(static)
        for (i64 r = 0; r < np * pl.rows; ++r) {
          const i64 pr = p0 + r / pl.rows, rr = r % pl.rows;
          const i64 b = pr / p.Hkv, h = (pr % p.Hkv) * p.group() + rr / p.Sq, i = rr % p.Sq;
          const float* src = partial + (r / pl.rows) * pl.C * head + rr * Dp;
          std::memcpy(w.acc, src, Dp * sizeof(float));
          for (i64 c = 1; c < pl.C; ++c)
            for (i64 x = 0; x < p.D; ++x) w.acc[x] += src[c * head + x];
          store_row(bp.dq, b * bp.dq.sb + h * bp.dq.sh + i * bp.dq.ss, w.acc, p.D);
        }
      }
    }
  }
};

}  // namespace qkv::detail::QKV_ENGINE_NS
