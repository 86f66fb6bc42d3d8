// qkv::attention and its explanation: lowered once (src/core), the kernel chosen and run by the
// registry (src/dispatch).
#include "qkv/attention.hpp"

#include "core/validate.hpp"
#include "dispatch/dispatch.hpp"

namespace qkv {

void attention(const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& out, const AttentionParams& params,
               const std::optional<TensorView>& softmax_lse,
               const std::optional<TensorView>& probs) {
  const detail::Problem p = detail::lower_attention(q, k, v, out, params, softmax_lse, probs);
  detail::run_call(detail::Call::forward(p, params));
}

std::string explain_dispatch(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const AttentionParams& params,
                             const std::optional<TensorView>& softmax_lse,
                             const std::optional<TensorView>& probs) {
  const detail::Problem p = detail::lower_attention(q, k, v, out, params, softmax_lse, probs);
  return detail::explain_call(detail::Call::forward(p, params));
}

}  // namespace qkv
