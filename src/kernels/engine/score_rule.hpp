#pragma once
// The score rule: what happens between a raw dot product q . k_j and the softmax's input, for
// every fast kernel family (the tiled forward, block.hpp; the backward, backward_tiles.hpp; the
// decode fast path, decode_fast.hpp; the serving item, serving_item.hpp, packed, paged and
// quantized caches alike):
//   s_j = scale (q . k_j), then softcap: s_j = softcap tanh(s_j / softcap) (Gemma 2), then the
//   position term: ALiBi's bias - slope |diag - j| (Press et al. 2022, sec. 3), then the explicit
//   mask: + its additive term, or excluded where it says false or -inf; keys outside the row's
//   admissible range [lo, hi) (causal, window, key lengths: Problem::key_range) excluded, but
//   with window_keep_first the first keys [0, first_hi) admitted too (StreamingLLM, Xiao et al.
//   2023, sec. 3.2; first_hi: Problem::key_ranges).
// An excluded score is -inf by select, never by addition, so a NaN computed from an excluded K
// row is discarded. Attention sinks (a logit per head in the denominator only) are no score:
// the online softmax joins them at the end of a row (online_softmax.hpp, join_sink), the split
// kernels as one more partial of the merge (lse_merge.hpp).
//
// ScoreRule<kMask, kSoftcap, kPosition> carries the per-call values (scale, softcap, the mask
// operand) and its options as compile-time flags, so a kernel is written once over its rule `R`
// and the branches of options it does not have vanish: a rule without kPosition compiles to the
// code it had before the position terms existed. with_score_rule() is the one switch from a
// call's run-time options to the rule type. The position terms of a row (keep-first range, ALiBi
// slope and diagonal) are per row, in a Position (workspace.hpp) the scalar form reads; the vector
// form reads them as float lanes, W rows at a time (PositionV), and gives the same bits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/problem.hpp"
#include "core/varlen_problem.hpp"
#include "kernels/engine/isa_ops.hpp"
#include "kernels/engine/workspace.hpp"

namespace qkv::detail::QKV_ENGINE_NS {

/// The position terms of W rows (a Position per lane, ScoreRule::position_lanes), for the
/// vector form.
template <IsaOps Ops>
struct PositionV {
  typename Ops::V first_hi, diag, slope;
  bool alibi;  // whether the call has ALiBi slopes (else the bias, exactly 0, is not computed)
  /// Lanes from the arrays of first_hi, diag and slope floats (W each).
  [[gnu::always_inline]] static PositionV load(const float* first_hi, const float* diag, const float* slope,
                                               bool alibi) {
    return {Ops::load(first_hi), Ops::load(diag), Ops::load(slope), alibi};
  }
};

template <bool kMask = false, bool kSoftcap = false, bool kPosition = false>
struct ScoreRule {
  static constexpr bool kHasMask = kMask;
  static constexpr bool kHasSoftcap = kSoftcap;
  static constexpr bool kHasPosition = kPosition;
  // Scores from raw dot products by the vector form: scale, key range and the position terms
  // (an explicit mask, and softcap's tanh from libm, take the scalar form).
  static constexpr bool kVectorForm = !kMask && !kSoftcap;
  // The vector form without position terms: no option at all (the kernels' plain fast paths).
  static constexpr bool kVector = kVectorForm && !kPosition;

  float scale, softcap;
  MaskOperand mask;

  explicit ScoreRule(const Problem& p)
      : scale(static_cast<float>(p.scale)), softcap(static_cast<float>(p.softcap)), mask(p.mask) {}

