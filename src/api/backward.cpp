// qkv::attention_backward and its explanation: lowered once to detail::BackwardProblem
// (src/core), the kernel chosen and run by the registry (src/dispatch).
#include "qkv/backward.hpp"

#include "core/validate.hpp"
#include "dispatch/dispatch.hpp"

namespace qkv {

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                        const TensorView& grad_k, const TensorView& grad_v, const AttentionParams& params) {
  const detail::BackwardProblem bp =
      detail::lower_attention_backward(q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, params);
  detail::run_call(detail::Call::backward(bp, params));
}

std::string explain_dispatch(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                             const TensorView& grad_k, const TensorView& grad_v, const AttentionParams& params) {
  const detail::BackwardProblem bp =
      detail::lower_attention_backward(q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, params);
  return detail::explain_call(detail::Call::backward(bp, params));
}

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                        const TensorView& grad_k, const TensorView& grad_v, const TensorView& grad_sinks,
                        const AttentionParams& params) {
  const detail::BackwardProblem bp =
      detail::lower_attention_backward(q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, grad_sinks, params);
  detail::run_call(detail::Call::backward(bp, params));
}

std::string explain_dispatch(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                             const TensorView& grad_k, const TensorView& grad_v, const TensorView& grad_sinks,
                             const AttentionParams& params) {
  const detail::BackwardProblem bp =
      detail::lower_attention_backward(q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, grad_sinks, params);
  return detail::explain_call(detail::Call::backward(bp, params));
}

}  // namespace qkv
