// Tensor views, owning tensors and the float16/bfloat16 storage conversions.
#include "qkv/tensor.hpp"

#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "qkv/error.hpp"

namespace qkv {

std::size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::f64: case DType::i64: return 8;
    case DType::f32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: return 2;
    case DType::b8: case DType::i8: case DType::u8: return 1;
  }
  return 1;
}

std::string_view dtype_name(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::b8: return "bool";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::i8: return "int8";
    case DType::u8: return "uint8";
  }
  return "?";
}

std::string shape_str(const Shape& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::int64_t checked_numel(const Shape& shape, std::size_t elem_size, std::string_view what) {
  std::int64_t n = 1;
  for (auto d : shape) {
    if (d < 0)
      throw Error(std::string(what) + ": expected non-negative dimensions, got " + shape_str(shape));
    if (d != 0 && n > std::numeric_limits<std::int64_t>::max() / d)
      throw Error(std::string(what) + ": element count of shape " + shape_str(shape) + " overflows int64");
    n *= d;
  }
  // The C-contiguous strides multiply the non-zero dimensions: they must fit int64 even when a
  // zero dimension makes the tensor empty (shape (0, 2^40, 2^40) has no representable strides).
  std::int64_t span = 1;
  for (auto d : shape)
    if (d > 1 && __builtin_mul_overflow(span, d, &span))
      throw Error(std::string(what) + ": the strides of shape " + shape_str(shape) + " overflow int64");
  if (elem_size && static_cast<std::uint64_t>(n) > std::numeric_limits<std::size_t>::max() / elem_size / 2)
    throw Error(std::string(what) + ": byte size of shape " + shape_str(shape) + " overflows size_t");
  return n;
}

Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  std::int64_t s = 1;
  for (std::size_t i = shape.size(); i-- > 0;) {
    st[i] = s;
    // The product past axis 0 is not a stride: skip it, so that a shape whose element count
    // overflows still has strides (and can be refused by checked_numel with a clear message).
    if (i > 0 && __builtin_mul_overflow(s, std::max<std::int64_t>(shape[i], 1), &s))
      throw Error("tensor: expected a shape whose contiguous strides fit in int64, got " + shape_str(shape));
  }
  return st;
}

TensorView::TensorView(void* data, DType dtype, Shape shape, Shape strides)
    : data_(data), dtype_(dtype), shape_(std::move(shape)), strides_(std::move(strides)) {
  for (auto d : shape_)
    if (d < 0) throw Error("tensor: expected non-negative dimensions, got " + shape_str(shape_));
  if (strides_.empty()) strides_ = contiguous_strides(shape_);
  if (strides_.size() != shape_.size())
    throw Error("tensor: expected " + std::to_string(shape_.size()) + " strides (the rank of shape " +
                shape_str(shape_) + "), got " + shape_str(strides_));
}

std::int64_t TensorView::numel() const noexcept {
  // Saturates instead of overflowing; checked_numel() is the checked form.
  for (auto d : shape_)
    if (d == 0) return 0;
  std::int64_t n = 1;
  for (auto d : shape_)
    if (__builtin_mul_overflow(n, d, &n)) return std::numeric_limits<std::int64_t>::max();
  return n;
}

bool TensorView::is_contiguous() const noexcept {
  // A view of no elements is trivially contiguous (contiguous_strides() gives such shapes
  // strides computed with size-0 axes counted as 1, which the loop below would reject).
  for (auto d : shape_)
    if (d == 0) return true;
  std::int64_t s = 1;
  for (std::size_t i = shape_.size(); i-- > 0;) {
    if (shape_[i] != 1 && strides_[i] != s) return false;
    if (__builtin_mul_overflow(s, shape_[i], &s)) return false;  // no such buffer can exist
  }
  return true;
}

TensorView TensorView::permute(std::initializer_list<int> order) const {
  if (order.size() != shape_.size())
    throw Error("permute: expected " + std::to_string(shape_.size()) + " axes, got " +
                std::to_string(order.size()));
  Shape sh, st;
  std::vector<bool> seen(shape_.size(), false);
  for (int a : order) {
    if (a < 0 || a >= rank())
      throw Error("permute: expected axes in [0, " + std::to_string(rank()) + "), got axis " + std::to_string(a));
    if (seen[static_cast<std::size_t>(a)])
      throw Error("permute: expected each axis once, got axis " + std::to_string(a) + " twice");
    seen[static_cast<std::size_t>(a)] = true;
    sh.push_back(shape_[static_cast<std::size_t>(a)]);
    st.push_back(strides_[static_cast<std::size_t>(a)]);
  }
  return TensorView(data_, dtype_, std::move(sh), std::move(st));
}

namespace {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
// From 4 MiB up, a tensor is a mapping of its own, of whole 2 MiB pages, 2 MiB aligned, advised
// as transparent huge pages; its own mapping, so that the advice never lands on memory that
// malloc hands out again.
constexpr std::size_t kHugePage = std::size_t{2} << 20, kHugeTensorBytes = std::size_t{4} << 20;

void* map_huge(std::size_t bytes) {  // bytes: a multiple of kHugePage
  const std::size_t span = bytes + kHugePage;
  void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return nullptr;
  const auto a = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t start = (a + kHugePage - 1) / kHugePage * kHugePage, end = start + bytes;
  if (start > a) munmap(raw, start - a);
  if (a + span > end) munmap(reinterpret_cast<void*>(end), a + span - end);
  void* p = reinterpret_cast<void*>(start);
  (void)madvise(p, bytes, MADV_HUGEPAGE);  // advice: where it is refused, 4 KiB pages
  return p;
}
#endif
}  // namespace

