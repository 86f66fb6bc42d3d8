#pragma once
/// @file npy.hpp
/// Reading and writing NumPy .npy files (format versions 1.0, 2.0 and 3.0).
///
/// Format: https://numpy.org/neps/nep-0001-npy-format.html. dtypes: float32 ('<f4'),
/// float64 ('<f8'), float16 ('<f2'), bool ('|b1'), int32 ('<i4'), int64 ('<i8'). Big-endian data
/// is byte-swapped and Fortran-order data is transposed to C order on read. A little-endian
/// C-order file is memory-mapped, not copied, so a large input costs no second buffer.
///
/// Malformed or hostile files (truncated, bad magic, a header length beyond 1 MiB, an unparsable
/// header, negative dimensions, an element count that overflows, an unknown dtype) are refused
/// with qkv::Error naming the file; nothing is allocated before the file size is checked
/// against the shape.

#include <cstddef>
#include <filesystem>
#include <memory>
#include <span>

#include "qkv/tensor.hpp"

namespace qkv {

/// An array read from a .npy file: C-contiguous, either memory-mapped or owned.
class NpyArray {
public:
  NpyArray() = default;
  DType dtype() const noexcept { return dtype_; }
  const Shape& shape() const noexcept { return shape_; }
  std::int64_t numel() const noexcept;
  /// A C-contiguous view; valid while this NpyArray (or a copy of it) lives.
  TensorView view() const { return TensorView(data_, dtype_, shape_); }
  void* data() const noexcept { return data_; }
  /// True when the data is mapped from the file rather than copied.
  bool mapped() const noexcept { return mapped_; }

private:
  friend NpyArray read_npy(const std::filesystem::path&);
  friend NpyArray parse_npy(std::span<const std::byte>, const std::string&);
  std::shared_ptr<void> owner_;
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  Shape shape_;
  bool mapped_ = false;
};

/// Reads a .npy file. @throws qkv::Error on a missing, unreadable or malformed file.
NpyArray read_npy(const std::filesystem::path& path);

/// Parses .npy bytes held in memory (copied into the result). `name` is used in messages.
/// @throws qkv::Error on malformed input.
NpyArray parse_npy(std::span<const std::byte> bytes, const std::string& name = "<memory>");

/// Writes `t` (any strides) as a version 1.0 little-endian C-order .npy file. The file is
/// written under a temporary name and renamed on success, so a failure leaves no partial file.
/// @throws qkv::Error for bfloat16 (no .npy dtype) or an I/O failure.
void write_npy(const std::filesystem::path& path, const TensorView& t);

/// Copies any view into a new C-contiguous tensor of dtype `to` (float conversions round).
Tensor to_contiguous(const TensorView& t, DType to);

}  // namespace qkv
