// KV cache of one layer: [B,Hkv,capacity,D] storage, per-sequence lengths, attention through
// qkv::attention() with kv_lens so slots beyond a sequence's length are never read.
#include "qkv/kv_cache.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "qkv/error.hpp"
#include "qkv/varlen.hpp"
#include "tensor/convert.hpp"
#include "tensor/kv_codec.hpp"

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

KVCache::KVCache(std::int64_t batch, std::int64_t num_kv_heads, std::int64_t capacity, std::int64_t head_dim,
                 DType dtype, std::int64_t head_dim_v)
    : B_(batch),
      Hkv_(num_kv_heads),
      capacity_(capacity),
      D_(head_dim),
      Dv_(head_dim_v ? head_dim_v : head_dim),
      dtype_(dtype) {
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
  k_ = Tensor(dtype, {B_, Hkv_, capacity_, D_});
  v_ = Tensor(dtype, {B_, Hkv_, capacity_, Dv_});
  lengths_.assign(static_cast<std::size_t>(B_), 0);
  widened_.assign(static_cast<std::size_t>(B_), 0);
}

KVCache::KVCache(std::int64_t batch, std::int64_t num_kv_heads, std::int64_t capacity, std::int64_t head_dim,
                 KVFormat k_format, KVFormat v_format, std::int64_t head_dim_v)
    : KVCache(batch, num_kv_heads, capacity, head_dim, kv_format_quantized(k_format) ? DType::f32 : kv_format_dtype(k_format),
              head_dim_v) {
  kf_ = k_format;
  vf_ = v_format;
  if (kf_ == kv_format_of(dtype_, "dtype") && vf_ == kf_) return;  // one float format: as the dtype constructor
  quant_ = true;
  dtype_ = kv_format_dtype(kf_);
  k_ = Tensor(kv_format_dtype(kf_), {B_, Hkv_, capacity_, D_});
  v_ = Tensor(kv_format_dtype(vf_), {B_, Hkv_, capacity_, Dv_});
  ks_ = Tensor(kv_scales_dtype(kf_), kv_scales_shape(kf_, k_.shape()));
  vs_ = Tensor(kv_scales_dtype(vf_), kv_scales_shape(vf_, v_.shape()));
  if (kf_ == KVFormat::fp8) std::fill_n(ks_.data_as<float>(), Hkv_, 1.0f);
  if (vf_ == KVFormat::fp8) std::fill_n(vs_.data_as<float>(), Hkv_, 1.0f);
}

void KVCache::set_fp8_scales(std::span<const float> k_scales, std::span<const float> v_scales) {
  if (max_length() != 0)
    throw Error("kv_cache: set_fp8_scales: expected an empty cache (scales change the meaning of stored codes), got " +
                std::to_string(max_length()) + " positions");
  const std::pair<std::span<const float>, const char*> args[] = {{k_scales, "k_scales"}, {v_scales, "v_scales"}};
  for (const auto& [sc, name] : args) {
    if (static_cast<std::int64_t>(sc.size()) != Hkv_)
      throw Error(std::string("kv_cache: ") + name + ": expected Hkv = " + std::to_string(Hkv_) + " scales, got " +
                  std::to_string(sc.size()));
    for (std::size_t h = 0; h < sc.size(); ++h)
      if (!(std::isfinite(sc[h]) && sc[h] > 0.0f))
        throw Error(std::string("kv_cache: ") + name + ": expected finite scales > 0, got " + std::to_string(sc[h]) +
                    " at head " + std::to_string(h));
  }
  if (kf_ == KVFormat::fp8) std::copy(k_scales.begin(), k_scales.end(), ks_.data_as<float>());
  if (vf_ == KVFormat::fp8) std::copy(v_scales.begin(), v_scales.end(), vs_.data_as<float>());
}

QuantizedKV KVCache::quantized_keys(std::int64_t length) const {
  const std::int64_t nb = kf_ == KVFormat::q8_0 ? (D_ + kQ8Block - 1) / kQ8Block : 1;
  return {kf_, TensorView(k_.data(), k_.dtype(), {length, Hkv_, D_}, {D_, capacity_ * D_, 1}),
          scales_view(ks_, kf_, length, nb)};
}

QuantizedKV KVCache::quantized_values(std::int64_t length) const {
  const std::int64_t nb = vf_ == KVFormat::q8_0 ? (Dv_ + kQ8Block - 1) / kQ8Block : 1;
  return {vf_, TensorView(v_.data(), v_.dtype(), {length, Hkv_, Dv_}, {Dv_, capacity_ * Dv_, 1}),
          scales_view(vs_, vf_, length, nb)};
}

