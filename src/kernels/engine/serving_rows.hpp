#pragma once
// The building blocks of a serving work item (engine/serving_item.hpp, which states the bit
// contract they keep), on an ISA's vectors: how a key or value row of each format is read in
// place or staged in the workspace, and the products of a group of W keys with the item's rows:
// scores by fp32 multiply-adds, bf16 dot products or AMX tile products, and P V.
#include <algorithm>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "core/varlen_problem.hpp"
#include "kernels/engine/isa_ops.hpp"
#include "kernels/engine/microkernels.hpp"
#include "kernels/engine/size_switch.hpp"
#include "kernels/engine/workspace.hpp"
#include "kernels/serving.hpp"
#include "tensor/kv_codec.hpp"

namespace qkv::detail::QKV_ENGINE_NS {

template <IsaOps Ops>
struct ServingRows {
  using V = typename Ops::V;
  static constexpr int W = Ops::W;
  static constexpr i64 P = kServingSplit;
  static_assert(P % W == 0, "splits are whole vectors of keys");
  static constexpr i64 SP = P + 16;  // pitch of a row's scores: rows off 4 KiB multiples
  static constexpr int kPvVecs = 8;  // vectors of Dv accumulated in registers at once

  // How a key (or value) row is read: vectors of its dtype, of q8_0 codes times their block's
  // scale (one fp32 product per element, as decode_row forms it), or of int8 or fp8 codes alone;
  // f32s: int8 or fp8 codes staged as fp32 in the workspace, their scale beside them; staged:
  // decoded to fp32 in the workspace by stage_row (a head_dim that is not whole vectors, f64);
  // staged_codes: int8 or fp8 of such a head_dim, their codes staged as fp32 by stage_row, the
  // scale beside (read as f32s).
  enum class Src { f32, bf16, f16, i8, q8, e4m3, f32s, staged, staged_codes };
  // Formats of one scale per row (int8 per token and head, fp8 per head): load_row gives the
  // codes as fp32 and the scale multiplies the row's score, s_j = sc_j (q . c_j), and the
  // weight of its value, (p_j sc_j) c_j, once per key rather than once per element.
  static constexpr bool row_scaled(Src s) {
    return s == Src::i8 || s == Src::e4m3 || s == Src::f32s || s == Src::staged_codes;
  }
  static constexpr bool is_staged(Src s) { return s == Src::staged || s == Src::staged_codes; }
  // A row: its data, and the scale of int8 and fp8 or the fp16 block scales of q8_0.
  struct RowRef {
    const void* p;
    float sc;
    const std::uint16_t* sc16;
  };

  static Src src_of(const Operand& x, const KVCodec& codec, i64 n, i64 np) {
    const bool row_scale = codec.scales && codec.format != KVFormat::q8_0;
    if (n != np) return row_scale ? Src::staged_codes : Src::staged;
    if (codec.scales) return codec.format == KVFormat::int8 ? Src::i8 : codec.format == KVFormat::q8_0 ? Src::q8 : Src::e4m3;
    return x.dtype == DType::f32 ? Src::f32 : x.dtype == DType::bf16 ? Src::bf16 : x.dtype == DType::f16 ? Src::f16 : Src::staged;
  }

  // f.template operator()<S>() for the run-time s (staged rows are fp32 by then).
  template <class F>
  static void with_src(Src s, F&& f) {
    switch (s) {
      case Src::bf16: f.template operator()<Src::bf16>(); break;
      case Src::f16: f.template operator()<Src::f16>(); break;
      case Src::i8: f.template operator()<Src::i8>(); break;
      case Src::q8: f.template operator()<Src::q8>(); break;
      case Src::e4m3: f.template operator()<Src::e4m3>(); break;
      case Src::f32s:
      case Src::staged_codes: f.template operator()<Src::f32s>(); break;
      default: f.template operator()<Src::f32>(); break;
    }
  }

