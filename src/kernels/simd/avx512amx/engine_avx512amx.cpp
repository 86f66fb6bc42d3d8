// The attention engine (src/kernels/engine/engine.hpp) instantiated for AVX-512 with the bf16
// matrix products on AMX tiles (AMX-TILE, AMX-BF16: tdpbf16ps, 16 x 16 fp32 results of 32-term
// bf16 dot products per instruction, about 15x the fp32 FMA rate of a core), for bfloat16 inputs.
// Everything else (fp32 and fp16 inputs, the softmax, masks, conversions) is the avx512 engine's:
// the Ops below are OpsAvx512 with the two bf16 products replaced.
//
// The products keep the dot-product path's layouts (engine_avx512's qk_bf16 and pv_bf16), so the
// block processor and the backward call them unchanged:
//   qk_bf16: S^T = K Q^T, tile A = 16 key rows of K read in place (32 bf16 of d each), tile B =
//            Q packed as (d, d+1) pairs per query (qp), C = 16 keys x 16 queries of fp32 scores,
//            stored key-major as the engine keeps S.
//   pv_bf16: O = alpha O + P V, tile A = 16 rows x 16 pairs of P (the pairs of pp transposed in
//            registers), tile B = V packed as (key, key+1) pairs (vp), C = 16 rows x 16 values
//            of alpha O (scaled in place), loaded from O and stored back.
// Shapes the tiles do not cover exactly (D not a multiple of 32, a key tile not a multiple of 16
// keys, an odd number of key pairs) take OpsAvx512's vdpbf16ps kernels instead: tiles never read
// past a row nor a padding that may hold stale bits.
//
// Precision: products of bf16 values are exact in fp32 and tdpbf16ps sums them in fp32 (its
// order within an instruction is the hardware's); P is rounded to bf16 as on the dot-product
// path, so the accuracy contract is that path's (docs/accuracy.md).
//
// The tile configuration (palette 1, eight 16 x 64-byte tiles) is loaded at the start of every
// product: another library on the same thread may have loaded its own in between.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "qkv/tensor.hpp"

#define QKV_ENGINE_NS engine_avx512amx
#include "kernels/engine/engine.hpp"
#include "kernels/engine/size_switch.hpp"
#include "kernels/isa_kernels.hpp"
#include "kernels/engine/serving_item.hpp"

namespace qkv::detail {
namespace engine_avx512amx {

#include "kernels/simd/avx512/ops_avx512.inc"

struct TileConfig {
  std::uint8_t palette = 1, start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  std::uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};
alignas(64) constexpr TileConfig kTileConfig{};

struct Ops : OpsAvx512 {
  using Base = OpsAvx512;

  // S^T for MR x 16 keys (the first 16 at k, the second at k2, rows ks apart) and NC x 16
  // queries: C tiles 0..3, A tiles 4, 5, B tiles 6, 7.
  template <int MR, int NC>
  static void qk_tiles(const std::uint32_t* qp, int sp, const std::uint16_t* k, const std::uint16_t* k2, std::int64_t ks,
                       std::int64_t D, float* s, int ssp) {
    _tile_zero(0);
    if constexpr (NC > 1) _tile_zero(1);
    if constexpr (MR > 1) _tile_zero(2);
    if constexpr (MR > 1 && NC > 1) _tile_zero(3);
    const int kstride = static_cast<int>(ks * 2), qstride = sp * 4;
    for (std::int64_t d0 = 0; d0 < D; d0 += 32) {
      _tile_loadd(4, k + d0, kstride);
      if constexpr (MR > 1) _tile_loadd(5, k2 + d0, kstride);
      _tile_loadd(6, qp + (d0 / 2) * sp, qstride);
      if constexpr (NC > 1) _tile_loadd(7, qp + (d0 / 2) * sp + 16, qstride);
      _tile_dpbf16ps(0, 4, 6);
      if constexpr (NC > 1) _tile_dpbf16ps(1, 4, 7);
      if constexpr (MR > 1) _tile_dpbf16ps(2, 5, 6);
      if constexpr (MR > 1 && NC > 1) _tile_dpbf16ps(3, 5, 7);
    }
    const int sstride = ssp * 4;
    _tile_stored(0, s, sstride);
    if constexpr (NC > 1) _tile_stored(1, s + 16, sstride);
    if constexpr (MR > 1) _tile_stored(2, s + 16 * ssp, sstride);
    if constexpr (MR > 1 && NC > 1) _tile_stored(3, s + 16 * ssp + 16, sstride);
  }

