#pragma once
// The fp32 microkernels: the two matrix products of FlashAttention-2 (Dao 2023, Algorithm 1)
// on one tile, S_i^(j) = Q_i K_j^T and the P~_i^(j) V_j added to the rescaled O_i, with the
// accumulators in registers; and the conversions of bf16/fp16 rows to fp32. They know nothing
// of the softmax, the masks or where rows come from: the block processor (block.hpp) calls them
// on buffers of the workspace, and a backward pass, which recomputes P from softmax_lse, can
// call the same QK^T kernels on the same buffers.
//
// QK^T: outer products over d (broadcast one K element, FMA with a vector of queries), MR keys x
// NQV query vectors of accumulators in registers (qk_tile); for a few rows, dot products along D
// instead (qk_dot). PV: MR query rows x NC vectors of Dv in registers, rescaled by alpha on load,
// accumulating over the tile's keys (pv_tile). Accumulation is fp32 throughout.
#include <bit>
#include <cstdint>
#include <cstring>

#include "kernels/engine/isa_ops.hpp"
#include "kernels/engine/size_switch.hpp"
#include "kernels/engine/workspace.hpp"

namespace qkv::detail::QKV_ENGINE_NS {

// The exact bf16 -> fp32 widening, the expression of qkv::bf16_to_float (src/tensor/tensor.cpp;
// src/tensor/convert.hpp calls that one and has no inline decoder). A copy inline here, because
// the library's function is out of line (a call per element in the tile conversions), and an
// inline function outside this namespace could be shared with a translation unit compiled for
// another ISA.
inline float bf16_bits_to_float(std::uint16_t b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

template <IsaOps Ops>
struct Microkernels {
  using V = typename Ops::V;
  static constexpr int W = Ops::W;
  static constexpr int NQV_MAX = Ops::kBq / W;  // query vectors of a block

  // ---- conversions -------------------------------------------------------------------------
  // n elements of row data at element offset off, as fp32.
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

  // W elements at element offset off, as a vector of fp32 (converted in registers).
  template <Elt E>
  static V load_elt(const void* base, i64 off) {
    if constexpr (E == Elt::f32) return Ops::load(static_cast<const float*>(base) + off);
    else if constexpr (E == Elt::bf16) return Ops::load_bf16(static_cast<const std::uint16_t*>(base) + off);
    else return Ops::load_f16(static_cast<const std::uint16_t*>(base) + off);
  }

  // ---- words moved unchanged -----------------------------------------------------------
  template <class T>
  static const char* bytes(const T* row) { return reinterpret_cast<const char*>(row); }

  // dst[c * sp + r] = 32-bit word c of row r (an fp32 value, or a bf16 pair) for c < cols and
  // r < sp, rows r >= n zero: W x W blocks transposed in registers (Ops::transpose, shuffles only:
  // the bits pass unchanged), the last cols % W words one by one. Element by element, with a
  // store to a new cache line each time, packing Q was a visible part of short calls
  // (`qkv bench --shapes forward`). T: the rows' element type (only their bytes are read).
  template <class T>
  static void transpose_words(const T* const* src, int n, i64 cols, float* dst, int sp) {
    alignas(64) static constexpr float kZeros[W] = {};
    const i64 cw = cols / W * W;
    for (int r0 = 0; r0 < sp; r0 += W) {
      const float* rows[W];
      for (i64 c = 0; c < cw; c += W) {
        for (int x = 0; x < W; ++x)
          rows[x] = r0 + x < n ? reinterpret_cast<const float*>(bytes(src[r0 + x]) + 4 * c) : kZeros;
        Ops::transpose(rows, dst + c * sp + r0, sp);
      }
      for (i64 c = cw; c < cols; ++c)
        for (int x = 0; x < W; ++x) {
          float* d = dst + c * sp + r0 + x;
          if (r0 + x < n) std::memcpy(d, bytes(src[r0 + x]) + 4 * c, 4);
          else *d = 0.0f;
        }
    }
  }

  // bf16 pairs for vdpbf16ps: dst[dp * sp + r] = (x_r[2 dp], x_r[2 dp + 1]) as one 32-bit word
  // (low half first) for n rows of X bf16 values, rows r >= n and the missing partner of an odd X
  // zero. A pair is one little-endian 32-bit word of the row as stored, so whole pairs are the
  // rows' words transposed.
  template <class T>
  static void pack_pairs(const T* const* src, int n, i64 X, std::uint32_t* dst, int sp) {
    const i64 X2 = X / 2;  // whole pairs
    transpose_words(src, n, X2, reinterpret_cast<float*>(dst), sp);
    if (X & 1)
      for (int r = 0; r < sp; ++r) {
        std::uint16_t last = 0;
        if (r < n) std::memcpy(&last, bytes(src[r]) + 2 * (X - 1), 2);
        dst[X2 * sp + r] = last;
      }
  }

  // ---- S = Q K^T ---------------------------------------------------------------------------
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

  // S[j][r] for kt keys (rows of k, stride ks) and nqv vectors of transposed queries qt[D][nqv W],
  // with the score pitch ssp.
  static void qk_tile(const float* qt, int nqv, const float* k, i64 ks, i64 D, int kt, float* s, int ssp,
                      Prefetch& pf) {
    const int sp = nqv * W;
    with_int<1, NQV_MAX>(nqv, [&]<int NQV>() __attribute__((always_inline)) {
      qk_rows<NQV>(qt, sp, k, ks, D, kt, s, ssp, pf);
    });
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

  // ---- O = alpha O + P V -------------------------------------------------------------------
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

  // O[r] = alpha[r] O[r] + sum_j P[j][r] V[j] for n rows and nvec vectors of Dv; P key-major
  // with pitch sp, V rows with stride vs.
  template <bool SKIP>
  static void pv_tile(const float* s, int sp, const float* v, i64 vs, int kt, float* o, i64 os,
                      const float* alpha, int n, int nvec, Prefetch& pf) {
    constexpr int NC = Ops::kPvCols;
    int c = 0;
    for (; c + NC <= nvec; c += NC) pv_cols<NC, SKIP>(s, sp, v + c * W, vs, kt, o + c * W, os, alpha, n, pf);
    for (; c < nvec; ++c) pv_cols<1, SKIP>(s, sp, v + c * W, vs, kt, o + c * W, os, alpha, n, pf);
    pf.rest();
  }
};

}  // namespace qkv::detail::QKV_ENGINE_NS
