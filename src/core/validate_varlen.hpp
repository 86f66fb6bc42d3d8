#pragma once
// Argument checks of attention_varlen and attention_paged (validate_varlen.cpp): each throws
// qkv::Error naming the argument, the expected and the actual shape or value.
#include <optional>

#include "core/varlen_problem.hpp"
#include "qkv/kv_quant.hpp"

namespace qkv::detail {

VarlenProblem lower_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                           const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                           const AttentionParams& params, const std::optional<TensorView>& softmax_lse);

VarlenProblem lower_paged(const TensorView& q, const TensorView& k_pool, const TensorView& v_pool, const TensorView& out,
                          const TensorView& cu_seqlens_q, const TensorView& seq_lens, const TensorView& block_table,
                          const AttentionParams& params, const std::optional<TensorView>& softmax_lse);

/// The same over K and V in any format (qkv/kv_quant.hpp); float formats lower as above.
VarlenProblem lower_varlen(const TensorView& q, const QuantizedKV& k, const QuantizedKV& v, const TensorView& out,
                           const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                           const AttentionParams& params, const std::optional<TensorView>& softmax_lse);
VarlenProblem lower_paged(const TensorView& q, const QuantizedKV& k_pool, const QuantizedKV& v_pool,
                          const TensorView& out, const TensorView& cu_seqlens_q, const TensorView& seq_lens,
                          const TensorView& block_table, const AttentionParams& params,
                          const std::optional<TensorView>& softmax_lse);

}  // namespace qkv::detail
