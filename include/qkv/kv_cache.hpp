#pragma once
/// @file kv_cache.hpp
/// The key/value cache of one attention layer, for incremental (autoregressive) decoding.
///
/// During generation the keys and values of earlier tokens do not change, so they are stored
/// once and each new token only computes its own q, k, v (Pope et al. 2022, "Efficiently Scaling
/// Transformer Inference"; the "KV cache" of every decoder runtime). A model holds one
/// KVCache per layer.
///
/// Storage, per layer:  K [B, Hkv, capacity, D],  V [B, Hkv, capacity, Dv], C-contiguous,
/// dtype float32, float64, bfloat16 or float16 (appended values are rounded to it), or K and V
/// each in a format of qkv/kv_quant.hpp (codes and scales), plus a length per sequence b:
/// positions [0, length(b)) hold data; slots at or beyond length(b) are never read. The storage
/// code (writing, quantizing, the views the kernels read) is the one PagedKVCache uses.
///
/// Typical use (prefill of a prompt of S tokens, then one token at a time):
///   KVCache cache(B, Hkv, max_seq_len, D);
///   auto pos = cache.next_positions(S);           // [B,S]: length(b) + t
///   apply_rope(q, pos, rope); apply_rope(k, pos, rope);
///   cache.append(k, v);                            // k [B,Hkv,S,D], v [B,Hkv,S,Dv]
///   AttentionParams p; p.causal = true;
///   cache.attend(q, out, p);                       // q [B,Hq,S,D] -> out [B,Hq,S,Dv]
/// Generating token by token, in chunks, or all at once gives the same outputs (tested); through
/// attend_varlen() (the serving kernel) the very same bits.
///
/// Not thread-safe: one cache is used by one thread at a time (attend() may use a scratch buffer).

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/kv_quant.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

namespace detail {
class KVStorage;  // src/cache/kv_storage.hpp
}

class KVCache {
 public:
  /// An empty cache (B = Hkv = capacity = 0), to be assigned one of the caches below.
  KVCache();
  /// Allocates K [B, Hkv, capacity, D] and V [B, Hkv, capacity, Dv] (zeroed), every length 0.
  /// @param dtype       storage: float32 (default), float64, bfloat16 or float16.
  /// @param head_dim_v  Dv; 0 means Dv = D.
  /// @throws qkv::Error for a negative size, D < 1, an unsupported dtype, or a byte size that overflows.
  KVCache(std::int64_t batch, std::int64_t num_kv_heads, std::int64_t capacity, std::int64_t head_dim,
          DType dtype = DType::f32, std::int64_t head_dim_v = 0);
  /// K and V each in its own format (qkv/kv_quant.hpp): f32, bf16, f16, int8, q8_0, fp8. One float
  /// format for both behaves as the dtype constructor. Otherwise the storage holds codes and
  /// scales (keys()/values() are the codes, key_scales()/value_scales() the scales, laid out like
  /// the rows: [B, Hkv, capacity] for int8, [B, Hkv, capacity, ceil(D/32)] float16 for q8_0, [Hkv]
  /// for fp8, which starts at 1: set_fp8_scales). append() quantizes (round to nearest even,
  /// saturating) and refuses NaN and infinities naming the batch, token and head; attend() is then
  /// attend_varlen(), the serving kernel directly on the codes: causal, window, softcap, scale,
  /// GQA; no explicit mask and no probs.
  /// @throws qkv::Error as above.
  KVCache(std::int64_t batch, std::int64_t num_kv_heads, std::int64_t capacity, std::int64_t head_dim,
          KVFormat k_format, KVFormat v_format, std::int64_t head_dim_v = 0);

  KVCache(KVCache&&) noexcept;
  KVCache& operator=(KVCache&&) noexcept;
  ~KVCache();