TensorView KVCache::scales_view(const Tensor& sc, KVFormat f, std::int64_t length, std::int64_t nb) const {
  if (f == KVFormat::fp8) return sc.view();
  if (f == KVFormat::int8) return TensorView(sc.data(), DType::f32, {length, Hkv_}, {1, capacity_});
  if (f == KVFormat::q8_0) return TensorView(sc.data(), DType::f16, {length, Hkv_, nb}, {nb, capacity_ * nb, 1});
  return {};
}

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

TensorView KVCache::active_keys() const {
  return TensorView(k_.data(), k_.dtype(), {B_, Hkv_, max_length(), D_},
                    {Hkv_ * capacity_ * D_, capacity_ * D_, D_, 1});
}

TensorView KVCache::active_values() const {
  return TensorView(v_.data(), v_.dtype(), {B_, Hkv_, max_length(), Dv_},
                    {Hkv_ * capacity_ * Dv_, capacity_ * Dv_, Dv_, 1});
}

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
  if (quant_) {
    append_quantized(k, v, counts);
    return;
  }
  const std::size_t es = dtype_size(dtype_);
  const std::size_t kes = dtype_size(k.dtype()), ves = dtype_size(v.dtype());
  auto* kd = static_cast<char*>(k_.data());
  auto* vd = static_cast<char*>(v_.data());
  const auto* ks = static_cast<const char*>(k.data());
  const auto* vs = static_cast<const char*>(v.data());
  for (std::int64_t b = 0; b < B_; ++b) {
    const std::int64_t n = counts.empty() ? S : counts[static_cast<std::size_t>(b)];
    const std::int64_t len = lengths_[static_cast<std::size_t>(b)];
    for (std::int64_t h = 0; h < Hkv_; ++h)
      for (std::int64_t t = 0; t < n; ++t) {
        const std::int64_t row = S - n + t;  // ragged batches take their last n rows
        const std::int64_t slot = ((b * Hkv_ + h) * capacity_ + len + t);
        detail::convert_row(
            ks + (b * k.stride(0) + h * k.stride(1) + row * k.stride(2)) * static_cast<std::int64_t>(kes),
            k.dtype(), kd + slot * D_ * static_cast<std::int64_t>(es), dtype_, D_);
        detail::convert_row(
            vs + (b * v.stride(0) + h * v.stride(1) + row * v.stride(2)) * static_cast<std::int64_t>(ves),
            v.dtype(), vd + slot * Dv_ * static_cast<std::int64_t>(es), dtype_, Dv_);
      }
    lengths_[static_cast<std::size_t>(b)] = len + n;
  }
}

