#pragma once
// Argument checks of the public attention entry points and lowering to detail::Problem.
#include <optional>

#include "core/problem.hpp"

namespace qkv::detail {

/// Validates one attention call and lowers it. Throws qkv::Error naming the argument, the
/// expected and the actual shape or value.
Problem lower_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const AttentionParams& params,
                        const std::optional<TensorView>& softmax_lse,
                        const std::optional<TensorView>& probs);

}  // namespace qkv::detail
