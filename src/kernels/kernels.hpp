#pragma once
// Registry hooks of the fast kernels (dispatch.cpp lists them in priority order).
#include <string>

#include "core/problem.hpp"
#include "core/varlen_problem.hpp"

namespace qkv::detail {

std::string flash_refuse(const Problem& p);
void flash_kernel(const Problem& p);
std::string flash_describe();

std::string decode_refuse(const Problem& p);
void decode_kernel(const Problem& p);
std::string decode_describe();

std::string flash_backward_refuse(const BackwardProblem& bp);
void flash_backward_kernel(const BackwardProblem& bp);
/// dL/dz of the sink logits into bp.dsinks (when given): - sum_{b,i} e^{z_h - lse_i} D_i, from
/// O, dO and softmax_lse in float64, in the order h, b, i (sink_grad.cpp). Every fast backward
/// calls it after its gradients.
void sink_gradient(const BackwardProblem& bp);

/// The serving kernel (serving.cpp): attention_varlen and attention_paged, batch invariant.
void serving_kernel(const VarlenProblem& vp);
/// Keys per split of the serving kernel, at absolute key positions (part of its arithmetic).
inline constexpr std::int64_t kServingSplit = 1024;

/// Largest Sq the decode kernel takes.
inline constexpr std::int64_t kDecodeMaxSq = 16;

}  // namespace qkv::detail
