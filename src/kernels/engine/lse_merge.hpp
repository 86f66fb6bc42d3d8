#pragma once
// The log-sum-exp merge of split partials (flash-decoding, Dao, Haziza, Massa, Sizov 2023): the
// one place that combines the partial softmaxes of the splits of a row's keys.
//
// LseMerge: partials c = 0 .. n - 1 of one row, each an unnormalised O_c (d values), its running
// max m_c and sum l_c (the online softmax's state, online_softmax.hpp), merged in the fixed
// order of c in float64,
//   M = max_c m_c, L = sum_c l_c e^{m_c - M}, O = sum_c O_c e^{m_c - M} / L, lse = M + log L,
// over the partials that admitted a key (l_c != 0), rounded once to fp32. A NaN l_c makes the
// row NaN; a row no partial admitted anything to is empty: O = 0, lse = -inf. An attention sink
// z (a logit in the denominator only) joins as one more partial, once per row whatever the
// number of splits: m = z, l = 1, O = 0; a row with nothing else admitted then has O = 0 and
// lse = z. Used by the decode driver (forward_schedule.hpp, key chunks) and the serving kernel
// (serving.cpp, key splits).
//
// lse_weight: the weight of a normalised partial against the max of all, for a merge whose sum
// runs elsewhere (src/dist's decode: a max and a gather across ranks, summed in rank order).
//
// lse_merge_pair: the streaming form, for partials already normalised (o_b, lse_b) folded one at
// a time into an accumulator (o_a, lse_a): w = e^{lse - max}, o_a = (w_a o_a + w_b o_b) / (w_a +
// w_b), lse_a = max + log(w_a + w_b) (float64 weights, fp32 stored between steps); lse_b = -inf
// adds nothing, lse_a = -inf takes b as it is. Used by the ring attention of src/dist.
//
// ISA-independent scalar code (exp and log from libm, float64 sums: the same bits on every ISA).
// It lives in the including engine's namespace where there is one (QKV_ENGINE_NS, engine.hpp),
// so no inline function is shared between translation units compiled for different ISAs, and
// in qkv::detail otherwise.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#ifdef QKV_ENGINE_NS
namespace qkv::detail::QKV_ENGINE_NS {
#else
namespace qkv::detail {
#endif

class LseMerge {
 public:
  /// `acc`: scratch of d doubles, the merged sum before its division.
  LseMerge(double* acc, std::int64_t d) : acc_(acc), d_(d) {}

  /// Merges the n partials part(c) (c ascending; a pointer to d values O_c, and at index
  /// m_at the pair m_c, l_c), and the sink z when given (not -inf).
  template <class Part>
  [[gnu::always_inline]] void run(std::int64_t n, std::int64_t m_at, Part&& part,
                                  float sink = -std::numeric_limits<float>::infinity()) {
    mx_ = -std::numeric_limits<double>::infinity();
    any_ = nan_ = sink_only_ = false;
    for (std::int64_t c = 0; c < n; ++c) {
      const float* x = part(c);
      if (x[m_at + 1] == 0.0f) continue;  // a split with no admissible key
      any_ = true;
      nan_ = nan_ || std::isnan(x[m_at + 1]);
      mx_ = std::max(mx_, static_cast<double>(x[m_at]));
    }
    // In float64 (a few vectors per row: cheap), so the merge adds no rounding but the last.
    for (std::int64_t i = 0; i < d_; ++i) acc_[i] = 0.0;
    lsum_ = 0.0;
    if (sink != -std::numeric_limits<float>::infinity()) {
      if (!any_) {  // only the sink: O = 0, lse = z
        sink_only_ = true;
        mx_ = sink;
        return;
      }
      mx_ = std::max(mx_, static_cast<double>(sink));
      if (!nan_) lsum_ = std::exp(static_cast<double>(sink) - mx_);
    }
    if (!any_ || nan_) return;
    for (std::int64_t c = 0; c < n; ++c) {
      const float* x = part(c);
      if (x[m_at + 1] == 0.0f) continue;
      const double a = std::exp(static_cast<double>(x[m_at]) - mx_);
      lsum_ += a * x[m_at + 1];
      for (std::int64_t i = 0; i < d_; ++i) acc_[i] += a * x[i];
    }
  }

  /// Whether no partial admitted a key (O = 0, lse = -inf).
  bool empty() const { return !any_; }
  /// O_i, rounded once.
  float out(std::int64_t i) const {
    return nan_ ? std::numeric_limits<float>::quiet_NaN() : any_ ? static_cast<float>(acc_[i] / lsum_) : 0.0f;
  }
  /// softmax_lse of the row.
  float lse() const {
    if (sink_only_) return static_cast<float>(mx_);
    return !any_ ? -std::numeric_limits<float>::infinity()
                 : nan_ ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(mx_ + std::log(lsum_));
  }

 private:
  double* acc_;
  std::int64_t d_;
  double mx_ = 0.0, lsum_ = 0.0;
  bool any_ = false, nan_ = false, sink_only_ = false;
};

/// The weight e^{lse - m} of a normalised partial against the row's max m over all partials
/// (float64 exp, rounded to fp32), 0 for a partial that admitted nothing (lse = -inf). The
/// weighted partials sum to the merge: O = sum w O_p / sum w, lse = m + log sum w (src/dist's
/// decode, whose sum runs across ranks).
inline float lse_weight(float lse, float m) {
  return lse == -std::numeric_limits<float>::infinity() ? 0.0f
                                                         : static_cast<float>(std::exp(static_cast<double>(lse) - m));
}

/// Folds the normalised partial (ob, lb) of a row into (oa, la), d values each (see above).
inline void lse_merge_pair(float* oa, float& la, const float* ob, float lb, std::int64_t d) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  if (lb == kNegInf) return;  // the row admits no key of this partial
  if (la == kNegInf) {
    la = lb;
    std::copy(ob, ob + d, oa);
    return;
  }
  const float m = la > lb ? la : lb;  // NaN in either makes the row NaN below
  const double wa = std::exp(static_cast<double>(la) - m), wb = std::exp(static_cast<double>(lb) - m);
  const double sum = wa + wb;
  for (std::int64_t x = 0; x < d; ++x) oa[x] = static_cast<float>((wa * oa[x] + wb * ob[x]) / sum);
  la = static_cast<float>(m + std::log(sum));
}

}  // namespace