  // Scores of ng groups of 16 keys, group g at group(g) (rows ks apart), against nqv x 16
  // queries, in tile products of two groups: group g's scores at rows 16 g of s.
  template <class Group>
  static void qk_groups(const std::uint32_t* qp, int nqv, Group&& group, std::int64_t ks, std::int64_t D, int ng,
                        float* s, int ssp, bool configured = false) {
    if (!configured) _tile_loadconfig(&kTileConfig);
    const int sp = nqv * 16;
    for (int g = 0; g < ng; g += 2) {
      const bool two = ng - g >= 2;
      const std::uint16_t* k1 = group(g);
      const std::uint16_t* k2 = two ? group(g + 1) : nullptr;
      for (int c = 0; c < nqv; c += 2) {
        const bool wide = nqv - c >= 2;
        float* sj = s + g * 16 * ssp + c * 16;
        if (two && wide) qk_tiles<2, 2>(qp + c * 16, sp, k1, k2, ks, D, sj, ssp);
        else if (two) qk_tiles<2, 1>(qp + c * 16, sp, k1, k2, ks, D, sj, ssp);
        else if (wide) qk_tiles<1, 2>(qp + c * 16, sp, k1, k2, ks, D, sj, ssp);
        else qk_tiles<1, 1>(qp + c * 16, sp, k1, k2, ks, D, sj, ssp);
      }
    }
  }

  // s[j * ssp + r] = q_r . k_j, as OpsAvx512::qk_bf16.
  static void qk_bf16(const std::uint32_t* qp, int nqv, const std::uint16_t* k, std::int64_t ks, std::int64_t D,
                      int kt, float* s, int ssp) {
    if (D % 32 != 0 || kt % 16 != 0) {
      Base::qk_bf16(qp, nqv, k, ks, D, kt, s, ssp);
      return;
    }
    qk_groups(qp, nqv, [&](int g) { return k + g * 16 * ks; }, ks, D, kt / 16, s, ssp);
  }

  // As qk_bf16 for ng groups of 16 keys, group g at kg[g] (its rows ks apart; D a multiple of
  // 32), scores of group g at rows 16 g of s: keys of a paged cache, one block per group, in tile
  // products of 32 keys as in a packed cache. `configured`: the caller loaded the configuration
  // (tile_config) on this thread and ran nothing since that could change it, so that a run of
  // products loads it once (loading it costs about a tenth of a memory-bound stream of products).
  static void qk_bf16_groups(const std::uint32_t* qp, int nqv, const std::uint16_t* const* kg, std::int64_t ks,
                             std::int64_t D, int ng, float* s, int ssp, bool configured = false) {
    qk_groups(qp, nqv, [&](int g) { return kg[g]; }, ks, D, ng, s, ssp, configured);
  }
  // Loads the products' tile configuration on this thread (see `configured` above).
  static void tile_config() { _tile_loadconfig(&kTileConfig); }

