// Builds against the installed qkv package, attention component only (qkv::attention), and checks
// the fast attention op against the float64 reference on a small causal grouped-query problem.
#include <cmath>
#include <cstdio>
#include <vector>

#include <qkv/attention.hpp>
#include <qkv/reference.hpp>
#include <qkv/version.hpp>

int main() {
  const long B = 2, Hq = 4, Hkv = 2, Sq = 37, Sk = 53, D = 16;
  std::vector<float> q(B * Hq * Sq * D), k(B * Hkv * Sk * D), v(k.size()), o(q.size()), r(q.size());
  unsigned s = 12345;
  auto next = [&s] {  // deterministic values in [-1, 1)
    s = s * 1664525u + 1013904223u;
    return static_cast<float>(s >> 8) / static_cast<float>(1u << 23) - 1.0f;
  };
  for (auto* x : {&q, &k, &v})
    for (float& e : *x) e = next();
  qkv::AttentionParams p;
  p.causal = true;
  const qkv::TensorView Q(q.data(), qkv::DType::f32, {B, Hq, Sq, D});
  const qkv::TensorView K(k.data(), qkv::DType::f32, {B, Hkv, Sk, D});
  const qkv::TensorView V(v.data(), qkv::DType::f32, {B, Hkv, Sk, D});
  qkv::attention(Q, K, V, qkv::TensorView(o.data(), qkv::DType::f32, {B, Hq, Sq, D}), p);
  qkv::reference::attention(Q, K, V, qkv::TensorView(r.data(), qkv::DType::f32, {B, Hq, Sq, D}), p);
  double err = 0;
  for (std::size_t i = 0; i < o.size(); ++i) err = std::fmax(err, std::fabs(double(o[i]) - double(r[i])));
  const bool ok = err <= 1e-5 && std::isfinite(err);
  std::printf("qkv %s attention consumer: max |fast - reference| = %.3g %s\n", qkv::version(), err,
              ok ? "ok" : "MISMATCH");
  return ok ? 0 : 1;
}
