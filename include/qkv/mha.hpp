#pragma once
/// @file mha.hpp
/// The multi-head attention layer: projections, heads, RoPE, attention, output projection.
///
/// Source: Vaswani et al. 2017, "Attention Is All You Need", sec. 3.2.2 (multi-head attention),
/// with grouped-query attention (Ainslie et al. 2023, GQA; num_kv_heads = 1 is multi-query
/// attention, Shazeer 2019), optional rotary position embedding (Su et al. 2021, see rope.hpp),
/// optional learned attention sinks (one logit z_h per query head, as gpt-oss: each row's softmax
/// gets one more term exp(z_h) that carries no value; AttentionParams::sinks) and optional ALiBi
/// biases with BLOOM's standard slopes (Press et al. 2022; AttentionParams::alibi_slopes).
///
///   q = x_q W_Q^T + b_Q      [B, Sq, Hq*D]   viewed as heads [B, Hq, Sq, D]  (BSHD storage)
///   k = x_kv W_K^T + b_K     [B, Sk, Hkv*D]  viewed as       [B, Hkv, Sk, D]
///   v = x_kv W_V^T + b_V     [B, Sk, Hkv*Dv] viewed as       [B, Hkv, Sk, Dv]
///   (RoPE on q and k, if configured)
///   o = attention(q, k, v)   [B, Sq, Hq*Dv]  (qkv::attention(), the fastest usable kernel;
///                                             with the layer's sinks and ALiBi slopes)
///   y = o W_O^T + b_O        [B, Sq, d_model]
/// Weights use PyTorch's Linear layout ([out_features, in_features], y = x W^T + b):
///   W_Q [Hq*D, d_model], W_K [Hkv*D, d_model], W_V [Hkv*Dv, d_model], W_O [d_model, Hq*Dv].
/// The layer stores W_Q, W_K, W_V packed row-wise in one matrix, as PyTorch's `in_proj_weight`,
/// so self-attention runs ONE GEMM for q, k and v; the heads are strided views of that GEMM's
/// output, never copied. Projections run on OpenBLAS (sgemm in blocks fixed by the shape, so that
/// their bits do not depend on the thread count: docs/threads.md); all tensors are float32.
///
/// Backward (backward()): the gradients of a loss L with respect to the inputs and every weight,
/// given dy = dL/dy: the chain rule through each step above, last to first (docs/layers.md,
/// "Backward"); the attention step is FlashAttention-2's backward (Dao 2023, Algorithm 2;
/// backward.hpp). Sums run over every (b, s) row:
///   dW_O += dy^T o,  db_O += sum dy,  do = dy W_O
///   dq, dk, dv = attention_backward(q, k, v, o, softmax_lse, do)   (GQA: dk, dv per KV head;
///                                                  with sinks also d sinks, summed over B and Sq)
///   dq, dk <- apply_rope_inverse(dq), apply_rope_inverse(dk)         (if configured; rope.hpp)
///   dW_Q += dq^T x_q, dW_K += dk^T x_kv, dW_V += dv^T x_kv,  db_* += column sums of dq, dk, dv
///   dx_q = dq W_Q,   dx_kv = dk W_K + dv W_V                          (self-attention: dx = both)
/// q, k, v, o and softmax_lse are recomputed from the inputs (nothing is saved by forward()).
///
/// Thread safety: forward() and backward() are const and may run concurrently on one layer (each
/// call allocates its own buffers) provided their outputs (y, dx, MhaGrads) are distinct; the
/// KV-cache overload mutates only the cache it is given.

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>

#include "qkv/attention.hpp"
#include "qkv/kv_cache.hpp"
#include "qkv/rope.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

