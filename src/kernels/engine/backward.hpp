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
//   P   = exp(scale S - lse)          (softcap, ALiBi, masks and excluded keys as the forward; lse
//                                      includes a sink's term, so sinks need nothing here; rows with
//                                      lse = -inf and padded rows get P = 0 exactly, never
//                                      exp(0 - lse) of a huge lse)
//   dP  = dO V^T                      (the same microkernel, dO transposed)
//   dS  = scale P (dP - D),  D = rowsum(dO * O)   (softcap: times 1 - tanh^2)
//   dV += P^T dO,  dK += dS^T Q,  dQ += dS K      (the forward's PV microkernel; P and dS
//                                                  transposed in registers for the first two)
// (the tiles and their fp32 and bf16 dot-product forms: backward_tiles.hpp).
// dK and dV of a chunk's keys are complete when the item ends (the item has every query row), so
// they are written once. dQ sums over all keys: each chunk adds into its own fp32 buffer of the
// group's rows, and the C buffers are summed in chunk order after the items, so no atomics and
// a fixed order: the gradients are bitwise the same for any number of threads. GQA is reduced
// inside the item (the query heads of a group in order), with no Hq-expanded copy of K, V, dK or
// dV.
//
// Memory beyond the operands: per thread a workspace of O((kBq + kKeyGroup kBk) (D + Dv)) floats
// (about 1.3 MiB at D = 128 on AVX-512, most of it the K, V, dK, dV tiles of a key group; the
// bf16 form adds about 0.2 MiB of paired operands), and the dQ buffers, C x (group rows) x D
// floats for as many (batch, KV head) pairs at a time as fit kPartialBytes (at least one; the
// pairs go in waves).
// Chunk boundaries balance the admitted (row, key block) pairs, so causal items cost the same.
//
// Excluded keys: a tile is read only if some row of the batch admits its keys (causal, window,
// keep-first and key lengths; keys outside every row's range are never read and get dK = dV = 0);
// within a tile,
// an excluded (row, key) gets P = 0 and dS = 0, and the products skip zero weights, so NaN or inf
// in a key or value excluded for a row never reaches that row's gradients.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "core/problem.hpp"
#include "kernels/engine/backward_tiles.hpp"
#include "kernels/engine/isa_ops.hpp"
#include "kernels/engine/microkernels.hpp"
#include "kernels/engine/score_rule.hpp"
#include "kernels/engine/workspace.hpp"
#include "platform/team.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail::QKV_ENGINE_NS {

template <IsaOps Ops>
struct Backward {
  using Tiles = BackwardTiles<Ops>;
  using Mk = Microkernels<Ops>;
  using Ws = typename Tiles::Ws;
  using QBlock = typename Tiles::QBlock;
  static constexpr int BK = Ops::kBk;
  static constexpr int BQ = Ops::kBq;
  static constexpr int kKeyGroup = Tiles::kKeyGroup;
  static constexpr int kMaxChunks = 4;
  static constexpr i64 kMinItems = 8;
  static constexpr i64 kPartialBytes = i64{32} << 20;

