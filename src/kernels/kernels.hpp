#pragma once
// Registry hooks of the fast kernels (dispatch.cpp lists them in priority order).
#include <string>

#include "core/problem.hpp"

namespace qkv::detail {

std::string flash_refuse(const Problem& p);
void flash_kernel(const Problem& p);
std::string flash_describe();

std::string decode_refuse(const Problem& p);
void decode_kernel(const Problem& p);
std::string decode_describe();

std::string flash_backward_refuse(const BackwardProblem& bp);
void flash_backward_kernel(const BackwardProblem& bp);

/// Largest Sq the decode kernel takes.
inline constexpr std::int64_t kDecodeMaxSq = 16;

}  // namespace qkv::detail
