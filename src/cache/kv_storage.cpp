// KVStorage: the rows of a cache's keys and values in their formats, their scales, the writes that
// quantize them and the views the attention ops read (kv_storage.hpp).
#include "cache/kv_storage.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "tensor/convert.hpp"
#include "tensor/kv_codec.hpp"

namespace qkv::detail {
namespace {

using i64 = std::int64_t;

char* at(const Tensor& t, i64 off) {
  return static_cast<char*>(t.data()) + off * static_cast<i64>(dtype_size(t.dtype()));
}

// Scale entries per row: nb blocks for q8_0, one for int8.
i64 scales_per_row(KVFormat f, i64 X) { return f == KVFormat::q8_0 ? (X + kQ8Block - 1) / kQ8Block : 1; }

}  // namespace

KVStorage::Part KVStorage::make_part(KVFormat f, DType dtype, i64 N, i64 H, i64 S, i64 X) {
  Part p{f, Tensor(dtype, {N, H, S, X}), Tensor(), N, H, S, X};
  if (kv_format_quantized(f)) p.scales = Tensor(kv_scales_dtype(f), kv_scales_shape(f, p.data.shape()));
  if (f == KVFormat::fp8) std::fill_n(p.scales.data_as<float>(), H, 1.0f);
  return p;
}

KVStorage::KVStorage(KVFormat k_format, KVFormat v_format, i64 N, i64 H, i64 S, i64 D, i64 Dv)
    : k_(make_part(k_format, kv_format_dtype(k_format), N, H, S, D)),
      v_(make_part(v_format, kv_format_dtype(v_format), N, H, S, Dv)) {}

KVStorage::KVStorage(DType dtype, i64 N, i64 H, i64 S, i64 D, i64 Dv)
    : k_(make_part(dtype == DType::f64 ? KVFormat::f32 : kv_format_of(dtype, "dtype"), dtype, N, H, S, D)),
      v_(make_part(k_.format, dtype, N, H, S, Dv)) {}

bool KVStorage::mixed_or_quantized() const noexcept {
  return k_.format != v_.format || kv_format_quantized(k_.format) || kv_format_quantized(v_.format);
}

QuantizedKV KVStorage::slot(const Part& p, i64 n, i64 length) {
  const i64 H = p.H, S = p.S, X = p.X;
  QuantizedKV x{p.format, TensorView(at(p.data, n * H * S * X), p.data.dtype(), {length, H, X}, {X, S * X, 1}),
                {}};
  if (p.format == KVFormat::fp8) {
    x.scales = p.scales.view();
  } else if (p.format == KVFormat::int8) {
    x.scales = TensorView(at(p.scales, n * H * S), DType::f32, {length, H}, {1, S});
  } else if (p.format == KVFormat::q8_0) {
    const i64 nb = scales_per_row(p.format, X);
    x.scales = TensorView(at(p.scales, n * H * S * nb), DType::f16, {length, H, nb}, {nb, S * nb, 1});
  }
  return x;
}

TensorView KVStorage::leading(const Part& p, i64 length) {
  const i64 N = p.N, H = p.H, S = p.S, X = p.X;
  return TensorView(p.data.data(), p.data.dtype(), {N, H, length, X}, {H * S * X, S * X, X, 1});
}

void KVStorage::set_fp8_scales(std::span<const float> k_scales, std::span<const float> v_scales,
                               std::string_view prefix) {
  const i64 H = k_.H;
  const std::pair<std::span<const float>, const char*> args[] = {{k_scales, "k_scales"},
                                                                 {v_scales, "v_scales"}};
  for (const auto& [sc, name] : args) {
    if (static_cast<i64>(sc.size()) != H)
      throw Error(std::string(prefix) + name + ": expected Hkv = " + std::to_string(H) + " scales, got " +
                  std::to_string(sc.size()));
    for (std::size_t h = 0; h < sc.size(); ++h)
      if (!(std::isfinite(sc[h]) && sc[h] > 0.0f))
        throw Error(std::string(prefix) + name + ": expected finite scales > 0, got " +
                    std::to_string(sc[h]) + " at head " + std::to_string(h));
  }
  if (k_.format == KVFormat::fp8) std::copy(k_scales.begin(), k_scales.end(), k_.scales.data_as<float>());
  if (v_.format == KVFormat::fp8) std::copy(v_scales.begin(), v_scales.end(), v_.scales.data_as<float>());
}

void KVStorage::write(const TensorView& k, const TensorView& v, std::span<const RowWrite> rows,
                      std::string_view prefix) {
  const struct {
    const TensorView* x;
    Part* p;
    const char* name;
    i64 RowWrite::*src;
  } parts[] = {{&k, &k_, "k", &RowWrite::k_src}, {&v, &v_, "v", &RowWrite::v_src}};
  const auto src = [](const TensorView& x, i64 off) {
    return static_cast<const char*>(x.data()) + off * static_cast<i64>(dtype_size(x.dtype()));
  };
  std::vector<float> row(static_cast<std::size_t>(std::max(k_.X, v_.X)));
  // Every row going to a quantized part is checked before anything is written: NaN and
  // infinities have no code.
  for (const auto& pt : parts) {
    if (!kv_format_quantized(pt.p->format)) continue;
    for (const RowWrite& r : rows) {
      convert_row(src(*pt.x, r.*pt.src), pt.x->dtype(), row.data(), DType::f32, pt.p->X);
      const i64 bad = first_nonfinite(row.data(), pt.p->X);
      if (bad >= 0)
        throw Error(std::string(prefix) + pt.name + ": expected finite values for the " +
                    std::string(kv_format_name(pt.p->format)) + " cache, got " +
                    std::to_string(row[static_cast<std::size_t>(bad)]) + " at " +
                    (r.batch >= 0 ? "batch " + std::to_string(r.batch) + ", " : std::string()) + "token " +
                    std::to_string(r.token) + ", head " + std::to_string(r.head));
    }
  }
  for (const RowWrite& r : rows)
    for (const auto& pt : parts) {
      const Part& p = *pt.p;
      char* dst = at(p.data, r.row * p.X);
      if (!kv_format_quantized(p.format)) {
        convert_row(src(*pt.x, r.*pt.src), pt.x->dtype(), dst, p.data.dtype(), p.X);
        continue;
      }
      convert_row(src(*pt.x, r.*pt.src), pt.x->dtype(), row.data(), DType::f32, p.X);
      if (p.format == KVFormat::fp8)
        encode_row(p.format, row.data(), p.X, dst, nullptr, p.scales.data_as<const float>()[r.head]);
      else
        encode_row(p.format, row.data(), p.X, dst, at(p.scales, r.row * scales_per_row(p.format, p.X)), 0.0f);
    }
}

}  // namespace qkv::detail
