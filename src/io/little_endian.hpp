#pragma once
// Little-endian loads from file bytes, correct on any host and at any alignment (the llama2.c
// checkpoint and tokenizer formats are little-endian).
#include <bit>
#include <cstddef>
#include <cstdint>

namespace qkv::detail {

inline std::uint32_t load_u32(const std::byte* p) noexcept {
  return static_cast<std::uint32_t>(p[0]) | static_cast<std::uint32_t>(p[1]) << 8 |
         static_cast<std::uint32_t>(p[2]) << 16 | static_cast<std::uint32_t>(p[3]) << 24;
}
inline std::int32_t load_i32(const std::byte* p) noexcept { return static_cast<std::int32_t>(load_u32(p)); }
inline float load_f32(const std::byte* p) noexcept { return std::bit_cast<float>(load_u32(p)); }

}  // namespace qkv::detail
