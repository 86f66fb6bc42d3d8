// qkv::reference::attention_backward — the executable specification of the backward pass.
//
// The derivative of the five steps of reference.cpp, written literally in float64, one query
// row at a time (the forward row is recomputed by the same ReferenceRows, so P and O are the
// specification's own). For row i of head h (KV head hk) with weights P_i, output O_i, dO_i and
// dropout factors F_ij = Z_ij / (1 - p) (1 without dropout; the same decisions as the forward's,
// regenerated from the seed, core/dropout.hpp):
//   dV_j   += P_ij F_ij dO_i                 (dV = (P o F)^T dO)
//   dP_ij   = F_ij dO_i . v_j                (dP = dO V^T o F)
//   D_i     = dO_i . O_i                     (rowsum(dO * O), O after dropout)
//   dS_ij   = P_ij (dP_ij - D_i)             (softmax backward: the gradient of the logits)
//   dX_ij   = dS_ij (1 - tanh^2(x_ij / c))   (softcap c > 0, x_ij = scale q_i.k_j; the
//                                             additive mask has derivative 1)
//   dQ_i   += scale dX_ij k_j,  dK_j += scale dX_ij q_i
// over the keys j the row admits; the others have P_ij = 0 and are never read. GQA: dK and dV
// of a KV head sum over the query heads of its group (and every row), in the order b, h, i.
// Sinks: the sink's logit z_h has weight P_i,sink in the denominator and no value (dP = 0), so
// D_i and dS above are unchanged and dz_h = -sum_{b,i} P_i,sink D_i. ALiBi's bias and the
// mask add constants: their derivative is 1 and they take no gradient.
// Checked against central finite differences of the float64 forward
// (tests/test_backward_reference.cpp).
#include <cmath>
#include <vector>

#include "core/validate.hpp"
#include "qkv/reference.hpp"
#include "reference/reference_kernel.hpp"

