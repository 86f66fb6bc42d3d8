// PagedKVCache: the addressing of pools of fixed-size blocks (the rows themselves in
// detail::KVStorage, kv_storage.hpp: slot n = block n), a free list, per-sequence block lists and
// block tables; attention through attention_paged, and the step that rotates, stores and attends.
#include "qkv/paged_kv_cache.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "cache/kv_storage.hpp"
#include "qkv/error.hpp"
#include "qkv/varlen.hpp"
#include "tensor/convert.hpp"

namespace qkv {
namespace {

using i64 = std::int64_t;
std::string str(i64 x) { return std::to_string(x); }

void check_rank3(const TensorView& t, const char* name, const char* axes) {
  if (t.rank() != 3)
    throw Error(std::string(name) + ": expected a 3-D tensor " + axes + ", got rank " + str(t.rank()) + " with shape " +
                shape_str(t.shape()));
  if (t.size(2) > 1 && t.stride(2) != 1)
    throw Error(std::string(name) + ": expected a contiguous last dimension (stride 1), got stride " + str(t.stride(2)));
  if (!detail::is_float_dtype(t.dtype()))
    throw Error(std::string(name) + ": expected dtype float32, float64, float16 or bfloat16, got " +
                std::string(dtype_name(t.dtype())));
}

void check_count_size(std::span<const i64> seqs, std::span<const i64> counts) {
  if (counts.size() != seqs.size())
    throw Error("counts: expected one count per sequence (" + str(static_cast<i64>(seqs.size())) + "), got " +
                str(static_cast<i64>(counts.size())));
}

KVFormat pool_format(DType dtype) {
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16)
    throw Error("dtype: expected float32, bfloat16 or float16 for the pools, got " + std::string(dtype_name(dtype)));
  return kv_format_of(dtype, "dtype");
}

}  // namespace

PagedKVCache::PagedKVCache() : store_(std::make_unique<detail::KVStorage>(DType::f32, 0, 0, 0, 0, 0)) {}
PagedKVCache::PagedKVCache(PagedKVCache&&) noexcept = default;
PagedKVCache& PagedKVCache::operator=(PagedKVCache&&) noexcept = default;
PagedKVCache::~PagedKVCache() = default;

PagedKVCache::PagedKVCache(i64 num_blocks, i64 block_size, i64 num_kv_heads, i64 head_dim, DType dtype, i64 head_dim_v)
    : PagedKVCache(num_blocks, block_size, num_kv_heads, head_dim, pool_format(dtype), pool_format(dtype), head_dim_v) {}

PagedKVCache::PagedKVCache(i64 num_blocks, i64 block_size, i64 num_kv_heads, i64 head_dim, KVFormat k_format,
                           KVFormat v_format, i64 head_dim_v)
    : num_blocks_(num_blocks), block_size_(block_size), Hkv_(num_kv_heads), D_(head_dim),
      Dv_(head_dim_v == 0 ? head_dim : head_dim_v) {
  if (num_blocks < 1 || num_blocks > std::numeric_limits<std::int32_t>::max())
    throw Error("num_blocks: expected 1 .. 2^31 - 1 (int32 block ids), got " + str(num_blocks));
  if (block_size < 16) throw Error("block_size: expected >= 16, got " + str(block_size));
  if (num_kv_heads < 1) throw Error("num_kv_heads: expected >= 1, got " + str(num_kv_heads));
  if (head_dim < 1) throw Error("head_dim: expected >= 1, got " + str(head_dim));
  if (head_dim_v < 0) throw Error("head_dim_v: expected >= 0 (0 = head_dim), got " + str(head_dim_v));
  store_ = std::make_unique<detail::KVStorage>(k_format, v_format, num_blocks, Hkv_, block_size, D_, Dv_);
  free_.reserve(static_cast<std::size_t>(num_blocks));
  for (i64 b = num_blocks - 1; b >= 0; --b) free_.push_back(static_cast<std::int32_t>(b));
}

