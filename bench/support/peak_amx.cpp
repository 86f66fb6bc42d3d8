// AMX loop of the peak microbenchmarks: tdpbf16ps on four independent accumulator tiles.
#include <immintrin.h>

#include <cstdint>

#include "peak_kernels.hpp"

namespace qkv::bench::detail {

float amx_loop(std::int64_t iters) noexcept {
  struct Config {
    std::uint8_t palette = 1, start_row = 0;
    std::uint8_t reserved[14] = {};
    std::uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    std::uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  };
  alignas(64) static constexpr Config kConfig{};
  // bf16 2^-10 everywhere: 32 products of 2^-20 per element and instruction, far from overflow.
  alignas(64) std::uint16_t ab[16 * 32];
  for (auto& x : ab) x = 0x3a80;
  _tile_loadconfig(&kConfig);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ab, 64);
  _tile_loadd(5, ab, 64);
  _tile_loadd(6, ab, 64);
  _tile_loadd(7, ab, 64);
  for (std::int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float c[256];
  _tile_stored(0, c, 64);
  _tile_release();
  return c[0];
}

}  // namespace qkv::bench::detail