  // C tiles 0..NC-1 += A (the nkb blocks of 16 pairs in a) times NC x 16 columns of vp. C starts
  // as 16 rows of `c` (pitch cs floats) when `load`, else as 0, and is stored back there.
  template <int NC>
  static void pv_tiles(const std::uint32_t* a, int nkb, const std::uint32_t* vp, int dvp, float* c, int cs,
                       bool load) {
    const int cstride = cs * 4;
    if (load) {
      _tile_loadd(0, c, cstride);
      if constexpr (NC > 1) _tile_loadd(1, c + 16, cstride);
      if constexpr (NC > 2) _tile_loadd(2, c + 32, cstride);
      if constexpr (NC > 3) _tile_loadd(3, c + 48, cstride);
    } else {
      _tile_zero(0);
      if constexpr (NC > 1) _tile_zero(1);
      if constexpr (NC > 2) _tile_zero(2);
      if constexpr (NC > 3) _tile_zero(3);
    }
    const int vstride = dvp * 4;
    for (int kb = 0; kb < nkb; ++kb) {
      _tile_loadd(4, a + kb * 256, 64);
      const std::uint32_t* v = vp + kb * 16 * dvp;
      _tile_loadd(5, v, vstride);
      if constexpr (NC > 1) _tile_loadd(6, v + 16, vstride);
      _tile_dpbf16ps(0, 4, 5);
      if constexpr (NC > 1) _tile_dpbf16ps(1, 4, 6);
      if constexpr (NC > 2) {
        _tile_loadd(7, v + 32, vstride);
        _tile_dpbf16ps(2, 4, 7);
      }
      if constexpr (NC > 3) {
        _tile_loadd(5, v + 48, vstride);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    _tile_stored(0, c, cstride);
    if constexpr (NC > 1) _tile_stored(1, c + 16, cstride);
    if constexpr (NC > 2) _tile_stored(2, c + 32, cstride);
    if constexpr (NC > 3) _tile_stored(3, c + 48, cstride);
  }

  // o[r] = alpha[r] o[r] + sum over the kt2 pairs of P V, as OpsAvx512::pv_bf16. A block of 16
  // whole rows is scaled by alpha in place (skipped where every alpha is 1, as after the first
  // tiles of a row) and then accumulated on the tiles, loaded from and stored to o; a last block
  // of fewer rows is computed from 0 and added, so that no row past n is ever read or written.
  static void pv_bf16(const std::uint32_t* pp, int sp, const std::uint32_t* vp, int nvec, int kt2, float* o,
                      std::int64_t os, const float* alpha, int n) {
    constexpr int kMaxPairBlocks = 4;  // kt2 <= 64: a key tile of kBk = 64 keys, or 128 rows
    if (kt2 % 16 != 0 || kt2 > 16 * kMaxPairBlocks || sp % 16 != 0) {
      Base::pv_bf16(pp, sp, vp, nvec, kt2, o, os, alpha, n);
      return;
    }
    _tile_loadconfig(&kTileConfig);
    const int nkb = kt2 / 16, dvp = nvec * 16;
    alignas(64) std::uint32_t a[kMaxPairBlocks * 256];  // A: 16 rows x 16 pairs per block
    alignas(64) float c[16 * 64];                       // C of a last block of fewer rows
    auto tiles = [&](int x0, int nc, float* dst, int ds, bool load) {
      switch (nc) {
        case 4: pv_tiles<4>(a, nkb, vp + x0, dvp, dst, ds, load); break;
        case 3: pv_tiles<3>(a, nkb, vp + x0, dvp, dst, ds, load); break;
        case 2: pv_tiles<2>(a, nkb, vp + x0, dvp, dst, ds, load); break;
        default: pv_tiles<1>(a, nkb, vp + x0, dvp, dst, ds, load); break;
      }
    };
    for (int r0 = 0; r0 < n; r0 += 16) {
      const int nr = n - r0 < 16 ? n - r0 : 16;
      // A[r][p] = pp[p][r0 + r]: the words of 16 x 16 blocks transposed (rows past n, inside the
      // pitch sp, give C rows that are never used).
      for (int kb = 0; kb < nkb; ++kb) {
        const float* rows[16];
        for (int x = 0; x < 16; ++x) rows[x] = reinterpret_cast<const float*>(pp + (kb * 16 + x) * sp + r0);
        Base::transpose(rows, reinterpret_cast<float*>(a + kb * 256), 16);
      }
      if (nr == 16 && os <= (1 << 14)) {  // a tile row stride is at most 64 KiB
        for (int r = 0; r < 16; ++r) {
          if (alpha[r0 + r] == 1.0f) continue;
          const V al = _mm512_set1_ps(alpha[r0 + r]);
          float* orow = o + (r0 + r) * os;
          for (int x = 0; x < dvp; x += 16) _mm512_storeu_ps(orow + x, _mm512_mul_ps(_mm512_loadu_ps(orow + x), al));
        }
        for (int x0 = 0; x0 < dvp; x0 += 64)
          tiles(x0, (dvp - x0) / 16 < 4 ? (dvp - x0) / 16 : 4, o + r0 * os + x0, static_cast<int>(os), true);
        continue;
      }
      for (int x0 = 0; x0 < dvp; x0 += 64) {
        const int nc = (dvp - x0) / 16 < 4 ? (dvp - x0) / 16 : 4;
        tiles(x0, nc, c, 64, false);
        for (int r = 0; r < nr; ++r) {
          const V al = _mm512_set1_ps(alpha[r0 + r]);
          float* orow = o + (r0 + r) * os + x0;
          for (int v = 0; v < nc; ++v)
            _mm512_storeu_ps(orow + v * 16, _mm512_fmadd_ps(_mm512_loadu_ps(orow + v * 16), al,
                                                            _mm512_loadu_ps(c + r * 64 + v * 16)));
        }
      }
    }
  }
};

static_assert(IsaOps<Ops>, "Ops must provide what the engine uses (kernels/engine/isa_ops.hpp)");

using E = Engine<Ops>;

// The scores of bf16 queries and keys as AMX tile products. bf16_dot is always on at this level
// (bf16_dot_enabled(), kernels/isa_select.cpp), so the flag is not read: the tile form is the
// level's one body (an fp32 instantiation beside it would never run).
void serving_item(const VarlenProblem& vp, const ServingItem& it, const ServingLayout& L, float* parts, std::int64_t NS,
                  char* ws, bool) {
  using Body = ServingItemBody<Ops>;
  Body::run<Body::Score::tiles>(vp, it, L, parts, NS, ws);
}

}  // namespace engine_avx512amx

const IsaKernels kIsaKernelsAvx512Amx = {
    "avx512amx",
    engine_avx512amx::E::flash_workspace, engine_avx512amx::E::flash_forward,
    engine_avx512amx::E::decode_workspace, engine_avx512amx::E::decode_forward,
    engine_avx512amx::E::backward_workspace, engine_avx512amx::E::backward,
    engine_avx512amx::Ops::kBq, engine_avx512amx::Ops::kBk,
    engine_avx512amx::E::exp_array,
    nullptr,
    engine_avx512amx::serving_item,
};

}  // namespace qkv::detail
