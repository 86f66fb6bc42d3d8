// .npy reading and writing: round trips, format versions, Fortran order and big-endian data,
// memory mapping, and hostile files (every one refused with qkv::Error, never a crash or a huge
// allocation). Fixture bytes are built here, following the format specification
// (https://numpy.org/neps/nep-0001-npy-format.html).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "io/atomic_file.hpp"
#include "qkv/error.hpp"
#include "qkv/npy.hpp"
#include "qkv/tensor.hpp"

namespace qkv {
namespace {

namespace fs = std::filesystem;

// A fresh directory per test program run, removed at exit.
class TempDir {
public:
  TempDir() : path_(fs::temp_directory_path() / ("qkv_test_npy_" + std::to_string(::getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  fs::path operator/(const std::string& name) const { return path_ / name; }
  const fs::path& path() const { return path_; }

private:
  fs::path path_;
};
const TempDir& tmp() {
  static TempDir d;
  return d;
}

// The .npy bytes of a header dict and raw data: magic, version, header length (2 bytes for
// version 1, 4 bytes otherwise, little-endian), the dict padded with spaces and a newline so the
// data starts at a multiple of `align`.
std::string npy_bytes(const std::string& dict, const std::string& data, int major = 1, int minor = 0,
                      std::size_t align = 64) {
  const std::size_t pre = major == 1 ? 10 : 12;
  std::string h = dict;
  const std::size_t total = pre + h.size() + 1;
  h.append((align - total % align) % align, ' ');
  h += '\n';
  std::string out = "\x93NUMPY";
  out += static_cast<char>(major);
  out += static_cast<char>(minor);
  const std::size_t n = h.size();
  out += static_cast<char>(n & 0xff);
  out += static_cast<char>((n >> 8) & 0xff);
  if (major != 1) {
    out += static_cast<char>((n >> 16) & 0xff);
    out += static_cast<char>((n >> 24) & 0xff);
  }
  return out + h + data;
}

template <class T>
std::string raw(const std::vector<T>& v, bool big_endian = false) {
  std::string s(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
  if (big_endian)
    for (std::size_t i = 0; i < s.size(); i += sizeof(T)) std::reverse(s.begin() + static_cast<std::ptrdiff_t>(i), s.begin() + static_cast<std::ptrdiff_t>(i + sizeof(T)));
  return s;
}

std::span<const std::byte> span_of(const std::string& s) {
  return {reinterpret_cast<const std::byte*>(s.data()), s.size()};
}

fs::path write_file(const std::string& name, const std::string& bytes) {
  const fs::path p = tmp() / name;
  std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return p;
}

// Parses in memory and from a file; both must agree. Returns the file result.
NpyArray read_both(const std::string& bytes, const std::string& name = "x.npy") {
  const NpyArray m = parse_npy(span_of(bytes), name);
  const NpyArray f = read_npy(write_file(name, bytes));
  EXPECT_EQ(m.shape(), f.shape());
  EXPECT_EQ(m.dtype(), f.dtype());
  const std::size_t n = static_cast<std::size_t>(f.numel()) * dtype_size(f.dtype());
  if (n) EXPECT_EQ(std::memcmp(m.data(), f.data(), n), 0);
  return f;
}

::testing::AssertionResult refused(const std::string& bytes, const std::vector<std::string>& parts, const std::string& name = "bad.npy") {
  for (int from_file = 0; from_file < 2; ++from_file) {
    try {
      if (from_file) read_npy(write_file(name, bytes));
      else parse_npy(span_of(bytes), name);
      return ::testing::AssertionFailure() << "accepted" << (from_file ? " (file)" : " (memory)");
    } catch (const Error& e) {
      const std::string m = e.what();
      if (m.find(name) == std::string::npos) return ::testing::AssertionFailure() << "message lacks the file name: " << m;
      for (const auto& p : parts)
        if (m.find(p) == std::string::npos) return ::testing::AssertionFailure() << "message \"" << m << "\" lacks \"" << p << "\"";
    }
  }
  return ::testing::AssertionSuccess();
}

// --- round trips -------------------------------------------------------------------------------

template <class T>
void round_trip(DType dtype, const std::vector<T>& values, const Shape& shape) {
  const fs::path p = tmp() / ("rt_" + std::string(dtype_name(dtype)) + ".npy");
  write_npy(p, TensorView(const_cast<T*>(values.data()), dtype, shape));
  const NpyArray a = read_npy(p);
  EXPECT_EQ(a.dtype(), dtype);
  EXPECT_EQ(a.shape(), shape);
  ASSERT_EQ(a.numel(), static_cast<std::int64_t>(values.size()));
  EXPECT_EQ(std::memcmp(a.data(), values.data(), values.size() * sizeof(T)), 0) << dtype_name(dtype);
  EXPECT_TRUE(a.mapped());
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data()) % 64, 0u);  // the header pads to 64 bytes
  EXPECT_TRUE(a.view().is_contiguous());
}

TEST(Npy, RoundTripEveryDtype) {
  round_trip<float>(DType::f32, {1.5f, -2.0f, 3.25f, 1e-30f, -0.0f, 7.0f}, {2, 3});
  round_trip<double>(DType::f64, {1.0 / 3, -1e300, 2.0, 4.0}, {4});
  round_trip<std::uint16_t>(DType::f16, {float_to_half(1.0f), float_to_half(-0.5f), 0x7c00, 0x0001}, {1, 2, 2});
  round_trip<std::uint8_t>(DType::b8, {1, 0, 0, 1, 1}, {5});
  round_trip<std::int32_t>(DType::i32, {-7, 2147483647, 0}, {3, 1});
  round_trip<std::int64_t>(DType::i64, {std::int64_t(1) << 40, -3}, {2});
}

TEST(Npy, HeaderWrittenAsNumpyDoes) {
  std::vector<float> v(6);
  const fs::path p = tmp() / "h.npy";
  write_npy(p, TensorView(v.data(), DType::f32, {2, 3}));
  std::ifstream f(p, std::ios::binary);
  std::string s((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  // 10 + 59 + 1 bytes of preamble, dict and newline, padded with spaces to 128 (as numpy does)
  ASSERT_EQ(s.size(), 128u + 24u);
  EXPECT_EQ(s.substr(0, 10), std::string("\x93NUMPY\x01\x00\x76\x00", 10));
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  EXPECT_EQ(s.substr(10, 118), dict + std::string(118 - dict.size() - 1, ' ') + "\n");
  write_npy(p, TensorView(v.data(), DType::f32, {6}));
  std::ifstream g(p, std::ios::binary);
  s.assign((std::istreambuf_iterator<char>(g)), std::istreambuf_iterator<char>());
  EXPECT_NE(s.find("'shape': (6,)"), std::string::npos);
}

TEST(Npy, RoundTripStridedViews) {
  std::vector<float> v(24);
  for (int i = 0; i < 24; ++i) v[static_cast<std::size_t>(i)] = static_cast<float>(i);
  const TensorView t(v.data(), DType::f32, {2, 3, 4});
  const fs::path p = tmp() / "strided.npy";
  // A permuted view is written in its logical (C) order.
  write_npy(p, t.permute({2, 0, 1}));
  NpyArray a = read_npy(p);
  ASSERT_EQ(a.shape(), (Shape{4, 2, 3}));
  const float* d = static_cast<const float*>(a.data());
  for (int x = 0; x < 4; ++x)
    for (int b = 0; b < 2; ++b)
      for (int s = 0; s < 3; ++s) EXPECT_EQ(d[(x * 2 + b) * 3 + s], v[static_cast<std::size_t>(b * 12 + s * 4 + x)]);
  // Every other element, reversed (a negative stride), in float64.
  std::vector<double> w = {0, 1, 2, 3, 4, 5, 6, 7};
  write_npy(p, TensorView(w.data() + 7, DType::f64, {4}, {-2}));
  a = read_npy(p);
  const double* e = static_cast<const double*>(a.data());
  EXPECT_EQ(std::vector<double>(e, e + 4), (std::vector<double>{7, 5, 3, 1}));
  // A broadcast view (stride 0) is materialised.
  write_npy(p, TensorView(w.data() + 3, DType::f64, {2, 3}, {0, 1}));
  a = read_npy(p);
  e = static_cast<const double*>(a.data());
  EXPECT_EQ(std::vector<double>(e, e + 6), (std::vector<double>{3, 4, 5, 3, 4, 5}));
}

TEST(Npy, ZeroDimensionalAndEmptyArrays) {
  double x = 42.5;
  const fs::path p = tmp() / "scalar.npy";
  write_npy(p, TensorView(&x, DType::f64, {}));
  NpyArray a = read_npy(p);
  EXPECT_EQ(a.shape(), Shape{});
  EXPECT_EQ(a.numel(), 1);
  EXPECT_EQ(*static_cast<const double*>(a.data()), 42.5);
  for (const Shape& s : {Shape{0}, Shape{3, 0}, Shape{0, 2, 5}}) {
    write_npy(p, TensorView(nullptr, DType::f32, s));
    a = read_npy(p);
    EXPECT_EQ(a.shape(), s);
    EXPECT_EQ(a.numel(), 0);
  }
  // numpy's own spelling of these headers
  a = read_both(npy_bytes("{'descr': '<i8', 'fortran_order': False, 'shape': (), }", raw<std::int64_t>({-9})));
  EXPECT_EQ(*static_cast<const std::int64_t*>(a.data()), -9);
  a = read_both(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 3), }", ""));
  EXPECT_EQ(a.shape(), (Shape{0, 3}));
}

TEST(Npy, WriteRefusesBfloat16) {
  std::uint16_t x = 0;
  try {
    write_npy(tmp() / "bf.npy", TensorView(&x, DType::bf16, {1}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bfloat16 has no .npy dtype"), std::string::npos);
  }
  EXPECT_FALSE(fs::exists(tmp() / "bf.npy"));
}

TEST(Npy, WriteRefusesAnOverflowingShape) {
  float x = 0;
  const std::int64_t big = std::int64_t(1) << 40;
  try {
    write_npy(tmp() / "huge.npy", TensorView(&x, DType::f32, {big, big, 1, 8}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("huge.npy: element count of shape [1099511627776,1099511627776,1,8] overflows"),
              std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(tmp() / "huge.npy"));
}

TEST(Npy, WriteIsAtomic) {
  float x[2] = {1, 2};
  const fs::path dir = tmp() / "no" / "such" / "dir";
  try {
    write_npy(dir / "o.npy", TensorView(x, DType::f32, {2}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("o.npy"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir));
  // Overwriting an existing file replaces it whole and leaves no temporary behind.
  const fs::path p = tmp() / "atomic.npy";
  write_npy(p, TensorView(x, DType::f32, {2}));
  write_npy(p, TensorView(x, DType::f32, {1}));
  EXPECT_EQ(read_npy(p).shape(), Shape{1});
  for (const auto& e : fs::directory_iterator(tmp().path()))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
}

// Several outputs as one set: a failure in a later one keeps the files already at every path
// (and leaves no staging file); commit renames them all; a set dropped before commit writes none.
TEST(Npy, AtomicFileSetKeepsEveryPathOnFailure) {
  float x[2] = {1, 2};
  const fs::path a = tmp() / "set_a.npy", b = tmp() / "set_b.npy";
  write_npy(a, TensorView(x, DType::f32, {2}));
  const auto listing = [] {
    std::vector<std::string> v;
    for (const auto& e : fs::directory_iterator(tmp().path())) v.push_back(e.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
  };
  const auto before = listing();
  try {
    detail::AtomicFileSet set;
    set.add("--a", a, [&](const fs::path& to) { write_npy(to, TensorView(x, DType::f32, {1})); });
    set.add("--b", tmp() / "no" / "b.npy", [&](const fs::path& to) { write_npy(to, TensorView(x, DType::f32, {1})); });
    FAIL() << "the second file cannot be written";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_EQ(m.rfind("--b: ", 0), 0u) << m;
    EXPECT_NE(m.find((tmp() / "no" / "b.npy").string()), std::string::npos) << m;  // the path, not the staging file
  }
  EXPECT_EQ(read_npy(a).shape(), Shape{2});  // kept
  EXPECT_EQ(listing(), before);
  {
    detail::AtomicFileSet set;
    set.add("--b", b, [&](const fs::path& to) { write_npy(to, TensorView(x, DType::f32, {1})); });
  }  // not committed
  EXPECT_FALSE(fs::exists(b));
  EXPECT_EQ(listing(), before);
  detail::AtomicFileSet set;
  set.add("--a", a, [&](const fs::path& to) { write_npy(to, TensorView(x, DType::f32, {1})); });
  set.add("--b", b, [&](const fs::path& to) { write_npy(to, TensorView(x, DType::f32, {2})); });
  EXPECT_EQ(read_npy(a).shape(), Shape{2});  // nothing in place before commit
  set.commit();
  EXPECT_EQ(read_npy(a).shape(), Shape{1});
  EXPECT_EQ(read_npy(b).shape(), Shape{2});
  EXPECT_EQ(set.paths(), (std::vector<fs::path>{a, b}));
  fs::remove(a);
  fs::remove(b);
}

// A path that names a directory (or nothing) is refused when it is added, before anything is
// written: renaming over a directory would fail only in commit(), after the earlier paths of
// the set had been replaced.
TEST(Npy, AtomicFileSetRefusesADirectoryBeforeWriting) {
  float x[2] = {1, 2};
  const fs::path a = tmp() / "dir_a.npy", d = tmp() / "a_directory";
  fs::create_directories(d);
  write_npy(a, TensorView(x, DType::f32, {2}));
  for (const fs::path& bad : {d, fs::path()}) {
    try {
      detail::AtomicFileSet set;
      set.add("--a", a, [&](const fs::path& to) { write_npy(to, TensorView(x, DType::f32, {1})); });
      set.add("--b", bad, [&](const fs::path& to) { write_npy(to, TensorView(x, DType::f32, {1})); });
      set.commit();
      FAIL() << "'" << bad << "' is not a file path";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.rfind("--b: ", 0), 0u) << m;
      EXPECT_NE(m.find(bad.empty() ? "expected a file path, got ''" : d.string() + ": is a directory"),
                std::string::npos) << m;
    }
    EXPECT_EQ(read_npy(a).shape(), Shape{2});  // kept
    EXPECT_TRUE(fs::is_directory(d));
  }
  // A single file: the same refusal, and no temporary file left in the directory.
  for (const fs::path& bad : {d, fs::path()}) {
    try {
      write_npy(bad, TensorView(x, DType::f32, {2}));
      FAIL() << "'" << bad << "' is not a file path";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(bad.empty() ? "expected a file path, got ''" : "is a directory"),
                std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(fs::is_empty(d));
  fs::remove(d);
  fs::remove(a);
}

// --- versions, layouts and byte orders ---------------------------------------------------------

TEST(Npy, Versions1To3) {
  const std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }";
  const std::string data = raw<float>({1, 2, 3});
  for (int major : {1, 2, 3}) {
    const NpyArray a = read_both(npy_bytes(dict, data, major), "v" + std::to_string(major) + ".npy");
    ASSERT_EQ(a.shape(), Shape{3});
    EXPECT_EQ(static_cast<const float*>(a.data())[2], 3.0f);
    EXPECT_TRUE(a.mapped());
  }
  EXPECT_TRUE(refused(npy_bytes(dict, data, 4), {"unsupported format version 4.0"}));
  EXPECT_TRUE(refused(npy_bytes(dict, data, 0), {"unsupported format version 0.0"}));
  EXPECT_TRUE(refused(npy_bytes(dict, data, 1, 1), {"unsupported format version 1.1"}));
  EXPECT_TRUE(refused(npy_bytes(dict, data, 2, 5), {"unsupported format version 2.5"}));
}

TEST(Npy, HeaderVariantsNumpyAccepts) {
  const std::string data = raw<std::int32_t>({1, 2, 3, 4, 5, 6});
  for (const char* dict : {"{'shape': (2, 3), 'fortran_order': False, 'descr': '<i4'}",
                           "{\"descr\": \"<i4\", \"fortran_order\": False, \"shape\": (2,3)}",
                           "{'descr':'<i4','fortran_order':False,'shape':(2L, 3L),}",
                           "{ 'descr' : '<i4' , 'fortran_order' : False , 'shape' : ( 2 , 3 , ) , }"}) {
    const NpyArray a = read_both(npy_bytes(dict, data));
    EXPECT_EQ(a.shape(), (Shape{2, 3})) << dict;
    EXPECT_EQ(a.dtype(), DType::i32);
  }
  // A data offset that is not a multiple of the element size: read correctly, not mapped.
  const NpyArray a = read_both(npy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (6,)}", data, 1, 0, 2));
  EXPECT_EQ(static_cast<const std::int32_t*>(a.data())[5], 6);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(a.data()) % 4, 0u);
}

TEST(Npy, FortranOrderIsTransposedToCOrder) {
  // C-order value at [i][j][k] = 100 i + 10 j + k, shape (2, 3, 4); Fortran order stores the
  // first index fastest.
  std::vector<double> f;
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < 3; ++j)
      for (int i = 0; i < 2; ++i) f.push_back(100 * i + 10 * j + k);
  const NpyArray a = read_both(npy_bytes("{'descr': '<f8', 'fortran_order': True, 'shape': (2, 3, 4), }", raw(f)), "fortran.npy");
  ASSERT_EQ(a.shape(), (Shape{2, 3, 4}));
  EXPECT_FALSE(a.mapped());
  const double* d = static_cast<const double*>(a.data());
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 4; ++k) EXPECT_EQ(d[(i * 3 + j) * 4 + k], 100 * i + 10 * j + k);
  // 1-D Fortran order is C order.
  const NpyArray b = read_both(npy_bytes("{'descr': '<f8', 'fortran_order': True, 'shape': (3,), }", raw<double>({1, 2, 3})));
  EXPECT_EQ(static_cast<const double*>(b.data())[2], 3.0);
  // A Fortran-order empty array.
  EXPECT_EQ(read_both(npy_bytes("{'descr': '<f8', 'fortran_order': True, 'shape': (0, 2), }", "")).numel(), 0);
}

TEST(Npy, BigEndianIsSwapped) {
  const NpyArray f4 = read_both(npy_bytes("{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", raw<float>({1.5f, -3.0f}, true)));
  EXPECT_EQ(static_cast<const float*>(f4.data())[1], -3.0f);
  EXPECT_FALSE(f4.mapped());
  const NpyArray f8 = read_both(npy_bytes("{'descr': '>f8', 'fortran_order': False, 'shape': (1,), }", raw<double>({0.1}, true)));
  EXPECT_EQ(static_cast<const double*>(f8.data())[0], 0.1);
  const NpyArray f2 = read_both(npy_bytes("{'descr': '>f2', 'fortran_order': False, 'shape': (1,), }",
                                          raw<std::uint16_t>({float_to_half(-2.5f)}, true)));
  EXPECT_EQ(half_to_float(static_cast<const std::uint16_t*>(f2.data())[0]), -2.5f);
  const NpyArray i4 = read_both(npy_bytes("{'descr': '>i4', 'fortran_order': False, 'shape': (1,), }", raw<std::int32_t>({-123456}, true)));
  EXPECT_EQ(static_cast<const std::int32_t*>(i4.data())[0], -123456);
  const NpyArray i8 = read_both(npy_bytes("{'descr': '>i8', 'fortran_order': False, 'shape': (1,), }", raw<std::int64_t>({std::int64_t(-1) << 50}, true)));
  EXPECT_EQ(static_cast<const std::int64_t*>(i8.data())[0], std::int64_t(-1) << 50);
  const NpyArray b1 = read_both(npy_bytes("{'descr': '|b1', 'fortran_order': False, 'shape': (3,), }", std::string("\x01\x00\x01", 3)));
  EXPECT_EQ(static_cast<const std::uint8_t*>(b1.data())[2], 1);
  // Big-endian and Fortran order together: shape (2, 2), C-order [[1, 2], [3, 4]].
  const NpyArray bf = read_both(npy_bytes("{'descr': '>i4', 'fortran_order': True, 'shape': (2, 2), }", raw<std::int32_t>({1, 3, 2, 4}, true)));
  const std::int32_t* d = static_cast<const std::int32_t*>(bf.data());
  EXPECT_EQ(std::vector<std::int32_t>(d, d + 4), (std::vector<std::int32_t>{1, 2, 3, 4}));
}

TEST(Npy, PlainFilesAreMemoryMapped) {
  const std::string bytes = npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4, 4), }", raw(std::vector<float>(16, 2.0f)));
  const NpyArray a = read_npy(write_file("mapped.npy", bytes));
  EXPECT_TRUE(a.mapped());
  EXPECT_FALSE(parse_npy(span_of(bytes)).mapped());  // bytes in memory are copied
  // The mapping outlives the file name and a copy of the array keeps it alive.
  fs::remove(tmp() / "mapped.npy");
  NpyArray copy = a;
  EXPECT_EQ(static_cast<const float*>(copy.data())[15], 2.0f);
}

// --- hostile files -----------------------------------------------------------------------------

TEST(Npy, TruncatedAtEveryByteOffset) {
  for (int major : {1, 2, 3}) {
    const std::string full = npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }",
                                       raw<double>({1, 2, 3, 4, 5, 6}), major);
    EXPECT_NO_THROW(read_both(full));
    for (std::size_t n = 0; n < full.size(); ++n) {
      const std::string cut = full.substr(0, n);
      EXPECT_THROW(parse_npy(span_of(cut), "cut.npy"), Error) << "v" << major << " " << n << " bytes";
      EXPECT_THROW(read_npy(write_file("cut.npy", cut)), Error) << "v" << major << " " << n << " bytes";
    }
  }
  const std::string data_short = npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (2, 3), }", raw<double>({1, 2}));
  EXPECT_TRUE(refused(data_short, {"truncated data: shape [2,3] of float64 needs 48 bytes, file has 16"}));
  EXPECT_TRUE(refused(std::string("\x93NUMPY\x01", 7), {"shorter than the 10-byte preamble"}));
}

TEST(Npy, BadMagic) {
  std::string b = npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", raw<float>({1}));
  b[1] = 'M';
  EXPECT_TRUE(refused(b, {"bad magic"}));
  EXPECT_TRUE(refused("PK\x03\x04 this is a zip file, not an array", {"bad magic"}));
  EXPECT_TRUE(refused(std::string(100, '\0'), {"bad magic"}));
}

TEST(Npy, AbsurdHeaderLength) {
  std::string v2 = "\x93NUMPY\x02";
  v2 += '\0';
  v2 += "\xff\xff\xff\x7f";  // 2 GiB header
  v2 += "{'descr': '<f4'";
  EXPECT_TRUE(refused(v2, {"header length 2147483647 exceeds the 1 MiB limit"}));
  std::string v1 = "\x93NUMPY\x01";
  v1 += '\0';
  v1 += "\xff\xff";  // 65535 bytes declared, few present
  v1 += "{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }";
  EXPECT_TRUE(refused(v1, {"truncated header (65535 bytes declared"}));
}

TEST(Npy, UnparsableHeaders) {
  const std::string d = raw<float>({1, 2});
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"", "expected '{'"},
      {"not a dict", "expected '{'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,)", "expected '}'"},
      {"{'descr': '<f4', 'fortran_order': False}", "missing 'descr', 'fortran_order' or 'shape'"},
      {"{'descr': '<f4', 'fortran_order': Maybe, 'shape': (2,)}", "expected True or False"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': [2]}", "expected '('"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2 2)}", "expected ')'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,,)}", "expected an integer in 'shape'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (x,)}", "expected an integer in 'shape'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2.0,)}", "expected ')'"},
      {"{'descr': '<f4, 'fortran_order': False, 'shape': (2,)}", "expected '}'"},
      {"{'descr' '<f4', 'fortran_order': False, 'shape': (2,)}", "expected ':'"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'extra': 1}", "unknown key 'extra'"},
      {"{descr: '<f4'}", "expected a string"},
      {"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,)}", "expected a string"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), 'descr", "unterminated string"},
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,)}", "overflows int64"},
  };
  for (const auto& [dict, why] : bad) EXPECT_TRUE(refused(npy_bytes(dict, d), {"not a valid .npy file", why})) << dict;
}

