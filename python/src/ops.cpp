// qkv.attention / qkv.attention_backward / qkv.explain_dispatch: the C++ entry points on
// caller-allocated arrays. The Python layer (python/qkv/_ops.py) checks the arguments, allocates
// the outputs in the caller's framework and dtype, and passes the options as one qkv._qkv.Options
// and the array options as one tuple (options.hpp), so a call costs a few microseconds.

#include <cstdint>
#include <string>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "options.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"

namespace qkv::python {

void bind_ops(nb::module_& m) {
  m.def(
      "_attention",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse, nb::handle probs,
         nb::handle arrays, const Options& o) {
        CallArrays a;
        const AttentionParams p = params_of(o, a, arrays);
        const TensorView qv = as_bhsd(a.in("q", q), o), kv = as_bhsd(a.in("k", k), o), vv = as_bhsd(a.in("v", v), o),
                         ov = as_bhsd(a.out("out", out), o);
        const auto lv = a.out_opt("softmax_lse", lse);
        const auto pv = a.out_opt("probs", probs);
        nb::gil_scoped_release release;
        attention(qv, kv, vv, ov, p, lv, pv);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse").none(), nb::arg("probs").none(),
      nb::arg("arrays"), nb::arg("options"), "qkv::attention on caller-allocated outputs (use qkv.attention).");

  // The backward's arguments as views; `run` is attention_backward or its explain_dispatch.
  auto backward_call = [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse,
                          nb::handle grad_out, nb::handle grad_q, nb::handle grad_k, nb::handle grad_v,
                          nb::handle arrays, const Options& o, auto&& run) {
    CallArrays a;
    const AttentionParams p = params_of(o, a, arrays);
    return run(as_bhsd(a.in("q", q), o), as_bhsd(a.in("k", k), o), as_bhsd(a.in("v", v), o),
               as_bhsd(a.in("out", out), o), a.in("softmax_lse", lse), as_bhsd(a.in("grad_out", grad_out), o),
               as_bhsd(a.out("grad_q", grad_q), o), as_bhsd(a.out("grad_k", grad_k), o),
               as_bhsd(a.out("grad_v", grad_v), o), p);
  };
  m.def(
      "_attention_backward",
      [backward_call](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse, nb::handle grad_out,
                      nb::handle grad_q, nb::handle grad_k, nb::handle grad_v, nb::handle arrays, const Options& o,
                      nb::handle grad_sinks) {
        if (grad_sinks.is_none()) {
          backward_call(q, k, v, out, lse, grad_out, grad_q, grad_k, grad_v, arrays, o, [](const auto&... x) {
            nb::gil_scoped_release release;
            attention_backward(x...);
          });
          return;
        }
        // d z_h of the attention sinks too: the overload that writes grad_sinks before the params.
        CallArrays a;
        const TensorView gs = a.out("grad_sinks", grad_sinks);
        backward_call(q, k, v, out, lse, grad_out, grad_q, grad_k, grad_v, arrays, o,
                      [&gs](const TensorView& qv, const TensorView& kv, const TensorView& vv, const TensorView& ov,
                            const TensorView& lv, const TensorView& gov, const TensorView& gq, const TensorView& gk,
                            const TensorView& gv, const AttentionParams& p) {
                        nb::gil_scoped_release release;
                        attention_backward(qv, kv, vv, ov, lv, gov, gq, gk, gv, gs, p);
                      });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("grad_out"),
      nb::arg("grad_q"), nb::arg("grad_k"), nb::arg("grad_v"), nb::arg("arrays"), nb::arg("options"),
      nb::arg("grad_sinks").none() = nb::none(),
      "qkv::attention_backward on caller-allocated gradients, with grad_sinks [Hq] the sinks' gradient "
      "(use qkv.attention_backward).");
  m.def(
      "_explain_dispatch_backward",
      [backward_call](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle lse, nb::handle grad_out,
                      nb::handle grad_q, nb::handle grad_k, nb::handle grad_v, nb::handle arrays, const Options& o,
                      nb::handle grad_sinks) {
        if (grad_sinks.is_none())
          return backward_call(q, k, v, out, lse, grad_out, grad_q, grad_k, grad_v, arrays, o,
                               [](const auto&... x) { return explain_dispatch(x...); });
        CallArrays a;
        const TensorView gs = a.out("grad_sinks", grad_sinks);
        return backward_call(q, k, v, out, lse, grad_out, grad_q, grad_k, grad_v, arrays, o,
                             [&gs](const TensorView& qv, const TensorView& kv, const TensorView& vv,
                                   const TensorView& ov, const TensorView& lv, const TensorView& gov,
                                   const TensorView& gq, const TensorView& gk, const TensorView& gv,
                                   const AttentionParams& p) {
                               return explain_dispatch(qv, kv, vv, ov, lv, gov, gq, gk, gv, gs, p);
                             });
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("lse"), nb::arg("grad_out"),
      nb::arg("grad_q"), nb::arg("grad_k"), nb::arg("grad_v"), nb::arg("arrays"), nb::arg("options"),
      nb::arg("grad_sinks").none() = nb::none(),
      "qkv::explain_dispatch of attention_backward (use qkv.explain_dispatch(..., backward=True)).");

  m.def(
      "_alibi_slopes", [](std::int64_t num_heads) { return alibi_slopes(num_heads); }, nb::arg("num_heads"),
      "qkv::alibi_slopes: BLOOM's ALiBi slopes of num_heads heads, float32 (use qkv.alibi_slopes).");

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
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle out, nb::handle arrays, const Options& o) {
        CallArrays a;
        const AttentionParams p = params_of(o, a, arrays);
        return explain_dispatch(as_bhsd(a.in("q", q), o), as_bhsd(a.in("k", k), o), as_bhsd(a.in("v", v), o),
                                as_bhsd(a.out("out", out), o), p);
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("out"), nb::arg("arrays"), nb::arg("options"),
      "qkv::explain_dispatch (use qkv.explain_dispatch).");
}

}  // namespace qkv::python
