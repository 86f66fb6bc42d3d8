#pragma once
// The tiles of the FlashAttention-2 backward (backward.hpp; Dao 2023, Algorithm 2): a thread's
// workspace, a query block packed for the products, and one key tile against it:
//   S = Q K^T, P = exp(scale S - lse), dP = dO V^T, dS = scale P (dP - D),
//   dV += P^T dO, dK += dS^T Q, dQ += dS K.
// Two forms of the five products:
//   fp32: the forward's microkernels (microkernels.hpp) on fp32 tiles; every input dtype, every
//         tile, and the partial tiles (some row excludes some key) of the bf16 path below,
//         whose zero-weight skip keeps NaN or inf at excluded keys out of the gradients.
//   bf16 (DP; q, k, v, dO and O bf16, AVX512_BF16): vdpbf16ps on (d, d+1) pairs of Q and dO
//         against K and V read in place for S and dP; P and dS rounded to bf16 (nearest even)
//         and paired along the reduced index for the three accumulating products, with dO, Q
//         and K paired the same way once per block or tile. Products of bf16 values are exact
//         in fp32; the extra roundings are those of P (in dV) and dS (in dK, dQ), relative
//         2^-9 each (docs/accuracy.md). D = rowsum(dO * O) is summed in pairs in the order of
//         the dP product, so that dP - D cancels where it should.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/problem.hpp"
#include "kernels/engine/isa_ops.hpp"
#include "kernels/engine/microkernels.hpp"
#include "kernels/engine/score_rule.hpp"
#include "kernels/engine/workspace.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail::QKV_ENGINE_NS {

template <IsaOps Ops>
struct BackwardTiles {
  using V = typename Ops::V;
  using Mk = Microkernels<Ops>;
  static constexpr int W = Ops::W;
  static constexpr int BQ = Ops::kBq;
  static constexpr int BK = Ops::kBk;
  static constexpr int SP = BQ + W;  // pitch of key-major tiles, off a power of two
  static constexpr int kKeyGroup = 8;

  static i64 dp(const Problem& p) { return round_up(std::max<i64>(p.D, 1), W); }
  static i64 dvp(const Problem& p) { return round_up(std::max<i64>(p.Dv, 1), W); }

  // ---- workspace ---------------------------------------------------------------------------
  struct BRow {
    i64 lo, hi;      // admissible key range
    i64 mask_off;    // element offset of (b, h, i, 0) in the mask
    Position pos;    // keep-first range and ALiBi (rules with kPosition)
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
    float* pos_f; // [3][BQ]    position terms as floats: first_hi, diag, slope (vector form)
    float* ones;  // [max(BQ, BK)]
    float* acc;   // [Dp]       the sum of one row's dQ buffers
    BRow* rows;   // [BQ]
    float* kbuf[kKeyGroup];  // [BK][Dp]   K tiles, fp32
    float* vbuf[kKeyGroup];  // [BK][Dvp]  V tiles, fp32
    float* dk[kKeyGroup];    // [BK][Dp]   dK accumulators
    float* dv[kKeyGroup];    // [BK][Dvp]  dV accumulators
    // bf16 path only (null otherwise): 32-bit words holding bf16 pairs.
    std::uint32_t* qp;   // [ceil(D/2)][BQ]   Q paired along d (S = Q K^T)
    std::uint32_t* dop;  // [ceil(Dv/2)][BQ]  dO paired along d (dP = dO V^T)
    std::uint32_t* op;   // [ceil(Dv/2)][BQ]  O paired along d (D)
    std::uint32_t* qrp;  // [BQ/2][Dp]        Q paired along rows (dK += dS^T Q)
    std::uint32_t* drp;  // [BQ/2][Dvp]       dO paired along rows (dV += P^T dO)
    std::uint32_t* pp;   // [M/2][M]          P or dS paired, M = max(BQ, BK)
    std::uint32_t* kp[kKeyGroup];  // [BK/2][Dp]  K paired along keys (dQ += dS K)
  };

  // Whether the bf16 dot-product buffers exist for this problem.
  static bool dp_buffers(const Problem& p) { return Ops::kHasDpbf16 && p.q.dtype == DType::bf16; }

