// The quantized KV formats (qkv/kv_quant.hpp): round trips with their exact error bounds, the
// e4m3 code table, saturation, NaN/inf refused with the token and head named, argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/kv_quant.hpp"
#include "tensor/kv_codec.hpp"

using namespace qkv;
using i64 = std::int64_t;

namespace {

// [T, H, D] rows of normal values with per-row magnitudes from 1e-3 to 1e3, some rows zero and
// some with one outlier (the case absmax scaling handles worst).
Tensor random_rows(i64 T, i64 H, i64 D, std::uint64_t seed) {
  Tensor x(DType::f32, {T, H, D});
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::uniform_real_distribution<float> mag(-3.0f, 3.0f);
  for (i64 r = 0; r < T * H; ++r) {
    const float m = std::pow(10.0f, mag(rng));
    for (i64 d = 0; d < D; ++d) x.data_as<float>()[r * D + d] = r % 7 == 3 ? 0.0f : n(rng) * m;
    if (r % 5 == 1) x.data_as<float>()[r * D + (r % D)] *= 40.0f;
  }
  return x;
}

QuantizedKV make(KVFormat f, const Tensor& data, const Tensor& scales) { return {f, data.view(), scales.view()}; }

// The finite e4m3 values, by code.
double e4m3_value(int c) {
  const int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
  const double mag = e == 0 ? m * std::ldexp(1.0, -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -mag : mag;
}

}  // namespace

TEST(KVQuant, FormatNames) {
  for (const char* n : {"f32", "bf16", "f16", "int8", "q8_0", "fp8"}) EXPECT_EQ(kv_format_name(parse_kv_format(n)), n);
  try {
    parse_kv_format("int4", "--kv-dtype");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "--kv-dtype: expected one of f32, bf16, f16, int8, q8_0, fp8, got 'int4'");
  }
  EXPECT_EQ(kv_scales_shape(KVFormat::q8_0, {3, 2, 40}), (Shape{3, 2, 2}));
  EXPECT_EQ(kv_scales_shape(KVFormat::int8, {4, 3, 5, 8}), (Shape{4, 3, 5}));
  EXPECT_EQ(kv_scales_shape(KVFormat::fp8, {4, 3, 5, 8}), (Shape{3}));
}

// int8: s = max|x| / 127 in float32, code = round(x / s) (nearest even), |code| <= 127 with 127 at
// the absmax element, and |x - code * s| <= s / 2 + the rounding of the float32 product.
TEST(KVQuant, Int8RoundTripWithinHalfAStep) {
  for (i64 D : {1, 7, 64, 128, 130}) {
    const i64 T = 23, H = 3;
    const Tensor x = random_rows(T, H, D, 10 + D);
    Tensor codes(DType::i8, {T, H, D}), sc(DType::f32, {T, H}), back(DType::f32, {T, H, D});
    const QuantizedKV q = make(KVFormat::int8, codes, sc);
    quantize_kv(x, q, "k");
    dequantize_kv(q, back);
    for (i64 r = 0; r < T * H; ++r) {
      const float* xr = x.data_as<float>() + r * D;
      float amax = 0;
      for (i64 d = 0; d < D; ++d) amax = std::max(amax, std::fabs(xr[d]));
      const float s = sc.data_as<float>()[r];
      ASSERT_EQ(s, amax / 127.0f) << "row " << r;
      int top = 0;
      for (i64 d = 0; d < D; ++d) {
        const int c = codes.data_as<std::int8_t>()[r * D + d];
        ASSERT_LE(std::abs(c), 127);
        top = std::max(top, std::abs(c));
        const double want = s > 0 ? std::nearbyint(static_cast<double>(xr[d]) / s) : 0.0;
        ASSERT_EQ(c, static_cast<int>(std::clamp(want, -127.0, 127.0))) << "row " << r << " d " << d;
        const double y = back.data_as<float>()[r * D + d];
        ASSERT_EQ(y, static_cast<double>(static_cast<float>(c) * s));
        ASSERT_LE(std::fabs(xr[d] - y), 0.5 * s + std::fabs(y) * 0x1p-24) << "row " << r << " d " << d;
      }
      if (amax > 0) EXPECT_EQ(top, 127) << "row " << r;
    }
  }
}

