// qkv::reference — the executable specification of attention.
//
// Algorithm: Vaswani et al. 2017, sec. 3.2.1, computed literally in float64, one query row at a
// time, with the five steps in order:
//   1. scores     s_j = q_i . k_j                       (dot product)
//   2. scale      s_j = scale * s_j                     (default 1/sqrt(D))
//      options    s_j = softcap * tanh(s_j / softcap)   (if softcap > 0)
//                 excluded keys removed; s_j += mask_j  (additive float mask)
//   3. softmax    alpha_j = exp(s_j - max) / sum_k exp(s_k - max)
//   4. weighted   z_i = sum_j alpha_j v_j
//   5. outputs    O_i = z_i, softmax_lse_i = max + log(sum)
// No SIMD, no threads, no blocking. Keys outside [lo, hi) (causal, window, key lengths) and keys
// a mask excludes are never read. Accuracy contract: exact up to float64 rounding.
#include "qkv/reference.hpp"

#include <cmath>
#include <limits>
#include <vector>

#include "core/problem.hpp"
#include "reference/reference_kernel.hpp"

namespace qkv::detail {
namespace {

// Loads n contiguous elements of any floating dtype as double.
void load_row(const void* base, DType dtype, std::int64_t offset, std::int64_t n, double* dst) {
  for (std::int64_t x = 0; x < n; ++x) dst[x] = load_as_double(base, dtype, offset + x);
}

// The explicit mask at (b, h, i, j): sets `attend` and the additive term.
void mask_at(const MaskOperand& m, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j,
             bool& attend, double& add) {
  attend = true;
  add = 0.0;
  if (!m.data) return;
  const std::int64_t off = b * m.sb + h * m.sh + i * m.sq + j * m.sk;
  if (m.dtype == DType::b8) {
    attend = static_cast<const std::uint8_t*>(m.data)[off] != 0;
  } else {
    add = load_as_double(m.data, m.dtype, off);
    attend = add != -std::numeric_limits<double>::infinity();
  }
}

}  // namespace

void reference_kernel(const Problem& p) {
  const double neg_inf = -std::numeric_limits<double>::infinity();
  std::vector<double> q(p.D), kj(p.D);
  std::vector<double> vj(p.Dv), z(p.Dv);
  std::vector<double> s(p.Sk), alpha(p.Sk);
  std::vector<bool> admitted(p.Sk);

  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h) {
      const std::int64_t hk = p.kv_head(h);
      for (std::int64_t i = 0; i < p.Sq; ++i) {
        load_row(p.q.data, p.q.dtype, b * p.q.sb + h * p.q.sh + i * p.q.ss, p.D, q.data());
        std::int64_t lo, hi;
        p.key_range(b, i, lo, hi);
        double row_max = neg_inf;
        for (std::int64_t j = 0; j < p.Sk; ++j) {
          bool attend = j >= lo && j < hi;
          double add = 0.0;
          if (attend) mask_at(p.mask, b, h, i, j, attend, add);
          admitted[j] = attend;
          if (!attend) continue;
          // Step 1: the dot product q_i . k_j.
          load_row(p.k.data, p.k.dtype, b * p.k.sb + hk * p.k.sh + j * p.k.ss, p.D, kj.data());
          double dot = 0.0;
          for (std::int64_t x = 0; x < p.D; ++x) dot += q[x] * kj[x];
          // Step 2: scaling, then softcap, then the additive mask.
          double sj = p.scale * dot;
          if (p.softcap > 0.0) sj = p.softcap * std::tanh(sj / p.softcap);
          sj += add;
          s[j] = sj;
          if (sj > row_max) row_max = sj;
          if (std::isnan(sj)) row_max = sj;  // NaN poisons its own row
        }
        // Step 3: softmax over the admitted keys.
        double sum = 0.0;
        const bool empty = row_max == neg_inf;
        for (std::int64_t j = 0; j < p.Sk; ++j) {
          alpha[j] = (!admitted[j] || empty) ? 0.0 : std::exp(s[j] - row_max);
          sum += alpha[j];
        }
        for (std::int64_t j = 0; j < p.Sk; ++j) alpha[j] = empty ? 0.0 : alpha[j] / sum;
        // Step 4: the weighted sum of the values.
        std::fill(z.begin(), z.end(), 0.0);
        for (std::int64_t j = 0; j < p.Sk && !empty; ++j) {
          if (!admitted[j]) continue;  // excluded keys are never read
          load_row(p.v.data, p.v.dtype, b * p.v.sb + hk * p.v.sh + j * p.v.ss, p.Dv, vj.data());
          for (std::int64_t x = 0; x < p.Dv; ++x) z[x] += alpha[j] * vj[x];
        }
        // Step 5: outputs.
        const std::int64_t o = b * p.out.sb + h * p.out.sh + i * p.out.ss;
        for (std::int64_t x = 0; x < p.Dv; ++x) store_from_double(p.out.data, p.out.dtype, o + x * p.out.sx, z[x]);
        if (p.lse.data)
          store_from_double(p.lse.data, p.lse.dtype, b * p.lse.sb + h * p.lse.sh + i * p.lse.ss,
                            empty ? neg_inf : row_max + std::log(sum));
        if (p.probs.data)
          for (std::int64_t j = 0; j < p.Sk; ++j)
            store_from_double(p.probs.data, p.probs.dtype,
                              b * p.probs.sb + h * p.probs.sh + i * p.probs.ss + j * p.probs.sx,
                              alpha[j]);
      }
    }
}

}  // namespace qkv::detail
