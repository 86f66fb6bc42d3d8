// The model's loss in float64, written as directly as train.hpp states it: one sequence, one
// position, one head at a time, attention as softmax over the admissible keys of scale q.k. It
// shares no code with model.cpp or the attention kernels, so a finite difference of it checks
// the float32 gradients of both.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/train.hpp"

namespace qkv::train {
namespace {

using Mat = std::vector<double>;  // row-major [rows, cols]

// y[r, o] = sum_i x[r, i] w[o, i] (+ b[o]).
Mat linear(const Mat& x, std::int64_t rows, std::int64_t in, const double* w, const double* b, std::int64_t out) {
  Mat y(static_cast<std::size_t>(rows * out));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t o = 0; o < out; ++o) {
      double s = b ? b[o] : 0.0;
      for (std::int64_t i = 0; i < in; ++i) s += x[static_cast<std::size_t>(r * in + i)] * w[o * in + i];
      y[static_cast<std::size_t>(r * out + o)] = s;
    }
  return y;
}

Mat rmsnorm(const Mat& x, std::int64_t rows, std::int64_t d, const double* g) {
  Mat y(x.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (std::int64_t j = 0; j < d; ++j) ss += x[static_cast<std::size_t>(r * d + j)] * x[static_cast<std::size_t>(r * d + j)];
    const double inv = 1.0 / std::sqrt(ss / static_cast<double>(d) + 1e-5);
    for (std::int64_t j = 0; j < d; ++j)
      y[static_cast<std::size_t>(r * d + j)] = x[static_cast<std::size_t>(r * d + j)] * inv * g[j];
  }
  return y;
}

}  // namespace

std::vector<std::vector<double>> parameters_f64(const Model& model) {
  std::vector<std::vector<double>> out;
  for (const Param& p : model.parameters()) {
    const float* v = p.value.data_as<const float>();
    out.emplace_back(v, v + p.value.numel());
  }
  return out;
}

double reference_loss(const Model& model, const Batch& batch, std::span<const std::vector<double>> params) {
  const ModelConfig& c = model.config();
  const std::vector<Param> ps = model.parameters();
  if (params.size() != ps.size())
    throw Error("reference_loss: params: expected " + std::to_string(ps.size()) + " tensors, got " +
                std::to_string(params.size()));
  for (std::size_t i = 0; i < ps.size(); ++i)
    if (static_cast<std::int64_t>(params[i].size()) != ps[i].value.numel())
      throw Error("reference_loss: params[" + std::to_string(i) + "] (" + ps[i].name + "): expected " +
                  std::to_string(ps[i].value.numel()) + " values, got " + std::to_string(params[i].size()));
  const std::int64_t V = c.vocab, T = c.seq_len, d = c.d_model, F = c.d_ff, H = c.num_heads, D = c.d_k;
  if (batch.T != T) throw Error("reference_loss: batch: expected T = " + std::to_string(T) + ", got " + std::to_string(batch.T));
  auto P = [&](std::size_t i) { return params[i].data(); };
  double total = 0;
  std::int64_t count = 0;
  for (std::int64_t s = 0; s < batch.batch; ++s) {
    const std::int32_t* tok = batch.tokens.data() + s * T;
    const std::int32_t* tgt = batch.targets.data() + s * T;
    Mat x(static_cast<std::size_t>(T * d));
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t prev = t == 0 ? V : tok[t - 1];
      for (std::int64_t j = 0; j < d; ++j)
        x[static_cast<std::size_t>(t * d + j)] = P(0)[tok[t] * d + j] + P(1)[prev * d + j] + P(2)[t * d + j];
    }
    for (std::int64_t l = 0; l < c.n_layers; ++l) {
      const std::size_t b = 3 + 10 * static_cast<std::size_t>(l);
      const Mat n1 = rmsnorm(x, T, d, P(b));
      const Mat qkv = linear(n1, T, d, P(b + 1), P(b + 2), 3 * H * D);  // rows q | k | v
      Mat o(static_cast<std::size_t>(T * H * D), 0.0);
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < T; ++i) {
          std::vector<double> sc(static_cast<std::size_t>(i + 1));
          for (std::int64_t j = 0; j <= i; ++j) {  // causal: keys 0 .. i
            double dot = 0;
            for (std::int64_t e = 0; e < D; ++e)
              dot += qkv[static_cast<std::size_t>(i * 3 * H * D + h * D + e)] *
                     qkv[static_cast<std::size_t>(j * 3 * H * D + H * D + h * D + e)];
            sc[static_cast<std::size_t>(j)] = c.scale * dot;
          }
          const double mx = *std::max_element(sc.begin(), sc.end());
          double z = 0;
          for (double& v : sc) z += v = std::exp(v - mx);
          for (std::int64_t j = 0; j <= i; ++j)
            for (std::int64_t e = 0; e < D; ++e)
              o[static_cast<std::size_t>(i * H * D + h * D + e)] +=
                  sc[static_cast<std::size_t>(j)] / z * qkv[static_cast<std::size_t>(j * 3 * H * D + 2 * H * D + h * D + e)];
        }
      const Mat att = linear(o, T, H * D, P(b + 3), P(b + 4), d);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] += att[i];
      const Mat n2 = rmsnorm(x, T, d, P(b + 5));
      Mat u = linear(n2, T, d, P(b + 6), P(b + 7), F);
      for (double& v : u) v = 0.5 * v * (1 + std::tanh(0.7978845608028654 * (v + 0.044715 * v * v * v)));
      const Mat f = linear(u, T, F, P(b + 8), P(b + 9), d);
      for (std::size_t i = 0; i < x.size(); ++i) x[i] += f[i];
    }
    const std::size_t last = params.size() - 1;
    const Mat logits = linear(rmsnorm(x, T, d, P(last - 1)), T, d, P(last), nullptr, V);
    for (std::int64_t t = 0; t < T; ++t) {
      if (tgt[t] < 0) continue;
      const double* z = logits.data() + t * V;
      const double mx = *std::max_element(z, z + V);
      double sum = 0;
      for (std::int64_t j = 0; j < V; ++j) sum += std::exp(z[j] - mx);
      total += mx + std::log(sum) - z[tgt[t]];
      ++count;
    }
  }
  if (count == 0) throw Error("reference_loss: batch: expected at least one scored position, got none");
  return total / static_cast<double>(count);
}

}  // namespace qkv::train
