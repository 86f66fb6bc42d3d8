// qkv::reference — the executable specification of attention.
//
// Algorithm: Vaswani et al. 2017, sec. 3.2.1, computed literally in float64, one query row at a
// time, with the five steps in order:
//   1. scores     s_j = q_i . k_j                       (dot product)
//   2. scale      s_j = scale * s_j                     (default 1/sqrt(D))
//      options    s_j = softcap * tanh(s_j / softcap)   (if softcap > 0)
//                 s_j -= slope_h * |diag_i - j|         (ALiBi, diag_i: the causal diagonal)
//                 excluded keys removed; s_j += mask_j  (additive float mask)
//   3. softmax    alpha_j = exp(s_j - max) / (exp(z_h - max) + sum_k exp(s_k - max)),
//                 max over the s_k and the sink logit z_h (the sink term only with sinks)
//   4. weighted   z_i = sum_j alpha_j v_j               (the sink adds no value)
//      dropout    alpha_j * Z_ij / (1 - p) in place of alpha_j (Z_ij: the keep decision,
//                 core/dropout.hpp); softmax_lse and the weights stay those before dropout
//   5. outputs    O_i = z_i, softmax_lse_i = max + log(sum)
// No SIMD, no threads, no blocking. Keys outside [lo, hi) (causal, window, key lengths; with
// window_keep_first, also [0, first_hi)) and keys a mask excludes are never read. Accuracy
// contract: exact up to float64 rounding.
#include "reference/reference_kernel.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>

namespace qkv::detail {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// Loads n contiguous elements of any floating dtype as double.
void load_row(const void* base, DType dtype, std::int64_t offset, std::int64_t n, double* dst) {
  for (std::int64_t x = 0; x < n; ++x) dst[x] = load_as_double(base, dtype, offset + x);
}

// The explicit mask at (b, h, i, j): whether the key is attended, and the additive term.
bool mask_at(const MaskOperand& m, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j, double& add) {
  add = 0.0;
  if (!m.data) return true;
  const std::int64_t off = b * m.sb + h * m.sh + i * m.sq + j * m.sk;
  if (m.dtype == DType::b8) return static_cast<const std::uint8_t*>(m.data)[off] != 0;
  add = load_as_double(m.data, m.dtype, off);
  return add != kNegInf;
}

}  // namespace

ReferenceRows::ReferenceRows(const Problem& p)
    : p_(p), q_(p.D), k_(p.D), v_(p.Dv), s_(p.Sk), state_(p.Sk) {}

double ReferenceRows::run(std::int64_t b, std::int64_t h, std::int64_t i, double* alpha, double* z,
                          const RowSteps& steps) {
  const Problem& p = p_;
  const std::int64_t hk = p.kv_head(h);
  load_row(p.q.data, p.q.dtype, b * p.q.sb + h * p.q.sh + i * p.q.ss, p.D, q_.data());
  std::int64_t lo, hi, first_hi;
  p.key_ranges(b, i, lo, hi, first_hi);
  const bool sink = !p.sinks.empty();
  const double z_sink = sink ? p.sinks[static_cast<std::size_t>(h)] : kNegInf;
  double row_max = z_sink;
  for (std::int64_t j = 0; j < p.Sk; ++j) {
    KeyState& st = state_[j];
    s_[j] = kNegInf;
    if (steps.scores) steps.scores[j] = kNegInf;
    if ((j < lo && j >= first_hi) || j >= hi) {
      st = j >= p.key_len(b) ? KeyState::beyond_kv_len : KeyState::outside_window;
      continue;
    }
    double add = 0.0;
    st = mask_at(p.mask, b, h, i, j, add) ? KeyState::admitted : KeyState::masked;
    if (steps.mask_add && p.mask.data) steps.mask_add[j] = add;
    if (st != KeyState::admitted) continue;
    // Step 1: the dot product q_i . k_j.
    load_row(p.k.data, p.k.dtype, b * p.k.sb + hk * p.k.sh + j * p.k.ss, p.D, k_.data());
    double dot = 0.0;
    for (std::int64_t x = 0; x < p.D; ++x) dot += q_[x] * k_[x];
    if (steps.scores) steps.scores[j] = dot;
    // Step 2: scaling, then softcap, then the ALiBi bias, then the additive mask.
    double sj = p.scale * dot;
    if (p.softcap > 0.0) sj = p.softcap * std::tanh(sj / p.softcap);
    if (!p.alibi.empty()) sj -= p.slope(b, h) * static_cast<double>(std::abs(p.diag(b, i) + p.alibi_diag_shift - j));
    sj += add;
    s_[j] = sj;
    if (sj > row_max) row_max = sj;
    if (std::isnan(sj)) row_max = sj;  // NaN poisons its own row
  }
  if (steps.scaled) std::copy(s_.begin(), s_.end(), steps.scaled);
  if (steps.state) std::copy(state_.begin(), state_.end(), steps.state);
  // Step 3: softmax over the admitted keys and the sink (in the denominator only).
  const bool empty = row_max == kNegInf;
  double sum = sink && !empty ? std::exp(z_sink - row_max) : 0.0;
  const double sink_term = sum;
  for (std::int64_t j = 0; j < p.Sk; ++j) {
    alpha[j] = (state_[j] != KeyState::admitted || empty) ? 0.0 : std::exp(s_[j] - row_max);
    sum += alpha[j];
  }
  for (std::int64_t j = 0; j < p.Sk; ++j) alpha[j] = empty ? 0.0 : alpha[j] / sum;
  if (steps.sink) *steps.sink = sink && !empty ? sink_term / sum : 0.0;
  // Step 4: the weighted sum of the values.
  std::fill(z, z + p.Dv, 0.0);
  for (std::int64_t j = 0; j < p.Sk && !empty; ++j) {
    if (state_[j] != KeyState::admitted) continue;  // excluded keys are never read
    load_row(p.v.data, p.v.dtype, b * p.v.sb + hk * p.v.sh + j * p.v.ss, p.Dv, v_.data());
    // A dropped key still multiplies its value by 0, as a weight that underflows does (NaN stays).
    const double w = p.dropout.on() ? alpha[j] * p.dropout.factor(b, h, i, j) : alpha[j];
    for (std::int64_t x = 0; x < p.Dv; ++x) z[x] += w * v_[x];
  }
  // Step 5: softmax_lse.
  return empty ? kNegInf : row_max + std::log(sum);
}

void reference_kernel(const Problem& p) {
  ReferenceRows rows(p);
  std::vector<double> alpha(p.Sk), z(p.Dv);
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t i = 0; i < p.Sq; ++i) {
        const double lse = rows.run(b, h, i, alpha.data(), z.data());
        const std::int64_t o = b * p.out.sb + h * p.out.sh + i * p.out.ss;
        for (std::int64_t x = 0; x < p.Dv; ++x) store_from_double(p.out.data, p.out.dtype, o + x * p.out.sx, z[x]);
        if (p.lse.data) store_from_double(p.lse.data, p.lse.dtype, b * p.lse.sb + h * p.lse.sh + i * p.lse.ss, lse);
        if (p.probs.data)
          for (std::int64_t j = 0; j < p.Sk; ++j)
            store_from_double(p.probs.data, p.probs.dtype,
                              b * p.probs.sb + h * p.probs.sh + i * p.probs.ss + j * p.probs.sx, alpha[j]);
      }
}

}  // namespace qkv::detail
