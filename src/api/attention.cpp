// qkv::attention and its explanation: lowered once (src/core), the kernel chosen and run by the
// registry (src/dispatch).
#include "qkv/attention.hpp"

#include <cmath>

#include "core/validate.hpp"
#include "dispatch/dispatch.hpp"
#include "qkv/error.hpp"

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

// Press et al. 2022, sec. 3, and BLOOM's build_alibi_tensor: a geometric sequence starting at
// 2^(-8/n) for a power of two n; otherwise the largest power of two c below n, then the odd
// powers of 2^(-4/c) (every other slope of 2c heads) for the n - c heads left.
std::vector<float> alibi_slopes(std::int64_t num_heads) {
  if (num_heads < 0) throw Error("num_heads: expected >= 0, got " + std::to_string(num_heads));
  std::vector<float> out;
  if (num_heads == 0) return out;
  std::int64_t c = 1;
  while (c * 2 <= num_heads) c *= 2;
  const double base = std::exp2(-8.0 / static_cast<double>(c));
  for (std::int64_t i = 1; i <= c; ++i) out.push_back(static_cast<float>(std::pow(base, static_cast<double>(i))));
  const double extra = std::exp2(-4.0 / static_cast<double>(c));
  for (std::int64_t i = 1; i <= num_heads - c; ++i)
    out.push_back(static_cast<float>(std::pow(extra, static_cast<double>(2 * i - 1))));
  return out;
}

}  // namespace qkv