TEST(Npy, UnknownDtypes) {
  for (const char* descr : {"<c8", "<u2", "|u1", "|O", "<U5", "<f16", "<M8[ns]", "", "f4", "<f3", "|V8", "<b1x"}) {
    const std::string dict = std::string("{'descr': '") + descr + "', 'fortran_order': False, 'shape': (1,), }";
    EXPECT_TRUE(refused(npy_bytes(dict, std::string(16, '\0')), {"unsupported dtype '" + std::string(descr) + "'"})) << descr;
  }
  EXPECT_TRUE(refused(npy_bytes("{'descr': '!f4', 'fortran_order': False, 'shape': (1,), }", std::string(4, '\0')),
                      {"unsupported byte order in dtype '!f4'"}));
}

TEST(Npy, NegativeDimensions) {
  EXPECT_TRUE(refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3), }", std::string(24, '\0')),
                      {"negative dimension -3 in 'shape'"}));
  EXPECT_TRUE(refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (-1,), }", ""), {"negative dimension -1"}));
}

TEST(Npy, ElementCountOverflow) {
  // int64: 2^32 * 2^32 elements.
  EXPECT_TRUE(refused(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", ""),
                      {"element count of shape [4294967296,4294967296] overflows"}));
  // size_t: 2^61 float64 elements fit int64 but not a byte count.
  EXPECT_TRUE(refused(npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (2305843009213693952,), }", ""),
                      {"overflows"}));
  // Representable, absurd, and not backed by the file: refused before any allocation.
  EXPECT_TRUE(refused(npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (1000000, 1000000), }", std::string(8, '\0')),
                      {"truncated data", "needs 8000000000000 bytes, file has 8"}));
  // A zero dimension makes a huge other dimension harmless.
  EXPECT_EQ(read_both(npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (0, 9223372036854775807), }", "")).numel(), 0);
  // Too many dimensions.
  std::string many = "(";
  for (int i = 0; i < 40; ++i) many += "1,";
  EXPECT_TRUE(refused(npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': " + many + "), }", std::string(8, '\0')),
                      {"more than 32 dimensions"}));
}