DType PagedKVCache::dtype() const noexcept { return store_->dtype(); }
KVFormat PagedKVCache::k_format() const noexcept { return store_->k_format(); }
KVFormat PagedKVCache::v_format() const noexcept { return store_->v_format(); }
TensorView PagedKVCache::key_pool() const { return store_->key_data(); }
TensorView PagedKVCache::value_pool() const { return store_->value_data(); }
TensorView PagedKVCache::key_scales() const { return store_->key_scales(); }
TensorView PagedKVCache::value_scales() const { return store_->value_scales(); }
QuantizedKV PagedKVCache::keys() const { return store_->keys(); }
QuantizedKV PagedKVCache::values() const { return store_->values(); }

void PagedKVCache::set_fp8_scales(std::span<const float> k_scales, std::span<const float> v_scales) {
  if (num_free_blocks() != num_blocks_)
    throw Error("set_fp8_scales: expected an empty cache (scales change the meaning of stored codes), got " +
                str(num_blocks_ - num_free_blocks()) + " blocks in use");
  store_->set_fp8_scales(k_scales, v_scales, "");
}

const PagedKVCache::Seq& PagedKVCache::live(i64 seq) const {
  if (seq < 0 || seq >= static_cast<i64>(seqs_.size()) || !seqs_[static_cast<std::size_t>(seq)].live)
    throw Error("seq: expected a live sequence id (from add_sequence, not freed), got " + str(seq));
  return seqs_[static_cast<std::size_t>(seq)];
}

i64 PagedKVCache::add_sequence() {
  i64 id;
  if (!free_ids_.empty()) {
    id = free_ids_.back();
    free_ids_.pop_back();
  } else {
    id = static_cast<i64>(seqs_.size());
    seqs_.emplace_back();
  }
  Seq& s = seqs_[static_cast<std::size_t>(id)];
  s.live = true;
  s.length = 0;
  s.blocks.clear();
  return id;
}

void PagedKVCache::free_sequence(i64 seq) {
  live(seq);
  Seq& s = seqs_[static_cast<std::size_t>(seq)];
  // Back to the stack in reverse, so that a sequence of the same length would take them in order.
  for (auto it = s.blocks.rbegin(); it != s.blocks.rend(); ++it) free_.push_back(*it);
  s.blocks.clear();
  s.length = 0;
  s.live = false;
  free_ids_.push_back(seq);
}

i64 PagedKVCache::length(i64 seq) const { return live(seq).length; }
std::span<const std::int32_t> PagedKVCache::blocks(i64 seq) const { return live(seq).blocks; }

std::vector<i64> PagedKVCache::allocate_slots(i64 seq, i64 count) {
  live(seq);
  if (count < 0) throw Error("count: expected >= 0, got " + str(count));
  Seq& s = seqs_[static_cast<std::size_t>(seq)];
  const i64 need = (s.length + count + block_size_ - 1) / block_size_ - static_cast<i64>(s.blocks.size());
  if (need > num_free_blocks())
    throw Error("count: expected at most the free blocks' room, got " + str(count) + " keys needing " + str(need) +
                " blocks with " + str(num_free_blocks()) + " free");
  for (i64 x = 0; x < need; ++x) {
    s.blocks.push_back(free_.back());
    free_.pop_back();
  }
  std::vector<i64> slots(static_cast<std::size_t>(count));
  for (i64 t = 0; t < count; ++t) {
    const i64 j = s.length + t;
    slots[static_cast<std::size_t>(t)] = i64{s.blocks[static_cast<std::size_t>(j / block_size_)]} * block_size_ + j % block_size_;
  }
  s.length += count;
  return slots;
}