  // ---- per row ----------------------------------------------------------------------------------
  /// The admissible key range [lo, hi) of row i of batch b (lo >= hi: the row is empty).
  static void key_range(const Problem& p, i64 b, i64 i, i64& lo, i64& hi) { p.key_range(b, i, lo, hi); }
  /// The element offset of (b, h, i, 0) in the mask.
  static i64 mask_row(const Problem& p, i64 b, i64 h, i64 i) { return b * p.mask.sb + h * p.mask.sh + i * p.mask.sq; }
  /// Problem::key_ranges written inline: key_range's [lo, hi) and keep-first's [0, first_hi).
  /// (Calls of Problem's own would leave an out-of-line copy, a weak symbol shared by the ISA
  /// objects: scripts/check_isa_symbols.py.)
  [[gnu::always_inline]] static void key_ranges(const Problem& p, i64 b, i64 i, i64& lo, i64& hi, i64& first_hi) {
    const i64 len = p.kv_lens.empty() ? p.Sk : p.kv_lens[static_cast<std::size_t>(b)];
    const i64 d = p.align == Alignment::bottom_right ? i + len - p.Sq : i;  // the diagonal
    const i64 right = p.window_right < 0 ? len : std::min<i64>(len, d + p.window_right + 1);
    lo = p.window_left < 0 ? 0 : std::max<i64>(0, d - p.window_left);
    hi = right < lo ? lo : right;
    first_hi = std::max<i64>(0, std::min(p.keep_first, right));
  }
  /// The position terms of row i of batch b, head h (keep-first range, ALiBi slope, diagonal).
  static Position position(const Problem& p, i64 b, i64 h, i64 i) {
    Position ps;
    i64 lo, hi;
    key_ranges(p, b, i, lo, hi, ps.first_hi);
    ps.diag = p.diag(b, i) + p.alibi_diag_shift;
    ps.slope = p.alibi.empty() ? 0.0f : static_cast<float>(p.slope(b, h));
    return ps;
  }

  // ---- per row of a packed or paged batch (the serving item) ---------------------------------
  /// position() for query t of sequence b, head h, of a packed or paged call: the diagonal and
  /// keep-first's bound by the sequence's own query and key lengths (VarlenProblem), the slope
  /// by its row of [batch, Hq] slopes.
  [[gnu::always_inline]] static Position position(const VarlenProblem& vp, i64 b, i64 h, i64 t) {
    Position ps;
    ps.first_hi = vp.first_hi(b, t);
    ps.diag = vp.diag(b, t);
    ps.slope = vp.p.alibi.empty() ? 0.0f : static_cast<float>(vp.p.slope(b, h));
    return ps;
  }

  // ---- per tile ---------------------------------------------------------------------------------
  /// Whether rows whose ranges all contain [max_lo, min_hi) admit every key of [t0, t1) without
  /// a mask: such a tile needs no exclusion (keep-first only admits more keys; ALiBi's bias is
  /// still to add: biased, vec_full).
  static bool full(i64 t0, i64 t1, i64 max_lo, i64 min_hi) {
    return !kMask && t0 >= max_lo && t1 <= min_hi;
  }

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
    static_assert(!kPosition, "a rule with position terms takes the row's Position");
    float add = 0.0f;
    const bool ok = admits(g, lo, hi, mo, add);
    const float y = scaled(x);
    return ok ? y + add : -std::numeric_limits<float>::infinity();
  }

  // ---- scalar form with the position terms (any rule; kPosition reads ps) ---------------------
  /// admits() with keep-first: key g below hi and in [lo, hi) or [0, ps.first_hi).
  [[gnu::always_inline]] bool admits(i64 g, i64 lo, i64 hi, i64 mo, const Position& ps, float& add) const {
    if constexpr (!kPosition) return admits(g, lo, hi, mo, add);
    bool ok = g < hi && (g >= lo || g < ps.first_hi);
    if constexpr (kMask) ok = ok && mask_admits(mask, mo + g * mask.sk, add);
    return ok;
  }
  /// y (scaled()) plus ALiBi's bias for key g: y - slope |diag - g| (y itself without ALiBi:
  /// slope 0). Two roundings, the product's then the difference's (no FMA: the build sets
  /// -ffp-contract=off), exactly as biased_v rounds: the distance is exact as a float
  /// (position_exact), so both forms give the same bits.
  [[gnu::always_inline]] float biased(float y, i64 g, const Position& ps) const {
    if constexpr (kPosition) {
      const i64 dist = ps.diag > g ? ps.diag - g : g - ps.diag;
      return y - ps.slope * static_cast<float>(dist);
    }
    return y;
  }
  /// The score of raw dot product x for key g of a row with position terms ps (without a mask
  /// no + 0 is added: a -0 score stays -0, as in the vector form).
  [[gnu::always_inline]] float score(float x, i64 g, i64 lo, i64 hi, i64 mo, const Position& ps) const {
    if constexpr (!kPosition) return score(x, g, lo, hi, mo);
    float add = 0.0f;
    const bool ok = admits(g, lo, hi, mo, ps, add);
    float y = biased(scaled(x), g, ps);
    if constexpr (kMask) y = y + add;
    return ok ? y : -std::numeric_limits<float>::infinity();
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
    static_assert(!kMask && !kPosition, "an explicit mask takes the scalar form, position terms the PositionV form");
    return Ops::range_select(scale_v<Ops>(x), lo, hi, g);
  }

