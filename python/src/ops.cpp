// qkv.attention / qkv.attention_backward: the C++ entry points on caller-allocated arrays.
// The Python layer (python/qkv/_ops.py) resolves defaults, allocates the outputs in the caller's
// framework and dtype, and passes everything positionally so a call costs a few microseconds.

#include <string>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/error.hpp"

namespace qkv::python {

namespace {

KernelKind kernel_from(const std::string& kernel) {
  if (kernel == "auto") return KernelKind::automatic;
  if (kernel == "reference") return KernelKind::reference;
  if (kernel == "flash") return KernelKind::flash;
  if (kernel == "decode") return KernelKind::decode;
  throw Error("kernel: expected 'auto', 'reference', 'flash' or 'decode', got '" + kernel + "'");
}

AttentionParams params_from(const std::optional<double>& scale, double softcap, bool causal,
                            const std::string& align, std::int64_t window_left, std::int64_t window_right,
                            const std::optional<InArray>& mask, const std::optional<InArray>& kv_lens,
                            const std::string& kernel, int num_threads) {
  AttentionParams p;
  p.scale = scale;
  p.softcap = softcap;
  p.causal = causal;
  if (align == "bottom-right" || align == "bottom_right") p.align = Alignment::bottom_right;
  else if (align == "top-left" || align == "top_left") p.align = Alignment::top_left;
  else throw Error("align: expected 'bottom-right' or 'top-left', got '" + align + "'");
  p.window_left = window_left;
  p.window_right = window_right;
  p.mask = view_of("mask", mask);
  p.kv_lens = view_of("kv_lens", kv_lens);
  p.kernel = kernel_from(kernel);
  p.num_threads = num_threads;
  return p;
}

// BSHD arrays are [B,S,H,D]; the C++ API reads BHSD views, so swap axes 1 and 2 (no copy).
TensorView as_bhsd(const TensorView& t, bool bshd) { return bshd && t.rank() == 4 ? t.permute({0, 2, 1, 3}) : t; }

}  // namespace

void bind_ops(nb::module_& m) {
  m.def(
      "_attention",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse, nb::handle probs, bool bshd,
         std::optional<double> scale, double softcap, bool causal, const std::string& align,
         std::int64_t window_left, std::int64_t window_right, nb::handle mask, nb::handle kv_lens,
         const std::string& kernel, int num_threads) {
        CallArrays a;
        AttentionParams p = params_from(scale, softcap, causal, align, window_left, window_right, std::nullopt,
                                        std::nullopt, kernel, num_threads);
        p.mask = a.in_opt("mask", mask);
        p.kv_lens = a.in_opt("kv_lens", kv_lens);
        const TensorView qv = as_bhsd(a.in("q", q), bshd), kv = as_bhsd(a.in("k", k), bshd),
                         vv = as_bhsd(a.in("v", v), bshd), ov = as_bhsd(a.out("out", out), bshd);
        const auto lv = a.out_opt("softmax_lse", lse);
        const auto pv = a.out_opt("probs", probs);
        nb::gil_scoped_release release;
        attention(qv, kv, vv, ov, p, lv, pv);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse").none(),
      nb::arg("probs").none(), nb::arg("bshd"), nb::arg("scale").none(), nb::arg("softcap"),
      nb::arg("causal"), nb::arg("align"), nb::arg("window_left"), nb::arg("window_right"),
      nb::arg("mask").none(), nb::arg("kv_lens").none(), nb::arg("kernel"), nb::arg("num_threads"),
      "qkv::attention on caller-allocated outputs (use qkv.attention).");

  m.def(
      "_attention_backward",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse, nb::handle grad_out,
         nb::handle grad_q, nb::handle grad_k, nb::handle grad_v, bool bshd, std::optional<double> scale,
         double softcap, bool causal, const std::string& align, std::int64_t window_left,
         std::int64_t window_right, nb::handle mask, nb::handle kv_lens, const std::string& kernel,
         int num_threads) {
        CallArrays a;
        AttentionParams p = params_from(scale, softcap, causal, align, window_left, window_right, std::nullopt,
                                        std::nullopt, kernel, num_threads);
        p.mask = a.in_opt("mask", mask);
        p.kv_lens = a.in_opt("kv_lens", kv_lens);
        const TensorView qv = as_bhsd(a.in("q", q), bshd), kv = as_bhsd(a.in("k", k), bshd),
                         vv = as_bhsd(a.in("v", v), bshd), ov = as_bhsd(a.in("out", out), bshd),
                         lv = a.in("softmax_lse", lse), dov = as_bhsd(a.in("grad_out", grad_out), bshd),
                         dqv = as_bhsd(a.out("grad_q", grad_q), bshd), dkv = as_bhsd(a.out("grad_k", grad_k), bshd),
                         dvv = as_bhsd(a.out("grad_v", grad_v), bshd);
        nb::gil_scoped_release release;
        attention_backward(qv, kv, vv, ov, lv, dov, dqv, dkv, dvv, p);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("grad_out"),
      nb::arg("grad_q"), nb::arg("grad_k"), nb::arg("grad_v"), nb::arg("bshd"), nb::arg("scale").none(),
      nb::arg("softcap"), nb::arg("causal"), nb::arg("align"), nb::arg("window_left"),
      nb::arg("window_right"), nb::arg("mask").none(), nb::arg("kv_lens").none(), nb::arg("kernel"),
      nb::arg("num_threads"), "qkv::attention_backward on caller-allocated gradients (use qkv.attention_backward).");

  // What the C++ side sees of an array: its address, shape, strides (elements) and dtype. The
  // zero-copy tests compare the address with the caller's.
  m.def("_view_info", [](nb::handle h) {
    CallArrays a;
    const TensorView t = a.in("array", h);
    return nb::make_tuple(reinterpret_cast<std::uintptr_t>(t.data()), t.shape(), t.strides(),
                          std::string(dtype_name(t.dtype())));
  });

  m.def(
      "_explain_dispatch",
      [](const InArray& q, const InArray& k, const InArray& v, const OutArray& out, bool bshd,
         std::optional<double> scale, double softcap, bool causal, const std::string& align,
         std::int64_t window_left, std::int64_t window_right, const std::optional<InArray>& mask,
         const std::optional<InArray>& kv_lens, const std::string& kernel, int num_threads) {
        const AttentionParams p = params_from(scale, softcap, causal, align, window_left, window_right, mask,
                                              kv_lens, kernel, num_threads);
        return explain_dispatch(as_bhsd(view_of("q", q), bshd), as_bhsd(view_of("k", k), bshd),
                                as_bhsd(view_of("v", v), bshd), as_bhsd(view_of("out", out), bshd), p);
      },
      "qkv::explain_dispatch (use qkv.explain_dispatch).");
}

}  // namespace qkv::python
