#pragma once
// A read-only memory mapping of a whole regular file, for the readers that parse from memory.
#include <cstddef>
#include <filesystem>
#include <span>

namespace qkv::detail {

class MappedFile {
 public:
  /// Maps `path` read-only. @throws qkv::Error naming the file when it is missing, not a regular
  /// file, or cannot be mapped. An empty file gives an empty span.
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  std::span<const std::byte> bytes() const noexcept { return {data_, size_}; }

 private:
  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace qkv::detail
