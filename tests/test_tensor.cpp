// Tensor views, owning tensors and the float16/bfloat16 conversions.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "qkv/error.hpp"
#include "qkv/tensor.hpp"

namespace qkv {
namespace {

// The float16 value nearest to x (ties to even), computed from its definition in float64:
// every float16 is exactly representable, so the two neighbours can be found by search.
std::uint16_t half_oracle(double x) {
  if (std::isnan(x)) return 0x7e00;
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  if (a >= 65520.0) return sign | 0x7c00;  // 65504 + half an ulp (16) rounds to inf
  // Largest h with half_to_float(h) <= a among the finite positive halves.
  std::uint16_t lo = 0, hi = 0x7bff;
  while (lo < hi) {
    const std::uint16_t mid = static_cast<std::uint16_t>((lo + hi + 1) / 2);
    if (half_to_float(mid) <= a) lo = mid; else hi = static_cast<std::uint16_t>(mid - 1);
  }
  const double below = half_to_float(lo);
  if (below == a || lo == 0x7bff) return sign | lo;
  const double above = half_to_float(static_cast<std::uint16_t>(lo + 1));
  const double d0 = a - below, d1 = above - a;
  if (d0 < d1) return sign | lo;
  if (d1 < d0) return sign | static_cast<std::uint16_t>(lo + 1);
  return sign | ((lo & 1) ? static_cast<std::uint16_t>(lo + 1) : lo);
}

// The bfloat16 value nearest to x (ties to even), from float64.
std::uint16_t bf16_oracle(double x) {
  if (std::isnan(x)) return 0x7fc0;
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  std::uint16_t lo = 0, hi = 0x7f7f;  // largest finite bf16
  if (a >= bf16_to_float(0x7f7f) + std::ldexp(1.0, 127 - 8)) return sign | 0x7f80;
  while (lo < hi) {
    const std::uint16_t mid = static_cast<std::uint16_t>((lo + hi + 1) / 2);
    if (bf16_to_float(mid) <= a) lo = mid; else hi = static_cast<std::uint16_t>(mid - 1);
  }
  const double below = bf16_to_float(lo);
  if (below == a || lo == 0x7f7f) return sign | lo;
  const double above = bf16_to_float(static_cast<std::uint16_t>(lo + 1));
  const double d0 = a - below, d1 = above - a;
  if (d0 < d1) return sign | lo;
  if (d1 < d0) return sign | static_cast<std::uint16_t>(lo + 1);
  return sign | ((lo & 1) ? static_cast<std::uint16_t>(lo + 1) : lo);
}

TEST(Tensor, LargeTensorsOnWholeHugePages) {
  // 64-byte alignment always; from 4 MiB up, 2 MiB alignment (whole huge pages); zeros either way
  const Tensor small(DType::f32, {1000});
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(small.data()) % 64, 0u);
  for (const std::int64_t n : {std::int64_t{1} << 20, (std::int64_t{3} << 20) + 5}) {  // 4 MiB, 12 MiB + 20 B
    Tensor t(DType::f32, {n});
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % (std::uintptr_t{2} << 20), 0u) << n;
    const float* f = t.data_as<float>();
    EXPECT_EQ(f[0], 0.0f);
    EXPECT_EQ(f[n - 1], 0.0f);
    t.data_as<float>()[n - 1] = 1.0f;  // the whole size is owned
    EXPECT_EQ(t.numel(), n);
  }
}

TEST(Tensor, HalfRoundTripsEveryValue) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float f = half_to_float(static_cast<std::uint16_t>(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(half_to_float(float_to_half(f)))) << std::hex << h;
      continue;
    }
    ASSERT_EQ(float_to_half(f), h) << std::hex << h;
  }
}

TEST(Tensor, HalfRoundsToNearestEven) {
  // Every midpoint between neighbouring halves, and points just beside it.
  for (std::uint32_t h = 0; h < 0x7bff; ++h) {
    const double a = half_to_float(static_cast<std::uint16_t>(h)), b = half_to_float(static_cast<std::uint16_t>(h + 1));
    const float mid = static_cast<float>((a + b) / 2);  // exact in float
    for (float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f), -mid}) {
      ASSERT_EQ(float_to_half(x), half_oracle(x)) << x;
      ASSERT_EQ(static_cast<std::uint16_t>(float_to_half(x)), std::bit_cast<std::uint16_t>(static_cast<_Float16>(x))) << x;
    }
  }
  EXPECT_EQ(float_to_half(65519.99f), 0x7bff);
  EXPECT_EQ(float_to_half(65520.0f), 0x7c00);
  EXPECT_EQ(float_to_half(1e-9f), 0x0000);
  EXPECT_EQ(float_to_half(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(std::numeric_limits<float>::quiet_NaN()))));
}

TEST(Tensor, Bf16RoundsToNearestEven) {
  std::mt19937 rng(3);
  for (int n = 0; n < 200000; ++n) {
    const float x = std::bit_cast<float>(static_cast<std::uint32_t>(rng()));
    if (std::isnan(x)) continue;
    ASSERT_EQ(float_to_bf16(x), bf16_oracle(x)) << x;
  }
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const float f = bf16_to_float(static_cast<std::uint16_t>(b));
    if (!std::isnan(f)) ASSERT_EQ(float_to_bf16(f), b);
  }
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload lies only in the low 16 bits must stay NaN, not become inf.
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::bit_cast<float>(0x7f800001u)))));
}

