// Builds against the installed qkv package and checks one attention call.
#include <cmath>
#include <cstdio>
#include <vector>

#include <qkv/qkv.hpp>

int main() {
  // Two keys with equal scores: the output is the mean of the two values.
  std::vector<float> q{0, 0}, k{1, 0, 1, 0}, v{1, 2, 3, 4}, o(2);
  qkv::attention(qkv::TensorView(q.data(), qkv::DType::f32, {1, 1, 1, 2}),
                 qkv::TensorView(k.data(), qkv::DType::f32, {1, 1, 2, 2}),
                 qkv::TensorView(v.data(), qkv::DType::f32, {1, 1, 2, 2}),
                 qkv::TensorView(o.data(), qkv::DType::f32, {1, 1, 1, 2}));
  const bool ok = std::fabs(o[0] - 2.0f) < 1e-6f && std::fabs(o[1] - 3.0f) < 1e-6f;
  std::printf("qkv %s consumer: O = [%g, %g] %s\n", qkv::version(), o[0], o[1], ok ? "ok" : "WRONG");
  return ok ? 0 : 1;
}