  // Rows are padded to 16 floats (whole vectors at every level; the driver's partials pitch).
  static i64 round_up(i64 n) { return (n + 15) / 16 * 16; }

  // Element offsets of keys j0 .. j0 + n - 1 of sequence b, KV head hk: one block-table lookup
  // per block, not one division per key.
  static void row_offsets(const VarlenProblem& vp, const Operand& x, i64 b, i64 hk, i64 j0, i64 n, i64* off) {
    if (!vp.paged) {
      const i64 base = (vp.cu_k[b] + j0) * x.ss + hk * x.sh;
      for (i64 i = 0; i < n; ++i) off[i] = base + i * x.ss;
      return;
    }
    i64 blk = j0 / vp.block_size, slot = j0 % vp.block_size;
    i64 base = vp.block_table[b * vp.bt_stride + blk * vp.bt_col_stride] * x.sb + hk * x.sh;
    for (i64 i = 0; i < n; ++i) {
      off[i] = base + slot * x.ss;
      if (++slot == vp.block_size && i + 1 < n) {
        slot = 0;
        ++blk;
        base = vp.block_table[b * vp.bt_stride + blk * vp.bt_col_stride] * x.sb + hk * x.sh;
      }
    }
  }

  // One row of n elements of x (dtype or codec) at element offset off, as fp32 at dst, zero to np;
  // of int8 and fp8 the codes alone (the row's scale multiplies its score and weight).
  static void stage_row(const Operand& x, const KVCodec& codec, i64 off, i64 hk, i64 n, i64 np, float* dst) {
    if (codec.scales && codec.format == KVFormat::int8) {
      const auto* c = static_cast<const std::int8_t*>(x.data) + off;
      for (i64 i = 0; i < n; ++i) dst[i] = static_cast<float>(c[i]);
    } else if (codec.scales && codec.format == KVFormat::fp8) {
      const auto* c = static_cast<const std::uint8_t*>(x.data) + off;
      for (i64 i = 0; i < n; ++i) dst[i] = e4m3_to_float(c[i]);
    } else if (codec.scales) {
      decode_row(codec, x.data, off, hk, dst);
    } else {
      switch (x.dtype) {
        case DType::f32: std::memcpy(dst, static_cast<const float*>(x.data) + off, static_cast<std::size_t>(n) * 4); break;
        case DType::bf16: {
          const auto* s = static_cast<const std::uint16_t*>(x.data) + off;
          for (i64 i = 0; i < n; ++i) dst[i] = std::bit_cast<float>(static_cast<std::uint32_t>(s[i]) << 16);
          break;
        }
        case DType::f16: Ops::f16_to_f32(static_cast<const std::uint16_t*>(x.data) + off, dst, n); break;
        default: {
          const auto* s = static_cast<const double*>(x.data) + off;
          for (i64 i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
        }
      }
    }
    for (i64 i = n; i < np; ++i) dst[i] = 0.0f;
  }

  // A q8_0 block scale (fp16 bits) as fp32, exactly: one instruction where the ISA has F16C.
  static float block_scale(std::uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return half_bits_to_f32(h);
#endif
  }

  // Bytes of one element of a row read as S.
  template <Src S>
  static constexpr int elt_bytes() {
    if constexpr (S == Src::bf16 || S == Src::f16) return 2;
    else if constexpr (S == Src::i8 || S == Src::q8 || S == Src::e4m3) return 1;
    else return 4;
  }

  // W elements e .. e + W - 1 of a row as fp32.
  template <Src S>
  static V load_row(const RowRef& r, i64 e) {
    if constexpr (S == Src::bf16) {
      return Ops::load_bf16(static_cast<const std::uint16_t*>(r.p) + e);
    } else if constexpr (S == Src::f16) {
      return Ops::load_f16(static_cast<const std::uint16_t*>(r.p) + e);
    } else if constexpr (S == Src::i8) {
      return Ops::load_i8(static_cast<const std::int8_t*>(r.p) + e);  // times r.sc per key
    } else if constexpr (S == Src::q8) {  // a vector lies in one block of 32
      return Ops::mul(Ops::load_i8(static_cast<const std::int8_t*>(r.p) + e), Ops::set1(block_scale(r.sc16[e / kQ8Block])));
    } else if constexpr (S == Src::e4m3) {
      return Ops::load_e4m3(static_cast<const std::uint8_t*>(r.p) + e);  // times r.sc per key
    } else {
      return Ops::load(static_cast<const float*>(r.p) + e);
    }
  }

  // s[r * SP + x] = q_r . k_x for the R rows and the W keys of a group (rows pitch Dp, nvec vectors).
  // pf (or nullptr): a row per key whose same elements are requested into L2 as the first rows
  // read key x, spread over the products as in group_pv.
  template <Src S>
  static void group_scores(const float* qf, i64 Dp, i64 R, const RowRef* kp, i64 nvec, float* s,
                           const char* const* pf = nullptr) {
    constexpr int kVecBytes = W * elt_bytes<S>();
    // Whether vector c of a row starts a cache line (or a vector spans lines), for the first rows.
    auto line_at = [&](i64 c) { return pf && (kVecBytes >= 64 || (c * kVecBytes) % 64 == 0); };
    auto request = [&](int x, i64 c) {
      for (int l = 0; l < (kVecBytes > 64 ? kVecBytes : 64); l += 64) __builtin_prefetch(pf[x] + c * kVecBytes + l, 0, 1);
    };
    i64 r = 0;
    if constexpr (IsaOpsGroupedScores<Ops>) {
      // Four rows at once, W / 4 keys at a time: each key vector is read once for the four. The
      // accumulator of (row, key) sees the same fused multiply-adds as in the one-row loop below
      // and hsum_w reduces every lane alike, so the bits do not depend on the grouping.
      constexpr int KQ = W / 4;
      for (; r + 4 <= R; r += 4) {
        for (int x0 = 0; x0 < W; x0 += KQ) {
          V acc[W];
#pragma GCC unroll 16
          for (int i = 0; i < W; ++i) acc[i] = Ops::zero();
          for (i64 c = 0; c < nvec; ++c) {
            V qv[4];
#pragma GCC unroll 4
            for (int y = 0; y < 4; ++y) qv[y] = Ops::load(qf + (r + y) * Dp + c * W);
#pragma GCC unroll 4
            for (int x = 0; x < KQ; ++x) {
              if (r == 0 && line_at(c)) request(x0 + x, c);
              const V kv = load_row<S>(kp[x0 + x], c * W);
#pragma GCC unroll 4
              for (int y = 0; y < 4; ++y) acc[y * KQ + x] = Ops::fma(qv[y], kv, acc[y * KQ + x]);
            }
          }
          Ops::store_quarters(s + r * SP + x0, SP, Ops::hsum_w(acc));
        }
      }
    }
    for (; r < R; ++r) {  // (row 0 here: no grouped rows requested the lines)
      const float* q = qf + r * Dp;
      V acc[W];
#pragma GCC unroll 16
      for (int x = 0; x < W; ++x) acc[x] = Ops::zero();
      for (i64 c = 0; c < nvec; ++c) {
        const V qv = Ops::load(q + c * W);
        const bool rq = r == 0 && line_at(c);
#pragma GCC unroll 16
        for (int x = 0; x < W; ++x) {
          if (rq) request(x, c);
          acc[x] = Ops::fma(qv, load_row<S>(kp[x], c * W), acc[x]);
        }
      }
      if constexpr (IsaOpsGroupedScores<Ops>) {
        Ops::store(s + r * SP, Ops::hsum_w(acc));
      } else {
        for (int x = 0; x < W; ++x) s[r * SP + x] = Ops::hsum(acc[x]);
      }
    }
  }

  // Scores of bf16 queries and keys on the bf16 dot product (the avx512bf16 level): the same
  // layout as group_scores, with W pairs of (d, d + 1) per vector and one vdpbf16ps per pair
  // vector, the query rows and key rows read in place (q[r], kp[x].p; D a multiple of 2 W). The
  // products of bf16 values are exact in fp32; each lane adds its two products in turn.
  static void group_scores_dp(const std::uint16_t* const* q, i64 R, const RowRef* kp, i64 D, float* s)
    requires(Ops::kHasDpbf16 && IsaOpsGroupedScores<Ops>)
  {
    constexpr int KQ = W / 4;
    const i64 nc = D / (2 * W);
    auto krow = [&](int x) { return static_cast<const std::uint16_t*>(kp[x].p); };
    i64 r = 0;
    for (; r + 4 <= R; r += 4) {
      for (int x0 = 0; x0 < W; x0 += KQ) {
        V acc[W];
#pragma GCC unroll 16
        for (int i = 0; i < W; ++i) acc[i] = Ops::zero();
        for (i64 c = 0; c < nc; ++c) {
          V qv[4];
#pragma GCC unroll 4
          for (int y = 0; y < 4; ++y) qv[y] = Ops::dp_load(q[r + y] + c * 2 * W);
#pragma GCC unroll 4
          for (int x = 0; x < KQ; ++x) {
            const V kv = Ops::dp_load(krow(x0 + x) + c * 2 * W);
#pragma GCC unroll 4
            for (int y = 0; y < 4; ++y) acc[y * KQ + x] = Ops::dp(acc[y * KQ + x], qv[y], kv);
          }
        }
        Ops::store_quarters(s + r * SP + x0, SP, Ops::hsum_w(acc));
      }
    }
    for (; r < R; ++r) {
      V acc[W];
#pragma GCC unroll 16
      for (int x = 0; x < W; ++x) acc[x] = Ops::zero();
      for (i64 c = 0; c < nc; ++c) {
        const V qv = Ops::dp_load(q[r] + c * 2 * W);
#pragma GCC unroll 16
        for (int x = 0; x < W; ++x) acc[x] = Ops::dp(acc[x], qv, Ops::dp_load(krow(x) + c * 2 * W));
      }
      Ops::store(s + r * SP, Ops::hsum_w(acc));
    }
  }

  // For NR rows with the same keys: o_y (NV vectors at o[y]) += p_y,j v_j for keys j = 0 .. n - 1
  // of a group, ascending (p_y at p[y]); each value vector is read once for the NR rows, and each
  // row sees the fused multiply-adds of the one-row loop.
  // pf (or nullptr): a row per key whose same elements are requested into L2 as key j is used, so
  // that a stream of values (decode) spreads its requests over the products: requested all at
  // once, they wait for the core's few line fill buffers and stall it.
  template <Src S, int NR, int NV>
  static void group_pv(const float* const* p, i64 n, const RowRef* vrow, i64 e0, float* const* o,
                       const char* const* pf = nullptr) {
    constexpr int kBytes = NV * W * elt_bytes<S>();
    V acc[NR][NV];
#pragma GCC unroll 4
    for (int y = 0; y < NR; ++y)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[y][v] = Ops::load(o[y] + e0 + v * W);
    for (i64 j = 0; j < n; ++j) {
      if (pf)
        for (int l = 0; l < kBytes; l += 64) __builtin_prefetch(pf[j] + e0 * elt_bytes<S>() + l, 0, 1);
      V pj[NR];
#pragma GCC unroll 4
      for (int y = 0; y < NR; ++y) {
        if constexpr (row_scaled(S)) pj[y] = Ops::set1(p[y][j] * vrow[j].sc);
        else pj[y] = Ops::set1(p[y][j]);
      }
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) {
        const V vv = load_row<S>(vrow[j], e0 + v * W);
#pragma GCC unroll 4
        for (int y = 0; y < NR; ++y) acc[y][v] = Ops::fma(pj[y], vv, acc[y][v]);
      }
    }
#pragma GCC unroll 4
    for (int y = 0; y < NR; ++y)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) Ops::store(o[y] + e0 + v * W, acc[y][v]);
  }