  std::int64_t batch() const noexcept { return B_; }
  std::int64_t num_kv_heads() const noexcept { return Hkv_; }
  std::int64_t capacity() const noexcept { return capacity_; }
  std::int64_t head_dim() const noexcept { return D_; }
  std::int64_t head_dim_v() const noexcept { return Dv_; }
  /// The storage dtype of the keys (the codes' dtype for a quantized format).
  DType dtype() const noexcept;
  /// The formats of K and V (f32 for float64 storage, which has no KVFormat).
  KVFormat k_format() const noexcept;
  KVFormat v_format() const noexcept;
  /// Scales of a quantized K / V (see the constructor); empty views for float formats.
  TensorView key_scales() const;
  TensorView value_scales() const;
  /// Sequence b's length(b) cached positions as packed [length(b), Hkv, D] / [..., Dv] operands
  /// of attention_varlen, with their scales: views into the storage (strides D * capacity between
  /// heads), what attend_varlen() passes on. Not for float64 storage (no KVFormat).
  /// @throws qkv::Error if b is out of [0, B).
  QuantizedKV sequence_keys(std::int64_t b) const;
  QuantizedKV sequence_values(std::int64_t b) const;
  /// Per-head fp8 scales of K and V ([Hkv] each; ignored for other formats).
  /// @throws qkv::Error unless the cache is empty, for sizes other than Hkv or a scale not finite and > 0.
  void set_fp8_scales(std::span<const float> k_scales, std::span<const float> v_scales);

  /// Number of cached positions of sequence b. @throws qkv::Error if b is out of [0, B).
  std::int64_t length(std::int64_t b) const;
  /// All lengths, [B].
  std::span<const std::int64_t> lengths() const noexcept { return lengths_; }
  /// max over b of length(b) (0 for an empty cache): Sk of the views attend() passes on.
  std::int64_t max_length() const noexcept;

  /// The whole storage, [B, Hkv, capacity, D] and [B, Hkv, capacity, Dv], writable.
  TensorView keys() const;
  TensorView values() const;
  /// The first max_length() positions: [B, Hkv, max_length(), D] / [..., Dv] strided views of
  /// the storage (no copy). Positions >= length(b) of sequence b hold stale or unwritten data.
  TensorView active_keys() const;
  TensorView active_values() const;

  /// Positions of the next S tokens, row-major [B, S]: entry (b, t) = length(b) + t. Pass them to
  /// apply_rope() before append() so the rotation matches the slot the token lands in.
  /// @param counts  as in append(); when given, row b holds length(b) - (S - counts[b]) + t, i.e.
  ///                the new tokens are right-aligned in the S rows (left padding).
  std::vector<std::int64_t> next_positions(std::int64_t S, std::span<const std::int64_t> counts = {}) const;

  /// Appends new tokens: k [B, Hkv, S, D] and v [B, Hkv, S, Dv] (float32, float64, float16 or
  /// bfloat16; any strides with a contiguous last dimension), written at positions
  /// length(b) .. length(b)+S-1, then length(b) += S. Works for a prefill chunk (S > 1) and a single
  /// decode token (S = 1).
  /// @param counts  optional [B] per-sequence counts for ragged batches: sequence b takes only its
  ///                last counts[b] rows (rows S-counts[b] .. S-1; left padding), 0 <= counts[b] <= S.
  /// @throws qkv::Error for mismatched shapes (B, Hkv, D, Dv, S of k vs v), a bad dtype or stride,
  ///         bad counts, or if any sequence would exceed the capacity. On error nothing is written.
  void append(const TensorView& k, const TensorView& v, std::span<const std::int64_t> counts = {});

