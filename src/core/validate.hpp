#pragma once
// Argument checks of the public attention entry points and lowering to detail::Problem.
#include <initializer_list>
#include <optional>
#include <utility>

#include "core/problem.hpp"

namespace qkv::detail {

/// Throws qkv::Error unless `t` is a valid 4-D operand (rank 4, sizes and strides whose extent
/// fits int64, a data pointer, a contiguous last dimension), e.g. "q: expected a 4-D tensor
/// [B,Hq,Sq,D], got rank 3 with shape [2,3,4]".
void check_rank4(const TensorView& t, const char* name, const char* axes);

/// The checks check_rank4 and lower_attention make, one at a time (validate.cpp), for entry points
/// whose operands are not 4-D (attention_varlen, attention_paged): the element count and the
/// strides' byte extent fit int64; a data pointer unless empty; no zero stride on an axis of
/// size > 1 (outputs); no byte shared between an output and another operand.
void check_sizes(const TensorView& t, const char* name);
void check_data(const TensorView& t, const char* name);
void check_distinct(const TensorView& t, const char* name);
void check_no_overlap(const TensorView& out, const char* oname, const TensorView& in, const char* iname);

/// Validates one attention call and lowers it. Throws qkv::Error naming the argument, the
/// expected and the actual shape or value.
Problem lower_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const AttentionParams& params,
                        const std::optional<TensorView>& softmax_lse,
                        const std::optional<TensorView>& probs);

/// Validates one backward call (qkv::attention_backward) and lowers it: the forward's checks
/// for q, k, v, out, softmax_lse (required) and params, then grad_out (the shape of out, any
/// float dtype), grad_q/grad_k/grad_v (the shapes of q/k/v, the dtype of q, float32 or float64, distinct
/// elements, memory disjoint from every other operand). Throws qkv::Error like lower_attention.
BackwardProblem lower_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                         const TensorView& out, const TensorView& softmax_lse,
                                         const TensorView& grad_out, const TensorView& grad_q,
                                         const TensorView& grad_k, const TensorView& grad_v,
                                         const AttentionParams& params);

/// The score options of `params` (sinks, alibi_slopes, window_keep_first, dropout) checked and
/// lowered into `p` (whose Hq and Sk are set): sinks float32 [Hq]; alibi_slopes float32 [Hq] or
/// [batch, Hq]; both contiguous and finite; window_keep_first >= 0; dropout_p in [0, 1). lower_attention calls it
/// with batch = B; packed calls with their number of sequences (lower_alibi alone, after
/// lowering the rest without the slopes).
void lower_score_options(Problem& p, const AttentionParams& params, std::int64_t batch);
void lower_alibi(Problem& p, const TensorView& slopes, std::int64_t batch);
/// Throws qkv::Error naming dropout_p unless it is in [0, 1) (NaN refused).
void check_dropout_p(double p);

/// lower_attention_backward, then grad_sinks through lower_grad_sinks (the grad_sinks overloads
/// of qkv::attention_backward and qkv::reference::attention_backward).
BackwardProblem lower_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                         const TensorView& out, const TensorView& softmax_lse,
                                         const TensorView& grad_out, const TensorView& grad_q,
                                         const TensorView& grad_k, const TensorView& grad_v,
                                         const TensorView& grad_sinks, const AttentionParams& params);

/// grad_sinks of the backward's sinks overloads checked (params.sinks given, float32 [Hq],
/// contiguous, disjoint from `others` and from the options' tensors) and set in bp.dsinks.
void lower_grad_sinks(BackwardProblem& bp, const TensorView& grad_sinks, const AttentionParams& params,
                      std::initializer_list<std::pair<const TensorView*, const char*>> others);

}  // namespace qkv::detail
