#pragma once
/// @file reference.hpp
/// qkv::reference: the executable specification of attention.
///
/// float64, plain loops, no SIMD, no threads: the five steps in the order of
/// Vaswani et al. 2017, sec. 3.2.1: (1) scores q_i.k_j, (2) scaling, then the options (softcap,
/// ALiBi, masks), (3) row softmax, (4) weighted sum of the values (with dropout_p > 0, of the kept weights rescaled). Every option of AttentionParams is
/// implemented literally. It is the judge of every fast kernel; see docs/semantics.md.

#include <optional>

#include "qkv/attention.hpp"

namespace qkv::reference {

/// Same arguments, shapes, dtypes and errors as qkv::attention(); always runs in float64.
void attention(const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& out, const AttentionParams& params = {},
               const std::optional<TensorView>& softmax_lse = std::nullopt,
               const std::optional<TensorView>& probs = std::nullopt);

/// Same arguments, shapes, dtypes and errors as qkv::attention_backward() (backward.hpp); the
/// derivative of the five steps written literally in float64 (src/reference/backward.cpp). It
/// recomputes P and O in float64 from q, k, v and reads neither `out` nor `softmax_lse`
/// (they are validated like the fast path's).
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& softmax_lse, const TensorView& grad_out,
                        const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                        const AttentionParams& params = {});
/// The same, also writing grad_sinks = dL/dz (float32 [Hq]) for params.sinks, as the grad_sinks
/// overload of qkv::attention_backward() (backward.hpp).
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& softmax_lse, const TensorView& grad_out,
                        const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                        const TensorView& grad_sinks, const AttentionParams& params);

}  // namespace qkv::reference
