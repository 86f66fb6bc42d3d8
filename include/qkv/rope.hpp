#pragma once
/// @file rope.hpp
/// Rotary position embedding (RoPE) of queries and keys.
///
/// Source: Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding",
/// sec. 3.4 (eq. 34). For a vector x of head_dim D at position p, each pair (x_a, x_b) of
/// dimensions is rotated by the angle p * theta^(-2j/D), j = 0 .. R/2 - 1 (R = rotary_dim):
///     x_a' = x_a cos(p w_j) - x_b sin(p w_j)
///     x_b' = x_b cos(p w_j) + x_a sin(p w_j)
/// Two conventions pair the dimensions differently (they are NOT interchangeable: a checkpoint
/// is trained with one of them):
///   interleaved  pairs (2j, 2j+1)      llama2.c, Meta's Llama reference code, RoFormer
///   half_split   pairs (j, j + R/2)    GPT-NeoX, Hugging Face `rotate_half`
/// Dimensions >= rotary_dim are left untouched (partial rotary, as GPT-NeoX's rotary_pct).
///
/// Positions are explicit, so a decode step at position p gives exactly the rotation the same
/// token would get inside a full prefill.
///
/// Angle precision (RopeAngles):
///   f64          w_j = theta^(-2j/R) and p*w_j, cos, sin in double; the rotation in double,
///                rounded once to the storage dtype. Exact to fp32 rounding at any position.
///   llama2c_f32  bit-for-bit the float computation of llama2.c's run.c:
///                freq = 1.0f / powf(theta, (float)(2j) / (float)R), val = (float)p * freq,
///                c = cosf(val), s = sinf(val), x_a' = x_a*c - x_b*s, x_b' = x_a*s + x_b*c in float.
///                The float angle loses accuracy at large positions (a relative error of ~6e-8
///                of p*w_j), which is what a model trained with that code expects.

#include <cstdint>
#include <span>

#include "qkv/tensor.hpp"

namespace qkv {

/// Which dimensions form a rotated pair.
enum class RopeStyle {
  interleaved,  ///< (2j, 2j+1): llama2.c, Meta Llama
  half_split,   ///< (j, j + R/2): GPT-NeoX, Hugging Face
};

/// How the angles are computed (see the file comment).
enum class RopeAngles { f64, llama2c_f32 };

struct RopeConfig {
  RopeStyle style = RopeStyle::interleaved;
  /// Base of the frequencies w_j = theta^(-2j/R); 10000 in RoFormer and Llama 2. Must be > 0.
  double theta = 10000.0;
  /// Number of leading dimensions rotated (R); 0 = all of head_dim. Must be even and <= D.
  std::int64_t rotary_dim = 0;
  RopeAngles angles = RopeAngles::f64;
};

/// Rotates `x` in place.
///
/// @param x  [B, H, S, D] view, any strides with a contiguous last dimension (so a BSHD
///           projection buffer viewed as BHSD works), dtype float32 or float64.
/// @param positions  the position of each token: S entries (shared by every batch row) or
///           B*S entries (row-major [B, S]); each >= 0.
/// @param config     style, theta, rotary_dim, angle precision.
/// @throws qkv::Error for a rank other than 4, a non-contiguous last dimension, an unsupported
///         dtype, an odd or too large rotary_dim, theta <= 0 or not finite, a positions length
///         other than S or B*S, or a negative position.
void apply_rope(const TensorView& x, std::span<const std::int64_t> positions, const RopeConfig& config = {});

/// Convenience: positions start, start+1, ..., start+S-1 for every batch row.
void apply_rope(const TensorView& x, std::int64_t start, const RopeConfig& config = {});

/// The inverse rotation, in place: each pair is rotated by -p w_j,
///     x_a' = x_a cos(p w_j) + x_b sin(p w_j)
///     x_b' = x_b cos(p w_j) - x_a sin(p w_j)
/// with the same cos and sin values apply_rope() computes (both RopeAngles), i.e. the transpose
/// of apply_rope()'s rotation matrix. It undoes apply_rope() (to rounding), and it is RoPE's
/// backward: for y = apply_rope(x), dL/dx = apply_rope_inverse(dL/dy) at the same positions.
/// Arguments and errors as apply_rope().
void apply_rope_inverse(const TensorView& x, std::span<const std::int64_t> positions,
                        const RopeConfig& config = {});

/// Convenience: positions start, start+1, ..., start+S-1 for every batch row.
void apply_rope_inverse(const TensorView& x, std::int64_t start, const RopeConfig& config = {});

}  // namespace qkv
