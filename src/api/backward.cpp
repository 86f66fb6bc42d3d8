// qkv::attention_backward: validate once, lower to detail::BackwardProblem, run a kernel.
#include "qkv/backward.hpp"

#include "core/validate.hpp"
#include "dispatch/dispatch.hpp"

namespace qkv {

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                        const TensorView& grad_k, const TensorView& grad_v, const AttentionParams& params) {
  const detail::BackwardProblem bp =
      detail::lower_attention_backward(q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, params);
  // Empty shapes need no special case: a call with Sq = 0 still writes dK = dV = 0.
  detail::run_backward(bp, params.kernel);
}

}  // namespace qkv
