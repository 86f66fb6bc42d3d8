#pragma once
/// @file varlen.hpp
/// Attention over packed batches of sequences of different lengths, from packed keys and values
/// (attention_varlen) or from a paged key/value pool (attention_paged), and the backward pass of
/// the packed form.
///
/// Conventions of FlashAttention's `flash_attn_varlen_func` (Dao 2023, FlashAttention-2, sec. 3;
/// the flash-attn package's varlen interface) and of vLLM's paged attention (Kwon et al. 2023,
/// "Efficient Memory Management for Large Language Model Serving with PagedAttention", sec. 4.1):
///   q            [total_q, Hq, D]    float32 | float16 | bfloat16 (float64: kernel = reference)
///   k            [total_k, Hkv, D]   same dtype as q
///   v            [total_k, Hkv, Dv]  same dtype as q
///   out          [total_q, Hq, Dv]   float32 | float64 | float16 | bfloat16 (written)
///   cu_seqlens_q [batch + 1] int32   prefix sums: sequence b owns tokens [cu[b], cu[b+1]) of q
///   cu_seqlens_k [batch + 1] int32   the same for k and v; cu[0] = 0, non-decreasing, cu[batch]
///                                    = total
///   softmax_lse  [Hq, total_q]       float32 | float64 (optional, written)
/// Any strides with a contiguous last dimension. Each sequence b is one attention call of
/// qkv::attention with Sq = cu_q[b+1] - cu_q[b] and Sk = cu_k[b+1] - cu_k[b], and every option
/// of AttentionParams applies to each sequence on its own: scale, softcap, causal and window in
/// both alignments (bottom_right: the last query of a sequence sits at its last key), GQA.
/// sinks [Hq], alibi_slopes ([Hq] or [batch, Hq]: one row per sequence) and window_keep_first
/// apply to each sequence as to one qkv::attention call (the reference runs them); so does
/// dropout_p, sequence b drawing the decisions of batch index b (the reference runs it).
/// Not accepted: mask and kv_lens (a sequence's keys are its range of cu_seqlens_k).
/// A sequence with no query does nothing; one with no key gives out = 0, softmax_lse = -inf.
///
/// Kernels (AttentionParams::kernel), as the registry names them (explain_dispatch below):
///   automatic  "serving", the batch-invariant split kernel (src/kernels/serving.cpp, below);
///              float64 inputs go "per-sequence" (each sequence's kernel: the reference)
///   reference  "per-sequence": the float64 specification, one qkv::attention call per sequence
///   flash, decode  "per-sequence": the tiled kernels of qkv::attention, one call per sequence
///              (faster prefill; each sequence's result depends on its own Sq, so not invariant
///              under chunking); a sequence the forced kernel cannot run throws before any runs
///
/// Batch invariance (the serving kernel): the bits of a query row's output and softmax_lse
/// depend only on its query vector, its admissible keys and values (their values, not where
/// they are stored) and the options. Not on the other sequences of the batch or their order,
/// the number of threads, whether the keys are packed or paged (any block table), nor whether the
/// row's sequence is computed as one prefill or in chunks of any size. The bits are fixed per ISA
/// level (QKV_ISA): the levels' vector widths, bf16 dot products and AMX tiles sum in different
/// orders, so a deployment that needs the same bits on every machine pins one level.
/// Keys are cut in splits fixed at absolute key positions [c * 1024, (c + 1) * 1024); each split
/// leaves an unnormalised partial (fp32), merged in split order in float64 by log-sum-exp
/// (flash-decoding, Dao, Haziza, Massa, Sizov 2023). docs/serving.md says more.
///
/// @throws qkv::Error naming the argument and the expected and actual value: ranks and shapes
///   ([total_q,Hq,D], ...), dtypes, cu_seqlens not int32, not of length batch + 1 (the same
///   batch for q and k), not starting at 0, decreasing, or not ending at total; a mask or
///   kv_lens given; any error qkv::attention raises for its options (scale, softcap, window,
///   num_threads, overlapping outputs, a forced kernel that cannot run a sequence).
#include <optional>
#include <string>

