#pragma once
// The serving kernel's work items (serving.cpp drives them; serving_item.hpp is their body, compiled
// once per ISA level in src/kernels/simd/<isa>/serving_<isa>.cpp).
#include <algorithm>
#include <cstdint>

#include "core/varlen_problem.hpp"
#include "kernels/kernels.hpp"

namespace qkv::detail {

/// Tokens t0 .. t0 + nt - 1 of sequence b, all query heads of KV head hk; cost orders the items.
struct ServingItem { std::int64_t b, hk, t0, nt, cost; };
/// One row of an item: element offsets of its query, output and lse, its key range [lo, hi).
struct ServingRow { std::int64_t q_off, out_off, lse_off, lo, hi; };

/// Tokens per work item: the query heads of one KV head times the tokens make up to 16 rows.
inline std::int64_t tile_tokens(const Problem& p) { return std::max<std::int64_t>(1, 16 / std::max<std::int64_t>(p.group(), 1)); }

/// Workspace of one thread: rows (at most), splits (at most) per row, D, Dv.
struct ServingLayout {
  std::int64_t rows, nsplit, D, Dv;
  std::int64_t bytes() const {
    const std::int64_t floats = rows * D + rows * (kServingSplit + 16) + rows * nsplit * (Dv + 2) + 4 * D + 4 * Dv + 2 * (Dv + 2);
    return (floats * 4 + rows * static_cast<std::int64_t>(sizeof(ServingRow)) + 8 * 64 + 63) / 64 * 64;
  }
};

using ServingItemFn = void (*)(const VarlenProblem&, const ServingItem&, const ServingLayout&, char*);
#if defined(QKV_HAVE_AVX512)
void serving_item_avx512(const VarlenProblem& vp, const ServingItem& it, const ServingLayout& L, char* ws);
#endif
#if defined(QKV_HAVE_AVX2)
void serving_item_avx2(const VarlenProblem& vp, const ServingItem& it, const ServingLayout& L, char* ws);
#endif
void serving_item_scalar(const VarlenProblem& vp, const ServingItem& it, const ServingLayout& L, char* ws);

}  // namespace qkv::detail
