#pragma once
#include "core/problem.hpp"

namespace qkv::detail {
/// The float64 reference kernel (src/reference/reference.cpp). Never throws.
void reference_kernel(const Problem& p);
}  // namespace qkv::detail
