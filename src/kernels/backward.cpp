// flash backward: FlashAttention-2's backward pass on the CPU.
//
// Algorithm: Dao 2023, "FlashAttention-2", Algorithm 2 (backward pass): K/V blocks outermost,
// P recomputed from softmax_lse tile by tile, dV = P^T dO, dP = dO V^T, dS = P (dP - D),
// dQ = scale dS K, dK = scale dS^T Q; sinks' dz by sink_gradient (sink_grad.cpp). The tiling, threading and the deterministic reduction of dQ
// are described in src/kernels/engine/backward.hpp (per-ISA instantiations in
// src/kernels/simd/<isa>/).
//
// Precision: f32 inputs, or f16/bf16 storage widened to fp32; every product, sum and gradient
// accumulator in fp32; float64 inputs go to the reference. bf16 q, k, v, dO and O on a CPU whose
// AVX512_BF16 dot products pay (kernels/isa_select.cpp) take the dot-product form: P and dS
// rounded to bf16 for the products (relative 2^-9), accumulation still in fp32.
//
// Accuracy contract (tests/test_backward.cpp, docs/accuracy.md): against the float64 backward,
// max |error| of each gradient <= 2 x (error of a naive fp32 backward) + 1e-6 max(1, max |grad|)
// (plus the rounding of a bf16/f16 gradient; on the bf16 dot-product form 2^-8 of the largest sum
// of absolute terms of a gradient element); NaN or inf at excluded keys never reach a
// gradient; bitwise identical gradients for any thread count and across runs, on each ISA.
#include "kernels/isa_kernels.hpp"
#include "kernels/kernels.hpp"
#include "kernels/workspace.hpp"

namespace qkv::detail {

std::string flash_backward_refuse(const BackwardProblem& bp) {
  if (bp.fwd.q.dtype == DType::f64)
    return "float64 inputs: the fast backward computes in fp32 (the reference computes in float64)";
  return {};
}

void flash_backward_kernel(const BackwardProblem& bp) {
  bool dot = false;
  const IsaKernels& k = active_isa_kernels(dot);
  const int threads = call_threads(bp.fwd);
  k.backward(bp, thread_workspace(k.backward_workspace(bp, threads)), threads, dot);
  sink_gradient(bp);
}

}  // namespace qkv::detail
