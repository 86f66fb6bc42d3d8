#pragma once
/// @file attention.hpp
/// Scaled dot-product attention: O = softmax(mask(softcap(scale * Q K^T))) V, per head.
///
/// Source: Vaswani et al. 2017, "Attention Is All You Need", sec. 3.2.1 (scaled dot-product
/// attention); options as in FlashAttention-2 (Dao 2023) and PyTorch
/// `scaled_dot_product_attention`. The complete semantics, with pictures of the diagonal
/// alignments, are in docs/semantics.md.
///
/// Shapes (axis letters used in every message):
///   q   [B, Hq,  Sq, D]     float32 | float64 | float16 | bfloat16
///   k   [B, Hkv, Sk, D]     same dtype as q
///   v   [B, Hkv, Sk, Dv]    same dtype as q
///   out [B, Hq,  Sq, Dv]    float32 | float64 | float16 | bfloat16 (written, each element
///                           rounded once to nearest even)
///   softmax_lse [B, Hq, Sq] float32 | float64 (optional, written): natural log of the sum of
///                           exp(score) over the admissible keys of each row
///   probs [B, Hq, Sq, Sk]   float32 | float64 (optional, written): the attention weights,
///                           0 where a key is not admissible
/// Any strides are accepted provided the last dimension is contiguous (stride 1), so both BHSD
/// and BSHD (a permuted view) work, as do views into a packed QKV buffer.
///
/// Thread safety: attention() may be called concurrently from many threads provided their
/// outputs do not overlap (inputs may be shared); it keeps no global mutable state, and a result
/// is bitwise the same whether calls run concurrently or alone, and for every num_threads.
/// The call's own threads: AttentionParams::num_threads, else OMP_NUM_THREADS (docs/threads.md).
///
/// Hostile numbers (NaN, inf, huge, subnormal, empty shapes, sizes that overflow) behave as
/// docs/semantics.md, "Hostile numbers", specifies: e.g. NaN stays in the rows that read it, a
/// row with no admissible key gives O = 0 and softmax_lse = -inf, shapes whose sizes overflow int64
/// are refused.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "qkv/tensor.hpp"

