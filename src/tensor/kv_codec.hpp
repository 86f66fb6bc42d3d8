#pragma once
// The element codecs of the quantized KV formats (qkv/kv_quant.hpp), inline so that the kernels
// (compiled once per ISA level) and quantize_kv/dequantize_kv decode with the same operations:
// a dequantized value is one float32 product, code * scale, so a kernel reading the quantized
// cache computes exactly what it computes on the float32 cache that dequantize_kv produces.
// The functions are static (internal linkage): each translation unit, compiled with its own ISA
// flags (src/kernels/simd/<isa>/), keeps its own copy.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "qkv/kv_quant.hpp"

namespace qkv::detail {

static inline float bits_to_float(std::uint32_t u) noexcept {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// float8 e4m3fn bits to float, exactly: a normal code (exponent field e >= 1) moves to float32
/// with its exponent rebased by 127 - 7 = 120, 2^(e - 7) (1 + m/8); a subnormal one is m 2^-9.
/// Both are formed and one is selected (branch-free, vectorizable). 0x7f and 0xff (NaN) are
/// never written by the encoder.
static inline float e4m3_to_float(std::uint8_t b) noexcept {
  // Integer operations only (a select and an or for the sign), so that loops over a row vectorize.
  const std::uint32_t mag = b & 0x7fu;
  const std::uint32_t normal = (mag + (120u << 3)) << 20;
  float sub = static_cast<float>(mag & 7u) * 0x1p-9f;
  std::uint32_t sub_bits;
  std::memcpy(&sub_bits, &sub, 4);
  const std::uint32_t bits = (mag >= 8u ? normal : sub_bits) | (std::uint32_t{b & 0x80u} << 24);
  return bits_to_float(bits);
}

/// A finite value to float8 e4m3fn: round to nearest even, saturating at +-448 (the largest
/// finite value). Taken in double so that x / scale is rounded once, here.
static inline std::uint8_t to_e4m3(double x) noexcept {
  const std::uint8_t sign = std::signbit(x) ? 0x80u : 0x00u;
  const double a = std::fabs(x);
  if (!(a < 464.0)) return sign | 0x7eu;  // 464 is the midpoint of 448 and 512: ties go to 448 (even)
  if (a < 0x1p-6) {                         // subnormal: steps of 2^-9 (8 rounds up to 2^-6 = 0x08)
    return sign | static_cast<std::uint8_t>(std::nearbyint(a * 0x1p9));
  }
  int e;
  const double f = std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1): exponent field e - 1 + 7
  const auto m = static_cast<std::uint32_t>(std::nearbyint((f * 2.0 - 1.0) * 8.0));  // 0..8: 8 carries
  const std::uint32_t code = (static_cast<std::uint32_t>(e + 6) << 3) + m;
  return sign | static_cast<std::uint8_t>(code > 0x7eu ? 0x7eu : code);
}

/// float16 bits to float, exactly.
static inline float half_bits_to_f32(std::uint16_t h) noexcept {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    const float f = static_cast<float>(m) * 0x1p-24f;
    return sign ? -f : f;
  }
  if (e == 31) return bits_to_float(sign | 0x7f800000u | (m << 13));
  return bits_to_float(sign | ((e + 112) << 23) | (m << 13));
}

/// Where the scales of a quantized K or V operand live, as the kernels read them: for a row of
/// D elements at element offset `off` of the data (off a multiple of D), int8 reads
/// scales[off / D], q8_0 reads scales[(off / D) * nb + block], fp8 reads scales[head * sh].
struct KVCodec {
  KVFormat format = KVFormat::f32;
  const void* scales = nullptr;
  std::int64_t D = 0, nb = 0, sh = 0;
};

/// Decodes the row of D elements at element offset `off` of `data` (KV head hk) to float32.
static inline void decode_row(const KVCodec& c, const void* data, std::int64_t off, std::int64_t hk, float* dst) noexcept {
  const std::int64_t D = c.D;
  switch (c.format) {
    case KVFormat::int8: {
      const auto* s = static_cast<const std::int8_t*>(data) + off;
      const float sc = static_cast<const float*>(c.scales)[off / D];
      for (std::int64_t i = 0; i < D; ++i) dst[i] = static_cast<float>(s[i]) * sc;
      break;
    }
    case KVFormat::q8_0: {
      const auto* s = static_cast<const std::int8_t*>(data) + off;
      const auto* d = static_cast<const std::uint16_t*>(c.scales) + (off / D) * c.nb;
      for (std::int64_t blk = 0; blk < c.nb; ++blk) {
        const float sc = half_bits_to_f32(d[blk]);
        const std::int64_t a = blk * kQ8Block, e = a + kQ8Block < D ? a + kQ8Block : D;
        for (std::int64_t i = a; i < e; ++i) dst[i] = static_cast<float>(s[i]) * sc;
      }
      break;
    }
    case KVFormat::fp8: {
      const auto* s = static_cast<const std::uint8_t*>(data) + off;
      const float sc = static_cast<const float*>(c.scales)[hk * c.sh];
      for (std::int64_t i = 0; i < D; ++i) dst[i] = e4m3_to_float(s[i]) * sc;
      break;
    }
    case KVFormat::f32: std::memcpy(dst, static_cast<const float*>(data) + off, static_cast<std::size_t>(D) * 4); break;
    case KVFormat::bf16: {
      const auto* s = static_cast<const std::uint16_t*>(data) + off;
      for (std::int64_t i = 0; i < D; ++i) dst[i] = bits_to_float(std::uint32_t{s[i]} << 16);
      break;
    }
    case KVFormat::f16: {
      const auto* s = static_cast<const std::uint16_t*>(data) + off;
      for (std::int64_t i = 0; i < D; ++i) dst[i] = half_bits_to_f32(s[i]);
      break;
    }
  }
}

/// Index of the first NaN or infinity of x[0, n), or -1.
static inline std::int64_t first_nonfinite(const float* x, std::int64_t n) noexcept {
  for (std::int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return i;
  return -1;
}

/// Encodes one row of D finite floats: the codes to `codes` (D elements of the format's dtype);
/// int8 writes its float scale to scale_row[0], q8_0 its nb float16 scales to scale_row[0..nb);
/// fp8 divides by `fp8_scale` (> 0). Absmax scales, round to nearest even, saturating.
void encode_row(KVFormat f, const float* x, std::int64_t D, void* codes, void* scale_row, float fp8_scale) noexcept;

/// Checks a QuantizedKV operand (rank 3 [T, H, D] or 4 [N, H, S, D] data of the format's dtype,
/// scales of the format's dtype, shape and strides, see qkv/kv_quant.hpp) and returns how the
/// kernels read its scales. `D_expected` >= 0 also checks head_dim.
/// @throws qkv::Error naming `name`.
KVCodec make_codec(const QuantizedKV& x, std::string_view name);

}  // namespace qkv::detail
