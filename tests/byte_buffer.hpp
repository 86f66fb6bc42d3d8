#pragma once
// Helpers for tests that build binary files byte by byte: a little-endian writer, whole-file
// reads, and a temporary directory removed at the end of the test.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::test {

struct ByteBuffer {
  std::vector<std::byte> bytes;

  void raw(const void* p, std::size_t n) {
    const std::size_t at = bytes.size();
    bytes.resize(at + n);
    if (n) std::memcpy(bytes.data() + at, p, n);
  }
  void i32(std::int32_t v) { raw(&v, 4); }  // hosts are little-endian, as the formats
  void u32(std::uint32_t v) { raw(&v, 4); }
  void f32(float v) { raw(&v, 4); }
  void u8(std::uint8_t v) { raw(&v, 1); }
  void str(std::string_view s) { raw(s.data(), s.size()); }
  void pad_to(std::size_t n) { bytes.resize(n, std::byte{0}); }
  template <class T>
  void put_at(std::size_t off, T v) {
    std::memcpy(bytes.data() + off, &v, sizeof v);
  }
};

inline std::vector<std::byte> file_bytes(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  f.seekg(0, std::ios::end);
  std::vector<std::byte> b(static_cast<std::size_t>(f.tellg()));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(b.data()), static_cast<std::streamsize>(b.size()));
  return b;
}

class TempDir {
 public:
  explicit TempDir(const std::string& tag)
      : path_(std::filesystem::temp_directory_path() /
              ("qkv_test_" + tag + "_" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::filesystem::path write(const std::string& name, const std::vector<std::byte>& b) const {
    const std::filesystem::path p = path_ / name;
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    return p;
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace qkv::test
