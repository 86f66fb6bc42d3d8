// Weight loading for MultiHeadAttention (PyTorch, Hugging Face and Meta names) and the
// conversion of PyTorch's "True = ignore" masks to qkv's "true = attend" masks.
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/mha.hpp"
#include "tensor/convert.hpp"

namespace qkv {
namespace {


using TensorMap = std::map<std::string, Tensor>;

// The one tensor among `names` (after prefix) present in the map, or nullptr; two present is an error.
const Tensor* find_one(const TensorMap& m, const std::string& prefix,
                       std::initializer_list<const char*> names, std::string* found = nullptr) {
  const Tensor* hit = nullptr;
  std::string hit_name;
  for (const char* n : names) {
    auto it = m.find(prefix + n);
    if (it == m.end()) continue;
    if (hit)
      throw Error("mha weights: both '" + hit_name + "' and '" + it->first +
                  "' are present; expected only one");
    hit = &it->second;
    hit_name = it->first;
  }
  if (found) *found = hit_name;
  return hit;
}

struct Names {
  const Tensor *in_w = nullptr, *in_b = nullptr, *q_w = nullptr, *k_w = nullptr, *v_w = nullptr,
               *o_w = nullptr;
  const Tensor *q_b = nullptr, *k_b = nullptr, *v_b = nullptr, *o_b = nullptr, *sinks = nullptr;
  std::string in_w_n, in_b_n, q_w_n, k_w_n, v_w_n, o_w_n, q_b_n, k_b_n, v_b_n, o_b_n, sinks_n;
};

Names lookup(const TensorMap& m, const std::string& p) {
  Names n;
  n.in_w = find_one(m, p, {"in_proj_weight"}, &n.in_w_n);
  n.in_b = find_one(m, p, {"in_proj_bias"}, &n.in_b_n);
  n.q_w = find_one(m, p, {"q_proj_weight", "q_proj.weight", "wq.weight"}, &n.q_w_n);
  n.k_w = find_one(m, p, {"k_proj_weight", "k_proj.weight", "wk.weight"}, &n.k_w_n);
  n.v_w = find_one(m, p, {"v_proj_weight", "v_proj.weight", "wv.weight"}, &n.v_w_n);
  n.o_w = find_one(m, p, {"out_proj.weight", "o_proj.weight", "wo.weight"}, &n.o_w_n);
  n.q_b = find_one(m, p, {"q_proj.bias", "wq.bias"}, &n.q_b_n);
  n.k_b = find_one(m, p, {"k_proj.bias", "wk.bias"}, &n.k_b_n);
  n.v_b = find_one(m, p, {"v_proj.bias", "wv.bias"}, &n.v_b_n);
  n.o_b = find_one(m, p, {"out_proj.bias", "o_proj.bias", "wo.bias"}, &n.o_b_n);
  n.sinks = find_one(m, p, {"sinks"}, &n.sinks_n);
  const bool sep = n.q_w || n.k_w || n.v_w;
  if (n.in_w && sep)
    throw Error("mha weights: both the packed '" + n.in_w_n +
                "' and separate q/k/v projection weights are present");
  if (!n.in_w && !sep)
    throw Error(
        "mha weights: no input projection found under prefix '" + p +
        "' (expected in_proj_weight, or q_proj.weight/k_proj.weight/v_proj.weight, q_proj_weight/..., "
        "or wq.weight/wk.weight/wv.weight)");
  if (sep && (!n.q_w || !n.k_w || !n.v_w))
    throw Error(std::string("mha weights: missing ") +
                (!n.q_w   ? "the query"
                 : !n.k_w ? "the key"
                          : "the value") +
                " projection weight under prefix '" + p + "' (the other separate projections are present)");
  if (!n.o_w)
    throw Error("mha weights: no output projection found under prefix '" + p +
                "' (expected out_proj.weight, o_proj.weight or wo.weight)");
  const bool sep_b = n.q_b || n.k_b || n.v_b;
  if (n.in_b && sep_b)
    throw Error("mha weights: both '" + n.in_b_n + "' and separate q/k/v biases are present");
  if (sep_b && (!n.q_b || !n.k_b || !n.v_b))
    throw Error("mha weights: expected all three of the separate q/k/v biases or none under prefix '" + p +
                "'");
  return n;
}

void expect_shape(const Tensor& t, const std::string& name, const Shape& want) {
  if (t.shape() != want)
    throw Error("mha weights: " + name + ": expected shape " + shape_str(want) + ", got " +
                shape_str(t.shape()));
  if (!detail::is_float_dtype(t.dtype()))
    throw Error("mha weights: " + name + ": expected a float dtype, got " +
                std::string(dtype_name(t.dtype())));
}

void copy_into(const TensorView& dst, const Tensor& src) {
  detail::convert_row(src.data(), src.dtype(), dst.data(), DType::f32, src.numel());
}

std::int64_t rows(const Tensor* t) { return t->shape().size() == 2 ? t->shape()[0] : -1; }
std::int64_t cols(const Tensor* t) { return t->shape().size() == 2 ? t->shape()[1] : -1; }

}  // namespace

MhaConfig infer_mha_config(const TensorMap& tensors, std::int64_t num_heads, std::int64_t num_kv_heads,
                           const std::string& prefix) {
  if (num_heads < 1) throw Error("mha weights: num_heads: expected Hq >= 1, got " + std::to_string(num_heads));
  if (num_kv_heads < 0)
    throw Error("mha weights: num_kv_heads: expected Hkv >= 0 (0 = Hq), got " + std::to_string(num_kv_heads));
  const std::int64_t Hq = num_heads, Hkv = num_kv_heads ? num_kv_heads : num_heads;
  if (Hq % Hkv) throw Error("mha weights: expected Hq % Hkv == 0, got Hq = " + std::to_string(Hq) + ", Hkv = " + std::to_string(Hkv));
  const Names n = lookup(tensors, prefix);
  if (n.o_w->shape().size() != 2)
    throw Error("mha weights: " + n.o_w_n + ": expected a 2-D [d_model, Hq*Dv] matrix, got shape " +
                shape_str(n.o_w->shape()));
  MhaConfig c;
  c.num_heads = Hq;
  c.num_kv_heads = Hkv;
  c.d_model = rows(n.o_w);
  const std::int64_t o_in = cols(n.o_w);
  if (o_in % Hq)
    throw Error("mha weights: " + n.o_w_n + ": expected [d_model, Hq*Dv] with Hq = " + std::to_string(Hq) + " dividing " +
                std::to_string(o_in));
  c.head_dim_v = o_in / Hq;
  if (n.in_w) {
    const std::int64_t r = rows(n.in_w), rest = r - Hkv * c.head_dim_v;
    if (r < 0 || rest <= 0 || rest % (Hq + Hkv))
      throw Error("mha weights: " + n.in_w_n +
                  ": expected [Hq*D + Hkv*D + Hkv*Dv, d_model] with Hq = " + std::to_string(Hq) + ", Hkv = " + std::to_string(Hkv) +
                  ", Dv = " + std::to_string(c.head_dim_v) + ", got shape " + shape_str(n.in_w->shape()));
    c.head_dim = rest / (Hq + Hkv);
  } else {
    const std::int64_t r = rows(n.q_w);
    if (r <= 0 || r % Hq)
      throw Error("mha weights: " + n.q_w_n + ": expected [Hq*D, d_model] with Hq = " + std::to_string(Hq) +
                  ", got shape " + shape_str(n.q_w->shape()));
    c.head_dim = r / Hq;
  }
  c.qkv_bias = n.in_b || n.q_b;
  c.out_bias = n.o_b != nullptr;
  c.sinks = n.sinks != nullptr;
  if (c.d_model < 1 || c.head_dim < 1 || c.head_dim_v < 1)
    throw Error("mha weights: inferred an empty layer (d_model = " + std::to_string(c.d_model) + ", D = " + std::to_string(c.head_dim) +
                ", Dv = " + std::to_string(c.head_dim_v) + ")");
  return c;
}

void MultiHeadAttention::load_weights(const TensorMap& tensors, const std::string& prefix) {
  if (cfg_.d_model < 1) throw Error("mha weights: the layer has no configuration");
  const Names n = lookup(tensors, prefix);
  const std::int64_t dm = cfg_.d_model, Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads, D = cfg_.head_dim,
                     Dv = cfg_.head_dim_v;
  const std::int64_t n_in = Hq * D + Hkv * D + Hkv * Dv;
  // Check everything before copying anything, so a refused file leaves the layer unchanged.
  if (n.in_w)
    expect_shape(*n.in_w, n.in_w_n, {n_in, dm});
  else {
    expect_shape(*n.q_w, n.q_w_n, {Hq * D, dm});
    expect_shape(*n.k_w, n.k_w_n, {Hkv * D, dm});
    expect_shape(*n.v_w, n.v_w_n, {Hkv * Dv, dm});
  }
  expect_shape(*n.o_w, n.o_w_n, {dm, Hq * Dv});
  const bool has_in_b = n.in_b || n.q_b;
  if (has_in_b != cfg_.qkv_bias)
    throw Error(cfg_.qkv_bias
                    ? "mha weights: the config has q/k/v biases but no in_proj_bias (or q_proj.bias, ...) "
                      "is present under prefix '" +
                          prefix + "'"
                    : "mha weights: q/k/v biases are present but the config has qkv_bias = false");
  if ((n.o_b != nullptr) != cfg_.out_bias)
    throw Error(cfg_.out_bias
                    ? "mha weights: the config has an output bias but no out_proj.bias (or o_proj.bias, "
                      "wo.bias) is present under prefix '" +
                          prefix + "'"
                    : "mha weights: an output bias is present but the config has out_bias = false");
  if (n.in_b) expect_shape(*n.in_b, n.in_b_n, {n_in});
  if (n.q_b) {
    expect_shape(*n.q_b, n.q_b_n, {Hq * D});
    expect_shape(*n.k_b, n.k_b_n, {Hkv * D});
    expect_shape(*n.v_b, n.v_b_n, {Hkv * Dv});
  }
  if (n.o_b) expect_shape(*n.o_b, n.o_b_n, {dm});
  if ((n.sinks != nullptr) != cfg_.sinks)
    throw Error(cfg_.sinks ? "mha weights: the config has attention sinks but no 'sinks' tensor is present under "
                             "prefix '" + prefix + "'"
                           : "mha weights: '" + n.sinks_n + "' is present but the config has sinks = false");
  if (n.sinks) expect_shape(*n.sinks, n.sinks_n, {Hq});

  if (n.in_w)
    copy_into(w_in_.view(), *n.in_w);
  else {
    copy_into(w_q(), *n.q_w);
    copy_into(w_k(), *n.k_w);
    copy_into(w_v(), *n.v_w);
  }
  copy_into(w_o_.view(), *n.o_w);
  if (n.in_b) copy_into(b_in_.view(), *n.in_b);
  if (n.q_b) {
    copy_into(b_q(), *n.q_b);
    copy_into(b_k(), *n.k_b);
    copy_into(b_v(), *n.v_b);
  }
  if (n.o_b) copy_into(b_o_.view(), *n.o_b);
  if (n.sinks) copy_into(sinks_.view(), *n.sinks);
}

Tensor mask_from_torch(const std::optional<TensorView>& attn_mask,
                       const std::optional<TensorView>& key_padding_mask, std::int64_t B, std::int64_t Hq,
                       std::int64_t Sq, std::int64_t Sk) {
  if (!attn_mask && !key_padding_mask) return {};
  if (B < 0 || Hq < 1 || Sq < 0 || Sk < 0)
    throw Error("mask_from_torch: expected B, Sq, Sk >= 0 and Hq >= 1, got B = " + std::to_string(B) + ", Hq = " + std::to_string(Hq) +
                ", Sq = " + std::to_string(Sq) + ", Sk = " + std::to_string(Sk));
  auto check_dtype = [](const TensorView& t, const char* name) {
    if (t.dtype() != DType::b8 && t.dtype() != DType::f32 && t.dtype() != DType::f64)
      throw Error(std::string("mask_from_torch: ") + name +
                  ": expected dtype bool (True = ignore) or float32/float64 "
                  "(additive), got " +
                  std::string(dtype_name(t.dtype())));
    if (!t.data() && t.numel() > 0)
      throw Error(std::string("mask_from_torch: ") + name + ": data pointer is null");
  };
  bool per_head = false;
  if (attn_mask) {
    const TensorView& a = *attn_mask;
    check_dtype(a, "attn_mask");
    const bool ok2 = a.rank() == 2 && a.size(0) == Sq && a.size(1) == Sk;
    const bool ok3 = a.rank() == 3 && a.size(0) == B * Hq && a.size(1) == Sq && a.size(2) == Sk;
    if (!ok2 && !ok3)
      throw Error("mask_from_torch: attn_mask: expected shape [Sq,Sk] = " + shape_str({Sq, Sk}) +
                  " or [B*Hq,Sq,Sk] = " + shape_str({B * Hq, Sq, Sk}) + ", got " + shape_str(a.shape()));
    per_head = ok3;
  }
  if (key_padding_mask) {
    const TensorView& k = *key_padding_mask;
    check_dtype(k, "key_padding_mask");
    if (k.rank() != 2 || k.size(0) != B || k.size(1) != Sk)
      throw Error("mask_from_torch: key_padding_mask: expected shape [B,Sk] = " + shape_str({B, Sk}) +
                  ", got " + shape_str(k.shape()));
  }
  const bool all_bool = (!attn_mask || attn_mask->dtype() == DType::b8) &&
                        (!key_padding_mask || key_padding_mask->dtype() == DType::b8);
  const std::int64_t H = per_head ? Hq : 1;
  Tensor out(all_bool ? DType::b8 : DType::f32, {B, H, Sq, Sk});
  const double neg_inf = -std::numeric_limits<double>::infinity();
  // PyTorch's value at an element: bool True -> ignore (-inf), bool False -> 0, float -> itself.
  auto torch_add = [&](const TensorView& t, std::int64_t off) {
    if (t.dtype() == DType::b8) return t.data_as<const std::uint8_t>()[off] ? neg_inf : 0.0;
    return load_as_double(t.data(), t.dtype(), off);
  };
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t i = 0; i < Sq; ++i)
        for (std::int64_t j = 0; j < Sk; ++j) {
          double add = 0.0;
          if (attn_mask) {
            const TensorView& a = *attn_mask;
            const std::int64_t off = per_head ? (b * Hq + h) * a.stride(0) + i * a.stride(1) + j * a.stride(2)
                                              : i * a.stride(0) + j * a.stride(1);
            add += torch_add(a, off);
          }
          if (key_padding_mask)
            add += torch_add(*key_padding_mask,
                             b * key_padding_mask->stride(0) + j * key_padding_mask->stride(1));
          const std::int64_t o = ((b * H + h) * Sq + i) * Sk + j;
          if (all_bool)
            out.data_as<std::uint8_t>()[o] = add == 0.0;  // true = attend
          else
            out.data_as<float>()[o] = static_cast<float>(add);
        }
  return out;
}

}  // namespace qkv