/// Shape of a MultiHeadAttention layer. Zero fields take the defaults noted.
struct MhaConfig {
  std::int64_t d_model = 0;        ///< model width (input and output features), >= 1
  std::int64_t num_heads = 0;      ///< Hq, >= 1
  std::int64_t num_kv_heads = 0;   ///< Hkv, divides Hq; 0 = Hq (1 = multi-query attention)
  std::int64_t head_dim = 0;       ///< D; 0 = d_model / Hq (then Hq must divide d_model)
  std::int64_t head_dim_v = 0;     ///< Dv; 0 = D
  bool qkv_bias = true;            ///< biases b_Q, b_K, b_V (PyTorch `bias=True`; Llama: false)
  bool out_bias = true;            ///< bias b_O
  std::optional<RopeConfig> rope;  ///< RoPE on q and k after their projections (none by default)
  /// Learned attention sinks: a float32 weight sinks() [Hq] (the logits z_h, zero at construction;
  /// gpt-oss's `sinks`), passed as AttentionParams::sinks to every call, with its gradient in
  /// MhaGrads::sinks().
  bool sinks = false;
  /// ALiBi: AttentionParams::alibi_slopes = alibi_slopes(Hq) (BLOOM's standard slopes), fixed, no
  /// gradient; the distance |i + offset - j| is aligned as the call's causal diagonal.
  bool alibi = false;
};

/// Per-call options of MultiHeadAttention::forward() and backward().
struct MhaOptions {
  /// Passed to qkv::attention(): causal, window, align, scale (default 1/sqrt(D), as PyTorch),
  /// softcap, mask (bool true = attend, or additive; broadcastable to [B,Hq,Sq,Sk]; see
  /// mask_from_torch() for PyTorch's opposite polarity), kv_lens [B], window_keep_first, kernel,
  /// num_threads; sinks and alibi_slopes too when the layer has none of its own (a layer
  /// configured with sinks or alibi refuses them here: they would be ambiguous).
  AttentionParams attention;
  /// RoPE positions of the queries and keys: S entries, or B*S ([B,S] row-major). Empty means
  /// 0 .. S-1. For self-attention the keys take the query positions unless k_positions is set.
  /// Ignored without config().rope. The KV-cache overload takes positions from the cache.
  std::span<const std::int64_t> q_positions;
  std::span<const std::int64_t> k_positions;
  /// Optional attention weights (written): float32 [B, Hq, Sq, Sk], or [B, Sq, Sk] averaged over
  /// the heads when average_heads (PyTorch `average_attn_weights=True`). Requires a kernel that
  /// can return them (the reference always can). With a KV cache, Sk is the cache's max_length()
  /// after the new tokens are appended.
  std::optional<TensorView> probs;
  bool average_heads = false;
};

class MhaGrads;

class MultiHeadAttention {
 public:
  MultiHeadAttention() = default;
  /// Allocates zeroed weights for `config` (defaults resolved: config() reports every field).
  /// @throws qkv::Error for d_model/num_heads < 1, Hq % Hkv != 0, D unspecified with
  ///         d_model % Hq != 0, a negative size, or an invalid rope config (odd rotary_dim, theta <= 0).
  explicit MultiHeadAttention(const MhaConfig& config);

  const MhaConfig& config() const noexcept { return cfg_; }

  /// Writable float32 views of the layer's weights (biases: empty views when disabled).
  TensorView w_q() const;  ///< [Hq*D, d_model]
  TensorView w_k() const;  ///< [Hkv*D, d_model]
  TensorView w_v() const;  ///< [Hkv*Dv, d_model]
  TensorView w_o() const;  ///< [d_model, Hq*Dv]
  TensorView b_q() const;  ///< [Hq*D]
  TensorView b_k() const;  ///< [Hkv*D]
  TensorView b_v() const;  ///< [Hkv*Dv]
  TensorView b_o() const;  ///< [d_model]
  TensorView sinks() const;  ///< [Hq], the attention-sink logits (empty view when config().sinks is false)
  /// BLOOM's ALiBi slopes [Hq] the layer passes (empty view when config().alibi is false); read only.
  TensorView alibi_slopes() const { return alibi_.view(); }
  /// The packed input projection [Hq*D + Hkv*D + Hkv*Dv, d_model] (rows: W_Q, W_K, W_V) and its bias.
  TensorView in_proj_weight() const { return w_in_.view(); }
  TensorView in_proj_bias() const;

  /// The AttentionParams of the layer's attention call: options.attention with the layer's sinks
  /// and ALiBi slopes (views of the layer: valid while it lives).
  /// @throws qkv::Error for options.attention.sinks (alibi_slopes) given to a layer with its own.
  AttentionParams attention_params(const MhaOptions& options) const;

