// flash: FlashAttention-2 forward on the CPU.
//
// Algorithm: Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
// Partitioning", Algorithm 1 (forward pass): Q blocks x K/V tiles, online softmax with running
// row max and row sum (Milakov & Gimelshein 2018), the accumulator rescaled when the max grows,
// one normalisation per row at the end, softmax_lse = m + log(l). The score matrix is never
// materialised beyond one kBq x kBk tile per thread.
//
// Tiling and threading: see src/kernels/engine/ (block.hpp, forward_schedule.hpp; per-ISA traits in
// src/kernels/simd/<isa>/): OpenMP over (batch, head, group of up to 4 query blocks), dynamic
// schedule, head-major, the query blocks with the most admissible keys first (causal balance);
// the blocks of a group go through the same K/V tiles in lockstep (one fetch from L3/DRAM per
// group).
// Workspace: four tile sets per thread, O(threads x (kBq + kBk) x (D + Dv)), in the calling
// thread's reusable buffer (kernels/workspace.hpp).
//
// Precision: fp32 inputs, or fp16/bf16 storage converted to fp32 (bf16 with AVX512_BF16: bf16
// products, exact, accumulated in fp32; P rounded to bf16 for PV); all sums, the running max and
// sum, and the output accumulator in fp32. float64 inputs and requests for the probabilities
// go to the reference kernel.
//
// Accuracy contract (tests/test_flash.cpp, docs/accuracy.md): against the float64 reference,
// max |error| <= 2 x (error of a naive fp32 attention) + 1e-6 for fp32; bf16/fp16 within their
// floors; NaN/inf at excluded keys never reach a row; bitwise identical results for any thread
// count and across runs, on each ISA.
#include "kernels/isa_kernels.hpp"
#include "kernels/kernels.hpp"
#include "kernels/workspace.hpp"

namespace qkv::detail {

std::string flash_refuse(const Problem& p) {
  if (p.q.dtype == DType::f64) return "float64 inputs: flash computes in fp32 (the reference computes in float64)";
  return {};
}

void flash_kernel(const Problem& p) {
  bool dot = false;
  const IsaKernels& k = active_isa_kernels(dot);
  const int threads = call_threads(p);
  k.flash_forward(p, thread_workspace(k.flash_workspace(p, threads)), threads, dot);
}

std::string flash_describe() {
  bool dot = false;
  const IsaKernels& k = active_isa_kernels(dot);
  return "FlashAttention-2 forward, fp32 accumulation (f32/f16/bf16 inputs); ISAs: " + isa_summary() +
         "; tiles " + std::to_string(k.block_q) + "x" + std::to_string(k.block_k) + " on " + k.name;
}

}  // namespace qkv::detail
