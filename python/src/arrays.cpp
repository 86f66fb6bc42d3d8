#include "arrays.hpp"

#include <nanobind/stl/vector.h>

#include <algorithm>
#include <cstring>
#include <cstdint>
#include <string>
#include <vector>

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

// NumPy 2 gives an array with a zero-size axis zero strides (and torch.from_numpy keeps them),
// which the library would refuse as a non-contiguous last dimension. Such an array holds no
// element: it is taken with contiguous strides, as PyTorch's own empty tensors have.
TensorView contiguous_if_empty(TensorView t) {
  if (t.numel() != 0) return t;
  Shape strides(t.shape().size());
  std::int64_t stride = 1;
  for (std::size_t i = strides.size(); i-- > 0; stride *= std::max<std::int64_t>(t.size(static_cast<int>(i)), 1))
    strides[i] = stride;
  return TensorView(t.data(), t.dtype(), t.shape(), std::move(strides));
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
  return contiguous_if_empty(TensorView(const_cast<void*>(static_cast<const void*>(a.data())), dt, std::move(shape),
                                        std::move(strides)));
}

}  // namespace

TensorView view_of(const char* name, const InArray& a) { return view_impl(name, a); }
TensorView view_of(const char* name, const OutArray& a) { return view_impl(name, a); }

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

// PyTorch tensors read through their own accessors: dtype, is_cpu, layout, is_neg(),
// data_ptr(), shape, stride() (about half a microsecond per tensor, where __dlpack__ takes about
// 2 us). The objects compared against are looked up once, after the caller has imported torch
// (qkv never imports it). A sparse layout and a lazily negated view are refused here by name;
// a tensor on another device or of a dtype qkv has no code for takes DLPack, which names it.
struct TorchObjects {
  PyTypeObject* tensor = nullptr;
  PyObject* strided = nullptr;
  PyObject* dtypes[7] = {};  // in qkv::DType's order: f32, f64, f16, bf16, b8, i32, i64
  PyObject *s_dtype = nullptr, *s_is_cpu = nullptr, *s_layout = nullptr, *s_is_neg = nullptr,
           *s_data_ptr = nullptr, *s_shape = nullptr, *s_stride = nullptr;
};

// Null while torch is not imported (or sys.modules["torch"] is None, as tests set to hide it):
// then no argument is a tensor. Called with the GIL held.
const TorchObjects* torch_objects() {
  static TorchObjects ready_objects;
  static bool ready = false;
  if (ready) return &ready_objects;
  PyObject* mod = PyImport_GetModule(nb::str("torch").ptr());
  if (!mod || mod == Py_None) {
    Py_XDECREF(mod);
    PyErr_Clear();
    return nullptr;
  }
  nb::object torch = nb::steal(mod);
  // Filled in full or not at all: every reference is kept (once) only when every lookup worked.
  TorchObjects t;
  std::vector<nb::object> held;
  try {
    held.push_back(torch.attr("Tensor"));
    held.push_back(torch.attr("strided"));
    for (const char* name : {"float32", "float64", "float16", "bfloat16", "bool", "int32", "int64"})
      held.push_back(torch.attr(name));
    for (const char* name : {"dtype", "is_cpu", "layout", "is_neg", "data_ptr", "shape", "stride"}) {
      PyObject* s = PyUnicode_InternFromString(name);
      if (!s) throw nb::python_error();
      held.push_back(nb::steal(s));
    }
  } catch (const nb::python_error&) {
    PyErr_Clear();
    return nullptr;  // a partial torch module: DLPack for everything
  }
  if (!PyType_Check(held[0].ptr())) return nullptr;
  t.tensor = reinterpret_cast<PyTypeObject*>(held[0].release().ptr());
  t.strided = held[1].release().ptr();
  for (int i = 0; i < 7; ++i) t.dtypes[i] = held[2 + i].release().ptr();
  PyObject** names[7] = {&t.s_dtype, &t.s_is_cpu, &t.s_layout, &t.s_is_neg, &t.s_data_ptr, &t.s_shape, &t.s_stride};
  for (int i = 0; i < 7; ++i) *names[i] = held[9 + i].release().ptr();
  ready_objects = t;
  ready = true;
  return &ready_objects;
}

