// qkv.MultiHeadAttention and qkv.KVCache: the C++ layer (mha.hpp) and cache (kv_cache.hpp).
// The Python classes of python/qkv/_layers.py wrap these, allocating outputs and converting
// PyTorch state_dicts.

#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "arrays.hpp"
#include "bindings.hpp"
#include "options.hpp"
#include "qkv/error.hpp"
#include "qkv/kv_cache.hpp"
#include "qkv/mha.hpp"

namespace qkv::python {

namespace {

DType dtype_named(const std::string& name) {
  if (name == "float32") return DType::f32;
  if (name == "float64") return DType::f64;
  if (name == "float16") return DType::f16;
  if (name == "bfloat16") return DType::bf16;
  throw Error("dtype: expected 'float32', 'float64', 'float16' or 'bfloat16', got '" + name + "'");
}

nb::object numpy_of_view(const TensorView& v) {
  if (v.empty()) return nb::none();
  Tensor t(v.dtype(), v.shape());
  if (t.nbytes()) std::memcpy(t.data(), v.data(), t.nbytes());
  return numpy_copy(t);
}

}  // namespace

void bind_layers(nb::module_& m) {
  nb::class_<KVCache>(m, "_KVCache")
      .def(
          "__init__",
          [](KVCache* self, std::int64_t batch, std::int64_t num_kv_heads, std::int64_t capacity,
             std::int64_t head_dim, const std::string& dtype, std::int64_t head_dim_v) {
            new (self) KVCache(batch, num_kv_heads, capacity, head_dim, dtype_named(dtype), head_dim_v);
          },
          nb::arg("batch"), nb::arg("num_kv_heads"), nb::arg("capacity"), nb::arg("head_dim"),
          nb::arg("dtype") = "float32", nb::arg("head_dim_v") = 0)
      .def_prop_ro("batch", &KVCache::batch)
      .def_prop_ro("num_kv_heads", &KVCache::num_kv_heads)
      .def_prop_ro("capacity", &KVCache::capacity)
      .def_prop_ro("head_dim", &KVCache::head_dim)
      .def_prop_ro("head_dim_v", &KVCache::head_dim_v)
      .def_prop_ro("dtype", [](const KVCache& c) { return std::string(dtype_name(c.dtype())); })
      .def_prop_ro("lengths",
                   [](const KVCache& c) { return std::vector<std::int64_t>(c.lengths().begin(), c.lengths().end()); })
      .def_prop_ro("max_length", &KVCache::max_length)
      .def("clear", &KVCache::clear)
      .def("truncate", [](KVCache& c, std::int64_t length) { c.truncate(length); })
      .def(
          "append",
          [](KVCache& c, const InArray& k, const InArray& v, bool bshd) {
            TensorView kv = view_of("k", k), vv = view_of("v", v);
            if (bshd && kv.rank() == 4 && vv.rank() == 4) {
              kv = kv.permute({0, 2, 1, 3});
              vv = vv.permute({0, 2, 1, 3});
            }
            nb::gil_scoped_release release;
            c.append(kv, vv);
          },
          nb::arg("k"), nb::arg("v"), nb::arg("bshd") = false)
      .def(
          "_attend",
          [](KVCache& c, nb::handle q, nb::handle out, nb::handle lse, nb::handle arrays, const Options& o) {
            CallArrays a;
            const AttentionParams p = params_of(o, a, arrays);
            const TensorView qv = as_bhsd(a.in("q", q), o), ov = as_bhsd(a.out("out", out), o);
            const auto lv = a.out_opt("softmax_lse", lse);
            nb::gil_scoped_release release;
            c.attend(qv, ov, p, lv);
          },
          nb::arg("q"), nb::arg("out"), nb::arg("lse").none(), nb::arg("arrays"), nb::arg("options"));

  nb::class_<MultiHeadAttention>(m, "_MultiHeadAttention")
      .def(
          "__init__",
          [](MultiHeadAttention* self, std::int64_t d_model, std::int64_t num_heads, std::int64_t num_kv_heads,
             std::int64_t head_dim, std::int64_t head_dim_v, bool qkv_bias, bool out_bias,
             const std::optional<std::string>& rope, double rope_theta, std::int64_t rotary_dim, bool sinks,
             bool alibi) {
            MhaConfig c;
            c.d_model = d_model;
            c.num_heads = num_heads;
            c.num_kv_heads = num_kv_heads;
            c.head_dim = head_dim;
            c.head_dim_v = head_dim_v;
            c.qkv_bias = qkv_bias;
            c.out_bias = out_bias;
            c.sinks = sinks;
            c.alibi = alibi;
            if (rope) {
              RopeConfig r;
              if (*rope == "interleaved") r.style = RopeStyle::interleaved;
              else if (*rope == "half" || *rope == "half_split") r.style = RopeStyle::half_split;
              else throw Error("rope: expected None, 'interleaved' or 'half', got '" + *rope + "'");
              r.theta = rope_theta;
              r.rotary_dim = rotary_dim;
              c.rope = r;
            }
            new (self) MultiHeadAttention(c);
          },
          nb::arg("d_model"), nb::arg("num_heads"), nb::arg("num_kv_heads") = 0, nb::arg("head_dim") = 0,
          nb::arg("head_dim_v") = 0, nb::arg("qkv_bias") = true, nb::arg("out_bias") = true,
          nb::arg("rope").none() = nb::none(), nb::arg("rope_theta") = 10000.0, nb::arg("rotary_dim") = 0,
          nb::arg("sinks") = false, nb::arg("alibi") = false)
      .def("config",
           [](const MultiHeadAttention& l) {
             const MhaConfig& c = l.config();
             nb::dict d;
             d["d_model"] = c.d_model;
             d["num_heads"] = c.num_heads;
             d["num_kv_heads"] = c.num_kv_heads;
             d["head_dim"] = c.head_dim;
             d["head_dim_v"] = c.head_dim_v;
             d["qkv_bias"] = c.qkv_bias;
             d["out_bias"] = c.out_bias;
             d["sinks"] = c.sinks;
             d["alibi"] = c.alibi;
             return d;
           })
      .def(
          "load_weights",
          [](MultiHeadAttention& l, const std::map<std::string, InArray>& arrays, const std::string& prefix) {
            std::map<std::string, Tensor> tensors;
            for (const auto& [name, a] : arrays) {
              const TensorView v = view_of(name.c_str(), a);
              if (!v.is_contiguous())
                throw Error(name + ": expected a C-contiguous array, got strides " + shape_str(v.strides()));
              Tensor t(v.dtype(), v.shape());
              if (t.nbytes()) std::memcpy(t.data(), v.data(), t.nbytes());
              tensors.emplace(name, std::move(t));
            }
            l.load_weights(tensors, prefix);
          },
          nb::arg("tensors"), nb::arg("prefix") = "")
      .def("weights",
           [](const MultiHeadAttention& l) {
             nb::dict d;
             d["w_q"] = numpy_of_view(l.w_q());
             d["w_k"] = numpy_of_view(l.w_k());
             d["w_v"] = numpy_of_view(l.w_v());
             d["w_o"] = numpy_of_view(l.w_o());
             d["b_q"] = numpy_of_view(l.b_q());
             d["b_k"] = numpy_of_view(l.b_k());
             d["b_v"] = numpy_of_view(l.b_v());
             d["b_o"] = numpy_of_view(l.b_o());
             d["sinks"] = numpy_of_view(l.sinks());
             return d;
           })
      .def(
          "_forward",
          [](const MultiHeadAttention& l, nb::handle x, nb::handle x_kv, nb::handle y, nb::handle arrays,
             const Options& o) {
            CallArrays a;
            MhaOptions mo;
            mo.attention = params_of(o, a, arrays);
            const TensorView xv = a.in("x", x), yv = a.out("y", y);
            const auto kvv = a.in_opt("x_kv", x_kv);
            nb::gil_scoped_release release;
            if (kvv) l.forward(xv, *kvv, yv, mo);
            else l.forward(xv, yv, mo);
          },
          nb::arg("x"), nb::arg("x_kv").none(), nb::arg("y"), nb::arg("arrays"), nb::arg("options"))
      .def(
          "_forward_cached",
          [](const MultiHeadAttention& l, nb::handle x, KVCache& cache, nb::handle y, nb::handle arrays,
             const Options& o) {
            CallArrays a;
            MhaOptions mo;
            mo.attention = params_of(o, a, arrays);
            const TensorView xv = a.in("x", x), yv = a.out("y", y);
            nb::gil_scoped_release release;
            l.forward(xv, cache, yv, mo);
          },
          nb::arg("x"), nb::arg("cache"), nb::arg("y"), nb::arg("arrays"), nb::arg("options"));
}

}  // namespace qkv::python