TEST(Npy, NotAFile) {
  for (const fs::path& p : {tmp() / "missing.npy", tmp().path()}) {
    try {
      read_npy(p);
      FAIL() << p;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
    }
  }
}

TEST(Npy, RandomCorruptionsNeverCrash) {
  // Byte flips anywhere in a small file: each is either read or refused with qkv::Error.
  const std::string good = npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (3, 2), }", raw<float>({1, 2, 3, 4, 5, 6}));
  std::mt19937 rng(17);
  int refused_count = 0;
  for (int n = 0; n < 3000; ++n) {
    std::string b = good;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) b[rng() % b.size()] = static_cast<char>(rng() % 256);
    try {
      const NpyArray a = parse_npy(span_of(b), "fuzz.npy");
      EXPECT_LE(static_cast<std::size_t>(a.numel()) * dtype_size(a.dtype()), b.size());
    } catch (const Error&) {
      ++refused_count;
    }
  }
  EXPECT_GT(refused_count, 0);
}

TEST(Npy, ToContiguousConverts) {
  std::vector<float> v = {1, 2, 3, 4, 5, 6};
  const Tensor t = to_contiguous(TensorView(v.data(), DType::f32, {2, 3}).permute({1, 0}), DType::f64);
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  const double* d = t.data_as<double>();
  EXPECT_EQ(std::vector<double>(d, d + 6), (std::vector<double>{1, 4, 2, 5, 3, 6}));
}

}  // namespace
}  // namespace qkv
