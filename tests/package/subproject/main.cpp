// Builds qkv from source as a subproject (add_subdirectory) and checks the fast attention op
// against the float64 reference; a multi-head attention layer (qkv::layers, on OpenBLAS) with
// zero weights and biases must give zeros.
#include <cmath>
#include <cstdio>
#include <vector>

#include <qkv/qkv.hpp>

int main() {
  const long B = 1, H = 2, S = 19, D = 8;
  std::vector<float> q(B * H * S * D), k(q.size()), v(q.size()), o(q.size()), r(q.size());
  unsigned s = 7;
  auto next = [&s] {  // deterministic values in [-1, 1)
    s = s * 1664525u + 1013904223u;
    return static_cast<float>(s >> 8) / static_cast<float>(1u << 23) - 1.0f;
  };
  for (auto* x : {&q, &k, &v})
    for (float& e : *x) e = next();
  qkv::AttentionParams p;
  p.causal = true;
  const qkv::TensorView Q(q.data(), qkv::DType::f32, {B, H, S, D});
  const qkv::TensorView K(k.data(), qkv::DType::f32, {B, H, S, D});
  const qkv::TensorView V(v.data(), qkv::DType::f32, {B, H, S, D});
  qkv::attention(Q, K, V, qkv::TensorView(o.data(), qkv::DType::f32, {B, H, S, D}), p);
  qkv::reference::attention(Q, K, V, qkv::TensorView(r.data(), qkv::DType::f32, {B, H, S, D}), p);
  double err = 0;
  for (std::size_t i = 0; i < o.size(); ++i) err = std::fmax(err, std::fabs(double(o[i]) - double(r[i])));
  qkv::MhaConfig c;
  c.d_model = 16;
  c.num_heads = 4;
  const qkv::MultiHeadAttention mha(c);
  std::vector<float> x(S * c.d_model, 0.5f), y(x.size(), 1.0f);
  mha.forward(qkv::TensorView(x.data(), qkv::DType::f32, {1, S, c.d_model}),
              qkv::TensorView(y.data(), qkv::DType::f32, {1, S, c.d_model}));
  double ymax = 0;
  for (float e : y) ymax = std::fmax(ymax, std::fabs(e));
  const bool ok = err <= 1e-5 && std::isfinite(err) && ymax == 0;
  std::printf("qkv %s subproject consumer: max |fast - reference| = %.3g, zero-weight MHA max |y| = %g %s\n",
              qkv::version(), err, ymax, ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
