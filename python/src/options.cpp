// qkv._qkv.Options: the scalar options of a call as one object, and their conversion to
// qkv::AttentionParams. The strings of the Python API (align, layout, kernel) become enums here
// and only here.

#include "options.hpp"

#include <cstddef>
#include <string>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include "bindings.hpp"
#include "qkv/error.hpp"

namespace qkv::python {

namespace {

Alignment alignment_named(const std::string& align) {
  if (align == "bottom-right" || align == "bottom_right") return Alignment::bottom_right;
  if (align == "top-left" || align == "top_left") return Alignment::top_left;
  throw Error("align: expected 'bottom-right' or 'top-left', got '" + align + "'");
}

const char* name_of(Alignment a) { return a == Alignment::top_left ? "top-left" : "bottom-right"; }

bool bshd_named(const std::string& layout) {
  if (layout == "bhsd") return false;
  if (layout == "bshd") return true;
  throw Error("layout: expected 'bhsd' or 'bshd', got '" + layout + "'");
}

KernelKind kernel_named(const std::string& kernel) {
  if (kernel == "auto") return KernelKind::automatic;
  if (kernel == "reference") return KernelKind::reference;
  if (kernel == "flash") return KernelKind::flash;
  if (kernel == "decode") return KernelKind::decode;
  throw Error("kernel: expected 'auto', 'reference', 'flash' or 'decode', got '" + kernel + "'");
}

const char* name_of(KernelKind k) {
  switch (k) {
    case KernelKind::reference: return "reference";
    case KernelKind::flash: return "flash";
    case KernelKind::decode: return "decode";
    case KernelKind::automatic: break;
  }
  return "auto";
}

constexpr std::size_t kNumArrayOptions = sizeof(kArrayOptions) / sizeof(kArrayOptions[0]);

}  // namespace

AttentionParams params_of(const Options& o, CallArrays& a, nb::handle arrays) {
  AttentionParams p;
  p.scale = o.scale;
  p.softcap = o.softcap;
  p.causal = o.causal;
  p.align = o.align;
  p.window_left = o.window_left;
  p.window_right = o.window_right;
  p.kernel = o.kernel;
  p.num_threads = o.num_threads;
  p.window_keep_first = o.keep_first;
  if (!PyTuple_Check(arrays.ptr()) || PyTuple_GET_SIZE(arrays.ptr()) != static_cast<Py_ssize_t>(kNumArrayOptions))
    throw nb::type_error(("arrays: expected a tuple of " + std::to_string(kNumArrayOptions) +
                          " arrays or None (qkv._qkv.ARRAY_OPTIONS), got " + nb::inst_name(arrays).c_str())
                             .c_str());
  for (std::size_t i = 0; i < kNumArrayOptions; ++i)
    p.*kArrayOptions[i].field = a.in_opt(kArrayOptions[i].name, PyTuple_GET_ITEM(arrays.ptr(), static_cast<Py_ssize_t>(i)));
  return p;
}

TensorView as_bhsd(const TensorView& t, const Options& o) {
  return o.bshd && t.rank() == 4 ? t.permute({0, 2, 1, 3}) : t;
}

void bind_options(nb::module_& m) {
  nb::class_<Options>(m, "Options",
                      "The scalar options of one attention call (build them with qkv._options.options, which checks "
                      "them and keeps the objects of recent values).")
      .def(
          "__init__",
          [](Options* self, std::optional<double> scale, double softcap, bool causal, const std::string& align,
             std::int64_t window_left, std::int64_t window_right, const std::string& layout,
             const std::string& kernel_name, int num_threads, std::int64_t keep_first) {
            Options o;
            o.scale = scale;
            o.softcap = softcap;
            o.causal = causal;
            o.align = alignment_named(align);
            o.window_left = window_left;
            o.window_right = window_right;
            o.bshd = bshd_named(layout);
            o.kernel = kernel_named(kernel_name);
            o.num_threads = num_threads;
            o.keep_first = keep_first;
            new (self) Options(o);
          },
          nb::kw_only(), nb::arg("scale").none() = nb::none(), nb::arg("softcap") = 0.0, nb::arg("causal") = false,
          nb::arg("align") = "bottom-right", nb::arg("window_left") = -1, nb::arg("window_right") = -1,
          nb::arg("layout") = "bhsd", nb::arg("kernel_name") = "auto", nb::arg("num_threads") = 0,
          nb::arg("keep_first") = 0)
      .def_ro("scale", &Options::scale)
      .def_ro("softcap", &Options::softcap)
      .def_ro("causal", &Options::causal)
      .def_prop_ro("align", [](const Options& o) { return name_of(o.align); })
      .def_ro("window_left", &Options::window_left)
      .def_ro("window_right", &Options::window_right)
      .def_prop_ro("layout", [](const Options& o) { return o.bshd ? "bshd" : "bhsd"; })
      .def_ro("bshd", &Options::bshd)
      .def_prop_ro("kernel_name", [](const Options& o) { return name_of(o.kernel); })
      .def_ro("num_threads", &Options::num_threads)
      .def_ro("keep_first", &Options::keep_first);

  nb::list names;
  for (const ArrayOption& a : kArrayOptions) names.append(a.name);
  m.attr("ARRAY_OPTIONS") = nb::steal(PySequence_Tuple(names.ptr()));
}

}  // namespace qkv::python