  // One thread's buffers from `base`; with base == nullptr only `bytes` (their size) is meaningful.
  static Ws layout(const Problem& p, char* base, std::size_t& bytes) {
    const std::size_t f = sizeof(float), Dp = dp(p), Dvp = dvp(p), M = std::max(BQ, BK);
    bytes = 0;
    auto take = [&](std::size_t n) {
      float* r = base ? reinterpret_cast<float*>(base + bytes) : nullptr;
      bytes += align_up(n);
      return r;
    };
    auto take_u = [&](std::size_t n) { return reinterpret_cast<std::uint32_t*>(take(n * 4)); };
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
    w.pos_f = take(3 * BQ * f);
    w.ones = take(M * f);
    w.acc = take(Dp * f);
    w.rows = reinterpret_cast<BRow*>(take(BQ * sizeof(BRow)));
    for (int x = 0; x < kKeyGroup; ++x) {
      w.kbuf[x] = take(BK * Dp * f);
      w.vbuf[x] = take(BK * Dvp * f);
      w.dk[x] = take(BK * Dp * f);
      w.dv[x] = take(BK * Dvp * f);
    }
    w.qp = w.dop = w.op = w.qrp = w.drp = w.pp = nullptr;
    for (int x = 0; x < kKeyGroup; ++x) w.kp[x] = nullptr;
    if (dp_buffers(p)) {
      const std::size_t D2 = (p.D + 1) / 2, Dv2 = (p.Dv + 1) / 2;
      w.qp = take_u(D2 * BQ);
      w.dop = take_u(Dv2 * BQ);
      w.op = take_u(Dv2 * BQ);
      w.qrp = take_u(BQ / 2 * Dp);
      w.drp = take_u(BQ / 2 * Dvp);
      w.pp = take_u(M / 2 * M);
      for (int x = 0; x < kKeyGroup; ++x) w.kp[x] = take_u(BK / 2 * Dp);
    }
    return w;
  }

  static std::size_t ws_bytes(const Problem& p) {
    std::size_t bytes = 0;
    layout(p, nullptr, bytes);
    return bytes;
  }

