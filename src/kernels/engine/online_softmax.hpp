#pragma once
// The online softmax (Milakov & Gimelshein 2018; FlashAttention-2, Dao 2023, Algorithm 1): the
// running max m and sum l of a row's scores over the key tiles seen so far, and per tile
//   m' = max(m, max_j s_j), shift = m' (0 while m' = -inf: nothing admitted yet, so that
//   e^{-inf - 0} = 0), alpha = e^{m - shift}, p_j = e^{s_j - shift}, l' = alpha l + sum_j p_j,
// the accumulator O rescaled by alpha; at the end O / l and softmax_lse = m + log l, a row with
// l = 0 (nothing admitted; a NaN score leaves l NaN, not 0) being empty: O = 0, lse = -inf.
//
// Two forms, each keeping the bits its kernels have always had:
//   Lanes: W rows at once, one per lane (block.hpp's tiles hold rows in lanes); l' is one fused
//          multiply-add, alpha l + sum;
//   Row:   one row in scalars (the decode fast path, decode_fast.hpp, and the serving item,
//          serving_item.hpp, whose single split is the first tile of the state); the tile's max
//          is reduced over the lanes of a vector of maxima (row_max), l' = alpha l, then + sum.
// Sinks join at the end (join_sink); the split kernels add them to the merge instead.
// The state lives in the workspace (Ws::m, l, alpha) and in the partials of the split kernels,
// merged by lse_merge.hpp.
#include <cmath>
#include <limits>

#include "kernels/engine/isa_ops.hpp"

namespace qkv::detail::QKV_ENGINE_NS {

template <IsaOps Ops>
struct OnlineSoftmax {
  using V = typename Ops::V;
  static constexpr int W = Ops::W;
  static constexpr float kNegInf = -std::numeric_limits<float>::infinity();

  /// Starts n rows: m = -inf, l = 0.
  static void begin(float* m, float* l, int n) {
    for (int r = 0; r < n; ++r) { m[r] = kNegInf; l[r] = 0.0f; }
  }

  /// W rows in lanes: rescale(m, tile max) gives m', the shift and alpha; add(l, tile sum)
  /// stores l' = alpha l + sum (one fused multiply-add), m' and alpha.
  struct Lanes {
    V m_old, m_new, shift, alpha;
    [[gnu::always_inline]] static Lanes rescale(const float* m, V tile_max) {
      Lanes s;
      s.m_old = Ops::load(m);
      s.m_new = Ops::max(s.m_old, tile_max);
      s.shift = Ops::safe_max(s.m_new);  // -inf (nothing admitted yet) -> 0, so exp(-inf - 0) = 0
      s.alpha = Ops::exp(Ops::sub(s.m_old, s.shift));
      return s;
    }
    [[gnu::always_inline]] void add(float* m, float* l, float* a, V tile_sum) const {
      Ops::store(l, Ops::fma(Ops::load(l), alpha, tile_sum));
      Ops::store(m, m_new);
      Ops::store(a, alpha);
    }
  };

  /// One row in scalars: rescale(m, tile max) gives m', the shift and alpha (the vector exp);
  /// add(l, tile sum) = alpha l + sum, rounded after the product.
  struct Row {
    float m_new, shift, alpha;
    [[gnu::always_inline]] static Row rescale(float m_old, float tile_max) {
      Row s;
      s.m_new = m_old > tile_max ? m_old : tile_max;
      s.shift = shift_of(s.m_new);
      alignas(64) float lanes[W];
      Ops::store(lanes, Ops::exp(Ops::set1(m_old - s.shift)));
      s.alpha = lanes[0];
      return s;
    }
    [[gnu::always_inline]] float add(float l, float tile_sum) const { return l * alpha + tile_sum; }
  };

  /// The exponent's shift for a max m: m, or 0 where m = -inf (every weight 0).
  static float shift_of(float m) { return m == kNegInf ? 0.0f : m; }

  /// The largest lane of a vector of maxima (lanes in order; NaN lanes never win).
  [[gnu::always_inline]] static float row_max(V v) {
    alignas(64) float lanes[W];
    Ops::store(lanes, v);
    float m = kNegInf;
    for (int x = 0; x < W; ++x) m = lanes[x] > m ? lanes[x] : m;
    return m;
  }

  /// The end of a row: whether it is empty, and its softmax_lse.
  static bool empty(float l) { return l == 0.0f; }
  static float lse(float m, float l) { return empty(l) ? kNegInf : m + std::log(l); }

  /// The end of a row with an attention sink z (a logit in the denominator only, no value;
  /// gpt-oss, Xiao et al. 2023): the divisor of O, l + e^{z - m}, and softmax_lse, m + log of
  /// it, in float64 (no overflow for z far above the scores), rounded once. An empty row (l = 0)
  /// keeps O = 0 and has lse = z. Joined once per row, after the last tile.
  static void join_sink(float m, float l, float z, float& div, float& lse_out) {
    if (empty(l)) {
      div = 1.0f;
      lse_out = z;
      return;
    }
    const double L = static_cast<double>(l) + std::exp(static_cast<double>(z) - static_cast<double>(m));
    div = static_cast<float>(L);
    lse_out = static_cast<float>(static_cast<double>(m) + std::log(L));
  }
};

}  // namespace qkv::detail::QKV_ENGINE_NS