void KVCache::append_quantized(const TensorView& k, const TensorView& v, std::span<const std::int64_t> counts) {
  const std::int64_t S = k.size(2);
  std::vector<float> row(static_cast<std::size_t>(std::max(D_, Dv_)));
  const struct { const TensorView* x; KVFormat f; std::int64_t n; const char* name; const Tensor* store; const Tensor* sc; } parts[] = {
      {&k, kf_, D_, "k", &k_, &ks_}, {&v, vf_, Dv_, "v", &v_, &vs_}};
  auto src = [](const TensorView& x, std::int64_t b, std::int64_t h, std::int64_t r) {
    return static_cast<const char*>(x.data()) +
           (b * x.stride(0) + h * x.stride(1) + r * x.stride(2)) * static_cast<std::int64_t>(dtype_size(x.dtype()));
  };
  // Every new value is checked before anything is written: NaN and infinities have no code.
  for (const auto& pt : parts) {
    if (!kv_format_quantized(pt.f)) continue;
    for (std::int64_t b = 0; b < B_; ++b) {
      const std::int64_t n = counts.empty() ? S : counts[static_cast<std::size_t>(b)];
      for (std::int64_t h = 0; h < Hkv_; ++h)
        for (std::int64_t t = 0; t < n; ++t) {
          detail::convert_row(src(*pt.x, b, h, S - n + t), pt.x->dtype(), row.data(), DType::f32, pt.n);
          const std::int64_t bad = detail::first_nonfinite(row.data(), pt.n);
          if (bad >= 0)
            throw Error(std::string("kv_cache: ") + pt.name + ": expected finite values for the " +
                        std::string(kv_format_name(pt.f)) + " cache, got " + std::to_string(row[static_cast<std::size_t>(bad)]) +
                        " at batch " + std::to_string(b) + ", token " + std::to_string(S - n + t) + ", head " + std::to_string(h));
        }
    }
  }
  for (std::int64_t b = 0; b < B_; ++b) {
    const std::int64_t n = counts.empty() ? S : counts[static_cast<std::size_t>(b)];
    const std::int64_t len = lengths_[static_cast<std::size_t>(b)];
    for (const auto& pt : parts)
      for (std::int64_t h = 0; h < Hkv_; ++h)
        for (std::int64_t t = 0; t < n; ++t) {
          const std::int64_t slot = (b * Hkv_ + h) * capacity_ + len + t;
          char* dst = static_cast<char*>(pt.store->data()) + slot * pt.n * static_cast<std::int64_t>(dtype_size(pt.store->dtype()));
          if (!kv_format_quantized(pt.f)) {
            detail::convert_row(src(*pt.x, b, h, S - n + t), pt.x->dtype(), dst, pt.store->dtype(), pt.n);
            continue;
          }
          detail::convert_row(src(*pt.x, b, h, S - n + t), pt.x->dtype(), row.data(), DType::f32, pt.n);
          const std::int64_t nb = pt.f == KVFormat::q8_0 ? (pt.n + kQ8Block - 1) / kQ8Block : 1;
          void* sc = pt.f == KVFormat::fp8 ? nullptr
                                           : static_cast<char*>(pt.sc->data()) + slot * nb * static_cast<std::int64_t>(dtype_size(pt.sc->dtype()));
          const float fs = pt.f == KVFormat::fp8 ? pt.sc->data_as<const float>()[h] : 0.0f;
          detail::encode_row(pt.f, row.data(), pt.n, dst, sc, fs);
        }
    lengths_[static_cast<std::size_t>(b)] = len + n;
  }
}

// Attention over a quantized (or mixed-format) cache: the serving kernel directly on the codes,
// one attention_varlen call per sequence over its first length(b) positions.
void KVCache::attend_quantized(const TensorView& q, const TensorView& out, const AttentionParams& params,
                               const std::optional<TensorView>& softmax_lse) {
  if (params.mask)
    throw Error("kv_cache: params.mask: expected none for a cache in formats " + std::string(kv_format_name(kf_)) + "/" +
                std::string(kv_format_name(vf_)) + " (causal and window masks only)");
  if (q.rank() != 4 || out.rank() != 4)
    throw Error("kv_cache: q, out: expected 4-D tensors [B,Hq,Sq,D] and [B,Hq,Sq,Dv], got shapes " + shape_str(q.shape()) +
                " and " + shape_str(out.shape()));
  if (out.size(0) != B_ || out.size(1) != q.size(1) || out.size(2) != q.size(2) || out.size(3) != Dv_)
    throw Error("kv_cache: out: expected shape " + shape_str({B_, q.size(1), q.size(2), Dv_}) + ", got " + shape_str(out.shape()));
  if (softmax_lse && (softmax_lse->rank() != 3 || softmax_lse->shape() != Shape{B_, q.size(1), q.size(2)}))
    throw Error("kv_cache: softmax_lse: expected shape " + shape_str({B_, q.size(1), q.size(2)}) + ", got " +
                shape_str(softmax_lse->shape()));
  const std::int64_t Sq = q.size(2), Hq = q.size(1);
  AttentionParams p = params;
  for (std::int64_t b = 0; b < B_; ++b) {
    const std::int64_t len = lengths_[static_cast<std::size_t>(b)], n = std::min(Sq, len), pad = Sq - n;
    // Rows before the sequence's first position (ragged padding): zero output, lse -inf.
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i = 0; i < pad; ++i) {
        for (std::int64_t d = 0; d < Dv_; ++d)
          store_from_double(out.data(), out.dtype(), b * out.stride(0) + h * out.stride(1) + i * out.stride(2) + d, 0.0);
        if (softmax_lse)
          store_from_double(softmax_lse->data(), softmax_lse->dtype(),
                            b * softmax_lse->stride(0) + h * softmax_lse->stride(1) + i * softmax_lse->stride(2),
                            -std::numeric_limits<double>::infinity());
      }
    if (n == 0) continue;
    const auto at = [](const TensorView& t, std::int64_t off) {
      return static_cast<char*>(t.data()) + off * static_cast<std::int64_t>(dtype_size(t.dtype()));
    };
    const TensorView qb(at(q, b * q.stride(0) + pad * q.stride(2)), q.dtype(), {n, Hq, q.size(3)}, {q.stride(2), q.stride(1), 1});
    const TensorView ob(at(out, b * out.stride(0) + pad * out.stride(2)), out.dtype(), {n, Hq, Dv_},
                        {out.stride(2), out.stride(1), 1});
    std::optional<TensorView> lb;
    if (softmax_lse)
      lb = TensorView(at(*softmax_lse, b * softmax_lse->stride(0) + pad * softmax_lse->stride(2)), softmax_lse->dtype(),
                      {Hq, n}, {softmax_lse->stride(1), softmax_lse->stride(2)});
    QuantizedKV kq = quantized_keys(len), vq = quantized_values(len);
    const auto shift = [&](QuantizedKV& x, std::int64_t X) {  // sequence b's rows
      x.data = TensorView(at(x.data, b * Hkv_ * capacity_ * X), x.data.dtype(), x.data.shape(), x.data.strides());
      if (x.format == KVFormat::int8 || x.format == KVFormat::q8_0) {
        const std::int64_t nb = x.format == KVFormat::q8_0 ? x.scales.size(2) : 1;
        x.scales = TensorView(at(x.scales, b * Hkv_ * capacity_ * nb), x.scales.dtype(), x.scales.shape(), x.scales.strides());
      }
    };
    shift(kq, D_);
    shift(vq, Dv_);
    std::int32_t cq[2] = {0, static_cast<std::int32_t>(n)}, ck[2] = {0, static_cast<std::int32_t>(len)};
    attention_varlen(qb, kq, vq, ob, TensorView(cq, DType::i32, {2}), TensorView(ck, DType::i32, {2}), p, lb);
  }
}