  /// Copies weights from named tensors (any float dtype, converted to float32). Accepted names,
  /// each after `prefix` (e.g. "self_attn." or "layers.0.attention."):
  ///   packed (PyTorch nn.MultiheadAttention): in_proj_weight, in_proj_bias,
  ///                                           out_proj.weight, out_proj.bias
  ///   separate (PyTorch with kdim/vdim):      q_proj_weight, k_proj_weight, v_proj_weight
  ///   separate (Hugging Face):  q_proj.weight, k_proj.weight, v_proj.weight, o_proj.weight
  ///                             (and .bias); out_proj.weight/.bias also accepted for W_O
  ///   separate (Meta Llama):    wq.weight, wk.weight, wv.weight, wo.weight
  ///   attention sinks (gpt-oss):              sinks [Hq]   (only with config().sinks)
  /// Every weight the config needs must be present with its exact shape; a bias or sinks present
  /// in the file but disabled in the config is an error (it would be silently dropped).
  /// @throws qkv::Error naming the missing or mis-shaped tensor and the expected shape.
  void load_weights(const std::map<std::string, Tensor>& tensors, const std::string& prefix = "");

  /// Self-attention: x [B, S, d_model] -> y [B, S, d_model], both float32 with a contiguous last
  /// dimension (other strides free). y may alias x (x is fully read before y is written).
  /// @throws qkv::Error for wrong ranks/shapes/dtypes, or anything qkv::attention() refuses.
  void forward(const TensorView& x, const TensorView& y, const MhaOptions& options = {}) const;

  /// Cross-attention: queries from x_q [B, Sq, d_model], keys and values from x_kv [B, Sk, d_model];
  /// y [B, Sq, d_model]. Errors as the self-attention overload.
  void forward(const TensorView& x_q, const TensorView& x_kv, const TensorView& y,
               const MhaOptions& options = {}) const;

  /// Incremental self-attention over a KV cache: x [B, S, d_model] are the S newest tokens of each
  /// sequence (a prefill chunk, or S = 1 for a decode step). Their q, k, v are projected, RoPE is
  /// applied at positions cache.next_positions(S), k and v are appended to the cache, and q attends
  /// over everything cached (KVCache::attend: bottom-right alignment, so `causal = true` gives
  /// exactly the full-sequence causal result). options.attention.kv_lens must be empty.
  /// @throws qkv::Error as forward(), for a cache whose B/Hkv/D/Dv differ from the layer's, or
  ///         when the cache would overflow its capacity (nothing is appended then).
  void forward(const TensorView& x, KVCache& cache, const TensorView& y,
               const MhaOptions& options = {}) const;

  /// Backward of self-attention forward(x, y, options) (the file comment gives the math).
  ///
  /// @param x      [B, S, d_model] float32, the forward's input
  /// @param dy     [B, S, d_model] float32, dL/dy
  /// @param dx     [B, S, d_model] float32, written: dL/dx. It may alias x or dy (both are fully
  ///               read before dx is written).
  /// @param grads  MhaGrads(*this): the weight gradients are ACCUMULATED into it (+=, as PyTorch's
  ///               .grad), so that several calls sum; MhaGrads::zero() resets it.
  /// @param options the forward's options: attention params (causal, window, align, scale, softcap,
  ///               mask, kv_lens, kernel, num_threads; the backward runs qkv::attention and
  ///               qkv::attention_backward with them) and RoPE positions. probs and
  ///               average_heads are ignored (nothing is written there). With config().sinks
  ///               the sinks' gradient is accumulated into grads.sinks(); sinks given in the
  ///               options instead get none.
  /// All activations: a contiguous last dimension, other strides free (as forward()).
  /// @throws qkv::Error naming the argument (x, dy, dx, grads): wrong rank, shape or dtype
  ///         (dy and dx must be [B,S,d_model] with x's B and S), grads of another shape of layer,
  ///         and anything qkv::attention() or qkv::attention_backward() refuses.
  void backward(const TensorView& x, const TensorView& dy, const TensorView& dx, MhaGrads& grads,
                const MhaOptions& options = {}) const;