void Tensor::Free::operator()(void* p) const noexcept {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (mapped) {
    munmap(p, mapped);
    return;
  }
#endif
  std::free(p);
}

Tensor::Tensor(DType dtype, Shape shape) : dtype_(dtype), shape_(std::move(shape)) {
  numel_ = checked_numel(shape_, dtype_size(dtype_), "tensor");
  std::size_t bytes = static_cast<std::size_t>(numel_) * dtype_size(dtype_);
  bytes = (bytes + 63) / 64 * 64;  // aligned_alloc needs a multiple of the alignment
  if (bytes == 0) bytes = 64;
  std::size_t mapped = 0;
  void* p = nullptr;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // Large tensors (KV caches and pools, weights) on transparent huge pages: a paged KV pool is
  // read block by block in random order, and on 4 KiB pages each 16-key block cost a TLB miss
  // and a page-table walk (paged / packed decode time on a Zen 5, the two calls timed alone:
  // 1.3-1.6 before, 1.0-1.2 with huge pages; `qkv bench --serving`).
  if (bytes >= kHugeTensorBytes) {
    mapped = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    p = map_huge(mapped);
    if (!p) throw std::bad_alloc();
  }
#endif
  if (!p) {
    p = std::aligned_alloc(64, bytes);
    if (!p) throw std::bad_alloc();
  }
  // Zeros, and every page of the data resident now rather than at a kernel's first write.
  std::memset(p, 0, bytes);
  buf_ = std::unique_ptr<void, Free>(p, Free{mapped});
}

std::uint16_t float_to_half(float x) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t au = u & 0x7fffffffu;
  if (au >= 0x7f800000u)  // inf or NaN (keep a quiet NaN)
    return static_cast<std::uint16_t>(sign | 0x7c00u | (au > 0x7f800000u ? 0x200u : 0u));
  if (au >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (au < 0x38800000u) {  // subnormal half (or zero): round x * 2^24 to an integer, RNE
    const float f = std::bit_cast<float>(au) * 16777216.0f;  // exact scaling by 2^24
    const float r = std::nearbyint(f);
    return static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(r));
  }
  // normal: rebias exponent, round mantissa from 23 to 10 bits, nearest even
  std::uint32_t m = au + 0xc8000000u;  // exponent - 112 (127 - 15) in place
  m += 0x0fffu + ((m >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (m >> 13));
}

float half_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = (h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float f = static_cast<float>(man) * 5.9604644775390625e-8f;
    return std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) | sign);
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (man << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (man << 13));
}

std::uint16_t float_to_bf16(float x) noexcept {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  return static_cast<std::uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float bf16_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

double load_as_double(const void* data, DType dtype, std::int64_t i) noexcept {
  switch (dtype) {
    case DType::f32: return static_cast<const float*>(data)[i];
    case DType::f64: return static_cast<const double*>(data)[i];
    case DType::f16: return half_to_float(static_cast<const std::uint16_t*>(data)[i]);
    case DType::bf16: return bf16_to_float(static_cast<const std::uint16_t*>(data)[i]);
    case DType::b8: return static_cast<const std::uint8_t*>(data)[i] ? 1.0 : 0.0;
    case DType::i32: return static_cast<const std::int32_t*>(data)[i];
    case DType::i64: return static_cast<double>(static_cast<const std::int64_t*>(data)[i]);
    case DType::i8: return static_cast<const std::int8_t*>(data)[i];
    case DType::u8: return static_cast<const std::uint8_t*>(data)[i];
  }
  return 0.0;
}

namespace {
// float64 -> float32 rounded to odd: an inexact result is truncated toward zero and its last
// bit set. Rounding that float32 to float16 or bfloat16 (nearest even) then equals rounding the
// float64 directly, since float32 carries more than two extra bits; rounding to nearest twice
// would not (1 + 2^-11 + 2^-40 would become the float16 midpoint 1 + 2^-11, then 1).
float to_float_round_odd(double x) noexcept {
  float f = static_cast<float>(x);
  if (!std::isfinite(f) || static_cast<double>(f) == x) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(x)) f = std::nextafter(f, 0.0f);
  return std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) | 1u);
}
}  // namespace

void store_from_float(void* data, DType dtype, std::int64_t i, float x) noexcept {
  switch (dtype) {
    case DType::f32: static_cast<float*>(data)[i] = x; break;
    case DType::f64: static_cast<double*>(data)[i] = x; break;
    case DType::bf16: static_cast<std::uint16_t*>(data)[i] = float_to_bf16(x); break;
    case DType::f16: static_cast<std::uint16_t*>(data)[i] = float_to_half(x); break;
    default: break;
  }
}

void store_from_double(void* data, DType dtype, std::int64_t i, double x) noexcept {
  switch (dtype) {
    case DType::f32: static_cast<float*>(data)[i] = static_cast<float>(x); break;
    case DType::f64: static_cast<double*>(data)[i] = x; break;
    case DType::f16: static_cast<std::uint16_t*>(data)[i] = float_to_half(to_float_round_odd(x)); break;
    case DType::bf16: static_cast<std::uint16_t*>(data)[i] = float_to_bf16(to_float_round_odd(x)); break;
    case DType::b8: static_cast<std::uint8_t*>(data)[i] = x != 0.0; break;
    case DType::i32: static_cast<std::int32_t*>(data)[i] = static_cast<std::int32_t>(x); break;
    case DType::i64: static_cast<std::int64_t*>(data)[i] = static_cast<std::int64_t>(x); break;
    case DType::i8: static_cast<std::int8_t*>(data)[i] = static_cast<std::int8_t>(x); break;
    case DType::u8: static_cast<std::uint8_t*>(data)[i] = static_cast<std::uint8_t>(x); break;
  }
}

}  // namespace qkv