  /// Attention of new queries over the cache. Bottom-right alignment: query row i of sequence b
  /// sits at position length(b) - Sq + i, so after append() of the Sq tokens whose queries these
  /// are, `params.causal = true` gives exactly causal attention of the full sequence. With ragged
  /// appends, sequence b's real queries are its last counts[b] rows; earlier rows sit at earlier
  /// positions and their outputs are to be ignored.
  /// A cache in one float format (the dtype constructor) runs qkv::attention() with kv_lens =
  /// lengths() and K/V = active_keys()/active_values() (Sk = max_length()), on the kernel the
  /// dispatcher picks; a quantized or mixed-format cache runs attend_varlen().
  ///
  /// @param q    [B, Hq, Sq, D], Hq % Hkv == 0 (GQA), any strides with a contiguous last dim.
  /// @param out  [B, Hq, Sq, Dv]. softmax_lse, probs: as qkv::attention() with Sk = max_length().
  /// @param params  causal, window, scale, softcap, mask (broadcastable to [B,Hq,Sq,max_length()]),
  ///                sinks, alibi_slopes ([Hq] or [B,Hq]), window_keep_first (these three on the
  ///                reference kernel), kernel, num_threads; kv_lens must be empty (the cache
  ///                supplies it) and align must be bottom_right.
  /// If q's dtype differs from the storage dtype (e.g. float32 queries over a bfloat16 cache),
  /// the cached positions are converted into a capacity-sized copy of q's dtype, incrementally
  /// (only positions appended since the previous call). After writing into keys()/values() below
  /// length(b) directly, call truncate() so the copy is refreshed.
  /// @throws qkv::Error as qkv::attention(), or for kv_lens set / top_left alignment; for a
  ///         quantized or mixed-format cache, as attend_varlen() and for probs given.
  void attend(const TensorView& q, const TensorView& out, const AttentionParams& params = {},
              const std::optional<TensorView>& softmax_lse = std::nullopt,
              const std::optional<TensorView>& probs = std::nullopt);

  /// Attention of new queries over the cache through qkv::attention_varlen, in any format: one
  /// call per sequence b, of its last min(Sq, length(b)) query rows over sequence_keys(b) /
  /// sequence_values(b) (the stored codes, no copy). With params.kernel automatic this is the
  /// batch-invariant serving kernel (qkv/varlen.hpp): a row's bits depend only on its query, its
  /// sequence's keys and values and the options, and equal those of attention_varlen or
  /// PagedKVCache over the same keys, whatever the batch or the chunking. Alignment, q, out and
  /// softmax_lse as attend(); rows before a sequence's first position (ragged padding) get out =
  /// 0 and softmax_lse = -inf.
  /// @param params  causal, window, scale, softcap, kernel (automatic or reference for quantized
  ///                K or V; any for float32/bfloat16/float16 K and V of q's dtype),
  ///                num_threads; no mask, no kv_lens, align bottom_right.
  /// @throws qkv::Error as attention_varlen(), for a mask, kv_lens, top_left alignment, shapes
  ///         of q, out, softmax_lse other than above, or float64 storage.
  void attend_varlen(const TensorView& q, const TensorView& out, const AttentionParams& params = {},
                     const std::optional<TensorView>& softmax_lse = std::nullopt);

  /// Forgets every cached position (lengths to 0); the storage is kept.
  void clear() noexcept;
  /// Shrinks every sequence to at most `length` positions (e.g. to roll back a rejected draft).
  /// @throws qkv::Error if length < 0.
  void truncate(std::int64_t length);
  /// Per-sequence form: sequence b keeps min(length(b), lengths[b]) positions.
  /// @throws qkv::Error if lengths has other than B entries or a negative entry.
  void truncate(std::span<const std::int64_t> lengths);

 private:
  void check_attend(const TensorView& q, const AttentionParams& params) const;
  std::string formats() const;  // "k_format/v_format", for messages
  void attend_sequences(const TensorView& q, const TensorView& out, const AttentionParams& params,
                        const std::optional<TensorView>& softmax_lse);
  std::int64_t B_ = 0, Hkv_ = 0, capacity_ = 0, D_ = 0, Dv_ = 0;
  std::unique_ptr<detail::KVStorage> store_;  // K, V and their scales: slot b = sequence b
  std::vector<std::int64_t> lengths_;
  Tensor scratch_k_, scratch_v_;       // copies in q's dtype for attend() when it differs
  std::vector<std::int64_t> widened_;  // per sequence: positions [0, widened_) of the copies are current
};

}  // namespace qkv