  // Where Ops has load_bf16_split (AVX-512): PV of bf16 values read in place, 2 W values per load
  // split into their even and odd elements. o then holds each block of 2 W values as (even, odd)
  // halves, put back in order by Ops::unsplit_bf16_order at the end of the item; every value sees
  // the same fused multiply-adds, so the bits are group_pv's.
  static constexpr bool kSplitPv = requires(const std::uint16_t* h, V& x) { Ops::load_bf16_split(h, x, x); };

  // As group_pv for NR rows (up to 8), bf16 values, one block of 2 W values at e0 (pf as there).
  template <int NR>
  static void group_pv_split(const float* const* p, i64 n, const RowRef* vrow, i64 e0, float* const* o,
                             const char* const* pf = nullptr)
    requires(kSplitPv)
  {
    V acc[NR][2];
#pragma GCC unroll 8
    for (int y = 0; y < NR; ++y) {
      acc[y][0] = Ops::load(o[y] + e0);
      acc[y][1] = Ops::load(o[y] + e0 + W);
    }
    for (i64 j = 0; j < n; ++j) {
      V ev, od;
      if (pf)
        for (int l = 0; l < 4 * W; l += 64) __builtin_prefetch(pf[j] + e0 * 2 + l, 0, 1);
      Ops::load_bf16_split(static_cast<const std::uint16_t*>(vrow[j].p) + e0, ev, od);
#pragma GCC unroll 8
      for (int y = 0; y < NR; ++y) {
        const V pj = Ops::set1(p[y][j]);
        acc[y][0] = Ops::fma(pj, ev, acc[y][0]);
        acc[y][1] = Ops::fma(pj, od, acc[y][1]);
      }
    }
#pragma GCC unroll 8
    for (int y = 0; y < NR; ++y) {
      Ops::store(o[y] + e0, acc[y][0]);
      Ops::store(o[y] + e0 + W, acc[y][1]);
    }
  }