void KVCache::attend(const TensorView& q, const TensorView& out, const AttentionParams& params,
                     const std::optional<TensorView>& softmax_lse, const std::optional<TensorView>& probs) {
  if (params.kv_lens)
    throw Error("kv_cache: params.kv_lens: expected none (the cache supplies its per-sequence lengths)");
  if (params.align != Alignment::bottom_right)
    throw Error(
        "kv_cache: params.align: expected bottom_right (queries are the newest cached tokens), got top_left");
  if (q.rank() == 4 && q.size(0) != B_)
    throw Error("kv_cache: q: expected [B,Hq,Sq,D] with B == cache B (" + std::to_string(B_) + "), got shape " +
                shape_str(q.shape()));
  if (quant_) {
    if (probs)
      throw Error("kv_cache: probs: expected none for a cache in formats " + std::string(kv_format_name(kf_)) + "/" +
                  std::string(kv_format_name(vf_)));
    attend_quantized(q, out, params, softmax_lse);
    return;
  }
  AttentionParams p = params;
  const TensorView lens(lengths_.data(), DType::i64, {B_});
  p.kv_lens = lens;
  TensorView k = active_keys(), v = active_values();
  if (detail::is_float_dtype(q.dtype()) && q.dtype() != dtype_) {
    // Keep a copy in q's dtype, converted incrementally: only positions appended since the last
    // call are converted, so a decode step costs O(new tokens), not O(cached tokens).
    if (scratch_k_.dtype() != q.dtype() || scratch_k_.numel() != k_.numel()) {
      scratch_k_ = Tensor(q.dtype(), k_.shape());
      scratch_v_ = Tensor(q.dtype(), v_.shape());
      std::fill(widened_.begin(), widened_.end(), 0);
    }
    const auto es = static_cast<std::int64_t>(dtype_size(dtype_)),
               qs = static_cast<std::int64_t>(dtype_size(q.dtype()));
    for (std::int64_t b = 0; b < B_; ++b) {
      const std::int64_t to = lengths_[static_cast<std::size_t>(b)];
      const std::int64_t from = std::min(widened_[static_cast<std::size_t>(b)], to);
      for (std::int64_t h = 0; h < Hkv_; ++h) {
        const std::int64_t row = (b * Hkv_ + h) * capacity_ + from;
        detail::convert_row(static_cast<const char*>(k_.data()) + row * D_ * es, dtype_,
                            static_cast<char*>(scratch_k_.data()) + row * D_ * qs, q.dtype(),
                            (to - from) * D_);
        detail::convert_row(static_cast<const char*>(v_.data()) + row * Dv_ * es, dtype_,
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
