#include "arrays.hpp"

#include <nanobind/stl/vector.h>

#include <cstring>
#include <cstdint>
#include <string>

#include "qkv/error.hpp"

namespace qkv::python {

namespace {

DType dtype_from(const char* name, nb::dlpack::dtype dt) {
  using C = nb::dlpack::dtype_code;
  const auto code = static_cast<C>(dt.code);
  if (dt.lanes == 1) {
    if (code == C::Float && dt.bits == 32) return DType::f32;
    if (code == C::Float && dt.bits == 64) return DType::f64;
    if (code == C::Float && dt.bits == 16) return DType::f16;
    if (code == C::Bfloat && dt.bits == 16) return DType::bf16;
    if (code == C::Bool && dt.bits == 8) return DType::b8;
    if (code == C::Int && dt.bits == 32) return DType::i32;
    if (code == C::Int && dt.bits == 64) return DType::i64;
  }
  throw nb::type_error((std::string(name) +
                        ": expected dtype float32, float64, float16 or bfloat16 (bool, int32 or int64 for "
                        "masks and lengths), got DLPack type code " + std::to_string(dt.code) + " with " +
                        std::to_string(dt.bits) + " bits and " + std::to_string(dt.lanes) + " lanes")
                           .c_str());
}

template <class A>
TensorView view_impl(const char* name, const A& a) {
  if (a.device_type() != nb::device::cpu::value)
    throw Error(std::string(name) + ": expected an array in CPU memory, got one on DLPack device type " +
                std::to_string(a.device_type()) + " (qkv computes on the CPU; move it with .cpu() explicitly)");
  const DType dt = dtype_from(name, a.dtype());
  Shape shape(a.ndim()), strides(a.ndim());
  for (size_t i = 0; i < a.ndim(); ++i) {
    shape[i] = static_cast<std::int64_t>(a.shape(i));
    strides[i] = a.stride(i);
  }
  return TensorView(const_cast<void*>(static_cast<const void*>(a.data())), dt, std::move(shape),
                    std::move(strides));
}

}  // namespace

TensorView view_of(const char* name, const InArray& a) { return view_impl(name, a); }
TensorView view_of(const char* name, const OutArray& a) { return view_impl(name, a); }
std::optional<TensorView> view_of(const char* name, const std::optional<InArray>& a) {
  if (!a) return std::nullopt;
  return view_impl(name, *a);
}
std::optional<TensorView> view_of(const char* name, const std::optional<OutArray>& a) {
  if (!a) return std::nullopt;
  return view_impl(name, *a);
}

namespace {
template <class T>
nb::object numpy_owning(std::vector<T>&& data, const std::vector<std::int64_t>& shape) {
  auto* owned = new std::vector<T>(std::move(data));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  std::vector<size_t> dims(shape.begin(), shape.end());
  return nb::cast(nb::ndarray<nb::numpy, T>(owned->data(), dims.size(), dims.data(), owner));
}
}  // namespace

namespace {

TensorView from_descriptor(const char* name, nb::handle h) {
  const nb::tuple t = nb::borrow<nb::tuple>(h);
  if (t.size() != 4) throw nb::type_error((std::string(name) + ": expected an array").c_str());
  const auto ptr = nb::cast<std::uintptr_t>(t[0]);
  auto shape = nb::cast<Shape>(t[1]);
  auto strides = nb::cast<Shape>(t[2]);
  const int code = nb::cast<int>(t[3]);
  if (code < 0 || code > static_cast<int>(DType::i64))
    throw nb::type_error((std::string(name) + ": bad dtype code in descriptor").c_str());
  return TensorView(reinterpret_cast<void*>(ptr), static_cast<DType>(code), std::move(shape), std::move(strides));
}

[[noreturn]] void not_an_array(const char* name, nb::handle h, const char* what) {
  throw nb::type_error((std::string(name) + ": expected " + what + " (NumPy, PyTorch, or anything speaking DLPack or "
                        "the buffer protocol), got " + nb::inst_name(h).c_str())
                           .c_str());
}

}  // namespace

TensorView CallArrays::in(const char* name, nb::handle h) {
  if (PyTuple_CheckExact(h.ptr())) return from_descriptor(name, h);
  InArray a;
  if (!nb::try_cast(h, a, false)) not_an_array(name, h, "an array");
  ins_.push_back(a);
  return view_of(name, ins_.back());
}

TensorView CallArrays::out(const char* name, nb::handle h) {
  if (PyTuple_CheckExact(h.ptr())) return from_descriptor(name, h);
  OutArray a;
  if (!nb::try_cast(h, a, false)) not_an_array(name, h, "a writable array");
  outs_.push_back(a);
  return view_of(name, outs_.back());
}

nb::object numpy_f64(std::vector<double>&& data, std::vector<std::int64_t> shape) {
  return numpy_owning(std::move(data), shape);
}
nb::object numpy_u8(std::vector<std::uint8_t>&& data, std::vector<std::int64_t> shape) {
  return numpy_owning(std::move(data), shape);
}

nb::object numpy_copy(const Tensor& t) {
  nb::dlpack::dtype dt{};
  switch (t.dtype()) {
    case DType::f32: dt = nb::dtype<float>(); break;
    case DType::f64: dt = nb::dtype<double>(); break;
    case DType::i64: dt = nb::dtype<std::int64_t>(); break;
    case DType::i32: dt = nb::dtype<std::int32_t>(); break;
    case DType::b8: dt = nb::dtype<bool>(); break;
    default: throw Error(std::string("numpy_copy: unsupported dtype ") + std::string(dtype_name(t.dtype())));
  }
  auto* buf = new unsigned char[t.nbytes() ? t.nbytes() : 1];
  if (t.nbytes()) std::memcpy(buf, t.data(), t.nbytes());
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<unsigned char*>(p); });
  std::vector<size_t> dims(t.shape().begin(), t.shape().end());
  return nb::cast(nb::ndarray<nb::numpy>(buf, dims.size(), dims.data(), owner, nullptr, dt));
}

}  // namespace qkv::python