void PagedKVCache::write(const TensorView& k, const TensorView& v, const TensorView& slot_mapping) {
  check_rank3(k, "k", "[T,Hkv,D]");
  check_rank3(v, "v", "[T,Hkv,Dv]");
  const i64 T = k.size(0);
  if (k.size(1) != Hkv_ || k.size(2) != D_)
    throw Error("k: expected shape [T,Hkv,D] with Hkv = " + str(Hkv_) + ", D = " + str(D_) + ", got " + shape_str(k.shape()));
  if (v.size(0) != T || v.size(1) != Hkv_ || v.size(2) != Dv_)
    throw Error("v: expected shape [T,Hkv,Dv] = " + shape_str({T, Hkv_, Dv_}) + ", got " + shape_str(v.shape()));
  if (slot_mapping.rank() != 1 || slot_mapping.size(0) != T)
    throw Error("slot_mapping: expected shape [T] = " + shape_str({T}) + ", got " + shape_str(slot_mapping.shape()));
  if (slot_mapping.dtype() != DType::i32 && slot_mapping.dtype() != DType::i64)
    throw Error("slot_mapping: expected dtype int32 or int64, got " + std::string(dtype_name(slot_mapping.dtype())));
  const i64 nslots = num_blocks_ * block_size_;
  std::vector<i64> slots(static_cast<std::size_t>(T));
  for (i64 t = 0; t < T; ++t) {
    const i64 off = t * slot_mapping.stride(0);
    const i64 s = slot_mapping.dtype() == DType::i32 ? slot_mapping.data_as<const std::int32_t>()[off]
                                                     : slot_mapping.data_as<const std::int64_t>()[off];
    if (s < -1 || s >= nslots)
      throw Error("slot_mapping: expected slots in [-1, num_blocks * block_size) = [-1, " + str(nslots) + "), got " +
                  str(s) + " at " + str(t));
    slots[static_cast<std::size_t>(t)] = s;
  }
  std::vector<detail::KVStorage::RowWrite> rows;
  rows.reserve(static_cast<std::size_t>(T * Hkv_));
  for (i64 t = 0; t < T; ++t) {
    const i64 s = slots[static_cast<std::size_t>(t)];
    if (s < 0) continue;
    const i64 blk = s / block_size_, off = s % block_size_;
    for (i64 h = 0; h < Hkv_; ++h)
      rows.push_back({t * k.stride(0) + h * k.stride(1), t * v.stride(0) + h * v.stride(1),
                      (blk * Hkv_ + h) * block_size_ + off, h, -1, t});
  }
  store_->write(k, v, rows, "");
}

Tensor PagedKVCache::block_table(std::span<const i64> seqs) const {
  std::size_t width = 1;
  for (i64 s : seqs) width = std::max(width, live(s).blocks.size());
  Tensor t(DType::i32, {static_cast<i64>(seqs.size()), static_cast<i64>(width)});
  std::fill_n(t.data_as<std::int32_t>(), t.numel(), 0);
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    const auto& bl = live(seqs[b]).blocks;
    std::copy(bl.begin(), bl.end(), t.data_as<std::int32_t>() + b * width);
  }
  return t;
}

Tensor PagedKVCache::seq_lens(std::span<const i64> seqs) const {
  Tensor t(DType::i32, {static_cast<i64>(seqs.size())});
  for (std::size_t b = 0; b < seqs.size(); ++b) t.data_as<std::int32_t>()[b] = static_cast<std::int32_t>(live(seqs[b]).length);
  return t;
}

void PagedKVCache::attend(std::span<const i64> seqs, std::span<const i64> counts, const TensorView& q,
                          const TensorView& out, const AttentionParams& params,
                          const std::optional<TensorView>& softmax_lse) const {
  paged_call(seqs, counts, q, out, params, softmax_lse, false);
}

void PagedKVCache::paged_call(std::span<const i64> seqs, std::span<const i64> counts, const TensorView& q,
                              const TensorView& out, const AttentionParams& params,
                              const std::optional<TensorView>& softmax_lse, bool explain) const {
  check_count_size(seqs, counts);
  Tensor cu(DType::i32, {static_cast<i64>(seqs.size()) + 1});
  cu.data_as<std::int32_t>()[0] = 0;
  i64 total = 0;
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    const i64 len = live(seqs[b]).length;
    if (counts[b] < 0 || counts[b] > len)
      throw Error("counts: expected a count in [0, length(seq)] = [0, " + str(len) + "], got " + str(counts[b]) +
                  " at " + str(static_cast<i64>(b)));
    total += counts[b];
    cu.data_as<std::int32_t>()[b + 1] = static_cast<std::int32_t>(total);
  }
  if (q.rank() == 3 && q.size(0) != total)
    throw Error("q: expected T = sum(counts) = " + str(total) + " tokens, got " + str(q.size(0)));
  if (explain)
    (void)explain_dispatch(q, keys(), values(), out, cu, seq_lens(seqs), block_table(seqs), params, softmax_lse);
  else
    attention_paged(q, keys(), values(), out, cu, seq_lens(seqs), block_table(seqs), params, softmax_lse);
}

