// Inputs found by the fuzz targets of tests/fuzz (scripts/fuzz.sh), each kept with the behaviour
// it must have now. Add one case per crash: the bytes as found, and what the reader must do.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "qkv/error.hpp"
#include "qkv/npy.hpp"
#include "qkv/tensor.hpp"

namespace {

std::span<const std::byte> as_bytes(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

// fuzz_npy, crash-2bc900150cad1b0776ab67b700394d85ab5d5d3d: an empty shape (0, 3333333333333,
// 333333333) passed the element-count check (the count is 0), then computing its C-contiguous
// strides overflowed int64 (undefined behaviour, reported by UBSan). Now refused.
TEST(FuzzRegressions, NpyEmptyShapeWithOverflowingStrides) {
  const std::string bytes(
      "\x93NUMPY\x01\x00v\x00{'descr': '>i4', 'fortran_order': False, 'shape': (0, 3333333333333,333333333), }"
      "         , } c  \x93NUMPY\x03?     \x00\x00        \x00",
      0x83);
  try {
    qkv::parse_npy(as_bytes(bytes), "crash.npy");
    ADD_FAILURE() << "accepted";
  } catch (const qkv::Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("crash.npy: not a valid .npy file: the element count of shape "
                                          "[0,3333333333333,333333333] overflows", 0), 0u)
        << e.what();
  }
  // The same shape as a view is refused when constructed: its strides do not fit int64.
  EXPECT_THROW(qkv::TensorView(nullptr, qkv::DType::i32, {0, 3333333333333, 333333333}), qkv::Error);
  EXPECT_THROW(qkv::checked_numel({0, 3333333333333, 333333333}, 4, "v"), qkv::Error);
}

}  // namespace
