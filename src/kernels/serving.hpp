#pragma once
// The serving kernel's work items: serving.cpp makes and orders them and merges their partials;
// their body is engine/serving_item.hpp (on engine/serving_rows.hpp), compiled once per ISA level in
// src/kernels/simd/<isa>/engine_<isa>.cpp and reached through IsaKernels::serving_item.
#include <algorithm>
#include <cstdint>

#include "core/varlen_problem.hpp"
#include "kernels/kernels.hpp"

namespace qkv::detail {

/// Tokens t0 .. t0 + nt - 1 of sequence b, all query heads of KV heads hk .. hk + nh - 1, against
/// the keys of split c; cost orders the items.
struct ServingItem { std::int64_t b, hk, nh, t0, nt, c, cost; };

/// Rows of one work item, at most: tokens times query heads.
inline constexpr std::int64_t kServingRows = 32;

/// Workspace of one thread: rows (at most), D, Dv.
struct ServingLayout {
  std::int64_t rows, D, Dv;
  std::int64_t bytes() const {
    const std::int64_t Dp = (D + 15) / 16 * 16, Dvp = (Dv + 15) / 16 * 16;
    const std::int64_t Rp = (rows + 15) / 16 * 16;
    // The scores have 16 rows of slack, and the tile products (avx512amx) need their queries as
    // bf16 pairs (at most 16 columns per row: a head of one row takes 16) and 64 keys of S^T.
    const std::int64_t floats = rows * Dp + (rows + 16) * (kServingSplit + 16) + 16 * Dp + 16 * Dvp +
                                std::max(Dp, Dvp) + (Dp / 2) * 16 * rows + 64 * Rp;
    // + per row: its key range, its query row (bf16 dot products), its partial's address, its
    // position terms and keep-first's keys (32 + 24 + 16 bytes)
    return floats * 4 + rows * 72 + 15 * 64;
  }
};

}  // namespace qkv::detail