  static i64 dp(const Problem& p) { return Tiles::dp(p); }
  static i64 dvp(const Problem& p) { return Tiles::dvp(p); }

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
    // Constructed, not assign()ed: vector<i64>::_M_fill_assign is emitted out of line, as a weak
    // symbol the linker may take from the avx512 object for every caller (SIGILL on an avx2
    // CPU); scripts/check_isa_symbols.py (CTest layers.isa_symbols) keeps the ISA objects free
    // of such symbols.
    pl.lo = std::vector<i64>(static_cast<std::size_t>(p.B), 0);
    pl.hi = std::vector<i64>(static_cast<std::size_t>(p.B), 0);
    pl.bounds = std::vector<i64>(static_cast<std::size_t>(p.B * (pl.C + 1)), 0);
    std::vector<i64> weight(pl.nkb + 1);
    for (i64 b = 0; b < p.B; ++b) {
      // Work per key block: the query rows that admit any of its keys (the same for every head).
      std::fill(weight.begin(), weight.end(), 0);
      i64 ulo = std::numeric_limits<i64>::max(), uhi = std::numeric_limits<i64>::min();
      for (i64 i = 0; i < p.Sq; ++i) {
        i64 lo, hi, first;
        ScoreRule<>::key_ranges(p, b, i, lo, hi, first);
        if (first > 0) {  // keep-first: keys [0, first) too, weighed where [lo, hi) lacks them
          ulo = 0;
          uhi = std::max(uhi, first);
          const i64 extra = lo < hi ? std::min(first, lo) : first;
          if (extra > 0) {
            weight[0] += 1;
            weight[(extra - 1) / BK + 1] -= 1;
          }
        }
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

  static std::size_t workspace(const Problem& p, int threads) {
    const Plan pl = plan(p);
    return Tiles::ws_bytes(p) * threads + align_up(pl.wave * pl.C * pl.rows * dp(p) * sizeof(float));
  }

  // ---- one item: chunk c of (b, hk) ----------------------------------------------------------
  // DP: the bf16 dot-product form for full tiles (backward_tiles.hpp); K and V are then
  // converted to fp32 only for a tile that some block meets partially.
  template <Elt E, bool DP, class Rule>
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
        Tiles::store_row(bp.dk, dkb + j * bp.dk.ss, w.acc, D);
        std::fill(w.orows, w.orows + Dvp, 0.0f);
        Tiles::store_row(bp.dv, dvb + j * bp.dv.ss, w.orows, Dv);
      }

    const i64 a0 = std::max(k0, ulo), a1 = std::min(k1, uhi);
    const i64 span = static_cast<i64>(kKeyGroup) * BK;
    bool f32[kKeyGroup];  // whether tile x of the group has its fp32 K and V
    for (i64 g0 = a0; g0 < a1; g0 += span) {
      // This group's tiles: K, V converted (or paired) once, dK and dV zeroed.
      const i64 g1 = std::min(a1, g0 + span);
      const int ntile = static_cast<int>((g1 - g0 + BK - 1) / BK);
      auto tile_at = [&](int x, i64& t0, int& kt) {
        t0 = g0 + x * BK;
        kt = static_cast<int>(std::min<i64>(BK, g1 - t0));
      };
      auto convert = [&](int x) {
        i64 t0;
        int kt;
        tile_at(x, t0, kt);
        for (int j = 0; j < kt; ++j) {
          float* kr = w.kbuf[x] + j * Dp;
          float* vr = w.vbuf[x] + j * Dvp;
          Mk::template to_f32<E>(p.k.data, kbase + (t0 + j) * p.k.ss, kr, D);
          std::fill(kr + D, kr + Dp, 0.0f);
          Mk::template to_f32<E>(p.v.data, vbase + (t0 + j) * p.v.ss, vr, Dv);
          std::fill(vr + Dv, vr + Dvp, 0.0f);
        }
        f32[x] = true;
      };
      for (int x = 0; x < ntile; ++x) {
        i64 t0;
        int kt;
        tile_at(x, t0, kt);
        f32[x] = false;
        if constexpr (DP)
          Ops::pack_v_bf16(static_cast<const std::uint16_t*>(p.k.data) + kbase + t0 * p.k.ss, p.k.ss, D,
                           static_cast<int>(Dp / Ops::W), kt, w.kp[x]);
        else
          convert(x);
        std::fill(w.dk[x], w.dk[x] + kt * Dp, 0.0f);
        std::fill(w.dv[x], w.dv[x] + kt * Dvp, 0.0f);
      }
      // Every query block of every head of the group that admits any of these keys.
      for (i64 g = 0; g < G; ++g) {
        const i64 h = hk * G + g;
        for (i64 i0 = 0; i0 < p.Sq; i0 += BQ) {
          if (!Tiles::touches(p, b, i0, g0, g1)) continue;  // before packing: causal skips half
          QBlock qb = Tiles::start_block(bp, w, b, h, i0);
          auto meets = [&](i64 t0, int kt) { return Tiles::meets(qb, t0, t0 + kt); };
          bool partial = !DP;  // the fp32 form is needed
          for (int x = 0; x < ntile && !partial; ++x) {
            i64 t0;
            int kt;
            tile_at(x, t0, kt);
            partial = meets(t0, kt) && !Tiles::template full_tile<Rule>(qb, t0, t0 + kt);
          }
          if (partial) Tiles::template pack_f32<E>(bp, w, qb, b, h, i0, !DP);
          if constexpr (DP) Tiles::pack_dp(bp, w, qb, b, h, i0);
          float* dqb = dq + (g * p.Sq + i0) * Dp;
          for (int x = 0; x < ntile; ++x) {
            i64 t0;
            int kt;
            tile_at(x, t0, kt);
            if (!meets(t0, kt)) continue;
            if constexpr (DP) {
              if (Tiles::template full_tile<Rule>(qb, t0, t0 + kt)) {
                Tiles::template tile_dp<Rule>(bp, w, qb, x, t0, kt,
                                             static_cast<const std::uint16_t*>(p.k.data) + kbase + t0 * p.k.ss,
                                             static_cast<const std::uint16_t*>(p.v.data) + vbase + t0 * p.v.ss, dqb);
                continue;
              }
              if (!f32[x]) convert(x);
            }
            Tiles::template tile<Rule>(bp, w, qb, x, t0, kt, dqb);
          }
        }
      }
      for (int x = 0; x < ntile; ++x) {
        i64 t0;
        int kt;
        tile_at(x, t0, kt);
        for (int j = 0; j < kt; ++j) {
          Tiles::store_row(bp.dk, dkb + (t0 + j) * bp.dk.ss, w.dk[x] + j * Dp, D);
          Tiles::store_row(bp.dv, dvb + (t0 + j) * bp.dv.ss, w.dv[x] + j * Dvp, Dv);
        }
      }
    }
  }

