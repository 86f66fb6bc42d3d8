// qkv::attention_backward: validate once, lower to detail::BackwardProblem, run a kernel.
#include "qkv/backward.hpp"

#include <string>

#include "core/validate.hpp"
#include "qkv/error.hpp"
#include "reference/reference_kernel.hpp"

namespace qkv {

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                        const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                        const TensorView& grad_k, const TensorView& grad_v, const AttentionParams& params) {
  const detail::BackwardProblem bp =
      detail::lower_attention_backward(q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, params);
  if (params.kernel == KernelKind::flash || params.kernel == KernelKind::decode)
    throw Error(std::string("kernel: expected automatic or reference for the backward pass, got '") +
                (params.kernel == KernelKind::flash ? "flash" : "decode") + "'");
  detail::reference_backward(bp);
}

}  // namespace qkv