#include "qkv/attention.hpp"
#include "qkv/kv_quant.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

/// Attention of each packed sequence over its own keys; see the file comment.
void attention_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                      const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                      const AttentionParams& params = {},
                      const std::optional<TensorView>& softmax_lse = std::nullopt);

/// The backward pass of attention_varlen: dQ, dK, dV of a loss whose gradient by out is
/// grad_out, one qkv::attention_backward call per sequence ("per-sequence"; FlashAttention-2
/// backward, Dao 2023, Algorithm 2), given the forward's out and softmax_lse [Hq, total_q]
/// (required). Every sequence is checked, and its kernel chosen, before any runs.
///   grad_out [total_q, Hq, Dv] any float dtype; grad_q [total_q, Hq, D], grad_k [total_k, Hkv, D],
///   grad_v [total_k, Hkv, Dv]: float32, float64 or q's dtype (written; keys of a sequence with
///   no query get 0).
/// @throws qkv::Error as attention_varlen, and as qkv::attention_backward for the gradients
///   (shapes, dtypes, overlapping memory).
void attention_varlen_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const TensorView& softmax_lse, const TensorView& grad_out,
                               const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                               const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                               const AttentionParams& params = {});
/// attention_varlen_backward() that also writes grad_sinks = dL/dz, float32 [Hq] (written), for
/// params.sinks: as attention_backward()'s grad_sinks overload, summed over the sequences in
/// order. @throws qkv::Error as that overload.
void attention_varlen_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const TensorView& softmax_lse, const TensorView& grad_out,
                               const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                               const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                               const TensorView& grad_sinks, const AttentionParams& params);

/// Attention of new query tokens over paged keys and values (vLLM's layout):
///   q            [total_q, Hq, D]                 float32 | float16 | bfloat16
///   k_pool       [num_blocks, Hkv, block_size, D]  float32 | float16 | bfloat16 (may differ from q)
///   v_pool       [num_blocks, Hkv, block_size, Dv] the dtype of k_pool
///   out          [total_q, Hq, Dv], softmax_lse [Hq, total_q]: as attention_varlen
///   cu_seqlens_q [batch + 1] int32: sequence b's new tokens are q rows [cu[b], cu[b+1])
///   seq_lens     [batch] int32: keys of sequence b (its new tokens included), each >= its
///                query count
///   block_table  [batch, max_blocks] int32: key position j of sequence b is slot j % block_size
///                of block block_table[b, j / block_size]; entries past the sequence's last
///                block are never read
/// The queries of sequence b sit at key positions seq_lens[b] - Sq_b .. seq_lens[b] - 1
/// (bottom-right alignment; top_left is refused), so after writing the new tokens' keys,
/// `causal = true` is causal attention over the whole sequence. kernel automatic: the serving
/// kernel ("serving"), the same bits as attention_varlen gives for the same keys stored
/// contiguously; reference: the float64 specification over each sequence's keys gathered
/// ("reference").
/// @throws qkv::Error as attention_varlen, and for a block_size < 1, pools of different
///   num_blocks/Hkv/block_size, a seq_lens entry < Sq_b or > max_blocks * block_size, a block
///   table entry out of [0, num_blocks) among a sequence's blocks, top_left alignment.
void attention_paged(const TensorView& q, const TensorView& k_pool, const TensorView& v_pool,
                     const TensorView& out, const TensorView& cu_seqlens_q, const TensorView& seq_lens,
                     const TensorView& block_table, const AttentionParams& params = {},
                     const std::optional<TensorView>& softmax_lse = std::nullopt);

