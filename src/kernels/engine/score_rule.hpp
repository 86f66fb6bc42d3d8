#pragma once
// The score rule: what happens between a raw dot product q . k_j and the softmax's input, for
// every fast kernel family (the tiled forward, block.hpp; the backward, backward_tiles.hpp; the
// decode fast path, decode_fast.hpp; the serving item, serving_item.hpp, packed, paged and
// quantized caches alike):
//   s_j = scale (q . k_j), then softcap: s_j = softcap tanh(s_j / softcap) (Gemma 2), then the
//   explicit mask: + its additive term, or excluded where it says false or -inf; keys outside the
//   row's admissible range [lo, hi) (causal, window, key lengths: Problem::key_range) excluded.
// An excluded score is -inf by select, never by addition, so a NaN computed from an excluded K
// row is discarded.
//
// ScoreRule<kMask, kSoftcap> carries the per-call values (scale, softcap, the mask operand) and
// its options as compile-time flags, so a kernel is written once over its rule `R` and the
// branches of options it does not have vanish. with_score_rule() is the one switch from a call's
// run-time options to the rule type. A new option (attention sinks, ALiBi slopes, a window that
// keeps the first tokens) is one more parameter here and in with_score_rule, its per-call
// values a member, and its term in score() and vec().
//
// Two forms of the same rule:
//   scalar: score(x, g, lo, hi, mask offset) -> s or -inf (or admits() and scaled() apart, for
//           the backward, which keeps tanh for the derivative, grad(), and its own exclusion
//           value);
//   vector: vec<Ops>(x, lo, hi, g) on W lanes (rows of one key, or keys of one row): scale, then
//           keys outside [lo, hi) to -inf. It covers a rule without mask (kVector); with softcap,
//           the scalar scaled() has already scaled and capped x, and vec only selects.
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/problem.hpp"
#include "kernels/engine/isa_ops.hpp"
#include "kernels/engine/workspace.hpp"

namespace qkv::detail::QKV_ENGINE_NS {

template <bool kMask = false, bool kSoftcap = false>
struct ScoreRule {
  static constexpr bool kHasMask = kMask;
  static constexpr bool kHasSoftcap = kSoftcap;
  // Scores from raw dot products by the vector form alone (scale and key range).
  static constexpr bool kVector = !kMask && !kSoftcap;

  float scale, softcap;
  MaskOperand mask;

  explicit ScoreRule(const Problem& p)
      : scale(static_cast<float>(p.scale)), softcap(static_cast<float>(p.softcap)), mask(p.mask) {}

  // ---- per row ----------------------------------------------------------------------------------
  /// The admissible key range [lo, hi) of row i of batch b (lo >= hi: the row is empty).
  static void key_range(const Problem& p, i64 b, i64 i, i64& lo, i64& hi) { p.key_range(b, i, lo, hi); }
  /// The element offset of (b, h, i, 0) in the mask.
  static i64 mask_row(const Problem& p, i64 b, i64 h, i64 i) { return b * p.mask.sb + h * p.mask.sh + i * p.mask.sq; }

  // ---- per tile ---------------------------------------------------------------------------------
  /// Whether rows whose ranges all contain [max_lo, min_hi) admit every key of [t0, t1) with
  /// its score unmasked: such a tile needs no exclusion.
  static bool full(i64 t0, i64 t1, i64 max_lo, i64 min_hi) { return !kMask && t0 >= max_lo && t1 <= min_hi; }

  // ---- scalar form ------------------------------------------------------------------------------
  /// Whether key g lies in the row's range [lo, hi) (all a rule without mask asks of a key).
  static bool in_range(i64 g, i64 lo, i64 hi) { return g >= lo && g < hi; }
  /// Whether key g of a row with range [lo, hi) and mask offset mo is admitted; `add`: the
  /// mask's additive term (left 0 without one).
  [[gnu::always_inline]] bool admits(i64 g, i64 lo, i64 hi, i64 mo, float& add) const {
    bool ok = in_range(g, lo, hi);
    if constexpr (kMask) ok = ok && mask_admits(mask, mo + g * mask.sk, add);
    return ok;
  }
  /// scale x, softcapped; `t`: tanh of the softcap (the backward's derivative), else untouched.
  [[gnu::always_inline]] float scaled(float x, float& t) const {
    float y = x * scale;
    if constexpr (kSoftcap) {
      t = std::tanh(y / softcap);
      y = softcap * t;
    }
    return y;
  }
  [[gnu::always_inline]] float scaled(float x) const {
    float t;
    return scaled(x, t);
  }
  /// The backward: dS at the raw score from dS at the softmax's input; softcap multiplies by
  /// 1 - tanh^2 (t: scaled()'s tanh).
  [[gnu::always_inline]] float grad(float ds, float t) const {
    if constexpr (kSoftcap) return ds * (1.0f - t * t);
    else return ds;
  }
  /// The score of raw dot product x for key g (see admits), -inf where excluded.
  [[gnu::always_inline]] float score(float x, i64 g, i64 lo, i64 hi, i64 mo) const {
    float add = 0.0f;
    const bool ok = admits(g, lo, hi, mo, add);
    const float y = scaled(x);
    return ok ? y + add : -std::numeric_limits<float>::infinity();
  }

  // ---- vector form ------------------------------------------------------------------------------
  /// W raw dot products scaled (a rule with softcap: x is already scaled(), left as is).
  template <IsaOps Ops>
  [[gnu::always_inline]] typename Ops::V scale_v(typename Ops::V x) const {
    if constexpr (kSoftcap) return x;
    else return Ops::mul(x, Ops::set1(scale));
  }
  /// W scores, lanes whose key g is outside [lo, hi) set to -inf (key indices below 2^24, exact
  /// as floats).
  template <IsaOps Ops>
  [[gnu::always_inline]] typename Ops::V vec(typename Ops::V x, typename Ops::V lo, typename Ops::V hi,
                                             typename Ops::V g) const {
    static_assert(!kMask, "an explicit mask takes the scalar form");
    return Ops::range_select(scale_v<Ops>(x), lo, hi, g);
  }
};

/// The one switch from a call's run-time options to its score rule: f.template operator()<R>().
/// kMasks = false for the kernels that take no explicit mask (serving), so that no masked rule
/// is instantiated for them.
template <bool kMasks = true, class F>
[[gnu::always_inline]] inline void with_score_rule(const Problem& p, F&& f) {
  const bool cap = p.softcap > 0.0;
  if (kMasks && p.mask.data != nullptr) {
    if constexpr (kMasks) {
      if (cap) f.template operator()<ScoreRule<true, true>>();
      else f.template operator()<ScoreRule<true, false>>();
      return;
    }
  }
  if (cap) f.template operator()<ScoreRule<false, true>>();
  else f.template operator()<ScoreRule<false, false>>();
}

}  // namespace qkv::detail::QKV_ENGINE_NS
