// safetensors: round trips, dtype conversion at load, and hostile files (each refused with
// qkv::Error, never a crash or a huge allocation).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/npy.hpp"
#include "qkv/safetensors.hpp"

namespace {

using qkv::DType;
using qkv::SafetensorsFile;
using qkv::Tensor;
using qkv::TensorView;

std::filesystem::path tmp_dir() {
  auto d = std::filesystem::path(QKV_BINARY_DIR) / "test_safetensors_tmp";
  std::filesystem::create_directories(d);
  return d;
}

// A file image: 8-byte length, the header text, then `data` bytes.
std::vector<std::byte> image(const std::string& header, std::size_t data_bytes,
                             std::uint64_t declared = ~0ull) {
  const std::uint64_t n = declared == ~0ull ? header.size() : declared;
  std::vector<std::byte> b(8 + header.size() + data_bytes, std::byte{0});
  for (int i = 0; i < 8; ++i) b[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  std::memcpy(b.data() + 8, header.data(), header.size());
  return b;
}

void expect_refused(const std::vector<std::byte>& bytes, const std::string& needle) {
  try {
    SafetensorsFile::parse(bytes, "hostile.safetensors");
    FAIL() << "expected qkv::Error mentioning '" << needle << "'";
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("hostile.safetensors"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, RoundTripOfEveryWritableDtypeWithMetadata) {
  Tensor f32(DType::f32, {2, 3}), f64(DType::f64, {4}), f16(DType::f16, {3}), bf16(DType::bf16, {2, 2}),
      i64(DType::i64, {2}), b(DType::b8, {3}), empty(DType::f32, {0, 5});
  for (int i = 0; i < 6; ++i) f32.data_as<float>()[i] = 0.5f * static_cast<float>(i) - 1.f;
  for (int i = 0; i < 4; ++i) f64.data_as<double>()[i] = 1.0 / (i + 3);
  for (int i = 0; i < 3; ++i)
    f16.data_as<std::uint16_t>()[i] = qkv::float_to_half(1.5f * static_cast<float>(i));
  for (int i = 0; i < 4; ++i)
    bf16.data_as<std::uint16_t>()[i] = qkv::float_to_bf16(-2.25f * static_cast<float>(i));
  i64.data_as<std::int64_t>()[1] = -7;
  b.data_as<std::uint8_t>()[2] = 1;
  // A strided (transposed) view is written in C order.
  const TensorView t = f32.view().permute({1, 0});
  const auto path = tmp_dir() / "round.safetensors";
  qkv::write_safetensors(path,
                         {{"a.weight", f32},
                          {"transposed", t},
                          {"f64", f64},
                          {"f16", f16},
                          {"bf16", bf16},
                          {"i64", i64},
                          {"mask", b},
                          {"empty", empty}},
                         {{"format", "pt"}, {"num_heads", "4"}});
  const SafetensorsFile f = SafetensorsFile::open(path);
  EXPECT_EQ(f.metadata().at("num_heads"), "4");
  EXPECT_EQ(f.names().size(), 8u);
  EXPECT_EQ(f.entry("bf16").dtype, "BF16");
  const Tensor a = f.load("a.weight");
  ASSERT_EQ(a.shape(), (qkv::Shape{2, 3}));
  for (int i = 0; i < 6; ++i) EXPECT_EQ(a.data_as<float>()[i], f32.data_as<float>()[i]);
  const Tensor tt = f.load("transposed");
  ASSERT_EQ(tt.shape(), (qkv::Shape{3, 2}));
  EXPECT_EQ(tt.data_as<float>()[1], f32.data_as<float>()[3]);  // [0][1] of the transpose = [1][0]
  const Tensor d = f.load("f64");
  EXPECT_EQ(d.dtype(), DType::f32);
  EXPECT_EQ(d.data_as<float>()[1], static_cast<float>(0.25));
  EXPECT_EQ(f.load("f16").data_as<float>()[2], 3.0f);
  EXPECT_EQ(f.load("bf16").dtype(), DType::f32);
  EXPECT_EQ(f.load("bf16").data_as<float>()[3], -6.75f);
  EXPECT_EQ(f.load("i64").data_as<std::int64_t>()[1], -7);
  EXPECT_EQ(f.load("mask").data_as<std::uint8_t>()[2], 1);
  EXPECT_EQ(f.load("empty").numel(), 0);
  EXPECT_THROW(f.load("missing"), qkv::Error);
  EXPECT_EQ(qkv::read_safetensors(path).size(), 8u);
}

TEST(Safetensors, ReadsAHandWrittenFileWithPaddedHeaderAndUnsupportedDtype) {
  // As written by the Python library: header padded with spaces; U8 is indexed but not loadable.
  std::string h = R"({"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("u":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}})";
  h.append(5, ' ');
  auto b = image(h, 11);
  const float vals[2] = {1.25f, -3.f};
  std::memcpy(b.data() + 8 + h.size(), vals, 8);
  const SafetensorsFile f = SafetensorsFile::parse(b);
  EXPECT_EQ(f.load("w").data_as<float>()[1], -3.f);
  EXPECT_THROW(f.load("u"), qkv::Error);
}

TEST(Safetensors, RefusesHostileFiles) {
  const std::string ok_entry = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  expect_refused(std::vector<std::byte>(5), "shorter than the 8-byte");
  expect_refused(image("{}", 0, 1ull << 62), "exceeds the 100 MB limit");
  expect_refused(image("{}", 0, 1000), "exceeds the file");
  expect_refused(image("{\"w\": [1,2", 0), "malformed JSON");
  expect_refused(image("[1, 2, 3]", 0), "does not start with '{'");
  expect_refused(image("{" + ok_entry + "} trailing", 8), "malformed JSON");
  expect_refused(image("{\"a\":" + std::string(100000, '[') + std::string(100000, ']') + "}", 0),
                 "nests deeper");
  expect_refused(image("{" + ok_entry + "," + ok_entry + "}", 8), "appears twice");
  expect_refused(image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 4),
                 "beyond the data buffer");
  expect_refused(image(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "needs 12 bytes");
  expect_refused(image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "begin > end");
  expect_refused(image(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8),
                 "non-negative integer");
  expect_refused(image(R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", 8),
                 "non-negative integer");
  expect_refused(image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,-8]}})", 8),
                 "pair of non-negative");
  expect_refused(image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8), "pair of non-negative");
  expect_refused(image(R"({"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", 8), "unknown dtype");
  expect_refused(image(R"({"w":{"dtype":"F32","shape":[2]}})", 8), "expected the fields");
  expect_refused(image(R"({"w":7})", 8), "not an object");
  expect_refused(image(R"({"__metadata__":{"a":1}})", 0), "not a string");
  expect_refused(
      image(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}})", 8),
      "overflows");
  expect_refused(image(R"({"w":{"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,8]}})", 8),
                 "non-negative integer");
  expect_refused(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                       12),
                 "overlap");
  expect_refused(image("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"\xff\xfe\":1}", 8),
                 "");
  // An empty tensor shares an offset with another without overlapping it.
  EXPECT_NO_THROW(SafetensorsFile::parse(image(
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]}})",
      8)));
}

