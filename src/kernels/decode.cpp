// decode: attention for a few query rows against a long KV cache (Sq <= 16).
//
// Algorithm: flash-decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context
// inference"): the keys of each (batch, KV head) are split in chunks processed in parallel, each
// with the FlashAttention-2 tile loop (Dao 2023, Alg. 1), leaving an unnormalised partial output,
// its running max m_c and sum l_c; the partials are merged by log-sum-exp:
//   M = max_c m_c, L = sum_c l_c e^{m_c - M}, O = sum_c O_c e^{m_c - M} / L, lse = M + log L.
// All query heads that share a KV head (GQA) and all Sq rows form one block of rows, so K and V
// are read once per KV head, not once per query head.
//
// Fast path (engine/decode_fast.hpp, process_fast): when the rows of a group are few (G x Sq <=
// min(kBq, 16)), D and Dv are multiples of the vector width, and there is no explicit mask and no
// softcap, a chunk is processed without the padded row block: scores by D-vectorised FMAs, one
// accumulator per (row, key), and for groups of 4 rows W / 4 keys at a time whose W sums are
// reduced by one tree pairing the lanes as a single horizontal sum does (the same bits); vector
// exp over the tile's scores, PV with the output rows in registers; with one row (MHA decode) the
// scores of the next tile and the PV product of the current one go in one pass, so K and V stream
// side by side; bf16/fp16 K and V are widened in registers (exact), so bf16 decode computes in
// fp32 throughout (no bf16 rounding of P as in the vdpbf16ps block path).
// The position terms (score_rule.hpp) go through the score rule on either path (the fast path scores their rows
// by the rule's scalar form). Other cases (masks, softcap, many rows, odd D) use the tile engine
// unchanged.
//
// Keep-first: a chunk holds the rows' first keys [0, first_hi) that lie in it besides their
// window's keys (forward_schedule.hpp, chunk_keep_first), so every chunk stays at fixed key
// positions and the merge still runs in chunk order.
//
// Threading: one work item per (batch, KV head, row block, chunk), dynamic schedule. The chunk
// size depends only on the problem (at most 64 chunks per KV head, at least 4096 keys, partials
// bounded to ~16 MiB), and the merge runs in chunk order, so results are bitwise identical for
// any number of threads.
//
// Precision: as flash (src/kernels/flash.cpp): fp32 accumulation within chunks; the merge of the
// chunk partials in float64 (libm exp), rounded once to the output.
// Accuracy contract (tests/test_decode.cpp): same tolerances as flash against the float64
// reference; NaN at excluded keys never leaks; bitwise identical across thread counts.
#include "kernels/isa_kernels.hpp"
#include "kernels/kernels.hpp"
#include "kernels/workspace.hpp"

namespace qkv::detail {

std::string decode_refuse(const Problem& p) {
  if (p.Sq > kDecodeMaxSq)
    return "Sq = " + std::to_string(p.Sq) + " > " + std::to_string(kDecodeMaxSq) + " (decode takes a few query rows)";
  if (p.q.dtype == DType::f64) return "float64 inputs: decode computes in fp32 (the reference computes in float64)";
  return {};
}

void decode_kernel(const Problem& p) {
  bool dot = false;
  const IsaKernels& k = active_isa_kernels(dot);
  const int threads = call_threads(p);
  k.decode_forward(p, thread_workspace(k.decode_workspace(p, threads)), threads, dot);
}

std::string decode_describe() {
  return "flash-decoding for Sq <= " + std::to_string(kDecodeMaxSq) +
         ": keys split in fixed chunks, GQA heads share K/V reads, log-sum-exp merge; ISAs: " + isa_summary();
}

}  // namespace qkv::detail