Shape int_tuple(const char* name, nb::handle h) {
  if (!PyTuple_Check(h.ptr()))
    throw nb::type_error((std::string(name) + ": expected a tensor whose shape and stride() are tuples").c_str());
  const Py_ssize_t n = PyTuple_GET_SIZE(h.ptr());
  Shape out(static_cast<std::size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    out[static_cast<std::size_t>(i)] = PyLong_AsLongLong(PyTuple_GET_ITEM(h.ptr(), i));
    if (PyErr_Occurred()) throw nb::python_error();
  }
  return out;
}

// The view of a strided CPU tensor of a known dtype, or nothing (the caller takes DLPack, which
// names a device or dtype it refuses). A sparse layout and a lazily negated view (whose memory
// holds the values before negation: DLPack would hand that memory over as it is) are refused.
std::optional<TensorView> torch_view(const char* name, const TorchObjects& t, nb::handle h) {
  PyObject* x = h.ptr();
  nb::object layout = nb::steal(PyObject_GetAttr(x, t.s_layout));
  if (!layout.is_valid()) throw nb::python_error();
  if (layout.ptr() != t.strided)
    throw nb::type_error((std::string(name) + ": expected a strided (dense) tensor, got layout " +
                          nb::str(layout).c_str())
                             .c_str());
  nb::object dt = nb::steal(PyObject_GetAttr(x, t.s_dtype));
  if (!dt.is_valid()) throw nb::python_error();
  int code = -1;
  for (int i = 0; i < 7; ++i)
    if (dt.ptr() == t.dtypes[i]) code = i;
  if (code < 0) return std::nullopt;
  nb::object cpu = nb::steal(PyObject_GetAttr(x, t.s_is_cpu));
  if (!cpu.is_valid()) throw nb::python_error();
  if (cpu.ptr() != Py_True) return std::nullopt;
  nb::object neg = nb::steal(PyObject_CallMethodNoArgs(x, t.s_is_neg));
  if (!neg.is_valid()) throw nb::python_error();
  if (neg.ptr() != Py_False)
    throw Error(std::string(name) + ": expected a tensor without the negative bit, got a lazily negated view "
                "(is_neg() is True); call .resolve_neg() on it first");
  nb::object ptr = nb::steal(PyObject_CallMethodNoArgs(x, t.s_data_ptr));
  nb::object shape = nb::steal(PyObject_GetAttr(x, t.s_shape));
  nb::object strides = nb::steal(PyObject_CallMethodNoArgs(x, t.s_stride));
  if (!ptr.is_valid() || !shape.is_valid() || !strides.is_valid()) throw nb::python_error();
  void* data = PyLong_AsVoidPtr(ptr.ptr());
  if (PyErr_Occurred()) throw nb::python_error();
  return TensorView(data, static_cast<DType>(code), int_tuple(name, shape), int_tuple(name, strides));
}

bool is_torch(nb::handle h) {
  const TorchObjects* t = torch_objects();
  return t && PyObject_TypeCheck(h.ptr(), t->tensor);
}

[[noreturn]] void not_an_array(const char* name, nb::handle h, const char* what) {
  throw nb::type_error((std::string(name) + ": expected " + what + " (NumPy, PyTorch, or anything speaking DLPack or "
                        "the buffer protocol), got " + nb::inst_name(h).c_str())
                           .c_str());
}

}  // namespace

TensorView CallArrays::in(const char* name, nb::handle h) {
  const bool tensor = is_torch(h);
  if (tensor)
    if (auto v = torch_view(name, *torch_objects(), h)) return contiguous_if_empty(*v);
  InArray a;
  if (tensor) h = keep(nb::borrow(h).attr("detach")());  // DLPack refuses a tensor that requires grad
  if (!nb::try_cast(h, a, false)) not_an_array(name, h, "an array");
  ins_.push_back(a);
  return view_of(name, ins_.back());
}

TensorView CallArrays::out(const char* name, nb::handle h) {
  const bool tensor = is_torch(h);
  if (tensor)
    if (auto v = torch_view(name, *torch_objects(), h)) return contiguous_if_empty(*v);
  OutArray a;
  if (tensor) h = keep(nb::borrow(h).attr("detach")());
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
