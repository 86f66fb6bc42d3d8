#pragma once
// Argument checks of attention_varlen, attention_varlen_backward and attention_paged
// (validate_varlen.cpp): each throws qkv::Error naming the argument, the expected and the actual
// shape or value.
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

/// The same over K and V in any format (qkv/kv_quant.hpp). Float K and V in one format of q's
/// dtype (varlen) or float pools in one format (paged) lower as the TensorView overloads, so that
/// they run as those do, any kernel included.
VarlenProblem lower_varlen(const TensorView& q, const QuantizedKV& k, const QuantizedKV& v, const TensorView& out,
                           const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                           const AttentionParams& params, const std::optional<TensorView>& softmax_lse);
VarlenProblem lower_paged(const TensorView& q, const QuantizedKV& k_pool, const QuantizedKV& v_pool,
                          const TensorView& out, const TensorView& cu_seqlens_q, const TensorView& seq_lens,
                          const TensorView& block_table, const AttentionParams& params,
                          const std::optional<TensorView>& softmax_lse);

/// attention_varlen_backward: lower_varlen's checks, the gradients' packed shapes, then each
/// sequence through lower_attention_backward on B = 1 views (its row of [batch, Hq] ALiBi
/// slopes), every one before any kernel runs; grad_sinks (optional) as lower_grad_sinks.
VarlenBackwardProblem lower_varlen_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                            const TensorView& out, const TensorView& softmax_lse,
                                            const TensorView& grad_out, const TensorView& grad_q,
                                            const TensorView& grad_k, const TensorView& grad_v,
                                            const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                                            const AttentionParams& params, const TensorView* grad_sinks = nullptr);

/// Sequence b of a lowered packed or paged call as a B = 1 dense problem: the Problem that
/// lower_attention gives for the [1, H, len, X] views of that sequence's q, out, softmax_lse and
/// (packed) k and v, its window clamped to the sequence's own Sq + Sk + 1 from `params`. Paged:
/// k and v still address the pools (the caller gathers them). No check: lowering the packed call
/// made them all.
Problem sequence_problem(const VarlenProblem& vp, std::int64_t b, const AttentionParams& params);

}  // namespace qkv::detail
