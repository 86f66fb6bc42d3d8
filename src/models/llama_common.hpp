#pragma once
// Pieces of the Llama-2 forward pass shared by Llama (llama.cpp) and LlamaBatch (llama_batch.cpp),
// so that both compute every row with the same calls.

#include <cmath>
#include <cstring>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "blas/gemm.hpp"
#include "qkv/error.hpp"
#include "qkv/llama.hpp"

namespace qkv::llama_detail {

// c[M, N] = a[M, K] w[N, K]^T + beta * c (row-major; w is a Linear-layout [out, in] matrix).
inline void gemm_nt(int M, int N, int K, const float* a, int lda, const float* w, int ldw, float beta, float* c,
             int ldc) {
  qkv::detail::sgemm(CblasNoTrans, CblasTrans, M, N, K, 1.0f, a, lda, w, ldw, beta, c, ldc);
}

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * gain, per row of `dim` floats; the mean in double.
inline void rmsnorm(const float* x, const float* gain, float* out, std::int64_t rows, std::int64_t dim) {
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    double ss = 0.0;
    for (std::int64_t i = 0; i < dim; ++i) ss += static_cast<double>(xr[i]) * xr[i];
    const auto inv = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(dim) + Llama::rms_eps));
    for (std::int64_t i = 0; i < dim; ++i) out[r * dim + i] = gain[i] * (inv * xr[i]);
  }
}

inline void check_tokens(std::span<const int> tokens, int vocab, const char* what) {
  for (std::size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab)
      throw Error(std::string(what) + ": token " + std::to_string(static_cast<std::int64_t>(i)) + " is " + std::to_string(tokens[i]) +
                  ", expected an id in [0, vocab_size) = [0, " + std::to_string(vocab) + ")");
}

// g[t, i] = SiLU(h[t, i]) * h[t, hid + i] for rows t of h = [w1 x | w3 x] (SwiGLU).
inline void swiglu(const float* h, float* g, std::int64_t rows, int hid) {
  for (std::int64_t t = 0; t < rows; ++t)
    for (int i = 0; i < hid; ++i) {
      const float a = h[t * 2 * hid + i];
      g[t * hid + i] = a / (1.0f + std::exp(-a)) * h[t * 2 * hid + hid + i];
    }
}

// The layer's projections fused for one GEMM each: W^Q, W^K, W^V stacked as [dim + 2 kv_dim, dim]
// and W1, W3 as [2 hidden, dim], appended to wqkv and w13.
inline void fuse_layer_weights(const Llama2cLayer& layer, std::int64_t dim, std::int64_t kv_dim, std::int64_t hidden,
                               std::vector<Tensor>& wqkv, std::vector<Tensor>& w13) {
  const auto copy_rows = [](const TensorView& src, float* dst) {
    std::memcpy(dst, src.data(), static_cast<std::size_t>(src.numel()) * sizeof(float));
    return dst + src.numel();
  };
  Tensor qkv(DType::f32, {dim + 2 * kv_dim, dim});
  copy_rows(layer.wv, copy_rows(layer.wk, copy_rows(layer.wq, qkv.data_as<float>())));
  wqkv.push_back(std::move(qkv));
  Tensor w(DType::f32, {2 * hidden, dim});
  copy_rows(layer.w3, copy_rows(layer.w1, w.data_as<float>()));
  w13.push_back(std::move(w));
}

// The activations of one forward step over T tokens, as row-major [T, features] matrices: x (the
// residual stream, the tokens' embeddings to start with), xb (its normalised copy), qkv
// ([T, dim + 2 kv_dim], the fused projections), att (the attention output), h13 ([T, 2 hidden])
// and hb ([T, hidden], the SwiGLU output).
struct StepBuffers {
  Tensor x, xb, qkv, att, h13, hb;
  StepBuffers(std::span<const int> tokens, const float* embedding, int dim, int kv_dim, int hidden) {
    const auto T = static_cast<std::int64_t>(tokens.size());
    x = Tensor(DType::f32, {T, dim});
    xb = Tensor(DType::f32, {T, dim});
    qkv = Tensor(DType::f32, {T, dim + 2 * kv_dim});
    att = Tensor(DType::f32, {T, dim});
    h13 = Tensor(DType::f32, {T, 2 * hidden});
    hb = Tensor(DType::f32, {T, hidden});
    for (std::int64_t t = 0; t < T; ++t)
      std::memcpy(x.data_as<float>() + t * dim, embedding + std::int64_t{tokens[static_cast<std::size_t>(t)]} * dim,
                  static_cast<std::size_t>(dim) * sizeof(float));
  }
};

}  // namespace qkv::llama_detail