  // ---- vector form with the position terms (kVectorForm rules; any, without kPosition) -------
  /// Whether the position terms' vector form is exact for p: row diagonals, key indices and
  /// their distances all below 2^24 in magnitude, so exact as floats (|diag - g| <= Sq + Sk).
  static bool position_exact(const Problem& p) { return !kPosition || p.Sq + p.Sk < (i64{1} << 24); }
  /// A row's position terms as the floats of its lanes: first_hi, diag, slope (position_exact).
  static void position_lanes(const Position& ps, float& first_hi, float& diag, float& slope) {
    first_hi = static_cast<float>(ps.first_hi);
    diag = static_cast<float>(ps.diag);
    slope = ps.slope;
  }
  /// W scores (scaled) plus ALiBi's bias for key g: the operations of biased(), per lane.
  template <IsaOps Ops>
  [[gnu::always_inline]] typename Ops::V biased_v(typename Ops::V y, typename Ops::V g,
                                                  const PositionV<Ops>& ps) const {
    if constexpr (kPosition) {
      if (!ps.alibi) return y;  // y - 0 |diag - g| is y, bit for bit
      const typename Ops::V dist = Ops::max(Ops::sub(ps.diag, g), Ops::sub(g, ps.diag));  // exact
      return Ops::sub(y, Ops::mul(ps.slope, dist));
    }
    return y;
  }
  /// W scores of a full tile (every lane's key admitted): scaled and biased.
  template <IsaOps Ops>
  [[gnu::always_inline]] typename Ops::V vec_full(typename Ops::V x, typename Ops::V g,
                                                  const PositionV<Ops>& ps) const {
    static_assert(kVectorForm, "an explicit mask or softcap takes the scalar form");
    return biased_v<Ops>(scale_v<Ops>(x), g, ps);
  }
  /// W scores, scaled and biased, lanes whose key g is not admitted set to -inf: admitted as in
  /// admits(), g < hi and (g >= lo or g < first_hi). `first`: whether g may lie below some lane's
  /// first_hi (false: keep-first's keys are out of reach and the select is vec()'s).
  template <IsaOps Ops>
  [[gnu::always_inline]] typename Ops::V vec(typename Ops::V x, typename Ops::V lo, typename Ops::V hi,
                                             typename Ops::V g, const PositionV<Ops>& ps, bool first) const {
    static_assert(kVectorForm, "an explicit mask or softcap takes the scalar form");
    // Keep-first: a lane whose key lies below its first_hi takes lo = -inf (admitted up to hi),
    // the others keep lo; one more select, no new operation of the ISA.
    const typename Ops::V l = first ? Ops::range_select(lo, ps.first_hi, Ops::set1(kNoKey), g) : lo;
    return Ops::range_select(biased_v<Ops>(scale_v<Ops>(x), g, ps), l, hi, g);
  }
  // Above every key index (exact keys stay below 2^24).
  static constexpr float kNoKey = 1e30f;
};

/// Whether a call has position terms (ALiBi slopes or window_keep_first).
inline bool has_position(const Problem& p) { return !p.alibi.empty() || p.keep_first > 0; }

/// The one switch from a call's run-time options to its score rule: f.template operator()<R>().
/// kMasks = false for the kernels that take no explicit mask (serving), kPositions = false for
/// those that take no position terms (their gates refuse them), so that no such rule is
/// instantiated for them.
template <bool kMasks = true, bool kPositions = false, class F>
[[gnu::always_inline]] inline void with_score_rule(const Problem& p, F&& f) {
  const bool cap = p.softcap > 0.0;
  auto with_pos = [&]<bool kM, bool kC>() {
    if constexpr (kPositions) {
      if (has_position(p)) { f.template operator()<ScoreRule<kM, kC, true>>(); return; }
    }
    f.template operator()<ScoreRule<kM, kC, false>>();
  };
  if (kMasks && p.mask.data != nullptr) {
    if constexpr (kMasks) {
      if (cap) with_pos.template operator()<true, true>();
      else with_pos.template operator()<true, false>();
      return;
    }
  }
  if (cap) with_pos.template operator()<false, true>();
  else with_pos.template operator()<false, false>();
}

}  // namespace qkv::detail::QKV_ENGINE_NS
