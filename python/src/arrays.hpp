#pragma once
// Arrays from Python (NumPy, PyTorch, anything speaking DLPack or the buffer protocol) seen as
// qkv::TensorView without a copy, and float64 results handed back as NumPy arrays.

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "qkv/tensor.hpp"

namespace qkv::python {

namespace nb = nanobind;

/// An input: read only, any framework, any device (the device is checked with a clear message).
using InArray = nb::ndarray<nb::ro>;
/// An output: written in place.
using OutArray = nb::ndarray<>;

/// The view of an array: its data pointer, dtype, shape and strides (in elements), no copy.
/// @throws nb::type_error for a dtype qkv has no name for; qkv::Error (ValueError) for an array
///         that is not in CPU memory.
TensorView view_of(const char* name, const InArray& a);
TensorView view_of(const char* name, const OutArray& a);

/// The arguments of one call, each an array object: a PyTorch tensor read through its own
/// accessors (data_ptr(), shape, stride(): the cheapest way without a copy; a sparse layout or a
/// lazily negated view refused by name), or anything speaking DLPack or the buffer protocol (kept
/// alive here until the call ends). A tensor on another device or of a dtype qkv has no code for
/// goes through DLPack, detached first (the memory is the same), which names what it refuses.
class CallArrays {
 public:
  TensorView in(const char* name, nb::handle h);
  TensorView out(const char* name, nb::handle h);
  std::optional<TensorView> in_opt(const char* name, nb::handle h) {
    return h.is_none() ? std::nullopt : std::optional<TensorView>(in(name, h));
  }
  std::optional<TensorView> out_opt(const char* name, nb::handle h) {
    return h.is_none() ? std::nullopt : std::optional<TensorView>(out(name, h));
  }

 private:
  nb::handle keep(nb::object o) {
    kept_.push_back(std::move(o));
    return kept_.back();
  }
  std::vector<InArray> ins_;
  std::vector<OutArray> outs_;
  std::vector<nb::object> kept_;  // detached tensors handed to DLPack
};

/// A float64 NumPy array owning `data` (moved), of the given shape.
nb::object numpy_f64(std::vector<double>&& data, std::vector<std::int64_t> shape);
/// A uint8 NumPy array owning `data` (moved).
nb::object numpy_u8(std::vector<std::uint8_t>&& data, std::vector<std::int64_t> shape);
/// A NumPy array of `dtype` copied from a C-contiguous tensor.
nb::object numpy_copy(const Tensor& t);

}  // namespace qkv::python
