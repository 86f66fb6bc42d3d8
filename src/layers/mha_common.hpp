#pragma once
// What MultiHeadAttention's forward (mha.cpp) and backward (mha_backward.cpp) share: the row
// layout of [B, S, features] activations, the projection GEMM, the argument checks, and the
// q/k/v projection + RoPE positions, so that the backward recomputes exactly the forward's q, k, v.
#include <cstdint>
#include <span>
#include <vector>

#include "qkv/mha.hpp"
#include "qkv/tensor.hpp"

namespace qkv::mha_detail {

// Pitch (elements) between consecutive flattened (b, s) rows of a [B, S, width] layout with
// strides s0, s1, or 0 if the rows are not evenly spaced at >= width apart.
std::int64_t row_pitch(std::int64_t B, std::int64_t S, std::int64_t s0, std::int64_t s1, std::int64_t width);

// c[b, s, :] = x[b, s, :] W^T + bias for a [B, S, K] view x (contiguous last dim) and a
// [B, S, N] destination with strides (sbc, ldc, 1).
void linear(const TensorView& x, const float* w, std::int64_t ldw, std::int64_t N, const float* bias,
            float* c, std::int64_t sbc, std::int64_t ldc);

// A float32 activation [B, S, d_model] (`axes` names it in messages): rank, dtype, contiguous
// last dimension, d_model, non-overlapping rows, the BLAS int range, a data pointer.
void check_act(const TensorView& t, const char* name, const char* axes, std::int64_t d_model);

std::vector<std::int64_t> iota_positions(std::int64_t S);

// A [B, S, H*d] buffer (BSHD) seen as heads [B, H, S, d]. The batch stride stays non-zero when
// S = 0, so the view is a valid attention output even then.
TensorView heads_view(const Tensor& t, std::int64_t H);

// q [B,Hq,Sq,D], k [B,Hkv,Sk,D], v [B,Hkv,Sk,Dv]: strided views of projection buffers (BSHD).
struct QkvHeads {
  Tensor pq, pkv;  // self-attention: pq holds all three ([B,S,Hq*D | Hkv*D | Hkv*Dv]), pkv is empty
  TensorView q, k, v;
};
// Self-attention: ONE GEMM with the packed in_proj_weight.
QkvHeads project_self(const TensorView& x, const TensorView& w_in, const float* b_in, const MhaConfig& cfg);
// Cross-attention: one GEMM for q, one for k and v together (adjacent rows of the packed matrix).
QkvHeads project_cross(const TensorView& x_q, const TensorView& x_kv, const TensorView& w_in,
                       const float* b_in, const MhaConfig& cfg);

// The RoPE positions of a call: options' spans, else 0 .. S-1; for self-attention the keys take
// the query positions unless k_positions is set.
class RopePositions {
 public:
  RopePositions(const MhaOptions& o, std::int64_t Sq, std::int64_t Sk, bool self);
  RopePositions(const RopePositions&) = delete;  // the spans may point into the vectors
  RopePositions& operator=(const RopePositions&) = delete;
  std::span<const std::int64_t> q() const;
  std::span<const std::int64_t> k() const;

 private:
  std::span<const std::int64_t> q_opt_, k_opt_;
  std::vector<std::int64_t> q_def_, k_def_;
  bool self_;
};

}  // namespace qkv::mha_detail
