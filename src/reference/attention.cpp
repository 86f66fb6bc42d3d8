// qkv::reference::attention: the public door to the float64 specification (reference.cpp).
#include "qkv/reference.hpp"

#include "core/validate.hpp"
#include "reference/reference_kernel.hpp"

namespace qkv {

namespace reference {

void attention(const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& out, const AttentionParams& params,
               const std::optional<TensorView>& softmax_lse,
               const std::optional<TensorView>& probs) {
  const detail::Problem p = detail::lower_attention(q, k, v, out, params, softmax_lse, probs);
  if (p.B == 0 || p.Hq == 0 || p.Sq == 0) return;
  detail::reference_kernel(p);
}

}  // namespace reference

}  // namespace qkv