// store_from_double must round a float64 once, straight to the target dtype. Rounding to
// float32 first and then to float16/bfloat16 goes wrong when the float32 lands exactly on a
// midpoint: 1 + 2^-11 + 2^-40 is above the float16 midpoint 1 + 2^-11 and must round up.
TEST(Tensor, StoreFromDoubleRoundsOnce) {
  const double h_case = 1.0 + std::ldexp(1.0, -11) + std::ldexp(1.0, -40);
  std::uint16_t out = 0;
  store_from_double(&out, DType::f16, 0, h_case);
  EXPECT_EQ(out, half_oracle(h_case));
  EXPECT_EQ(half_to_float(out), 1.0f + std::ldexp(1.0f, -10));
  const double b_case = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40);
  store_from_double(&out, DType::bf16, 0, b_case);
  EXPECT_EQ(out, bf16_oracle(b_case));
  EXPECT_EQ(bf16_to_float(out), 1.0f + std::ldexp(1.0f, -7));
  // Random doubles, including ones near midpoints.
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(-70000.0, 70000.0);
  for (int n = 0; n < 100000; ++n) {
    double x = u(rng);
    if (n % 2) {  // near a float16 midpoint
      const std::uint16_t h = half_oracle(x);
      const double a = half_to_float(h), b = half_to_float(static_cast<std::uint16_t>(h + 1));
      if (std::isfinite(b)) x = (a + b) / 2 + std::ldexp(a, -45) * ((n % 4) == 1 ? 1 : -1);
    }
    store_from_double(&out, DType::f16, 0, x);
    ASSERT_EQ(out, half_oracle(x)) << x;
    store_from_double(&out, DType::bf16, 0, x);
    ASSERT_EQ(out, bf16_oracle(x)) << x;
  }
  // Values beyond the float32 range still become inf, tiny ones zero.
  store_from_double(&out, DType::bf16, 0, 1e300);
  EXPECT_EQ(out, 0x7f80);
  store_from_double(&out, DType::f16, 0, -1e300);
  EXPECT_EQ(out, 0xfc00);
  store_from_double(&out, DType::f16, 0, 1e-300);
  EXPECT_EQ(out, 0x0000);
  store_from_double(&out, DType::f16, 0, std::nan(""));
  EXPECT_TRUE(std::isnan(half_to_float(out)));
}

TEST(Tensor, LoadAndStoreEveryDtype) {
  std::uint64_t buf[4] = {};
  for (DType d : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64}) {
    store_from_double(buf, d, 2, -3.0);
    EXPECT_EQ(load_as_double(buf, d, 2), -3.0) << dtype_name(d);
  }
  store_from_double(buf, DType::b8, 5, 2.0);
  EXPECT_EQ(load_as_double(buf, DType::b8, 5), 1.0);
  EXPECT_EQ(dtype_size(DType::f64), 8u);
  EXPECT_EQ(dtype_size(DType::bf16), 2u);
  EXPECT_EQ(dtype_size(DType::b8), 1u);
  EXPECT_EQ(dtype_name(DType::bf16), "bfloat16");
  EXPECT_EQ(dtype_name(DType::b8), "bool");
}

TEST(Tensor, ViewsAndPermute) {
  float data[24];
  const TensorView t(data, DType::f32, {2, 3, 4});
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.numel(), 24);
  const TensorView p = t.permute({0, 2, 1});
  EXPECT_EQ(p.shape(), (Shape{2, 4, 3}));
  EXPECT_EQ(p.strides(), (Shape{12, 1, 4}));
  EXPECT_FALSE(p.is_contiguous());
  EXPECT_EQ(p.data(), t.data());
  EXPECT_EQ(shape_str({2, 3}), "[2,3]");
  EXPECT_EQ(shape_str({}), "[]");
  EXPECT_TRUE(TensorView().empty());
  // Size-1 axes may carry any stride and still be contiguous.
  EXPECT_TRUE(TensorView(data, DType::f32, {1, 3}, {99, 1}).is_contiguous());
}

TEST(Tensor, EmptyTensorsAreContiguous) {
  // A Tensor's own view must count as contiguous, whatever its zero-size axes.
  for (const Shape& s : {Shape{3, 0}, Shape{0, 3}, Shape{2, 0, 4}, Shape{0}}) {
    const Tensor t(DType::f32, s);
    EXPECT_EQ(t.numel(), 0);
    EXPECT_TRUE(t.view().is_contiguous()) << shape_str(s);
  }
}

TEST(Tensor, OwningTensorIsAlignedAndZeroed) {
  const Tensor t(DType::f64, {3, 5});
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u);
  EXPECT_EQ(t.nbytes(), 120u);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(t.data_as<double>()[i], 0.0);
  const Tensor s(DType::f32, {});
  EXPECT_EQ(s.numel(), 1);
  const TensorView v = t;
  EXPECT_EQ(v.shape(), (Shape{3, 5}));
}

TEST(Tensor, NumelSaturatesInsteadOfOverflowing) {
  float x = 0;
  const std::int64_t big = std::int64_t(1) << 40;
  EXPECT_EQ(TensorView(&x, DType::f32, {big, big, 1, 8}).numel(), std::numeric_limits<std::int64_t>::max());
  EXPECT_EQ(TensorView(&x, DType::f32, {big, big, 0, 8}).numel(), 0);
  EXPECT_FALSE(TensorView(&x, DType::f32, {big, big, 1, 8}).is_contiguous());
}

TEST(Tensor, CheckedNumel) {
  EXPECT_EQ(checked_numel({2, 3, 4}, 4, "x"), 24);
  EXPECT_EQ(checked_numel({}, 4, "x"), 1);
  EXPECT_EQ(checked_numel({5, 0, std::int64_t(1) << 40, 8}, 4, "x"), 0);
  // Empty, but its C-contiguous strides (8 * 2^62) overflow int64: refused all the same.
  EXPECT_THROW(checked_numel({5, 0, std::int64_t(1) << 62, 8}, 4, "x"), Error);
}

}  // namespace
}  // namespace qkv