/// attention_varlen and attention_paged over keys and values in any format of qkv/kv_quant.hpp,
/// K and V each in its own (int8, q8_0, fp8, or float32/bfloat16/float16): k [total_k, Hkv, D]
/// and v [total_k, Hkv, Dv] packed, or the pools [num_blocks, Hkv, block_size, D|Dv], with their
/// scales. q is float32, bfloat16 or float16. The result is attention over the dequantized
/// values (code * scale in float32): the serving kernel converts each key and value row in
/// registers as a decode item reads it, or decodes it once into the workspace of a prefill item
/// (whose up to 32 rows, the query heads of a KV head times tokens, share it), and keeps every
/// guarantee of batch invariance above. q8_0 rows are decoded as code * scale per element, so
/// those bits equal the kernel's over float32 copies of the dequantized cache; an int8 or fp8
/// row's one scale multiplies its score and its weight instead, s_j = sc_j (q . c_j) and
/// (p_j sc_j) c_j, once per key, for any head_dim (a rounding apart from those copies).
/// kernel = reference runs the float64 specification on the dequantized values ("reference",
/// gathered). K and V in one float format of q's dtype take the float form above (any kernel);
/// other mixes of float formats (e.g. float32 q over bfloat16 K and V) the serving kernel.
/// @throws qkv::Error as the float forms, for operands that do not match their format
///   (dtype, scales shape, dtype or layout, fp8 scales not finite and > 0), float64 q, or a
///   kernel other than automatic and reference.
void attention_varlen(const TensorView& q, const QuantizedKV& k, const QuantizedKV& v, const TensorView& out,
                      const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                      const AttentionParams& params = {},
                      const std::optional<TensorView>& softmax_lse = std::nullopt);
void attention_paged(const TensorView& q, const QuantizedKV& k_pool, const QuantizedKV& v_pool,
                     const TensorView& out, const TensorView& cu_seqlens_q, const TensorView& seq_lens,
                     const TensorView& block_table, const AttentionParams& params = {},
                     const std::optional<TensorView>& softmax_lse = std::nullopt);

/// Which path each entry point above would take for exactly these arguments, and why not the
/// others: one line per kernel the registry has for that entry point, in priority order, as
/// explain_dispatch() of attention.hpp says them ("NAME: chosen (...)", "NAME: refused (reason)",
/// "NAME: not requested", "NAME: usable, lower priority"). The kernels:
///   attention_varlen (float or QuantizedKV)  serving, per-sequence, reference
///   attention_varlen_backward                per-sequence
///   attention_paged (float or QuantizedKV)   serving, reference
/// "serving: chosen (ISA level[, bf16 form])" (the bf16 form for bf16 q over bf16 keys);
/// "per-sequence: chosen (one qkv::attention call per sequence: flash (avx512) for 3, decode
/// (avx512) for 1)", each sequence's own choice by qkv::attention's (attention_backward's)
/// kernels under the same request; per-sequence refuses K and V that are not of q's dtype;
/// "reference" here is the float64 specification over each sequence's keys gathered (packed or
/// paged, dequantized). Arguments, shapes and dtypes exactly as the entry point's; runs no
/// kernel. @throws qkv::Error as the entry point does: every argument check, and a forced kernel
/// that cannot run a sequence.
std::string explain_dispatch(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                             const AttentionParams& params = {},
                             const std::optional<TensorView>& softmax_lse = std::nullopt);
std::string explain_dispatch(const TensorView& q, const QuantizedKV& k, const QuantizedKV& v, const TensorView& out,
                             const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                             const AttentionParams& params = {},
                             const std::optional<TensorView>& softmax_lse = std::nullopt);
std::string explain_dispatch(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                             const TensorView& grad_k, const TensorView& grad_v, const TensorView& cu_seqlens_q,
                             const TensorView& cu_seqlens_k, const AttentionParams& params = {});
std::string explain_dispatch(const TensorView& q, const TensorView& k_pool, const TensorView& v_pool,
                             const TensorView& out, const TensorView& cu_seqlens_q, const TensorView& seq_lens,
                             const TensorView& block_table, const AttentionParams& params = {},
                             const std::optional<TensorView>& softmax_lse = std::nullopt);
std::string explain_dispatch(const TensorView& q, const QuantizedKV& k_pool, const QuantizedKV& v_pool,
                             const TensorView& out, const TensorView& cu_seqlens_q, const TensorView& seq_lens,
                             const TensorView& block_table, const AttentionParams& params = {},
                             const std::optional<TensorView>& softmax_lse = std::nullopt);

}  // namespace qkv
