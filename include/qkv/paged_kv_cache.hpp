#pragma once
/// @file paged_kv_cache.hpp
/// A paged key/value cache shared by many sequences (vLLM's PagedAttention: Kwon et al. 2023,
/// "Efficient Memory Management for Large Language Model Serving with PagedAttention", sec. 4).
///
/// Storage, per layer: pools K [num_blocks, Hkv, block_size, D] and V [num_blocks, Hkv,
/// block_size, Dv] (vLLM's layout), float32, bfloat16 or float16 (written values are rounded to
/// it). A sequence owns a list of blocks (its row of the block table): key position j lives in
/// slot j % block_size of its block j / block_size, i.e. at slot id block * block_size +
/// j % block_size of the pool. Blocks come from a free list and return to it when the sequence is
/// freed; a freed sequence id is reused by the next add_sequence().
///
/// Typical step of a serving loop (continuous batching: the sequences of a step change freely):
///   PagedKVCache cache(1024, 16, Hkv, D);
///   std::int64_t a = cache.add_sequence(), b = cache.add_sequence();
///   // prefill 7 tokens of a and decode 1 token of b in one call; q, k, v packed [8, H, D]:
///   cache.forward({a, b}, {7, 1}, q, k, v, out, params, rope);
///   cache.free_sequence(a);                       // its blocks go back to the pool
/// forward() = positions length(s) + t, RoPE of q and k at those positions (as
/// MultiHeadAttention does before its KVCache), allocate_slots(), write(), attend() (which runs
/// attention_paged()).
/// The outputs are batch invariant (qkv/varlen.hpp): a sequence gets the same bits alone or in
/// any batch, as one prefill or in chunks, whatever blocks it holds.
///
/// Not thread-safe: one cache is used by one thread at a time.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/kv_quant.hpp"
#include "qkv/rope.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

namespace detail {
class KVStorage;  // src/cache/kv_storage.hpp
}

class PagedKVCache {
 public:
  /// An empty cache (no block), to be assigned one of the caches below.
  PagedKVCache();
  /// Allocates the pools (zeroed), every block free.
  /// @param block_size  keys per block, >= 16 (vLLM's sizes are 16 and 32).
  /// @param dtype       storage: float32 (default), bfloat16 or float16.
  /// @param head_dim_v  Dv; 0 means Dv = D.
  /// @throws qkv::Error for num_blocks < 1 or > 2^31 - 1, block_size < 16, Hkv < 1, D < 1, an
  ///         unsupported dtype, or a byte size that overflows.
  PagedKVCache(std::int64_t num_blocks, std::int64_t block_size, std::int64_t num_kv_heads, std::int64_t head_dim,
               DType dtype = DType::f32, std::int64_t head_dim_v = 0);
  /// The same with K and V each in its own format (qkv/kv_quant.hpp): f32, bf16, f16, or the
  /// quantized int8, q8_0, fp8. Quantized pools hold the codes ([num_blocks, Hkv, block_size, D]
  /// int8 or uint8) and their scales (key_scales(), value_scales()); write() quantizes each new
  /// row (round to nearest even, saturating) and refuses NaN and infinities, naming the token and
  /// head. fp8's per-head scales start at 1 (set_fp8_scales). forward() attends directly on the
  /// codes (attention_paged over QuantizedKV, batch invariant as the float pools).
  /// @throws qkv::Error as the constructor above.
  PagedKVCache(std::int64_t num_blocks, std::int64_t block_size, std::int64_t num_kv_heads, std::int64_t head_dim,
               KVFormat k_format, KVFormat v_format, std::int64_t head_dim_v = 0);

  PagedKVCache(PagedKVCache&&) noexcept;
  PagedKVCache& operator=(PagedKVCache&&) noexcept;
  ~PagedKVCache();

  std::int64_t num_blocks() const noexcept { return num_blocks_; }
  std::int64_t block_size() const noexcept { return block_size_; }
  std::int64_t num_kv_heads() const noexcept { return Hkv_; }
  std::int64_t head_dim() const noexcept { return D_; }
  std::int64_t head_dim_v() const noexcept { return Dv_; }
  /// Dtype of the key pool's elements (int8 / uint8 codes for a quantized format).
  DType dtype() const noexcept;
  KVFormat k_format() const noexcept;
  KVFormat v_format() const noexcept;
  /// The pools, [num_blocks, Hkv, block_size, D] and [..., Dv], writable (codes when quantized).
  TensorView key_pool() const;
  TensorView value_pool() const;
  /// Scales of quantized pools (kv_scales_shape of the pool; empty for float formats).
  TensorView key_scales() const;
  TensorView value_scales() const;
  /// Pools and scales as attention_paged's operands.
  QuantizedKV keys() const;
  QuantizedKV values() const;
  /// Per-head scales of fp8 K and V ([Hkv] each; ignored for another format): stored values are
  /// x / scale in e4m3 (range +-448). @throws qkv::Error unless every block is free, for sizes
  /// other than Hkv, or a scale not finite and > 0.
  void set_fp8_scales(std::span<const float> k_scales, std::span<const float> v_scales);
  /// Blocks on the free list.
  std::int64_t num_free_blocks() const noexcept { return static_cast<std::int64_t>(free_.size()); }