namespace qkv {

/// Where the causal/window diagonal sits when Sq != Sk.
enum class Alignment {
  /// Query i sits at key position i + Sk - Sq (the last query sees the last key):
  /// FlashAttention >= 2.1, KV-cache decoding. The default.
  bottom_right,
  /// Query i sits at key position i: PyTorch `is_causal`.
  top_left,
};

/// Which implementation runs. `automatic` picks the fastest usable one (see explain_dispatch()).
enum class KernelKind { automatic, reference, flash, decode };

/// Options of one attention call. Defaults give plain softmax(QK^T/sqrt(D))V.
struct AttentionParams {
  /// Multiplies q.k before softmax; default 1/sqrt(D). Must be finite.
  std::optional<double> scale;
  /// If > 0: score = softcap * tanh(score / softcap), after scaling, before masks (Gemma 2).
  double softcap = 0.0;
  /// Causal masking: shorthand for window (-1, 0). With a window (L, R): (L, min(R, 0)).
  bool causal = false;
  /// Sliding window: keys j in [diag - window_left, diag + window_right] are admissible;
  /// -1 means unbounded on that side. Both -1 (default) means no window.
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  /// Diagonal alignment for causal and window masks.
  Alignment align = Alignment::bottom_right;
  /// Optional explicit mask broadcastable to [B, Hq, Sq, Sk] (NumPy rules, rank 1..4):
  /// bool (true = attend, as PyTorch SDPA) or float32/float64 (added to the score; -inf
  /// excludes the key).
  std::optional<TensorView> mask;
  /// Optional per-batch key lengths, int32 or int64 [B], each in [0, Sk]: keys j >= len[b] are
  /// excluded and the bottom-right diagonal moves with len[b].
  std::optional<TensorView> kv_lens;
  /// Force an implementation (KernelKind::reference for the float64 specification).
  KernelKind kernel = KernelKind::automatic;
  /// Threads used inside the call; 0 = OpenMP's default (OMP_NUM_THREADS or all cores). Results
  /// do not depend on it. Set 1 when calling from many application threads (docs/threads.md).
  int num_threads = 0;
  /// Attention sinks (gpt-oss model card, 2025; Xiao et al. 2023, "Efficient Streaming Language
  /// Models with Attention Sinks", sec. 3): optional float32 [Hq], contiguous, finite: one learned
  /// logit z_h per query head that joins every row's softmax denominator and adds no value:
  ///   p_ij = exp(s_ij - m) / (exp(z_h - m) + sum_j exp(s_ij - m)),  m = max(z_h, max_j s_ij),
  ///   O_i = sum_j p_ij v_j,  softmax_lse_i = log(exp(z_h) + sum_j exp(s_ij)).
  /// z_h is not scaled, softcapped or masked. A row whose keys are all excluded gives O_i = 0
  /// and softmax_lse_i = z_h. attention_backward() can return dL/dz (its grad_sinks overload).
  std::optional<TensorView> sinks;
  /// ALiBi (Press et al. 2022, "Train Short, Test Long", sec. 3): optional float32 slopes [Hq]
  /// (every batch) or [B, Hq] (packed calls: B = the number of sequences), contiguous, finite
  /// (any sign; alibi_slopes() gives the standard ones). The bias b_ij = -slope * |i + offset - j|
  /// is added after scaling and softcap, before masks, with offset the causal diagonal's:
  /// bottom_right Sk - Sq (per sequence, its own key length: kv_lens, packed and paged calls),
  /// top_left 0; FlashAttention-2's `alibi_slopes` convention. The bias has no gradient.
  std::optional<TensorView> alibi_slopes;
  /// StreamingLLM (Xiao et al. 2023, sec. 3.2): keys 0 .. window_keep_first - 1 are admissible
  /// to every query besides the window's keys, unless the right bound (causal, window_right),
  /// the key length or a mask excludes them: it extends the window's left side only. 0 = off;
  /// must be >= 0.
  std::int64_t window_keep_first = 0;
  /// Attention dropout (Srivastava et al. 2014, "Dropout", sec. 2; applied to the attention
  /// weights as FlashAttention-2, Dao 2023, sec. 3.1, does in its fused kernel): each weight
  /// P_ij of (batch b, query head h, row i, key j) is kept with probability 1 - dropout_p and
  /// then multiplied by exactly 1 / (1 - dropout_p), else set to 0:
  ///   O_i = sum_j P_ij Z_ij v_j / (1 - dropout_p),  Z_ij in {0, 1}.
  /// softmax_lse and probs are those of the weights before dropout (so the backward can recompute
  /// P). Must be in [0, 1) (NaN refused); 0 (the default) is no dropout, bit for bit.
  /// The decisions Z are a pure function of (dropout_seed, dropout_offset, b, h, i, j), from
  /// the counter-based generator Philox 4x32-10 (Salmon et al. 2011, "Parallel random numbers: as
  /// easy as 1, 2, 3", sec. 4.1); the exact rule is in docs/semantics.md, "Dropout", and
  /// dropout_keep_mask() (dropout.hpp) returns it. The same arguments give the same mask in
  /// attention() and attention_backward() (which regenerates it, never stores it), whatever the
  /// kernel, threads or traversal. A call draws the Philox counters
  /// [dropout_offset, dropout_offset + B * Hq) of its seed: advance the offset by B * Hq between
  /// calls for independent masks under one seed. Packed calls: b is the sequence's index, i and j
  /// positions within the sequence.
  double dropout_p = 0.0;
  std::uint64_t dropout_seed = 0;
  std::uint64_t dropout_offset = 0;
};

/// The standard ALiBi slopes of `num_heads` heads (Press et al. 2022, sec. 3; BLOOM's
/// build_alibi_tensor): for a power of two n, 2^(-8 i / n) for i = 1 .. n; otherwise the slopes
/// of the largest power of two c < n, then every other slope of 2c heads (2^(-4 (2 i - 1) / c),
/// i = 1 .. n - c). E.g. n = 8: 1/2, 1/4, ..., 1/256; n = 1: 1/256.
/// @throws qkv::Error for num_heads < 0 (0 gives no slope).
std::vector<float> alibi_slopes(std::int64_t num_heads);

/// Computes attention into `out` (and optionally softmax_lse and probs).
///
/// Semantics, per (b, h, i): the admissible keys are those j < len[b] (or Sk) inside the window
/// around the diagonal (or among the first window_keep_first keys, left of it) and not excluded
/// by the mask; s_j = scale * q_i.k_j, then softcap, then the ALiBi bias, then the additive
/// mask; O_i = sum_j softmax(s)_j v_j over admissible j, the sink's logit (if any) in the
/// softmax's denominator, each weight dropped or rescaled when dropout_p > 0 (the fast kernels
/// do not apply dropout yet: such calls run the reference). A row with no admissible key gives O_i = 0 and softmax_lse = -inf
/// (with sinks: z_h). Keys excluded by causal, window or key lengths are
/// never read, so NaN or inf stored there cannot leak into any row.
///
/// @throws qkv::Error naming the argument and the expected and actual shape or value, for:
///   a rank other than 4, a non-contiguous last dimension, mismatched B/D/Sk/Dv, Hq % Hkv != 0,
///   unsupported or mismatched dtypes, a mask not broadcastable to [B,Hq,Sq,Sk], key lengths
///   out of [0, Sk], a non-finite scale, a negative softcap, a window side < -1, sinks or
///   alibi_slopes not float32, not [Hq] (or [B, Hq] for the slopes), not contiguous or not
///   finite, a window_keep_first < 0, a dropout_p outside [0, 1) or NaN, an output
///   overlapping an input (q, k, v, mask) or another output, an output with a zero stride on
///   an axis of size > 1, a null data pointer for a non-empty operand, a shape or stride extent
///   that overflows int64, num_threads < 0, or a forced kernel that cannot run this call.
void attention(const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& out, const AttentionParams& params = {},
               const std::optional<TensorView>& softmax_lse = std::nullopt,
               const std::optional<TensorView>& probs = std::nullopt);

/// Which kernel attention() would run for these arguments and why not the others: one line per
/// kernel of qkv::attention, in priority order (decode, flash, reference), each
///   "NAME: chosen (ISA level[, bf16 form])"  e.g. "flash: chosen (avx512)", "decode: chosen
///                                            (avx512amx, bf16 AMX tiles)"; the reference shows none
///   "NAME: refused (reason)"                 e.g. "decode: refused (Sq = 64 > 16 (decode takes a
///                                            few query rows))"
///   "NAME: not requested"                    params.kernel forces another kernel
///   "NAME: usable, lower priority"
/// and, when probs is given to a fast kernel, a line "probs: ..." on how the weights are filled.
/// The bf16 form is the one the level hands the kernel for bf16 inputs (the tiles may still take
/// fp32 products for a shape they do not fit). Runs no kernel; throws like attention(), a forced
/// kernel that cannot run the call included. The other entry points' explanations are declared
/// beside them (backward.hpp, varlen.hpp).
std::string explain_dispatch(const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const AttentionParams& params = {},
                             const std::optional<TensorView>& softmax_lse = std::nullopt,
                             const std::optional<TensorView>& probs = std::nullopt);

/// Lowers the user-facing alignment + window options to the effective (left, right) window:
/// causal => (-1, 0); causal with (L, R) => (L, min(R, 0)); -1 = unbounded.
struct EffectiveWindow {
  std::int64_t left = -1;
  std::int64_t right = -1;
};
EffectiveWindow effective_window(const AttentionParams& params) noexcept;

}  // namespace qkv
