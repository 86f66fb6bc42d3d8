#pragma once
// Argument checks of attention_varlen and attention_paged (validate_varlen.cpp): each throws
// qkv::Error naming the argument, the expected and the actual shape or value.
#include <optional>

#include "core/varlen_problem.hpp"

namespace qkv::detail {

VarlenProblem lower_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                           const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                           const AttentionParams& params, const std::optional<TensorView>& softmax_lse);

VarlenProblem lower_paged(const TensorView& q, const TensorView& k_pool, const TensorView& v_pool, const TensorView& out,
                          const TensorView& cu_seqlens_q, const TensorView& seq_lens, const TensorView& block_table,
                          const AttentionParams& params, const std::optional<TensorView>& softmax_lse);

}  // namespace qkv::detail