  static Ws carve(const Problem& p, char* base) {
    std::size_t bytes = 0;
    Ws w = layout(p, base, bytes);
    for (int x = 0; x < std::max(BQ, BK); ++x) w.ones[x] = 1.0f;
    return w;
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
    i64 first_max;                       // keep-first: the rows' first keys [0, first_max)
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

  // The rows' key ranges, mask offsets and softmax_lse; nothing packed yet.
  static QBlock start_block(const BackwardProblem& bp, const Ws& w, i64 b, i64 h, i64 i0) {
    const Problem& p = bp.fwd;
    QBlock qb;
    qb.n = static_cast<int>(std::min<i64>(BQ, p.Sq - i0));
    qb.nqv = (qb.n + W - 1) / W;
    const int n = qb.n, sp = qb.nqv * W;
    qb.lo_min = std::numeric_limits<i64>::max();
    qb.hi_max = std::numeric_limits<i64>::min();
    qb.max_lo = std::numeric_limits<i64>::min();
    qb.min_hi = std::numeric_limits<i64>::max();
    qb.first_max = 0;
    const bool pos = has_position(p);
    const float inf = std::numeric_limits<float>::infinity();
    for (int r = 0; r < sp; ++r) {
      if (r >= n) {  // padding: rows whose P is exactly 0 (lse = +inf) and whose D is 0
        w.lse[r] = inf;
        w.lo_f[r] = -1e30f;
        w.hi_f[r] = 1e30f;
        if (pos) ScoreRule<>::position_lanes(Position{}, w.pos_f[r], w.pos_f[BQ + r], w.pos_f[2 * BQ + r]);
        continue;
      }
      const i64 i = i0 + r;
      BRow& row = w.rows[r];
      ScoreRule<>::key_range(p, b, i, row.lo, row.hi);
      row.mask_off = ScoreRule<>::mask_row(p, b, h, i);
      if (pos) {
        row.pos = ScoreRule<>::position(p, b, h, i);
        qb.first_max = std::max(qb.first_max, row.pos.first_hi);
        ScoreRule<>::position_lanes(row.pos, w.pos_f[r], w.pos_f[BQ + r], w.pos_f[2 * BQ + r]);
      }
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
    return qb;
  }

  // Whether some row of the block may admit a key of [t0, t1) (its range or keep-first's keys).
  static bool meets(const QBlock& qb, i64 t0, i64 t1) { return (qb.lo_min < t1 && qb.hi_max > t0) || t0 < qb.first_max; }

  // Whether every row of the block admits every key of [t0, t1) (no mask): a full tile.
  template <class Rule>
  static bool full_tile(const QBlock& qb, i64 t0, i64 t1) {
    return Rule::full(t0, t1, qb.max_lo, qb.min_hi);
  }

  // The fp32 operands of the block; D too unless the bf16 path computes it (with_d false).
  template <Elt E>
  static void pack_f32(const BackwardProblem& bp, const Ws& w, QBlock& qb, i64 b, i64 h, i64 i0, bool with_d) {
    const Problem& p = bp.fwd;
    const i64 D = p.D, Dv = p.Dv, Dp = dp(p), Dvp = dvp(p);
    const int n = qb.n, sp = qb.nqv * W;
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
    if (!with_d) return;
    // D = rowsum(dO * O), W rows at a time, one FMA chain over x per row: the order and the
    // roundings of the dP microkernel, so that dP - D cancels exactly where it should (a row
    // whose only key has P = 1).
    for (int c = 0; c < qb.nqv; ++c) {
      V acc = Ops::zero();
      for (i64 x = 0; x < Dv; ++x) acc = Ops::fma(Ops::load(w.dot + x * sp + c * W), Ops::load(w.ot + x * sp + c * W), acc);
      Ops::store(w.di + c * W, acc);
    }
  }

  // The bf16 operands of the block (q, dO and O bf16): Q, dO and O paired along d for the
  // dot products, Q and dO paired along rows for the products that sum over rows; and
  // D = rowsum(dO * O) summed in pairs as the dP product sums (Ops::dot_pairs).
  static void pack_dp(const BackwardProblem& bp, const Ws& w, const QBlock& qb, i64 b, i64 h, i64 i0)
    requires(Ops::kHasDpbf16)
  {
    const Problem& p = bp.fwd;
    const int n = qb.n, sp = qb.nqv * W;
    const auto* q = static_cast<const std::uint16_t*>(p.q.data) + b * p.q.sb + h * p.q.sh + i0 * p.q.ss;
    const auto* d = static_cast<const std::uint16_t*>(bp.dout.data) + b * bp.dout.sb + h * bp.dout.sh + i0 * bp.dout.ss;
    const auto* o = static_cast<const std::uint16_t*>(p.out.data) + b * p.out.sb + h * p.out.sh + i0 * p.out.ss;
    const char* rows[BQ];
    auto pairs = [&](const std::uint16_t* base, i64 ss, i64 X, std::uint32_t* dst) {
      for (int r = 0; r < n; ++r) rows[r] = reinterpret_cast<const char*>(base + r * ss);
      Mk::pack_pairs(rows, n, X, dst, sp);
    };
    pairs(q, p.q.ss, p.D, w.qp);
    pairs(d, bp.dout.ss, p.Dv, w.dop);
    pairs(o, p.out.ss, p.Dv, w.op);
    Ops::pack_v_bf16(q, p.q.ss, p.D, static_cast<int>(dp(p) / W), n, w.qrp);
    Ops::pack_v_bf16(d, bp.dout.ss, p.Dv, static_cast<int>(dvp(p) / W), n, w.drp);
    const i64 Dv2 = (p.Dv + 1) / 2;
    for (int c = 0; c < qb.nqv; ++c) {
      V acc = Ops::zero();
      for (i64 x = 0; x < Dv2; ++x) acc = Ops::dot_pairs(acc, w.dop + x * sp + c * W, w.op + x * sp + c * W);
      Ops::store(w.di + c * W, acc);
    }
  }

  // ---- one tile: keys [t0, t0 + kt) of key buffer x against a packed query block ------------

  // w.s holds S = Q K^T (key-major); makes it P = exp(S' - lse), S' the scores of the rule Rule
  // (score_rule.hpp) with the tile's exclusions as exact zeros; softcap: tanh kept in w.th.
  template <class Rule>
  static void probs(const Problem& p, const Ws& w, const QBlock& qb, i64 t0, int kt, bool full) {
    const int n = qb.n, nqv = qb.nqv, sp = nqv * W;
    const Rule rule(p);
    if constexpr (Rule::kVectorForm && Rule::kHasPosition) {
      if (t0 + kt < (i64{1} << 24) && Rule::position_exact(p)) {  // keys and distances exact as floats
        const bool first = t0 < p.keep_first;  // keep-first's keys within reach
        const bool alibi = !p.alibi.empty();
        for (int c = 0; c < nqv; ++c) {
          const V l = Ops::load(w.lse + c * W), lo = Ops::load(w.lo_f + c * W), hi = Ops::load(w.hi_f + c * W);
          const PositionV<Ops> ps =
              PositionV<Ops>::load(w.pos_f + c * W, w.pos_f + BQ + c * W, w.pos_f + 2 * BQ + c * W, alibi);
          for (int j = 0; j < kt; ++j) {
            float* e = w.s + j * SP + c * W;
            const V g = Ops::set1(static_cast<float>(t0 + j));
            const V y = full ? rule.template vec_full<Ops>(Ops::load(e), g, ps)
                             : rule.template vec<Ops>(Ops::load(e), lo, hi, g, ps, first);
            Ops::store(e, Ops::exp(Ops::sub(y, l)));
          }
        }
        return;
      }
    }
    if constexpr (Rule::kVector) {
      if (t0 + kt < (i64{1} << 24)) {  // key indices exact as floats
        for (int c = 0; c < nqv; ++c) {
          const V l = Ops::load(w.lse + c * W), lo = Ops::load(w.lo_f + c * W), hi = Ops::load(w.hi_f + c * W);
          for (int j = 0; j < kt; ++j) {
            float* e = w.s + j * SP + c * W;
            const V y = full ? rule.template scale_v<Ops>(Ops::load(e))
                             : rule.template vec<Ops>(Ops::load(e), lo, hi, Ops::set1(static_cast<float>(t0 + j)));
            Ops::store(e, Ops::exp(Ops::sub(y, l)));
          }
        }
        return;
      }
    }
    for (int r = 0; r < sp; ++r)
      for (int j = 0; j < kt; ++j) {
        float& e = w.s[j * SP + r];
        if (r >= n) { e = 0.0f; continue; }
        const BRow& row = w.rows[r];
        float add = 0.0f, t = 0.0f;
        const bool ok = rule.admits(t0 + j, row.lo, row.hi, row.mask_off, row.pos, add);
        const float y = rule.biased(rule.scaled(e, t), t0 + j, row.pos);
        if constexpr (Rule::kHasSoftcap) w.th[j * SP + r] = t;
        e = ok ? std::exp(y + add - w.lse[r]) : 0.0f;
      }
  }

  // w.dps holds dP = dO V^T; makes it dS = scale P (dP - D) (softcap: times 1 - tanh^2). An
  // excluded (row, key) has P = 0 and so dS = 0 already unless dP is not finite (NaN or inf in
  // a value or in dO): the sum of a partial tile's dS, kept on the side, says whether the scalar
  // pass that zeroes those must run.
  template <class Rule>
  static void dscores(const Problem& p, const Ws& w, const QBlock& qb, int kt, bool full) {
    const int nqv = qb.nqv, sp = nqv * W;
    const Rule rule(p);
    const V vs = Ops::set1(rule.scale);
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
    if (Rule::kHasSoftcap || (!full && !std::isfinite(Ops::hsum(check))))
      for (int j = 0; j < kt; ++j)
        for (int r = 0; r < sp; ++r) {
          float& e = w.dps[j * SP + r];
          if (w.s[j * SP + r] == 0.0f) {
            e = 0.0f;  // excluded (or a weight that is exactly 0): nothing flows, NaN included
          } else if constexpr (Rule::kHasSoftcap) {
            e = rule.grad(e, w.th[j * SP + r]);
          }
        }
  }

  // The fp32 form: every product on fp32 tiles; partial tiles skip zero weights.
  template <class Rule>
  static void tile(const BackwardProblem& bp, const Ws& w, const QBlock& qb, int x, i64 t0, int kt, float* dq) {
    const Problem& p = bp.fwd;
    const i64 D = p.D, Dv = p.Dv, Dp = dp(p), Dvp = dvp(p);
    const int n = qb.n, nqv = qb.nqv, sp = nqv * W;
    if constexpr (Rule::kHasPosition) {
      // A tile the rows reach only through keep-first: its first keys [t0, first_max) alone (the
      // others have P = 0 and dS = 0 for every row, which the partial tile's products skip).
      if (!(qb.lo_min < t0 + kt && qb.hi_max > t0)) kt = static_cast<int>(std::min<i64>(kt, qb.first_max - t0));
    }
    const bool full = full_tile<Rule>(qb, t0, t0 + kt);
    Prefetch none;
    Mk::qk_tile(w.qt, nqv, w.kbuf[x], Dp, D, kt, w.s, SP, none);
    probs<Rule>(p, w, qb, t0, kt, full);
    Mk::qk_tile(w.dot, nqv, w.vbuf[x], Dvp, Dv, kt, w.dps, SP, none);
    dscores<Rule>(p, w, qb, kt, full);

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

  // The bf16 form, for full tiles only (a partial tile takes the fp32 form): k and v are the
  // tile's first K and V rows (bf16, read in place).
  template <class Rule>
  static void tile_dp(const BackwardProblem& bp, const Ws& w, const QBlock& qb, int x, i64 t0, int kt,
                      const std::uint16_t* k, const std::uint16_t* v, float* dq)
    requires(Ops::kHasDpbf16)
  {
    const Problem& p = bp.fwd;
    const int n = qb.n, nqv = qb.nqv, sp = nqv * W;
    const int nvd = static_cast<int>(dp(p) / W), nvv = static_cast<int>(dvp(p) / W);
    Ops::qk_bf16(w.qp, nqv, k, p.k.ss, p.D, kt, w.s, SP);
    probs<Rule>(p, w, qb, t0, kt, true);
    Ops::qk_bf16(w.dop, nqv, v, p.v.ss, p.Dv, kt, w.dps, SP);
    dscores<Rule>(p, w, qb, kt, true);

    // dQ += dS K: dS paired along keys, K paired along keys (once per tile).
    Ops::pack_p_bf16(w.dps, SP, nqv, kt, w.pp);
    Ops::pv_bf16(w.pp, sp, w.kp[x], nvd, (kt + 1) / 2, dq, dp(p), w.ones, n);
    // dV += P^T dO and dK += dS^T Q: P and dS transposed, then paired along rows.
    const int nkv = (kt + W - 1) / W, n2 = (n + 1) / 2;
    transpose(w.s, SP, kt, sp, w.pt, BK);
    Ops::pack_p_bf16(w.pt, BK, nkv, n, w.pp);
    Ops::pv_bf16(w.pp, nkv * W, w.drp, nvv, n2, w.dv[x], dvp(p), w.ones, kt);
    transpose(w.dps, SP, kt, sp, w.dst, BK);
    Ops::pack_p_bf16(w.dst, BK, nkv, n, w.pp);
    Ops::pv_bf16(w.pp, nkv * W, w.qrp, nvd, n2, w.dk[x], dp(p), w.ones, kt);
  }

  // Whether any row of the query block at i0 admits a key in [g0, g1).
  static bool touches(const Problem& p, i64 b, i64 i0, i64 g0, i64 g1) {
    const i64 n = std::min<i64>(BQ, p.Sq - i0);
    for (i64 r = 0; r < n; ++r) {
      i64 lo, hi;
      i64 first;
      ScoreRule<>::key_ranges(p, b, i0 + r, lo, hi, first);
      if (lo < hi && lo < g1 && hi > g0) return true;
      if (first > g0) return true;  // keep-first's keys [0, first)
    }
    return false;
  }
};

}  // namespace qkv::detail::QKV_ENGINE_NS
