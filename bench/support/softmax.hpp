#pragma once
// Row softmax of the naive baseline, compiled twice: for AVX-512 and for the build's baseline
// ISA, both with -ffast-math so that expf vectorises through glibc's libmvec.
#include <cstdint>

namespace qkv::bench::detail {

/// row[0..n) <- softmax(row[0..keep)) with row[keep..n) set to 0 (causal masking: only the
/// first `keep` keys are admissible). keep == 0 gives a zero row.
void softmax_row_generic(float* row, std::int64_t keep, std::int64_t n) noexcept;
void softmax_row_avx512(float* row, std::int64_t keep, std::int64_t n) noexcept;

}  // namespace qkv::bench::detail
