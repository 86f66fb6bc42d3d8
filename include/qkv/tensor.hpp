#pragma once
/// @file tensor.hpp
/// Tensor views (non-owning, strided) and owning, 64-byte-aligned tensors.
///
/// Strides are in elements, not bytes. A view may have any strides (zero for broadcast axes);
/// the attention entry points require a contiguous last dimension. dtypes: float32, float64,
/// float16 and bfloat16 (storage only: arithmetic is done in float32 or float64), plus bool,
/// int32 and int64 for masks and lengths, int8 and uint8 for quantized KV caches (kv_quant.hpp).

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace qkv {

/// Element types. f16 is IEEE 754 binary16; bf16 is the upper half of a binary32.
enum class DType : std::uint8_t { f32, f64, f16, bf16, b8, i32, i64, i8, u8 };

/// Bytes per element.
std::size_t dtype_size(DType dtype) noexcept;
/// Short name: "float32", "float64", "float16", "bfloat16", "bool", "int32", "int64", "int8",
/// "uint8".
std::string_view dtype_name(DType dtype) noexcept;

using Shape = std::vector<std::int64_t>;

/// Renders a shape as "[2,3,4]".
std::string shape_str(const Shape& shape);

/// Number of elements of a shape; throws qkv::Error naming `what` if a dimension is negative,
/// the product overflows int64, the product of the non-zero dimensions (the largest C-contiguous
/// stride) overflows int64, or the byte count of `elem_size`-byte elements overflows size_t.
std::int64_t checked_numel(const Shape& shape, std::size_t elem_size, std::string_view what);

/// A non-owning view: data pointer, dtype, shape and strides (in elements).
class TensorView {
public:
  TensorView() = default;
  /// @param strides empty means C-contiguous (row-major) strides for `shape`.
  /// @throws qkv::Error if shape and strides differ in rank, a dimension is negative, or the
  /// contiguous strides of `shape` overflow int64.
  TensorView(void* data, DType dtype, Shape shape, Shape strides = {});

  void* data() const noexcept { return data_; }
  template <class T> T* data_as() const noexcept { return static_cast<T*>(data_); }
  DType dtype() const noexcept { return dtype_; }
  int rank() const noexcept { return static_cast<int>(shape_.size()); }
  const Shape& shape() const noexcept { return shape_; }
  const Shape& strides() const noexcept { return strides_; }
  std::int64_t size(int axis) const { return shape_.at(static_cast<std::size_t>(axis)); }
  std::int64_t stride(int axis) const { return strides_.at(static_cast<std::size_t>(axis)); }
  /// Number of elements; INT64_MAX if that overflows (checked_numel() throws instead).
  std::int64_t numel() const noexcept;
  bool empty() const noexcept { return data_ == nullptr && shape_.empty(); }
  /// True when the strides are the C-contiguous strides of the shape.
  bool is_contiguous() const noexcept;
  /// The same data with axes reordered: result axis i is this view's axis order[i].
  /// permute({0,2,1,3}) turns a [B,S,H,D] (BSHD) view into a [B,H,S,D] (BHSD) view.
  TensorView permute(std::initializer_list<int> order) const;

private:
  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  Shape shape_;
  Shape strides_;
};

/// C-contiguous strides of a shape (size-0 axes count as 1).
/// @throws qkv::Error if a stride overflows int64.
Shape contiguous_strides(const Shape& shape);

/// An owning, C-contiguous tensor whose buffer is 64-byte aligned and zero-initialised. On Linux,
/// from 4 MiB up (KV caches and pools) the buffer is a mapping of its own of whole 2 MiB pages,
/// 2 MiB aligned, advised as transparent huge pages (fewer TLB misses when a paged KV pool is
/// read at random).
class Tensor {
public:
  Tensor() = default;
  /// @throws qkv::Error if a dimension is negative or the byte size overflows.
  Tensor(DType dtype, Shape shape);

  TensorView view() const { return TensorView(buf_.get(), dtype_, shape_); }
  operator TensorView() const { return view(); }  // NOLINT: a tensor is usable as its view
  void* data() const noexcept { return buf_.get(); }
  template <class T> T* data_as() const noexcept { return static_cast<T*>(data()); }
  DType dtype() const noexcept { return dtype_; }
  const Shape& shape() const noexcept { return shape_; }
  std::int64_t numel() const noexcept { return numel_; }
  std::size_t nbytes() const noexcept { return numel_ * dtype_size(dtype_); }

private:
  struct Free {
    Free() noexcept : mapped(0) {}
    explicit Free(std::size_t bytes) noexcept : mapped(bytes) {}
    std::size_t mapped;  // bytes of a mapping of its own (large tensors), else 0: malloc's
    void operator()(void* p) const noexcept;
  };
  std::unique_ptr<void, Free> buf_;
  DType dtype_ = DType::f32;
  Shape shape_;
  std::int64_t numel_ = 0;
};

/// float32 <-> float16 / bfloat16 conversions, round to nearest even, NaN preserved.
std::uint16_t float_to_half(float x) noexcept;
float half_to_float(std::uint16_t h) noexcept;
std::uint16_t float_to_bf16(float x) noexcept;
float bf16_to_float(std::uint16_t b) noexcept;

/// Reads element `i` (a flat index into a contiguous buffer of `dtype`) as double.
double load_as_double(const void* data, DType dtype, std::int64_t i) noexcept;
/// Writes `x` to element `i` of a buffer of `dtype` (rounded for narrower float types).
void store_from_double(void* data, DType dtype, std::int64_t i, double x) noexcept;
/// Writes `x` to element `i` of a float buffer (f32, f64, bf16 or f16; round to nearest even);
/// other dtypes are left untouched.
void store_from_float(void* data, DType dtype, std::int64_t i, float x) noexcept;

}  // namespace qkv
