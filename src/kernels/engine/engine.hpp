#pragma once
// The tiled attention engine shared by the `flash` and `decode` kernels: FlashAttention-2
// forward (Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
// Partitioning", Algorithm 1), and for a few query rows flash-decoding (Dao, Haziza, Massa,
// Sizov 2023), partial results merged by their log-sum-exp.
//
// ISA-independent: it is included by one translation unit per ISA
// (src/kernels/simd/<isa>/engine_<isa>.cpp), which first defines QKV_ENGINE_NS (a namespace
// private to that ISA, so that no inline function is shared between translation units compiled
// with different instruction sets) and then a struct `Ops` giving the vector type, its width, the
// tile sizes (the per-ISA constexpr traits) and the vector primitives (load, store, fma, max,
// exp, ...), the contract that the concept IsaOps (isa_ops.hpp) states.
//
// The parts, class templates over Ops, each using only parts listed above it:
//   isa_ops.hpp       the concept IsaOps; size_switch.hpp: a run-time count to a template argument
//   workspace.hpp     the per-thread buffers of a block (the "on-chip" memory), Row, Prefetch
//   score_rule.hpp    raw dot products to scores (scale, softcap, ALiBi, masks, key ranges with
//                     keep-first): ScoreRule,
//                     and with_score_rule, the switch from run-time options to the rule type
//   online_softmax.hpp the running max and sum, the rescale factor, the end (1 / l, lse)
//   lse_merge.hpp     the log-sum-exp merge of split partials (decode, serving, dist)
//   microkernels.hpp  S = Q K^T and O = alpha O + P V on one tile, fp32 conversions
//   block.hpp         one query block against its key tiles: online softmax, masks, the end
//   decode_fast.hpp   the decode fast path (a few rows, no mask or softcap; ALiBi, keep-first)
//   forward_schedule.hpp flash and decode over the whole problem, threads, the log-sum-exp merge
//   backward_tiles.hpp  the backward's workspace, packed query blocks and key tiles (fp32, bf16)
//   backward.hpp      the FlashAttention-2 backward (Algorithm 2) over the whole problem
// and here the switch from run-time options to template parameters (the score rule's by
// with_score_rule; the element type and the bf16 dot product), and the entry points of
// the IsaKernels table (kernels/isa_kernels.hpp).
#include <cstddef>

#include "core/problem.hpp"
#include "kernels/engine/backward.hpp"
#include "kernels/engine/block.hpp"
#include "kernels/engine/decode_fast.hpp"
#include "kernels/engine/forward_schedule.hpp"
#include "kernels/engine/isa_ops.hpp"
#include "kernels/engine/microkernels.hpp"
#include "kernels/engine/score_rule.hpp"
#include "kernels/engine/workspace.hpp"

namespace qkv::detail::QKV_ENGINE_NS {

template <IsaOps Ops>
struct Engine {
  using Dr = Drivers<Ops>;
  static constexpr int W = Ops::W;

  // ---- the one switch from run-time options to template parameters --------------------------
  // `call` is a Problem (forward) or a BackwardProblem; Fn<E, DP, Rule>::run(call, ws, t), R the
  // call's score rule (score_rule.hpp, with_score_rule).
  static const Problem& problem_of(const Problem& p) { return p; }
  static const Problem& problem_of(const BackwardProblem& bp) { return bp.fwd; }

  // kPositions: whether the kernel takes the position terms (ALiBi, keep-first): all of them do
  // (the parameter stays for a kernel that would not).
  template <template <Elt, bool, class> class Fn, bool kPositions, class Call>
  static void dispatch(const Call& call, char* ws, int threads, bool bf16_dot) {
    const Problem& p = problem_of(call);
    auto with_opts = [&]<Elt E, bool DP>() {
      with_score_rule<true, kPositions>(p, [&]<class Rule>() { Fn<E, DP, Rule>::run(call, ws, threads); });
    };
    switch (p.q.dtype) {
      case DType::bf16:
        if constexpr (Ops::kHasDpbf16) {
          if (bf16_dot) { with_opts.template operator()<Elt::bf16, true>(); break; }
        }
        with_opts.template operator()<Elt::bf16, false>();
        break;
      case DType::f16: with_opts.template operator()<Elt::f16, false>(); break;
      default: with_opts.template operator()<Elt::f32, false>(); break;
    }
  }

  template <Elt E, bool DP, class Rule>
  struct FlashFn {
    static void run(const Problem& p, char* ws, int t) { Dr::template flash_impl<E, DP, Rule>(p, ws, t); }
  };
  template <Elt E, bool DP, class Rule>
  struct DecodeFn {
    static void run(const Problem& p, char* ws, int t) { Dr::template decode_impl<E, DP, Rule>(p, ws, t); }
  };

  /// The engine's vector exp on an array (for its accuracy test).
  static void exp_array(const float* x, float* y, i64 n) {
    i64 i = 0;
    for (; i + W <= n; i += W) Ops::store(y + i, Ops::exp(Ops::load(x + i)));
    if (i < n) {
      float tx[W], ty[W];
      for (int t = 0; t < W; ++t) tx[t] = i + t < n ? x[i + t] : 0.0f;
      Ops::store(ty, Ops::exp(Ops::load(tx)));
      for (int t = 0; i + t < n; ++t) y[i + t] = ty[t];
    }
  }

  static std::size_t flash_workspace(const Problem& p, int threads) { return Dr::flash_ws(p, threads); }
  static void flash_forward(const Problem& p, void* ws, int threads, bool bf16_dot) {
    dispatch<FlashFn, true>(p, static_cast<char*>(ws), threads, bf16_dot);
  }
  static std::size_t decode_workspace(const Problem& p, int threads) { return Dr::decode_ws(p, threads); }

  static void decode_forward(const Problem& p, void* ws, int threads, bool bf16_dot) {
    dispatch<DecodeFn, true>(p, static_cast<char*>(ws), threads, bf16_dot);
  }

  // The backward (backward.hpp): the bf16 dot-product form when q, k, v, dO and O are all bf16.
  template <Elt E, bool DP, class Rule>
  struct BackwardFn {
    static void run(const BackwardProblem& bp, char* ws, int t) { Backward<Ops>::template run<E, DP, Rule>(bp, ws, t); }
  };
  static std::size_t backward_workspace(const BackwardProblem& bp, int threads) {
    return Backward<Ops>::workspace(bp.fwd, threads);
  }
  static void backward(const BackwardProblem& bp, void* ws, int threads, bool bf16_dot) {
    const bool dot = bf16_dot && bp.dout.dtype == DType::bf16 && bp.fwd.out.dtype == DType::bf16;
    dispatch<BackwardFn, true>(bp, static_cast<char*>(ws), threads, dot);
  }
};

}  // namespace qkv::detail::QKV_ENGINE_NS
