// KV cache of one layer: the addressing of its storage (slot b = sequence b, capacity positions;
// the rows themselves in detail::KVStorage, kv_storage.hpp) and the per-sequence lengths; attention
// through qkv::attention() with kv_lens, so slots beyond a sequence's length are never read, or
// through attention_varlen per sequence on the stored codes.
#include "qkv/kv_cache.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "cache/kv_storage.hpp"
#include "qkv/error.hpp"
#include "qkv/varlen.hpp"
#include "tensor/convert.hpp"

namespace qkv {
namespace {

void check_kv_input(const TensorView& t, const char* name, const char* axes, std::int64_t B, std::int64_t Hkv,
                    std::int64_t X, const char* xl) {
  if (t.rank() != 4)
    throw Error(std::string("kv_cache: ") + name + ": expected a 4-D tensor " + axes + ", got shape " +
                shape_str(t.shape()));
  if (t.size(3) > 1 && t.stride(3) != 1)
    throw Error(std::string("kv_cache: ") + name +
                ": expected a contiguous last dimension (stride 1), got stride " + std::to_string(t.stride(3)));
  if (!detail::is_float_dtype(t.dtype()))
    throw Error(std::string("kv_cache: ") + name +
                ": expected dtype float32, float64, float16 or bfloat16, got " +
                std::string(dtype_name(t.dtype())));
  if (t.size(0) != B || t.size(1) != Hkv || t.size(3) != X)
    throw Error(std::string("kv_cache: ") + name + ": expected " + axes + " with B = " + std::to_string(B) + ", Hkv = " +
                std::to_string(Hkv) + ", " + xl + " = " + std::to_string(X) + " (the cache's), got shape " + shape_str(t.shape()));
  if (!t.data() && t.numel() > 0) throw Error(std::string("kv_cache: ") + name + ": data pointer is null");
}

}  // namespace

KVCache::KVCache() : store_(std::make_unique<detail::KVStorage>(DType::f32, 0, 0, 0, 0, 0)) {}
KVCache::KVCache(KVCache&&) noexcept = default;
KVCache& KVCache::operator=(KVCache&&) noexcept = default;
KVCache::~KVCache() = default;

KVCache::KVCache(std::int64_t batch, std::int64_t num_kv_heads, std::int64_t capacity, std::int64_t head_dim,
                 DType dtype, std::int64_t head_dim_v)
    : B_(batch),
      Hkv_(num_kv_heads),
      capacity_(capacity),
      D_(head_dim),
      Dv_(head_dim_v ? head_dim_v : head_dim) {
  if (batch < 0 || num_kv_heads < 0 || capacity < 0)
    throw Error("kv_cache: expected batch, num_kv_heads and capacity >= 0, got B = " + std::to_string(batch) +
                ", Hkv = " + std::to_string(num_kv_heads) + ", capacity = " + std::to_string(capacity));
  if (head_dim < 1 || head_dim_v < 0)
    throw Error("kv_cache: expected head_dim D >= 1 and head_dim_v Dv >= 0 (0 = D), got D = " + std::to_string(head_dim) +
                ", Dv = " + std::to_string(head_dim_v));
  if (!detail::is_float_dtype(dtype))
    throw Error("kv_cache: dtype: expected float32, float64, bfloat16 or float16, got " +
                std::string(dtype_name(dtype)));
  checked_numel({B_, Hkv_, capacity_, D_}, dtype_size(dtype), "kv_cache: keys");
  checked_numel({B_, Hkv_, capacity_, Dv_}, dtype_size(dtype), "kv_cache: values");
  store_ = std::make_unique<detail::KVStorage>(dtype, B_, Hkv_, capacity_, D_, Dv_);
  lengths_.assign(static_cast<std::size_t>(B_), 0);
  widened_.assign(static_cast<std::size_t>(B_), 0);
}

KVCache::KVCache(std::int64_t batch, std::int64_t num_kv_heads, std::int64_t capacity, std::int64_t head_dim,
                 KVFormat k_format, KVFormat v_format, std::int64_t head_dim_v)
    : KVCache(batch, num_kv_heads, capacity, head_dim, kv_format_quantized(k_format) ? DType::f32 : kv_format_dtype(k_format),
              head_dim_v) {
  // One float format: as the dtype constructor.
  if (k_format == kv_format_of(dtype(), "dtype") && v_format == k_format) return;
  store_ = std::make_unique<detail::KVStorage>(k_format, v_format, B_, Hkv_, capacity_, D_, Dv_);
}

DType KVCache::dtype() const noexcept { return store_->dtype(); }
KVFormat KVCache::k_format() const noexcept { return store_->k_format(); }
KVFormat KVCache::v_format() const noexcept { return store_->v_format(); }
TensorView KVCache::key_scales() const { return store_->key_scales(); }
TensorView KVCache::value_scales() const { return store_->value_scales(); }
TensorView KVCache::keys() const { return store_->key_data(); }
TensorView KVCache::values() const { return store_->value_data(); }

void KVCache::set_fp8_scales(std::span<const float> k_scales, std::span<const float> v_scales) {
  if (max_length() != 0)
    throw Error("kv_cache: set_fp8_scales: expected an empty cache (scales change the meaning of stored codes), got " +
                std::to_string(max_length()) + " positions");
  store_->set_fp8_scales(k_scales, v_scales, "kv_cache: ");
}

QuantizedKV KVCache::sequence_keys(std::int64_t b) const { return store_->slot_keys(b, length(b)); }
QuantizedKV KVCache::sequence_values(std::int64_t b) const { return store_->slot_values(b, length(b)); }

std::int64_t KVCache::length(std::int64_t b) const {
  if (b < 0 || b >= B_)
    throw Error("kv_cache: b: expected a sequence index in [0, " + std::to_string(B_) + "), got " + std::to_string(b));
  return lengths_[static_cast<std::size_t>(b)];
}

std::int64_t KVCache::max_length() const noexcept {
  std::int64_t m = 0;
  for (auto l : lengths_) m = std::max(m, l);
  return m;
}

TensorView KVCache::active_keys() const { return store_->leading_keys(max_length()); }
TensorView KVCache::active_values() const { return store_->leading_values(max_length()); }

std::vector<std::int64_t> KVCache::next_positions(std::int64_t S,
                                                  std::span<const std::int64_t> counts) const {
  if (S < 0) throw Error("kv_cache: S: expected a token count >= 0, got " + std::to_string(S));
  if (!counts.empty() && static_cast<std::int64_t>(counts.size()) != B_)
    throw Error("kv_cache: counts: expected B = " + std::to_string(B_) + " entries, got " +
                std::to_string(static_cast<std::int64_t>(counts.size())));
  std::vector<std::int64_t> pos(static_cast<std::size_t>(B_ * S));
  for (std::int64_t b = 0; b < B_; ++b) {
    const std::int64_t start = lengths_[static_cast<std::size_t>(b)] -
                               (counts.empty() ? 0 : S - counts[static_cast<std::size_t>(b)]);
    // Padding rows of a ragged batch would get negative positions; clamp them to 0 (their
    // outputs are ignored, and RoPE refuses negative positions).
    for (std::int64_t t = 0; t < S; ++t)
      pos[static_cast<std::size_t>(b * S + t)] = std::max<std::int64_t>(0, start + t);
  }
  return pos;
}

void KVCache::append(const TensorView& k, const TensorView& v, std::span<const std::int64_t> counts) {
  check_kv_input(k, "k", "[B,Hkv,S,D]", B_, Hkv_, D_, "D");
  check_kv_input(v, "v", "[B,Hkv,S,Dv]", B_, Hkv_, Dv_, "Dv");
  const std::int64_t S = k.size(2);
  if (v.size(2) != S)
    throw Error("kv_cache: v: expected [B,Hkv,S,Dv] with S == k.S (" + std::to_string(S) + "), got S = " + std::to_string(v.size(2)));
  if (!counts.empty() && static_cast<std::int64_t>(counts.size()) != B_)
    throw Error("kv_cache: counts: expected B = " + std::to_string(B_) + " entries, got " +
                std::to_string(static_cast<std::int64_t>(counts.size())));
  for (std::int64_t b = 0; b < B_; ++b) {
    const std::int64_t n = counts.empty() ? S : counts[static_cast<std::size_t>(b)];
    if (n < 0 || n > S)
      throw Error("kv_cache: counts: expected each count in [0, S] = [0, " + std::to_string(S) + "], got " + std::to_string(n) +
                  " at batch " + std::to_string(b));
    const std::int64_t len = lengths_[static_cast<std::size_t>(b)];
    if (n > capacity_ - len)
      throw Error("kv_cache: append of " + std::to_string(n) + " tokens to sequence " + std::to_string(b) + " at length " + std::to_string(len) +
                  " exceeds the capacity " + std::to_string(capacity_) + " (" + std::to_string(len + n) + " > " + std::to_string(capacity_) + ")");
  }
  // Row (b, h, len + t) of the storage takes source row S - n + t (ragged batches take their last n rows).
  std::vector<detail::KVStorage::RowWrite> rows;
  rows.reserve(static_cast<std::size_t>(B_ * Hkv_ * S));
  for (std::int64_t b = 0; b < B_; ++b) {
    const std::int64_t n = counts.empty() ? S : counts[static_cast<std::size_t>(b)];
    const std::int64_t len = lengths_[static_cast<std::size_t>(b)];
    for (std::int64_t h = 0; h < Hkv_; ++h)
      for (std::int64_t t = 0; t < n; ++t) {
        const std::int64_t row = S - n + t;
        rows.push_back({b * k.stride(0) + h * k.stride(1) + row * k.stride(2),
                        b * v.stride(0) + h * v.stride(1) + row * v.stride(2),
                        (b * Hkv_ + h) * capacity_ + len + t, h, b, row});
      }
  }
  store_->write(k, v, rows, "kv_cache: ");
  for (std::int64_t b = 0; b < B_; ++b)
    lengths_[static_cast<std::size_t>(b)] += counts.empty() ? S : counts[static_cast<std::size_t>(b)];
}

void KVCache::check_attend(const TensorView& q, const AttentionParams& params) const {
  if (params.kv_lens)
    throw Error("kv_cache: params.kv_lens: expected none (the cache supplies its per-sequence lengths)");
  if (params.align != Alignment::bottom_right)
    throw Error(
        "kv_cache: params.align: expected bottom_right (queries are the newest cached tokens), got top_left");
  if (q.rank() == 4 && q.size(0) != B_)
    throw Error("kv_cache: q: expected [B,Hq,Sq,D] with B == cache B (" + std::to_string(B_) + "), got shape " +
                shape_str(q.shape()));
}

std::string KVCache::formats() const {
  return std::string(kv_format_name(k_format())) + "/" + std::string(kv_format_name(v_format()));
}

// One attention_varlen call per sequence, of its last min(Sq, length(b)) query rows over its
// first length(b) positions, on the stored codes.
void KVCache::attend_sequences(const TensorView& q, const TensorView& out, const AttentionParams& params,
                               const std::optional<TensorView>& softmax_lse) {
  if (params.mask)
    throw Error("kv_cache: params.mask: expected none for a cache in formats " + formats() +
                " (causal and window masks only)");
  if (q.rank() != 4 || out.rank() != 4)
    throw Error("kv_cache: q, out: expected 4-D tensors [B,Hq,Sq,D] and [B,Hq,Sq,Dv], got shapes " + shape_str(q.shape()) +
                " and " + shape_str(out.shape()));
  if (out.size(0) != B_ || out.size(1) != q.size(1) || out.size(2) != q.size(2) || out.size(3) != Dv_)
    throw Error("kv_cache: out: expected shape " + shape_str({B_, q.size(1), q.size(2), Dv_}) + ", got " + shape_str(out.shape()));
  if (softmax_lse && (softmax_lse->rank() != 3 || softmax_lse->shape() != Shape{B_, q.size(1), q.size(2)}))
    throw Error("kv_cache: softmax_lse: expected shape " + shape_str({B_, q.size(1), q.size(2)}) + ", got " +
                shape_str(softmax_lse->shape()));
  const std::int64_t Sq = q.size(2), Hq = q.size(1);
  const auto at = [](const TensorView& t, std::int64_t off) {
    return static_cast<char*>(t.data()) + off * static_cast<std::int64_t>(dtype_size(t.dtype()));
  };
  // Sequence b's call: its last n = min(Sq, length(b)) query rows over its positions, or (explain)
  // qkv::explain_dispatch of that call, which checks the same and runs nothing.
  const auto call = [&](std::int64_t b, bool explain) {
    const std::int64_t len = lengths_[static_cast<std::size_t>(b)], n = std::min(Sq, len), pad = Sq - n;
    const TensorView qb(at(q, b * q.stride(0) + pad * q.stride(2)), q.dtype(), {n, Hq, q.size(3)}, {q.stride(2), q.stride(1), 1});
    const TensorView ob(at(out, b * out.stride(0) + pad * out.stride(2)), out.dtype(), {n, Hq, Dv_},
                        {out.stride(2), out.stride(1), 1});
    std::optional<TensorView> lb;
    if (softmax_lse)
      lb = TensorView(at(*softmax_lse, b * softmax_lse->stride(0) + pad * softmax_lse->stride(2)), softmax_lse->dtype(),
                      {Hq, n}, {softmax_lse->stride(1), softmax_lse->stride(2)});
    std::int32_t cq[2] = {0, static_cast<std::int32_t>(n)}, ck[2] = {0, static_cast<std::int32_t>(len)};
    const TensorView cu_q(cq, DType::i32, {2}), cu_k(ck, DType::i32, {2});
    // [B, Hq] ALiBi slopes: the sequence's own row, as the [Hq] slopes of its one-sequence call.
    AttentionParams pb = params;
    if (params.alibi_slopes && params.alibi_slopes->rank() == 2 && params.alibi_slopes->size(0) == B_) {
      const TensorView& a = *params.alibi_slopes;
      pb.alibi_slopes = TensorView(at(a, b * a.stride(0)), a.dtype(), {a.size(1)}, {a.stride(1)});
    }
    if (explain)
      (void)explain_dispatch(qb, sequence_keys(b), sequence_values(b), ob, cu_q, cu_k, pb, lb);
    else
      attention_varlen(qb, sequence_keys(b), sequence_values(b), ob, cu_q, cu_k, pb, lb);
  };
  // Nothing is written unless every call will run: the calls' checks first (each sequence's when
  // a kernel is forced, since it may refuse one sequence and not another; otherwise the first's,
  // as the checks do not depend on the sequence then), then the calls, then the padding rows.
  if (q.size(3) != D_)
    throw Error("kv_cache: q: expected [B,Hq,Sq,D] with D == cache D (" + std::to_string(D_) + "), got shape " +
                shape_str(q.shape()));
  for (std::int64_t b = 0; b < (params.kernel == KernelKind::automatic ? std::min<std::int64_t>(B_, 1) : B_); ++b)
    call(b, true);
  for (std::int64_t b = 0; b < B_; ++b)
    if (std::min(Sq, lengths_[static_cast<std::size_t>(b)]) > 0) call(b, false);
  // Rows before a sequence's first position (ragged padding): zero output, lse -inf.
  for (std::int64_t b = 0; b < B_; ++b) {
    const std::int64_t pad = Sq - std::min(Sq, lengths_[static_cast<std::size_t>(b)]);
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < pad; ++i) {
        for (std::int64_t d = 0; d < Dv_; ++d)
          store_from_double(out.data(), out.dtype(), b * out.stride(0) + h * out.stride(1) + i * out.stride(2) + d, 0.0);
        if (softmax_lse)
          store_from_double(softmax_lse->data(), softmax_lse->dtype(),
                            b * softmax_lse->stride(0) + h * softmax_lse->stride(1) + i * softmax_lse->stride(2),
                            -std::numeric_limits<double>::infinity());
      }
  }
}