  /// Backward of cross-attention forward(x_q, x_kv, y, options): x_q [B,Sq,d_model], x_kv
  /// [B,Sk,d_model], dy [B,Sq,d_model]; writes dx_q [B,Sq,d_model] and dx_kv [B,Sk,d_model] (which
  /// must not overlap each other; either may alias x_q, x_kv or dy) and accumulates into grads.
  /// Options and errors as the self-attention overload (arguments x_q, x_kv, dy, dx_q, dx_kv, grads).
  void backward(const TensorView& x_q, const TensorView& x_kv, const TensorView& dy,
                const TensorView& dx_q, const TensorView& dx_kv, MhaGrads& grads,
                const MhaOptions& options = {}) const;

 private:
  MhaConfig cfg_;
  Tensor w_in_, b_in_, w_o_, b_o_, sinks_, alibi_;
};

/// Gradients of a MultiHeadAttention layer's weights: float32, stored and viewed exactly as the
/// layer stores its weights (grads.w_q() has the shape of layer.w_q(), grads.in_proj_weight() is
/// the packed [dW_Q; dW_K; dW_V], ...), so an optimizer pairs layer.X() with grads.X().
class MhaGrads {
 public:
  MhaGrads() = default;
  /// Zeroed gradients of `layer`'s shapes (biases empty when the layer has none).
  /// @throws qkv::Error for a default-constructed layer.
  explicit MhaGrads(const MultiHeadAttention& layer);

  /// The config of the layer the gradients were sized for (default-constructed: d_model = 0).
  const MhaConfig& config() const noexcept { return cfg_; }
  /// Sets every gradient to 0.
  void zero();

  /// Writable float32 views, the shapes of the layer's (biases: empty views when disabled).
  TensorView w_q() const;  ///< [Hq*D, d_model]
  TensorView w_k() const;  ///< [Hkv*D, d_model]
  TensorView w_v() const;  ///< [Hkv*Dv, d_model]
  TensorView w_o() const { return w_o_.view(); }  ///< [d_model, Hq*Dv]
  TensorView b_q() const;  ///< [Hq*D]
  TensorView b_k() const;  ///< [Hkv*D]
  TensorView b_v() const;  ///< [Hkv*Dv]
  TensorView b_o() const;  ///< [d_model]
  TensorView in_proj_weight() const { return w_in_.view(); }  ///< [Hq*D + Hkv*D + Hkv*Dv, d_model]
  TensorView in_proj_bias() const;                           ///< [Hq*D + Hkv*D + Hkv*Dv]
  TensorView sinks() const;  ///< [Hq] (empty view when the layer has no sinks)

 private:
  MhaConfig cfg_;
  Tensor w_in_, b_in_, w_o_, b_o_, sinks_;
};

/// Infers a config from named tensors (names as load_weights()): d_model, head_dim and
/// head_dim_v from the shapes, the bias flags from which biases are present, sinks from a
/// `sinks` tensor (alibi stays false: ALiBi has no weight).
/// @param num_heads     Hq (cannot be inferred from the shapes), >= 1
/// @param num_kv_heads  Hkv, 0 = Hq
/// @throws qkv::Error if no accepted weight names are found or the shapes are inconsistent.
MhaConfig infer_mha_config(const std::map<std::string, Tensor>& tensors, std::int64_t num_heads,
                           std::int64_t num_kv_heads = 0, const std::string& prefix = "");

/// Converts PyTorch nn.MultiheadAttention masks to a qkv mask (AttentionParams::mask).
///
/// PyTorch's polarity is the OPPOSITE of qkv's (and of scaled_dot_product_attention's): in
/// nn.MultiheadAttention a bool `key_padding_mask` or `attn_mask` value True means "ignore this
/// key"; qkv's bool mask True means "attend". Float masks are additive in both and pass through.
///
/// @param attn_mask         optional [Sq, Sk] or [B*Hq, Sq, Sk]: bool (True = ignore) or float (added)
/// @param key_padding_mask  optional [B, Sk]: bool (True = padding, ignore) or float (added)
/// @return [B, 1 or Hq, Sq, Sk] mask for AttentionParams::mask: bool (true = attend) when every
///         given mask is bool, else float32 additive (-inf where a bool mask said ignore).
///         An empty Tensor when neither mask is given.
/// @throws qkv::Error for shapes other than the above or non-bool/float dtypes.
Tensor mask_from_torch(const std::optional<TensorView>& attn_mask,
                       const std::optional<TensorView>& key_padding_mask, std::int64_t B, std::int64_t Hq,
                       std::int64_t Sq, std::int64_t Sk);

}  // namespace qkv