// q8_0: blocks of 32 along D (the last one shorter), d = fp16(max|x| / 127), the same bound per
// block with s = d.
TEST(KVQuant, Q80RoundTripWithinHalfABlockStep) {
  for (i64 D : {8, 32, 40, 128}) {
    const i64 T = 17, H = 2, nb = (D + 31) / 32;
    const Tensor x = random_rows(T, H, D, 20 + D);
    Tensor codes(DType::i8, {T, H, D}), sc(DType::f16, {T, H, nb}), back(DType::f32, {T, H, D});
    const QuantizedKV q = make(KVFormat::q8_0, codes, sc);
    quantize_kv(x, q, "v");
    dequantize_kv(q, back);
    for (i64 r = 0; r < T * H; ++r)
      for (i64 blk = 0; blk < nb; ++blk) {
        const float* xr = x.data_as<float>() + r * D;
        float amax = 0;
        for (i64 d = blk * 32; d < std::min(D, blk * 32 + 32); ++d) amax = std::max(amax, std::fabs(xr[d]));
        const float dsc = half_to_float(sc.data_as<std::uint16_t>()[r * nb + blk]);
        ASSERT_EQ(dsc, half_to_float(float_to_half(amax / 127.0f)));
        for (i64 d = blk * 32; d < std::min(D, blk * 32 + 32); ++d) {
          const double y = back.data_as<float>()[r * D + d];
          ASSERT_LE(std::abs(codes.data_as<std::int8_t>()[r * D + d]), 127);
          ASSERT_LE(std::fabs(xr[d] - y), 0.5 * dsc + std::fabs(y) * 0x1p-24) << "row " << r << " d " << d;
        }
      }
  }
}

// e4m3: every finite code decodes to its value and encodes back to itself; the encoder picks the
// nearest value (ties to the even code) for random and midpoint inputs, and saturates at 448.
TEST(KVQuant, Fp8CodesAndNearestEvenRounding) {
  std::vector<double> vals;
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7f) == 0x7f) continue;  // NaN
    const float v = detail::e4m3_to_float(static_cast<std::uint8_t>(c));
    ASSERT_EQ(static_cast<double>(v), e4m3_value(c)) << "code " << c;
    ASSERT_EQ(detail::to_e4m3(v), c) << "code " << c;
    if (c < 0x80) vals.push_back(v);
  }
  EXPECT_EQ(detail::e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(detail::e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(detail::e4m3_to_float(0x01), 0x1p-9f);
  // Midpoints between neighbours: ties go to the even code.
  for (std::size_t i = 0; i + 1 < vals.size(); ++i) {
    const double mid = (vals[i] + vals[i + 1]) / 2;
    const int want = (i % 2 == 0) ? static_cast<int>(i) : static_cast<int>(i + 1);
    ASSERT_EQ(detail::to_e4m3(mid), want) << "midpoint " << mid;
    ASSERT_EQ(detail::to_e4m3(-mid), want | 0x80) << "midpoint " << -mid;
  }
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> u(-10.0, 9.0);
  for (int t = 0; t < 20000; ++t) {
    const double x = std::ldexp(1.0 + u(rng) / 20.0, static_cast<int>(u(rng)));
    const int c = detail::to_e4m3(x);
    const double y = e4m3_value(c);
    for (double v : vals) ASSERT_LE(std::fabs(x - y), std::fabs(std::fabs(x) - v)) << x;
  }
  EXPECT_EQ(detail::to_e4m3(463.9), 0x7e);
  EXPECT_EQ(detail::to_e4m3(464.0), 0x7e);
  EXPECT_EQ(detail::to_e4m3(1e30), 0x7e);
  EXPECT_EQ(detail::to_e4m3(-1e30), 0xfe);
  EXPECT_EQ(detail::to_e4m3(0x1p-11), 0x00);      // below half the smallest subnormal
  EXPECT_EQ(detail::to_e4m3(0x1p-10 * 1.01), 0x01);
}

// fp8 with per-head scales: x / s rounded once; the error is half an e4m3 step of x / s, times s.
TEST(KVQuant, Fp8RoundTripWithPerHeadScales) {
  const i64 T = 31, H = 3, D = 16;
  Tensor x = random_rows(T, H, D, 3);
  Tensor codes(DType::u8, {T, H, D}), sc(DType::f32, {H}), back(DType::f32, {T, H, D});
  const float scales[] = {1.0f, 0.25f, 3.0f};
  for (i64 h = 0; h < H; ++h) sc.data_as<float>()[h] = scales[h];
  const QuantizedKV q = make(KVFormat::fp8, codes, sc);
  quantize_kv(x, q, "k");
  dequantize_kv(q, back);
  for (i64 t = 0; t < T; ++t)
    for (i64 h = 0; h < H; ++h)
      for (i64 d = 0; d < D; ++d) {
        const i64 i = (t * H + h) * D + d;
        const double s = scales[h], v = x.data_as<float>()[i] / s, y = back.data_as<float>()[i];
        const double a = std::fabs(v);
        double bound;
        if (a >= 448.0) bound = (a - 448.0) * s + 1e-30;
        else if (a < 0x1p-6) bound = 0x1p-10 * s;
        else bound = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(a))) - 4) * s;
        ASSERT_LE(std::fabs(x.data_as<float>()[i] - y), bound * (1 + 1e-6) + std::fabs(y) * 0x1p-24)
            << "token " << t << " head " << h << " x " << x.data_as<float>()[i];
      }
}