void KVCache::attend_varlen(const TensorView& q, const TensorView& out, const AttentionParams& params,
                            const std::optional<TensorView>& softmax_lse) {
  check_attend(q, params);
  if (dtype() == DType::f64)
    throw Error(
        "kv_cache: attend_varlen: expected a cache in a KVFormat (f32, bf16, f16, int8, q8_0, fp8), got float64");
  attend_sequences(q, out, params, softmax_lse);
}

void KVCache::attend(const TensorView& q, const TensorView& out, const AttentionParams& params,
                     const std::optional<TensorView>& softmax_lse, const std::optional<TensorView>& probs) {
  check_attend(q, params);
  if (store_->mixed_or_quantized()) {
    if (probs) throw Error("kv_cache: probs: expected none for a cache in formats " + formats());
    attend_sequences(q, out, params, softmax_lse);
    return;
  }
  AttentionParams p = params;
  const TensorView lens(lengths_.data(), DType::i64, {B_});
  p.kv_lens = lens;
  TensorView k = active_keys(), v = active_values();
  const DType dt = dtype();
  if (detail::is_float_dtype(q.dtype()) && q.dtype() != dt) {
    // Keep a copy in q's dtype, converted incrementally: only positions appended since the last
    // call are converted, so a decode step costs O(new tokens), not O(cached tokens).
    const TensorView ks = keys(), vs = values();
    if (scratch_k_.dtype() != q.dtype() || scratch_k_.numel() != ks.numel()) {
      scratch_k_ = Tensor(q.dtype(), ks.shape());
      scratch_v_ = Tensor(q.dtype(), vs.shape());
      std::fill(widened_.begin(), widened_.end(), 0);
    }
    const auto es = static_cast<std::int64_t>(dtype_size(dt)),
               qs = static_cast<std::int64_t>(dtype_size(q.dtype()));
    for (std::int64_t b = 0; b < B_; ++b) {
      const std::int64_t to = lengths_[static_cast<std::size_t>(b)];
      const std::int64_t from = std::min(widened_[static_cast<std::size_t>(b)], to);
      for (std::int64_t h = 0; h < Hkv_; ++h) {
        const std::int64_t row = (b * Hkv_ + h) * capacity_ + from;
        detail::convert_row(static_cast<const char*>(ks.data()) + row * D_ * es, dt,
                            static_cast<char*>(scratch_k_.data()) + row * D_ * qs, q.dtype(),
                            (to - from) * D_);
        detail::convert_row(static_cast<const char*>(vs.data()) + row * Dv_ * es, dt,
                            static_cast<char*>(scratch_v_.data()) + row * Dv_ * qs, q.dtype(),
                            (to - from) * Dv_);
      }
      widened_[static_cast<std::size_t>(b)] = to;
    }
    const std::int64_t L = max_length();
    k = TensorView(scratch_k_.data(), q.dtype(), {B_, Hkv_, L, D_},
                   {Hkv_ * capacity_ * D_, capacity_ * D_, D_, 1});
    v = TensorView(scratch_v_.data(), q.dtype(), {B_, Hkv_, L, Dv_},
                   {Hkv_ * capacity_ * Dv_, capacity_ * Dv_, Dv_, 1});
  }
  attention(q, k, v, out, p, softmax_lse, probs);
}

