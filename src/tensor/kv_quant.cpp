// The quantized KV formats: names, scale shapes, the row encoder, quantize_kv / dequantize_kv and
// the checks of a QuantizedKV operand.
#include "qkv/kv_quant.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "tensor/convert.hpp"
#include "tensor/kv_codec.hpp"

namespace qkv {
namespace {

std::string str(std::int64_t x) { return std::to_string(x); }

constexpr KVFormat kAll[] = {KVFormat::f32, KVFormat::bf16, KVFormat::f16, KVFormat::int8, KVFormat::q8_0, KVFormat::fp8};

// Visits every row of a rank-3 [T, H, D] or rank-4 [N, H, S, D] view: fn(row element offset in
// `t`, leading indices i0, h, i2 (i2 = -1 for rank 3)).
template <class Fn> void for_rows(const TensorView& t, Fn fn) {
  if (t.rank() == 3) {
    for (std::int64_t i = 0; i < t.size(0); ++i)
      for (std::int64_t h = 0; h < t.size(1); ++h) fn(i * t.stride(0) + h * t.stride(1), i, h, std::int64_t{-1});
  } else {
    for (std::int64_t n = 0; n < t.size(0); ++n)
      for (std::int64_t h = 0; h < t.size(1); ++h)
        for (std::int64_t s = 0; s < t.size(2); ++s) fn(n * t.stride(0) + h * t.stride(1) + s * t.stride(2), n, h, s);
  }
}

std::string where(std::int64_t i0, std::int64_t h, std::int64_t i2) {
  if (i2 < 0) return "token " + str(i0) + ", head " + str(h);
  return "batch " + str(i0) + ", head " + str(h) + ", token " + str(i2);
}

char* at(const TensorView& t, std::int64_t off) {
  return static_cast<char*>(t.data()) + off * static_cast<std::int64_t>(dtype_size(t.dtype()));
}

// Offset of the scales of the row at (i0, h, i2) of the data.
std::int64_t scale_off(const TensorView& sc, KVFormat f, std::int64_t i0, std::int64_t h, std::int64_t i2) {
  if (f == KVFormat::fp8) return h * sc.stride(0);
  std::int64_t o = i0 * sc.stride(0) + h * sc.stride(1);
  if (i2 >= 0) o += i2 * sc.stride(2);
  return o;
}

}  // namespace

std::string_view kv_format_name(KVFormat f) noexcept {
  switch (f) {
    case KVFormat::f32: return "f32";
    case KVFormat::bf16: return "bf16";
    case KVFormat::f16: return "f16";
    case KVFormat::int8: return "int8";
    case KVFormat::q8_0: return "q8_0";
    case KVFormat::fp8: return "fp8";
  }
  return "?";
}

KVFormat parse_kv_format(std::string_view name, std::string_view what) {
  for (KVFormat f : kAll)
    if (kv_format_name(f) == name) return f;
  throw Error(std::string(what) + ": expected one of f32, bf16, f16, int8, q8_0, fp8, got '" + std::string(name) + "'");
}

bool kv_format_quantized(KVFormat f) noexcept { return f == KVFormat::int8 || f == KVFormat::q8_0 || f == KVFormat::fp8; }

DType kv_format_dtype(KVFormat f) noexcept {
  switch (f) {
    case KVFormat::f32: return DType::f32;
    case KVFormat::bf16: return DType::bf16;
    case KVFormat::f16: return DType::f16;
    case KVFormat::int8: case KVFormat::q8_0: return DType::i8;
    case KVFormat::fp8: return DType::u8;
  }
  return DType::f32;
}

KVFormat kv_format_of(DType d, std::string_view what) {
  if (d == DType::f32) return KVFormat::f32;
  if (d == DType::bf16) return KVFormat::bf16;
  if (d == DType::f16) return KVFormat::f16;
  throw Error(std::string(what) + ": expected dtype float32, bfloat16 or float16, got " + std::string(dtype_name(d)));
}

DType kv_scales_dtype(KVFormat f) noexcept { return f == KVFormat::q8_0 ? DType::f16 : DType::f32; }

Shape kv_scales_shape(KVFormat f, const Shape& s) {
  if (!kv_format_quantized(f) || s.size() < 2) return {};
  if (f == KVFormat::fp8) return {s[1]};
  Shape r(s.begin(), s.end() - 1);
  if (f == KVFormat::q8_0) r.push_back((s.back() + kQ8Block - 1) / kQ8Block);
  return r;
}

namespace detail {

void encode_row(KVFormat f, const float* x, std::int64_t D, void* codes, void* scale_row, float fp8_scale) noexcept {
  switch (f) {
    case KVFormat::f32: std::memcpy(codes, x, static_cast<std::size_t>(D) * 4); return;
    case KVFormat::bf16:
      for (std::int64_t i = 0; i < D; ++i) static_cast<std::uint16_t*>(codes)[i] = float_to_bf16(x[i]);
      return;
    case KVFormat::f16:
      for (std::int64_t i = 0; i < D; ++i) static_cast<std::uint16_t*>(codes)[i] = float_to_half(x[i]);
      return;
    case KVFormat::fp8: {
      const double s = fp8_scale;
      for (std::int64_t i = 0; i < D; ++i) static_cast<std::uint8_t*>(codes)[i] = to_e4m3(static_cast<double>(x[i]) / s);
      return;
    }
    case KVFormat::int8:
    case KVFormat::q8_0: {
      // One scale for the row (int8) or per block of 32 (q8_0): s = max|x| / 127; the quotient x / s
      // is formed in double, exact enough that its rounding to an integer is the exact quotient's.
      const std::int64_t bs = f == KVFormat::int8 ? D : kQ8Block;
      auto* q = static_cast<std::int8_t*>(codes);
      for (std::int64_t a = 0, blk = 0; a < D; a += bs, ++blk) {
        const std::int64_t e = std::min(D, a + bs);
        float amax = 0.0f;
        for (std::int64_t i = a; i < e; ++i) amax = std::max(amax, std::fabs(x[i]));
        float s = amax / 127.0f;
        if (f == KVFormat::q8_0) {
          std::uint16_t h = float_to_half(s);
          if ((h & 0x7fffu) == 0x7c00u) h = 0x7bffu;  // beyond float16: the largest finite, 65504
          static_cast<std::uint16_t*>(scale_row)[blk] = h;
          s = half_to_float(h);
        } else {
          static_cast<float*>(scale_row)[0] = s;
        }
        for (std::int64_t i = a; i < e; ++i) {
          const double r = s > 0.0f ? std::nearbyint(static_cast<double>(x[i]) / s) : 0.0;
          q[i] = static_cast<std::int8_t>(std::clamp(r, -127.0, 127.0));
        }
      }
      return;
    }
  }
}

KVCodec make_codec(const QuantizedKV& x, std::string_view name) {
  const std::string n(name), fname(kv_format_name(x.format));
  const TensorView& d = x.data;
  if (d.rank() != 3 && d.rank() != 4)
    throw Error(n + ": expected 3-D [T,H,D] or 4-D [N,H,S,D] data, got shape " + shape_str(d.shape()));
  if (d.dtype() != kv_format_dtype(x.format))
    throw Error(n + ": expected data of dtype " + std::string(dtype_name(kv_format_dtype(x.format))) + " for format " +
                fname + ", got " + std::string(dtype_name(d.dtype())));
  const std::int64_t D = d.size(d.rank() - 1);
  if (D > 1 && d.stride(d.rank() - 1) != 1)
    throw Error(n + ": expected a contiguous last dimension (stride 1), got stride " + str(d.stride(d.rank() - 1)));
  KVCodec c;
  c.format = x.format;
  c.D = D;
  if (!kv_format_quantized(x.format)) return c;
  const TensorView& s = x.scales;
  const Shape want = kv_scales_shape(x.format, d.shape());
  if (s.shape() != want)
    throw Error(n + ": expected scales of shape " + shape_str(want) + " for format " + fname + " and data " +
                shape_str(d.shape()) + ", got " + shape_str(s.shape()));
  if (s.dtype() != kv_scales_dtype(x.format))
    throw Error(n + ": expected scales of dtype " + std::string(dtype_name(kv_scales_dtype(x.format))) + ", got " +
                std::string(dtype_name(s.dtype())));
  if (s.numel() > 0 && s.data() == nullptr) throw Error(n + ": expected scales with data, got a null pointer");
  c.scales = s.data();
  if (x.format == KVFormat::fp8) {
    c.sh = s.stride(0);
    for (std::int64_t h = 0; h < s.size(0); ++h) {
      const float v = static_cast<const float*>(s.data())[h * c.sh];
      if (!(std::isfinite(v) && v > 0.0f))
        throw Error(n + ": expected fp8 scales finite and > 0, got " + std::to_string(v) + " at head " + str(h));
    }
    return c;
  }
  // The kernels find a row's scales at (data offset / D) * nb: every stride must agree.
  c.nb = x.format == KVFormat::q8_0 ? (D + kQ8Block - 1) / kQ8Block : 1;
  for (int a = 0; a + 1 < d.rank(); ++a) {
    if (d.size(a) <= 1) continue;
    if (D == 0 || d.stride(a) % D != 0 || s.stride(a) * D != d.stride(a) * c.nb)
      throw Error(n + ": expected scales laid out like the rows of data (data stride a multiple of D = " + str(D) +
                  ", scales stride = data stride / D" + (c.nb > 1 ? " * nb" : "") + ") on axis " + str(a) +
                  ", got data stride " + str(d.stride(a)) + " and scales stride " + str(s.stride(a)));
  }
  if (x.format == KVFormat::q8_0 && c.nb > 1 && s.stride(s.rank() - 1) != 1)
    throw Error(n + ": expected contiguous q8_0 block scales (last stride 1), got stride " + str(s.stride(s.rank() - 1)));
  return c;
}

}  // namespace detail

void quantize_kv(const TensorView& x, const QuantizedKV& dst, std::string_view name) {
  const std::string n(name);
  const detail::KVCodec c = detail::make_codec(dst, n + " (destination)");
  if (x.shape() != dst.data.shape())
    throw Error(n + ": expected shape " + shape_str(dst.data.shape()) + " (the destination's), got " + shape_str(x.shape()));
  if (!detail::is_float_dtype(x.dtype()))
    throw Error(n + ": expected a float dtype, got " + std::string(dtype_name(x.dtype())));
  const std::int64_t D = c.D;
  if (D > 1 && x.stride(x.rank() - 1) != 1)
    throw Error(n + ": expected a contiguous last dimension (stride 1), got stride " + str(x.stride(x.rank() - 1)));
  std::vector<float> row(static_cast<std::size_t>(D));
  const bool quant = kv_format_quantized(dst.format);
  // First every value is checked, so that an error writes nothing.
  if (quant)
    for_rows(x, [&](std::int64_t off, std::int64_t i0, std::int64_t h, std::int64_t i2) {
      detail::convert_row(at(x, off), x.dtype(), row.data(), DType::f32, D);
      const std::int64_t bad = detail::first_nonfinite(row.data(), D);
      if (bad >= 0)
        throw Error(n + ": expected finite values for format " + std::string(kv_format_name(dst.format)) + ", got " +
                    std::to_string(row[static_cast<std::size_t>(bad)]) + " at " + where(i0, h, i2) + ", element " + str(bad));
    });
  for_rows(x, [&](std::int64_t off, std::int64_t i0, std::int64_t h, std::int64_t i2) {
    detail::convert_row(at(x, off), x.dtype(), row.data(), DType::f32, D);
    std::int64_t doff = i0 * dst.data.stride(0) + h * dst.data.stride(1);
    if (i2 >= 0) doff += i2 * dst.data.stride(2);
    void* sc = quant ? at(dst.scales, scale_off(dst.scales, dst.format, i0, h, i2)) : nullptr;
    const float fs = dst.format == KVFormat::fp8 ? *static_cast<const float*>(sc) : 1.0f;
    detail::encode_row(dst.format, row.data(), D, at(dst.data, doff), sc, fs);
  });
}

void dequantize_kv(const QuantizedKV& src, const TensorView& out) {
  const detail::KVCodec c = detail::make_codec(src, "src");
  if (out.shape() != src.data.shape())
    throw Error("out: expected shape " + shape_str(src.data.shape()) + " (src's), got " + shape_str(out.shape()));
  if (out.dtype() != DType::f32 && out.dtype() != DType::f64)
    throw Error("out: expected dtype float32 or float64, got " + std::string(dtype_name(out.dtype())));
  if (c.D > 1 && out.stride(out.rank() - 1) != 1)
    throw Error("out: expected a contiguous last dimension (stride 1), got stride " + str(out.stride(out.rank() - 1)));
  std::vector<float> row(static_cast<std::size_t>(c.D));
  for_rows(src.data, [&](std::int64_t off, std::int64_t i0, std::int64_t h, std::int64_t i2) {
    detail::decode_row(c, src.data.data(), off, h, row.data());
    std::int64_t o = i0 * out.stride(0) + h * out.stride(1);
    if (i2 >= 0) o += i2 * out.stride(2);
    detail::convert_row(row.data(), DType::f32, at(out, o), out.dtype(), c.D);
  });
}

}  // namespace qkv
