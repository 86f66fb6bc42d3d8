#pragma once
/// @file backward.hpp
/// The backward pass of scaled dot-product attention: the gradients dQ, dK, dV of a loss L
/// given dO = dL/dO, for every option of the forward (attention.hpp).
///
/// Source: the derivative of the five steps of Vaswani et al. 2017, sec. 3.2.1, as
/// FlashAttention-2 computes it (Dao 2023, "FlashAttention-2", Algorithm 2): with
/// P = softmax(S) recomputed row by row,
///   dV = P^T dO;  dP = dO V^T;  D_i = rowsum(dO_i * O_i);  dS = P * (dP - D);
///   softcap c: dS *= 1 - tanh^2(x / c) for the scaled score x;
///   dQ = scale dS K;  dK = scale dS^T Q;
/// GQA: dK and dV of a KV head sum the contributions of all query heads of its group. Keys a
/// row does not admit have P = 0 and contribute nothing (keys that no row admits are never read,
/// and NaN or inf in a key a row excludes never reaches that row's gradients), so a row with no
/// admissible key gives dQ = 0. Dropout (dropout_p > 0): the forward's keep decisions Z are
/// regenerated from dropout_seed and dropout_offset (never stored) and, with F = Z / (1 - p),
///   dV = (P * F)^T dO;  dP = (dO V^T) * F;  D_i = rowsum(dO_i * O_i) (O after dropout)
/// as FlashAttention-2's backward (the reference computes it; the fast backward refuses it yet).
///
/// Shapes (the forward's, docs/semantics.md), any strides with a contiguous last dimension
/// (BSHD and BHSD are both views):
///   q [B,Hq,Sq,D], k [B,Hkv,Sk,D], v [B,Hkv,Sk,Dv]   float32 | float64 | float16 | bfloat16
///   out [B,Hq,Sq,Dv]        the forward's output O (any float dtype)
///   softmax_lse [B,Hq,Sq]   the forward's softmax_lse (float32 or float64, natural log)
///   grad_out [B,Hq,Sq,Dv]   dO (any float dtype)
///   grad_q [B,Hq,Sq,D], grad_k [B,Hkv,Sk,D], grad_v [B,Hkv,Sk,Dv]   written: the dtype of q,
///                           float32 or float64 (the caller's choice), each element rounded once
/// Accumulation is at least fp32; the reference (KernelKind::reference) computes in float64.
///
/// Thread safety and determinism as the forward: concurrent calls with disjoint outputs are
/// safe, and the gradients are bitwise the same for every num_threads and every run.

#include <string>

#include "qkv/attention.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

/// Computes dQ, dK, dV (see the file comment) into grad_q, grad_k, grad_v.
///
/// `out` and `softmax_lse` must be the forward's results for the same q, k, v and params (the
/// fast kernels rebuild P from softmax_lse; the reference recomputes P and O in float64).
///
/// @throws qkv::Error naming the argument and the expected and actual shape or value: every
///   error of attention() for q, k, v, out, softmax_lse and params, and for grad_out a shape
///   other than out's or a non-float dtype; for grad_q/grad_k/grad_v a shape other than q/k/v's,
///   a dtype other than q's, float32 or float64, a zero stride on an axis of size > 1, or memory that
///   overlaps any other operand; params.kernel = decode (no backward), or flash for float64
///   inputs (the fast backward computes in fp32).
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& softmax_lse, const TensorView& grad_out,
                        const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                        const AttentionParams& params = {});

/// attention_backward() that also writes grad_sinks = dL/dz, float32 [Hq], contiguous (written,
/// not accumulated), for params.sinks (AttentionParams::sinks): with P_i,sink = exp(z_h - lse_i)
/// the sink's weight in row i and D_i = rowsum(dO_i * O_i),
///   dz_h = - sum over the batch and the rows i of head h of P_i,sink D_i,
/// summed in float64 in the order b, i (the same bits for every thread count). The sink adds
/// no value, so dQ, dK, dV are those of the overload above (which takes sinks too and skips
/// dz). Source: the softmax's derivative with a value-less extra logit (gpt-oss model card).
/// @throws qkv::Error as the overload above, and for grad_sinks given without params.sinks, not
///   float32 [Hq], not contiguous, or overlapping another operand.
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& softmax_lse, const TensorView& grad_out,
                        const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                        const TensorView& grad_sinks, const AttentionParams& params);

/// Which kernel attention_backward() would run for exactly these arguments (shapes and dtypes
/// as above) and why not the others: one line per backward kernel, in priority order, as
/// explain_dispatch() of attention.hpp says them:
///   "flash: chosen (ISA level[, bf16 form])"  FlashAttention-2's backward; the bf16 form for
///                                             bf16 q, grad_out and out where the level has one
///   "flash: refused (float64 inputs: ...)"
///   "reference: usable, lower priority" | "reference: chosen" | "...: not requested"
/// Runs no kernel. @throws qkv::Error as attention_backward(): every argument check,
/// params.kernel = decode, flash for float64 inputs.
std::string explain_dispatch(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                             const TensorView& grad_k, const TensorView& grad_v, const AttentionParams& params = {});
/// The same for the grad_sinks overload of attention_backward().
std::string explain_dispatch(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                             const TensorView& grad_k, const TensorView& grad_v, const TensorView& grad_sinks,
                             const AttentionParams& params);

}  // namespace qkv