void PagedKVCache::forward(std::span<const i64> seqs, std::span<const i64> counts, const TensorView& q, const TensorView& k,
                           const TensorView& v, const TensorView& out, const AttentionParams& params,
                           const std::optional<RopeConfig>& rope, const std::optional<TensorView>& softmax_lse) {
  check_count_size(seqs, counts);
  check_rank3(q, "q", "[T,Hq,D]");
  check_rank3(k, "k", "[T,Hkv,D]");
  check_rank3(v, "v", "[T,Hkv,Dv]");
  i64 total = 0, need = 0;
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    const Seq& s = live(seqs[b]);
    for (std::size_t c = 0; c < b; ++c)
      if (seqs[c] == seqs[b]) throw Error("seqs: expected distinct sequences, got " + str(seqs[b]) + " twice");
    if (counts[b] < 0) throw Error("counts: expected >= 0, got " + str(counts[b]) + " at " + str(static_cast<i64>(b)));
    total += counts[b];
    need += (s.length + counts[b] + block_size_ - 1) / block_size_ - static_cast<i64>(s.blocks.size());
  }
  if (q.size(0) != total || k.size(0) != total || v.size(0) != total)
    throw Error("q: expected T = sum(counts) = " + str(total) + " tokens in q, k and v, got " + str(q.size(0)) + ", " +
                str(k.size(0)) + ", " + str(v.size(0)));
  if (need > num_free_blocks())
    throw Error("counts: expected at most the free blocks' room, got " + str(total) + " new keys needing " + str(need) +
                " blocks with " + str(num_free_blocks()) + " free");

  // Allocate, remembering how to undo it; then check the attention call's arguments before q and
  // k are rotated, so that a refused call changes nothing.
  std::vector<std::pair<i64, std::size_t>> undo;  // (old length, old block count) per sequence
  Tensor slots(DType::i64, {total});
  i64 t = 0;
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    const Seq& s = live(seqs[b]);
    undo.emplace_back(s.length, s.blocks.size());
    for (i64 sl : allocate_slots(seqs[b], counts[b])) slots.data_as<i64>()[t++] = sl;
  }
  const auto undo_allocation = [&] {
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      Seq& s = seqs_[static_cast<std::size_t>(seqs[b])];
      while (s.blocks.size() > undo[b].second) {
        free_.push_back(s.blocks.back());
        s.blocks.pop_back();
      }
      s.length = undo[b].first;
    }
  };
  try {
    paged_call(seqs, counts, q, out, params, softmax_lse, true);
    if (rope) {
      std::vector<i64> pos(static_cast<std::size_t>(total));
      i64 r = 0;
      for (std::size_t b = 0; b < seqs.size(); ++b)
        for (i64 x = 0; x < counts[b]; ++x) pos[static_cast<std::size_t>(r++)] = undo[b].first + x;
      const auto bhsd = [](const TensorView& x) {
        return TensorView(x.data(), x.dtype(), {1, x.size(1), x.size(0), x.size(2)}, {0, x.stride(1), x.stride(0), x.stride(2)});
      };
      apply_rope(bhsd(q), pos, *rope);
      apply_rope(bhsd(k), pos, *rope);
    }
    write(k, v, slots);
    attend(seqs, counts, q, out, params, softmax_lse);
  } catch (...) {
    undo_allocation();
    throw;
  }
}

}  // namespace qkv