  // NR rows (1, 2 or 4) over nvec vectors of Dv, kPvVecs / NR vectors at a time in registers.
  template <Src S, int NR>
  static void pv_rows(const float* const* p, i64 n, const RowRef* vrow, i64 nvec, float* const* o,
                      const char* const* pf = nullptr) {
    constexpr int kNV = kPvVecs * 2 / NR > kPvVecs ? kPvVecs : kPvVecs * 2 / NR;
    for (i64 c = 0; c < nvec; c += kNV) {
      const int nv = static_cast<int>(std::min<i64>(kNV, nvec - c));
      with_int<1, kNV>(nv, [&]<int NV>() __attribute__((always_inline)) {
        group_pv<S, NR, NV>(p, n, vrow, c * W, o, pf);
      });
    }
  }

  // How the scores of bf16 queries and keys are formed (a head dim of whole pair vectors; other
  // inputs always take fma): fp32 multiply-adds of the widened values, the level's bf16 dot
  // products (group_scores_dp), or its tile products (Ops::qk_bf16_groups on AMX tiles).
  enum class Score { fma, dp, tiles };

  // Keys per tile product call: S^T of up to 64 keys x 32 rows in the workspace (8 KiB).
  static constexpr i64 kTileKeys = 64;

  // Scores on tiles (Score::tiles): s[r * SP + j - s0] = q_r . k_j for the item's rows and the
  // keys of [g0, e) (16-key groups; may write up to 15 rows past the last head's). Per KV head,
  // its Rh query rows are packed as bf16 pairs, qp[d / 2][sp] with sp = 16 ceil(Rh / 16) (zero
  // past Rh); then, a run of at most kTileKeys keys at a time, each head's S^T goes to km and is
  // transposed into s in 16 x 16 blocks. A group of 16 keys is read in place where its rows lie
  // one stride apart inside the sequence (a packed cache; a paged one with 16 | block_size),
  // otherwise its keys of [a, e) are copied into kb (16 x D bf16, zeros elsewhere): the same
  // values, so the same bits.
  template <class F>
  static void tile_scores(const VarlenProblem& vp, const ServingItem& it, const std::uint16_t* const* qrow, i64 Rh,
                          i64 a, i64 e, i64 g0, i64 s0, std::uint16_t* kb, char* ws, float* s, F&& prefetch_ahead)
    requires(Ops::kHasDpbf16)
  {
    const Problem& p = vp.p;
    const Operand& k = p.k;
    const i64 D = p.D, b = it.b, nh = it.nh, sp = (Rh + 15) / 16 * 16, lk = vp.seq_k[b];
    auto* qp = reinterpret_cast<std::uint32_t*>(ws);
    float* km = reinterpret_cast<float*>(ws + (nh * (D / 2) * sp * 4 + 63) / 64 * 64);
    for (i64 x = 0; x < nh; ++x)  // (Rh = G rows can exceed kServingRows: no fixed array of them)
      Microkernels<Ops>::pack_pairs(qrow + x * Rh, static_cast<int>(Rh), D, qp + x * (D / 2) * sp, static_cast<int>(sp));
    const auto* kd = static_cast<const std::uint16_t*>(k.data);
    const bool paged_whole = vp.paged && vp.block_size % 16 == 0;
    // Where group j0 of head hk lies in memory (nullptr: not one stride apart).
    auto in_place = [&](i64 hk, i64 j0) -> const std::uint16_t* {
      if (vp.paged) return paged_whole ? kd + vp.key_off(k, b, hk, j0) : nullptr;
      return j0 + 16 <= lk ? kd + vp.key_off(k, b, hk, j0) : nullptr;
    };
    Ops::tile_config();  // once for the item's products (nothing between them changes it)
    for (i64 j0 = g0; j0 < e;) {
      // A run of up to kTileKeys keys in whole groups each read in place (a packed cache; a paged
      // one with 16 | block_size, each group inside one block), or one group copied.
      i64 n = 16;
      const bool place = in_place(it.hk, j0) != nullptr;
      if (place)
        while (n < kTileKeys && j0 + n < e && in_place(it.hk, j0 + n) != nullptr) n += 16;
      for (i64 x = 0; x < nh; ++x) {
        const i64 hk = it.hk + x;
        for (i64 g = 0; g < n; g += 16) prefetch_ahead(k, vp.kc, D, hk, j0 + g);
        const std::uint16_t* kg[kTileKeys / 16];
        i64 ks = k.ss;
        if (place) {
          for (i64 g = 0; g < n; g += 16) kg[g / 16] = in_place(hk, j0 + g);
        } else {  // one group, its keys of [a, e) copied
          const i64 ja = std::max(j0, a), jb = std::min(j0 + 16, e);
          std::memset(kb, 0, static_cast<std::size_t>(16 * D) * 2);
          for (i64 j = ja; j < jb; ++j) std::memcpy(kb + (j - j0) * D, kd + vp.key_off(k, b, hk, j), static_cast<std::size_t>(D) * 2);
          kg[0] = kb;
          ks = D;
        }
        Ops::qk_bf16_groups(qp + x * (D / 2) * sp, static_cast<int>(sp / 16), kg, ks, D, static_cast<int>(n / 16), km,
                            static_cast<int>(sp), true);
        for (i64 g = 0; g < n; g += 16)
          for (i64 r0 = 0; r0 < Rh; r0 += 16) {
            const float* rows[16];
            for (int y = 0; y < 16; ++y) rows[y] = km + (g + y) * sp + r0;
            Ops::transpose(rows, s + (x * Rh + r0) * SP + (j0 + g - s0), SP);
          }
      }
      j0 += n;
    }
  }
};

}  // namespace qkv::detail::QKV_ENGINE_NS
