// qkv.explain: the five steps of one attention call (qkv::explain::trace_attention, float64) as
// NumPy arrays, so a notebook can show each of them.

#include <cstdint>
#include <string>
#include <vector>

#include <nanobind/stl/vector.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "options.hpp"
#include "qkv/explain.hpp"

namespace qkv::python {

void bind_explain(nb::module_& m) {
  m.def(
      "_trace",
      [](nb::handle q, nb::handle k, nb::handle v, nb::handle arrays, const Options& o) {
        CallArrays a;
        const AttentionParams p = params_of(o, a, arrays);
        const TensorView qv = as_bhsd(a.in("q", q), o), kv = as_bhsd(a.in("k", k), o), vv = as_bhsd(a.in("v", v), o);
        explain::Trace t;
        {
          nb::gil_scoped_release release;
          t = explain::trace_attention(qv, kv, vv, p);
        }
        const std::vector<std::int64_t> s4{t.B, t.Hq, t.Sq, t.Sk};
        std::vector<std::uint8_t> status(t.status.size());
        for (size_t i = 0; i < status.size(); ++i) status[i] = static_cast<std::uint8_t>(t.status[i]);
        std::vector<double> mask_add = t.mask_add;
        if (mask_add.empty()) mask_add.assign(t.scaled.size(), 0.0);
        nb::dict d;
        d["scores"] = numpy_f64(std::move(t.scores), s4);
        d["scaled"] = numpy_f64(std::move(t.scaled), s4);
        d["mask_add"] = numpy_f64(std::move(mask_add), s4);
        d["status"] = numpy_u8(std::move(status), s4);
        d["weights"] = numpy_f64(std::move(t.weights), s4);
        d["output"] = numpy_f64(std::move(t.output), {t.B, t.Hq, t.Sq, t.Dv});
        d["softmax_lse"] = numpy_f64(std::move(t.lse), {t.B, t.Hq, t.Sq});
        d["scale"] = t.scale;
        d["softcap"] = t.softcap;
        d["window"] = nb::make_tuple(t.window.left, t.window.right);
        d["kv_lens"] = t.kv_lens.empty() ? nb::list() : nb::cast(std::vector<std::int64_t>(t.kv_lens));
        // The score options: None where the call has none.
        const bool sinks = !t.sinks.empty(), alibi = !t.alibi_slopes.empty();
        d["sinks"] = sinks ? numpy_f64(std::move(t.sinks), {t.Hq}) : nb::none();
        d["sink_weights"] = sinks ? numpy_f64(std::move(t.sink_weights), {t.B, t.Hq, t.Sq}) : nb::none();
        d["alibi_slopes"] = alibi ? numpy_f64(std::move(t.alibi_slopes), {t.B, t.Hq}) : nb::none();
        d["keep_first"] = t.keep_first;
        return d;
      },
      nb::arg("q"), nb::arg("k"), nb::arg("v"), nb::arg("arrays"), nb::arg("options"),
      "qkv::explain::trace_attention as a dict of NumPy arrays (use qkv.explain).");
}

}  // namespace qkv::python
