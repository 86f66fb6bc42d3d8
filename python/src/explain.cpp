// qkv.explain: the five steps of one attention call (qkv::explain::trace_attention, float64) as
// NumPy arrays, so a notebook can show each of them.

#include <cstdint>
#include <string>
#include <vector>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "qkv/error.hpp"
#include "qkv/explain.hpp"

namespace qkv::python {

void bind_explain(nb::module_& m) {
  m.def(
      "_trace",
      [](const InArray& q, const InArray& k, const InArray& v, bool bshd, std::optional<double> scale,
         double softcap, bool causal, const std::string& align, std::int64_t window_left,
         std::int64_t window_right, const std::optional<InArray>& mask, const std::optional<InArray>& kv_lens) {
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
        TensorView qv = view_of("q", q), kv = view_of("k", k), vv = view_of("v", v);
        if (bshd && qv.rank() == 4 && kv.rank() == 4 && vv.rank() == 4) {
          qv = qv.permute({0, 2, 1, 3});
          kv = kv.permute({0, 2, 1, 3});
          vv = vv.permute({0, 2, 1, 3});
        }
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
        return d;
      },
      "qkv::explain::trace_attention as a dict of NumPy arrays (use qkv.explain).");
}

}  // namespace qkv::python
