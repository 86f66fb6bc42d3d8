// The extension module qkv._qkv. qkv::Error derives from std::invalid_argument, which nanobind
// raises as ValueError with the C++ message (argument, expected, actual).

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include "bindings.hpp"
#include "qkv/version.hpp"

NB_MODULE(_qkv, m) {
  m.doc() = "qkv's C++ library: exact, fast scaled dot-product attention on the CPU.";
  m.attr("__version__") = qkv::version();
  qkv::python::bind_options(m);
  qkv::python::bind_ops(m);
  qkv::python::bind_layers(m);
  qkv::python::bind_explain(m);
}
