#pragma once
// Row conversion between the floating storage dtypes, with fast paths for the common pairs.
#include <cstdint>
#include <cstring>

#include "qkv/tensor.hpp"

namespace qkv::detail {

inline bool is_float_dtype(DType d) noexcept {
  return d == DType::f32 || d == DType::f64 || d == DType::f16 || d == DType::bf16;
}

/// Copies n contiguous elements of dtype `sd` to `dd` (rounding to nearest even when narrowing).
inline void convert_row(const void* src, DType sd, void* dst, DType dd, std::int64_t n) noexcept {
  if (sd == dd) {
    std::memcpy(dst, src, static_cast<std::size_t>(n) * dtype_size(sd));
  } else if (sd == DType::f32 && dd == DType::bf16) {
    const auto* s = static_cast<const float*>(src);
    auto* d = static_cast<std::uint16_t*>(dst);
    for (std::int64_t i = 0; i < n; ++i) d[i] = float_to_bf16(s[i]);
  } else if (sd == DType::bf16 && dd == DType::f32) {
    const auto* s = static_cast<const std::uint16_t*>(src);
    auto* d = static_cast<float*>(dst);
    for (std::int64_t i = 0; i < n; ++i) d[i] = bf16_to_float(s[i]);
  } else if (sd == DType::f32 && dd == DType::f64) {
    const auto* s = static_cast<const float*>(src);
    auto* d = static_cast<double*>(dst);
    for (std::int64_t i = 0; i < n; ++i) d[i] = s[i];
  } else if (sd == DType::f64 && dd == DType::f32) {
    const auto* s = static_cast<const double*>(src);
    auto* d = static_cast<float*>(dst);
    for (std::int64_t i = 0; i < n; ++i) d[i] = static_cast<float>(s[i]);
  } else {
    for (std::int64_t i = 0; i < n; ++i) store_from_double(dst, dd, i, load_as_double(src, sd, i));
  }
}

}  // namespace qkv::detail
