// Public entry points: validate once, lower to detail::Problem, dispatch.
#include "qkv/attention.hpp"

#include "core/validate.hpp"
#include "dispatch/dispatch.hpp"
#include "reference/reference_kernel.hpp"

namespace qkv {

void attention(const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& out, const AttentionParams& params,
               const std::optional<TensorView>& softmax_lse,
               const std::optional<TensorView>& probs) {
  const detail::Problem p = detail::lower_attention(q, k, v, out, params, softmax_lse, probs);
  const detail::Choice c = detail::choose_kernel(p, params.kernel);
  if (p.B == 0 || p.Hq == 0 || p.Sq == 0) return;  // empty output: nothing to compute
  if (!p.probs.data || c.kernel->kind == KernelKind::reference) {
    c.kernel->run(p);
    return;
  }
  // The fast kernels never form the Sq x Sk weights, so asking for them must not change O or
  // softmax_lse: the chosen kernel computes those, and the reference fills probs in a second
  // pass (its own O goes to a scratch buffer).
  detail::Problem fast = p;
  fast.probs = {};
  c.kernel->run(fast);
  Tensor scratch(DType::f64, {p.B, p.Hq, p.Sq, p.Dv});
  detail::Problem weights = p;
  weights.lse = {};
  weights.out = {scratch.data(), DType::f64, p.Hq * p.Sq * p.Dv, p.Sq * p.Dv, p.Dv, 1};
  detail::reference_kernel(weights);
}

std::string explain_dispatch(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const AttentionParams& params,
                             const std::optional<TensorView>& softmax_lse,
                             const std::optional<TensorView>& probs) {
  const detail::Problem p = detail::lower_attention(q, k, v, out, params, softmax_lse, probs);
  return detail::choose_kernel(p, params.kernel).explanation;
}

}  // namespace qkv