  /// A new sequence of length 0 holding no block; returns its id (a freed id first).
  std::int64_t add_sequence();
  /// Returns the sequence's blocks to the free list and retires its id.
  /// @throws qkv::Error if `seq` is not a live sequence.
  void free_sequence(std::int64_t seq);
  /// Keys stored for `seq`. @throws qkv::Error if `seq` is not a live sequence.
  std::int64_t length(std::int64_t seq) const;
  /// The blocks of `seq`, in key order. @throws qkv::Error if `seq` is not a live sequence.
  std::span<const std::int32_t> blocks(std::int64_t seq) const;

  /// Slot ids for the next `count` keys of `seq`, taking blocks from the free list as needed;
  /// length(seq) grows by `count`. Write the keys there with write().
  /// @throws qkv::Error if `seq` is not live, count < 0, or the free list is too short (then
  ///         nothing changes).
  std::vector<std::int64_t> allocate_slots(std::int64_t seq, std::int64_t count);

  /// Writes k [T, Hkv, D] and v [T, Hkv, Dv] (float32, float64, bfloat16 or float16, any
  /// strides with a contiguous last dimension) to the pools: token t to slot slot_mapping[t]
  /// (int32 or int64 [T]; -1 skips the token, as vLLM's padding). vLLM's reshape_and_cache.
  /// @throws qkv::Error for mismatched shapes, dtypes, or a slot out of [-1, num_blocks *
  ///         block_size); on error nothing is written.
  void write(const TensorView& k, const TensorView& v, const TensorView& slot_mapping);

  /// The block table of `seqs`, [seqs.size(), max_blocks] int32 with max_blocks the most blocks
  /// one of them holds (at least 1), rows padded with 0; and their lengths, [seqs.size()] int32.
  /// @throws qkv::Error if a sequence is not live.
  Tensor block_table(std::span<const std::int64_t> seqs) const;
  Tensor seq_lens(std::span<const std::int64_t> seqs) const;

  /// Attention of the newest counts[b] keys of each sequence seqs[b] (stored already, by write()
  /// or forward()) as queries over all its keys: attention_paged() with this cache's block table
  /// and lengths. q [T, Hq, D] packed in the order of seqs, T = sum(counts); out [T, Hq, Dv],
  /// softmax_lse [Hq, T]. Query row t of sequence b sits at position length(b) - counts[b] + t
  /// (bottom-right alignment), so `causal = true` is causal attention over the whole sequence.
  /// The serving kernel (kernel automatic, or reference): batch invariant (qkv/varlen.hpp).
  /// @throws qkv::Error as attention_paged(), or for a sequence not live, counts of another size
  ///         than seqs, a count < 0 or > length(seq), or a sum of counts other than q's T.
  void attend(std::span<const std::int64_t> seqs, std::span<const std::int64_t> counts, const TensorView& q,
              const TensorView& out, const AttentionParams& params = {},
              const std::optional<TensorView>& softmax_lse = std::nullopt) const;

  /// One step for the sequences `seqs` (distinct), counts[b] new tokens each, packed in order:
  /// q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] with T = sum(counts). With `rope`, q and k
  /// (float32 or float64) are rotated in place at positions length(seqs[b]) + t (apply_rope).
  /// The new keys and values are stored (allocate_slots(), write()), then out [T, Hq, Dv] (and
  /// softmax_lse [Hq, T]) gets attend(): the new queries over each sequence's keys, the new ones
  /// included (`causal = true` for a decoder). A count of 0 is allowed.
  /// @throws qkv::Error as allocate_slots(), write(), attention_paged(), apply_rope(), or for
  ///         counts of another size than seqs, a repeated sequence, a sum of counts other than T.
  ///         When the pool is too short, or the attention call would refuse its arguments
  ///         (checked before q and k are rotated), nothing changes; when writing the keys fails
  ///         (a NaN or infinity going to a quantized pool), the allocation is undone, but q and k
  ///         have been rotated.
  void forward(std::span<const std::int64_t> seqs, std::span<const std::int64_t> counts, const TensorView& q,
               const TensorView& k, const TensorView& v, const TensorView& out, const AttentionParams& params = {},
               const std::optional<RopeConfig>& rope = std::nullopt,
               const std::optional<TensorView>& softmax_lse = std::nullopt);

 private:
  struct Seq {
    bool live = false;
    std::int64_t length = 0;
    std::vector<std::int32_t> blocks;
  };
  const Seq& live(std::int64_t seq) const;
  // attend()'s call of attention_paged, or (explain) its qkv::explain_dispatch: the same checks,
  // nothing run.
  void paged_call(std::span<const std::int64_t> seqs, std::span<const std::int64_t> counts, const TensorView& q,
                  const TensorView& out, const AttentionParams& params,
                  const std::optional<TensorView>& softmax_lse, bool explain) const;
  std::int64_t num_blocks_ = 0, block_size_ = 0, Hkv_ = 0, D_ = 0, Dv_ = 0;
  std::unique_ptr<detail::KVStorage> store_;  // the pools and their scales: slot n = block n
  std::vector<std::int32_t> free_;   // a stack: the last freed block is taken first
  std::vector<Seq> seqs_;
  std::vector<std::int64_t> free_ids_;
};

}  // namespace qkv