TEST(KVQuant, NonFiniteValuesAreRefusedNamingTokenAndHead) {
  Tensor x(DType::f32, {4, 3, 8});
  for (i64 i = 0; i < x.numel(); ++i) x.data_as<float>()[i] = 0.5f;
  Tensor codes(DType::i8, {4, 3, 8}), sc(DType::f32, {4, 3});
  for (i64 i = 0; i < codes.numel(); ++i) codes.data_as<std::int8_t>()[i] = 9;
  for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
    x.data_as<float>()[(2 * 3 + 1) * 8 + 5] = bad;
    try {
      quantize_kv(x, make(KVFormat::int8, codes, sc), "k");
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("at token 2, head 1, element 5"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("k: expected finite values for format int8"), std::string::npos) << e.what();
    }
    for (i64 i = 0; i < codes.numel(); ++i) ASSERT_EQ(codes.data_as<std::int8_t>()[i], 9) << "written on error";
  }
}

TEST(KVQuant, SaturationAndZeroRows) {
  // q8_0: a block whose scale exceeds float16 keeps 65504 and saturates its codes.
  Tensor x(DType::f32, {1, 1, 32}), codes(DType::i8, {1, 1, 32}), sc(DType::f16, {1, 1, 1}), back(DType::f32, {1, 1, 32});
  for (i64 d = 0; d < 32; ++d) x.data_as<float>()[d] = d == 0 ? 1e9f : 1.0f;
  quantize_kv(x, make(KVFormat::q8_0, codes, sc), "k");
  EXPECT_EQ(half_to_float(sc.data_as<std::uint16_t>()[0]), 65504.0f);
  EXPECT_EQ(codes.data_as<std::int8_t>()[0], 127);
  // int8: an all-zero row has scale 0 and decodes to zeros.
  Tensor z(DType::f32, {1, 1, 8}), zc(DType::i8, {1, 1, 8}), zs(DType::f32, {1, 1}), zb(DType::f32, {1, 1, 8});
  for (i64 d = 0; d < 8; ++d) z.data_as<float>()[d] = 0.0f;
  quantize_kv(z, make(KVFormat::int8, zc, zs), "v");
  dequantize_kv(make(KVFormat::int8, zc, zs), zb);
  EXPECT_EQ(zs.data_as<float>()[0], 0.0f);
  for (i64 d = 0; d < 8; ++d) EXPECT_EQ(zb.data_as<float>()[d], 0.0f);
}

TEST(KVQuant, OperandErrors) {
  Tensor x(DType::f32, {2, 2, 8}), codes(DType::i8, {2, 2, 8}), bad_sc(DType::f32, {2, 3}), sc16(DType::f16, {2, 2});
  for (i64 i = 0; i < x.numel(); ++i) x.data_as<float>()[i] = 1.0f;
  EXPECT_THROW(quantize_kv(x, make(KVFormat::int8, codes, bad_sc), "k"), Error);
  EXPECT_THROW(quantize_kv(x, make(KVFormat::int8, codes, sc16), "k"), Error);
  Tensor u(DType::u8, {2, 2, 8}), zero_scale(DType::f32, {2});
  zero_scale.data_as<float>()[0] = 1.0f;
  zero_scale.data_as<float>()[1] = 0.0f;
  try {
    quantize_kv(x, make(KVFormat::fp8, u, zero_scale), "k");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected fp8 scales finite and > 0"), std::string::npos) << e.what();
  }
  Tensor f(DType::f32, {2, 2, 8});
  EXPECT_THROW(quantize_kv(x, make(KVFormat::int8, f, bad_sc), "k"), Error);  // f32 codes for int8
}