TEST(Safetensors, TruncatedRealFileIsRefusedAtOpen) {
  Tensor w(DType::f32, {16, 16});
  const auto path = tmp_dir() / "trunc.safetensors";
  qkv::write_safetensors(path, {{"w", w}});
  const auto full = std::filesystem::file_size(path);
  std::filesystem::resize_file(path, full - 1);
  EXPECT_THROW(SafetensorsFile::open(path), qkv::Error);
  std::filesystem::resize_file(path, 3);
  EXPECT_THROW(SafetensorsFile::open(path), qkv::Error);
  EXPECT_THROW(SafetensorsFile::open(tmp_dir() / "does_not_exist.safetensors"), qkv::Error);
}

TEST(Safetensors, WriterRefusesBadNames) {
  Tensor w(DType::f32, {2});
  const auto path = tmp_dir() / "bad.safetensors";
  std::filesystem::remove(path);
  EXPECT_THROW(qkv::write_safetensors(path, {{"__metadata__", w}}), qkv::Error);
  EXPECT_THROW(qkv::write_safetensors(path, {{"w", w}, {"w", w}}), qkv::Error);
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(Safetensors, ReadWeightsFromNpyDirectory) {
  const auto dir = tmp_dir() / "npydir";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  Tensor w(DType::f64, {2, 2});
  w.data_as<double>()[3] = 4.5;
  qkv::write_npy(dir / "out_proj.weight.npy", w);
  const auto m = qkv::read_weights(dir);
  ASSERT_EQ(m.count("out_proj.weight"), 1u);
  EXPECT_EQ(m.at("out_proj.weight").dtype(), DType::f32);
  EXPECT_EQ(m.at("out_proj.weight").data_as<float>()[3], 4.5f);
  std::filesystem::remove(dir / "out_proj.weight.npy");
  EXPECT_THROW(qkv::read_weights(dir), qkv::Error);
  EXPECT_THROW(qkv::read_weights(dir / "nothing"), qkv::Error);
}

TEST(Safetensors, RandomCorruptionNeverCrashes) {
  // Flip bytes of a valid file's header: every outcome is either a valid file or qkv::Error.
  Tensor w(DType::f32, {3, 4});
  Tensor v(DType::bf16, {5});
  const auto path = tmp_dir() / "fuzz.safetensors";
  qkv::write_safetensors(path, {{"w", w}, {"v", v}}, {{"k", "v"}});
  std::ifstream in(path, std::ios::binary);
  std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::mt19937 rng(42);
  int refused = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<std::byte> b(raw.size());
    std::memcpy(b.data(), raw.data(), raw.size());
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int i = 0; i < flips; ++i)
      b[rng() % std::min<std::size_t>(b.size(), 120)] = static_cast<std::byte>(rng());
    try {
      const auto f = SafetensorsFile::parse(b);
      for (const auto& n : f.names()) {
        try {
          (void)f.load(n);
        } catch (const qkv::Error&) {
        }
      }
    } catch (const qkv::Error&) {
      ++refused;
    }
  }
  EXPECT_GT(refused, 100);
}

}  // namespace