namespace qkv::detail {

void reference_backward(const BackwardProblem& bp) {
  const Problem& p = bp.fwd;
  const auto at = [](std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t H, std::int64_t S,
                     std::int64_t X) { return static_cast<std::size_t>(((b * H + h) * S + s) * X); };
  std::vector<double> dk(static_cast<std::size_t>(p.B * p.Hkv * p.Sk * p.D), 0.0);
  std::vector<double> dv(static_cast<std::size_t>(p.B * p.Hkv * p.Sk * p.Dv), 0.0);
  std::vector<double> alpha(p.Sk), o(p.Dv), dout(p.Dv), q(p.D), kj(p.D), vj(p.Dv), dq(p.D);
  std::vector<double> scores(p.Sk);
  std::vector<KeyState> state(p.Sk);
  std::vector<double> dz(static_cast<std::size_t>(p.Hq), 0.0);
  double sink = 0.0;
  ReferenceRows rows(p);
  RowSteps steps;
  steps.scores = scores.data();
  steps.state = state.data();
  steps.sink = &sink;

  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h) {
      const std::int64_t hk = p.kv_head(h);
      for (std::int64_t i = 0; i < p.Sq; ++i) {
        rows.run(b, h, i, alpha.data(), o.data(), steps);
        for (std::int64_t x = 0; x < p.Dv; ++x)
          dout[x] = load_as_double(bp.dout.data, bp.dout.dtype, b * bp.dout.sb + h * bp.dout.sh + i * bp.dout.ss + x);
        for (std::int64_t x = 0; x < p.D; ++x)
          q[x] = load_as_double(p.q.data, p.q.dtype, b * p.q.sb + h * p.q.sh + i * p.q.ss + x);
        std::fill(dq.begin(), dq.end(), 0.0);
        // D_i = dO_i . O_i
        double Di = 0.0;
        for (std::int64_t x = 0; x < p.Dv; ++x) Di += dout[x] * o[x];
        dz[static_cast<std::size_t>(h)] -= sink * Di;
        for (std::int64_t j = 0; j < p.Sk; ++j) {
          if (state[j] != KeyState::admitted) continue;  // never read: P_ij = 0, nothing flows
          for (std::int64_t x = 0; x < p.Dv; ++x)
            vj[x] = load_as_double(p.v.data, p.v.dtype, b * p.v.sb + hk * p.v.sh + j * p.v.ss + x);
          for (std::int64_t x = 0; x < p.D; ++x)
            kj[x] = load_as_double(p.k.data, p.k.dtype, b * p.k.sb + hk * p.k.sh + j * p.k.ss + x);
          // dV_j += P_ij F_ij dO_i;  dP_ij = F_ij dO_i . v_j
          const double f = p.dropout.on() ? p.dropout.factor(b, h, i, j) : 1.0;
          const double pf = p.dropout.on() ? alpha[j] * f : alpha[j];
          double dP = 0.0;
          double* dvj = &dv[at(b, hk, j, p.Hkv, p.Sk, p.Dv)];
          for (std::int64_t x = 0; x < p.Dv; ++x) {
            dvj[x] += pf * dout[x];
            dP += dout[x] * vj[x];
          }
          if (p.dropout.on()) dP *= f;
          // dS_ij = P_ij (dP_ij - D_i), through softcap to the scaled score.
          double dS = alpha[j] * (dP - Di);
          if (p.softcap > 0.0) {
            const double t = std::tanh(p.scale * scores[j] / p.softcap);
            dS *= 1.0 - t * t;
          }
          // dQ_i += scale dS_ij k_j;  dK_j += scale dS_ij q_i
          double* dkj = &dk[at(b, hk, j, p.Hkv, p.Sk, p.D)];
          for (std::int64_t x = 0; x < p.D; ++x) {
            dq[x] += p.scale * dS * kj[x];
            dkj[x] += p.scale * dS * q[x];
          }
        }
        for (std::int64_t x = 0; x < p.D; ++x)
          store_from_double(bp.dq.data, bp.dq.dtype, b * bp.dq.sb + h * bp.dq.sh + i * bp.dq.ss + x * bp.dq.sx, dq[x]);
      }
    }
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t hk = 0; hk < p.Hkv; ++hk)
      for (std::int64_t j = 0; j < p.Sk; ++j) {
        for (std::int64_t x = 0; x < p.D; ++x)
          store_from_double(bp.dk.data, bp.dk.dtype, b * bp.dk.sb + hk * bp.dk.sh + j * bp.dk.ss + x * bp.dk.sx,
                            dk[at(b, hk, j, p.Hkv, p.Sk, p.D) + x]);
        for (std::int64_t x = 0; x < p.Dv; ++x)
          store_from_double(bp.dv.data, bp.dv.dtype, b * bp.dv.sb + hk * bp.dv.sh + j * bp.dv.ss + x * bp.dv.sx,
                            dv[at(b, hk, j, p.Hkv, p.Sk, p.Dv) + x]);
      }
  if (bp.dsinks.data)
    for (std::int64_t h = 0; h < p.Hq; ++h)
      store_from_double(bp.dsinks.data, bp.dsinks.dtype, h * bp.dsinks.sx, dz[static_cast<std::size_t>(h)]);
}

}  // namespace qkv::detail

namespace qkv::reference {

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                        const TensorView& grad_k, const TensorView& grad_v, const AttentionParams& params) {
  const detail::BackwardProblem bp =
      detail::lower_attention_backward(q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, params);
  detail::reference_backward(bp);
}

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                        const TensorView& grad_k, const TensorView& grad_v, const TensorView& grad_sinks,
                        const AttentionParams& params) {
  detail::reference_backward(detail::lower_attention_backward(q, k, v, out, softmax_lse, grad_out, grad_q, grad_k,
                                                              grad_v, grad_sinks, params));
}

}  // namespace qkv::reference
