#pragma once
// The table through which the ISA-independent glue (flash.cpp, decode.cpp, backward.cpp,
// serving.cpp) reaches the per-ISA instantiations of the attention engine (src/kernels/engine/,
// instantiated in src/kernels/simd/<isa>/). Each ISA translation unit defines one IsaKernels
// object; active_isa_kernels() (isa_select.cpp) picks one at run time, the one place that maps an
// ISA level to the code of every fast kernel.
#include <cstddef>
#include <string>

#include "core/problem.hpp"
#include "kernels/serving.hpp"

namespace qkv::detail {

struct IsaKernels {
  const char* name;  // "avx512", "avx2", "scalar"
  /// Bytes of workspace flash_forward needs for `p` with `threads` threads (64-byte aligned).
  std::size_t (*flash_workspace)(const Problem& p, int threads);
  /// FlashAttention-2 forward of the whole problem; `ws` holds flash_workspace() bytes.
  void (*flash_forward)(const Problem& p, void* ws, int threads, bool bf16_dot);
  /// Bytes of workspace decode_forward needs (the threads' tile sets and the chunk partials).
  std::size_t (*decode_workspace)(const Problem& p, int threads);
  /// Flash-decoding (Sq small): keys split in fixed chunks, partials merged by log-sum-exp.
  void (*decode_forward)(const Problem& p, void* ws, int threads, bool bf16_dot);
  /// Bytes of workspace backward() needs (the threads' tiles and the dQ chunk buffers).
  std::size_t (*backward_workspace)(const BackwardProblem& bp, int threads);
  /// FlashAttention-2 backward (kernels/engine/backward.hpp): dQ, dK, dV of the whole problem;
  /// bf16_dot: the AVX512_BF16 form may be used (bf16 q, k, v, dO and O).
  void (*backward)(const BackwardProblem& bp, void* ws, int threads, bool bf16_dot);
  /// Tile sizes, for describe(): rows per query block and keys per key tile.
  int block_q, block_k;
  /// The vector exp of the online softmax, on an array (tests measure its error).
  void (*exp_array)(const float* x, float* y, std::int64_t n);
  /// The FLOP rate of the bf16 dot product over that of the fp32 FMA, measured on this CPU
  /// (null where the ISA has no bf16 dot product).
  double (*bf16_dot_rate)();
  /// One work item of the serving kernel (engine/serving_item.hpp): the partials of its rows to
  /// parts (NS splits per row); bf16_dot: the scores of bf16 queries and keys on the level's bf16
  /// products (avx512bf16: dot products), as the tiled kernels use them. avx512amx, where
  /// bf16_dot is always on, has only its tile form.
  void (*serving_item)(const VarlenProblem& vp, const ServingItem& it, const ServingLayout& L, float* parts,
                       std::int64_t NS, char* ws, bool bf16_dot);
};

#if defined(QKV_HAVE_AVX512)
extern const IsaKernels kIsaKernelsAvx512;
#endif
#if defined(QKV_HAVE_AVX512AMX)
extern const IsaKernels kIsaKernelsAvx512Amx;
#endif
#if defined(QKV_HAVE_AVX2)
extern const IsaKernels kIsaKernelsAvx2;
#endif
extern const IsaKernels kIsaKernelsScalar;

}  // namespace qkv::detail

namespace qkv::detail {

/// The engine of the active ISA level (active_isa(): CPU, QKV_ISA, set_isa_cap) and whether
/// its bf16 dot-product path may be used.
const IsaKernels& active_isa_kernels(bool& bf16_dot) noexcept;
/// The measured rate of the bf16 dot product against the fp32 FMA (0 where there is none),
/// measured once per process when first asked (qkv info, qkv bench); no kernel choice uses it.
double bf16_dot_rate() noexcept;
/// Whether the fast kernels use bf16 products for bf16 inputs: always on avx512amx (AMX tiles);
/// on avx512bf16 (vdpbf16ps) on CPUs without AMX hardware (where vdpbf16ps runs at twice the FMA
/// rate; with AMX hardware it runs at half), or when avx512bf16 was asked for by name. Decided
/// from CPUID, never from bf16_dot_rate(), so every process on a CPU makes the same choice.
bool bf16_dot_enabled() noexcept;
/// Threads a call uses: params.num_threads, or OpenMP's default when 0 (1 for calls under ~10^6
/// multiply-adds, which cannot repay waking a thread team).
int call_threads(const Problem& p) noexcept;
/// "avx512bf16 avx512 avx2 scalar": the compiled levels, each marked usable or not on this CPU.
std::string isa_summary();
/// The active level as a kernel choice is explained: "avx512amx"; for a call whose operands the
/// kernel multiplies in bf16 where the level allows (bf16_operands) and a level that does, with
/// the form: "avx512amx, bf16 AMX tiles" or "avx512bf16, bf16 dot products".
std::string active_isa_form(bool bf16_operands);

}  // namespace qkv::detail