  // ---- the whole problem ---------------------------------------------------------------------
  template <Elt E, bool DP, class Rule>
  static void run(const BackwardProblem& bp, char* ws, int threads) {
    const Problem& p = bp.fwd;
    const Plan pl = plan(p);
    const std::size_t wsb = Tiles::ws_bytes(p);
    const i64 Dp = dp(p), head = pl.rows * Dp;  // floats of one chunk's dQ buffer
    float* partial = reinterpret_cast<float*>(ws + wsb * threads);
    const i64 pairs = p.B * p.Hkv;
    run_team(threads, [&](const TeamLoops& team) {
      const Ws w = Tiles::carve(p, ws + wsb * team.thread());
      for (i64 p0 = 0; p0 < pairs; p0 += pl.wave) {
        const i64 np = std::min(pl.wave, pairs - p0);
        team.dynamic(np * pl.C, [&](i64 it) {
          const i64 pr = p0 + it / pl.C;
          chunk<E, DP, Rule>(bp, pl, w, pr / p.Hkv, pr % p.Hkv, it % pl.C, partial + it * head);
        });
        // dQ of each row: its chunks' buffers summed in chunk order, rounded once.
        team.fixed(np * pl.rows, [&](i64 r) {
          const i64 pr = p0 + r / pl.rows, rr = r % pl.rows;
          const i64 b = pr / p.Hkv, h = (pr % p.Hkv) * p.group() + rr / p.Sq, i = rr % p.Sq;
          const float* src = partial + (r / pl.rows) * pl.C * head + rr * Dp;
          std::memcpy(w.acc, src, Dp * sizeof(float));
          for (i64 c = 1; c < pl.C; ++c)
            for (i64 x = 0; x < p.D; ++x) w.acc[x] += src[c * head + x];
          Tiles::store_row(bp.dq, b * bp.dq.sb + h * bp.dq.sh + i * bp.dq.ss, w.acc, p.D);
        });
      }
    });
  }
};

}  // namespace qkv::detail::QKV_ENGINE_NS
