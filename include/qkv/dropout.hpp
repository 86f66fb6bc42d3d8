#pragma once
/// @file dropout.hpp
/// The keep decisions of attention dropout (AttentionParams::dropout_p), for tests and debugging.
///
/// Source: dropout, Srivastava et al. 2014, sec. 2; applied to the attention weights inside the
/// fused kernel, the mask regenerated rather than stored, as FlashAttention-2 (Dao 2023, sec. 3.1)
/// does; the generator is Philox 4x32-10 (Salmon et al. 2011, "Parallel random numbers: as easy
/// as 1, 2, 3", sec. 4.1). The exact rule from (seed, offset, b, h, i, j) to a decision is in
/// docs/semantics.md, "Dropout".

#include <cstdint>

#include "qkv/tensor.hpp"

namespace qkv {

/// The keep mask Z of a call with B batches, num_heads query heads, seqlen_q rows and seqlen_k
/// keys: uint8 [B, num_heads, seqlen_q, seqlen_k], Z[b,h,i,j] = 1 where qkv::attention() with
/// these dropout_p, dropout_seed and dropout_offset keeps the weight P_ij (and rescales it by
/// 1 / (1 - dropout_p)), 0 where it drops it. The decisions of keys a call excludes (causal,
/// window, masks) are listed too and unused. dropout_p = 0 gives all ones.
/// Meant for small problems: it allocates the whole mask.
/// @throws qkv::Error naming the argument for dropout_p outside [0, 1) or NaN, a negative size,
///   or sizes whose product overflows int64.
Tensor dropout_keep_mask(std::uint64_t dropout_seed, std::uint64_t dropout_offset, double dropout_p,
                         std::int64_t B, std::int64_t num_heads, std::int64_t seqlen_q, std::int64_t seqlen_k);

}  // namespace qkv