void KVCache::clear() noexcept {
  std::fill(lengths_.begin(), lengths_.end(), 0);
  std::fill(widened_.begin(), widened_.end(), 0);
}

void KVCache::truncate(std::int64_t length) {
  if (length < 0) throw Error("kv_cache: length: expected >= 0, got " + std::to_string(length));
  for (auto& l : lengths_) l = std::min(l, length);
  for (auto& w : widened_) w = std::min(w, length);
}

void KVCache::truncate(std::span<const std::int64_t> lengths) {
  if (static_cast<std::int64_t>(lengths.size()) != B_)
    throw Error("kv_cache: lengths: expected B = " + std::to_string(B_) + " entries, got " +
                std::to_string(static_cast<std::int64_t>(lengths.size())));
  for (std::size_t b = 0; b < lengths.size(); ++b)
    if (lengths[b] < 0)
      throw Error("kv_cache: lengths: expected >= 0, got " + std::to_string(lengths[b]) + " at batch " +
                  std::to_string(static_cast<std::int64_t>(b)));
  for (std::size_t b = 0; b < lengths.size(); ++b) {
    lengths_[b] = std::min(lengths_[b], lengths[b]);
    widened_[b] = std::min(widened_[b], lengths_[b]);
  }
}

}  // namespace qkv
