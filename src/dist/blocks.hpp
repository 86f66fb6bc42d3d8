#pragma once
// The per-rank arithmetic of context-parallel attention, without any communication: the tiles of
// one (query shard, key block) pair, each computed by qkv::attention / attention_backward on
// sub-views whose window is re-expressed in the block's own coordinates, and the fp32
// log-sum-exp merge. The MPI drivers (ring.cpp, decode.cpp) and the one-process simulations call
// exactly these functions in the same order, so their results are bitwise equal.
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <utility>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/dist.hpp"
#include "qkv/tensor.hpp"

namespace qkv::dist::detail {

/// The global problem every block belongs to.
struct Global {
  std::int64_t Sq = 0, Sk = 0;
  AttentionParams params;            // the caller's; kv_lens read into `lens`
  std::int64_t L = -1, R = -1;       // effective window, clamped to Sq + Sk + 1
  std::vector<std::int64_t> lens;    // key lengths per batch (empty: Sk)
  std::int64_t keep = 0;             // window_keep_first
  std::vector<float> sinks;          // sink logits z_h [Hq] (empty: none)
  Global(std::int64_t sq, std::int64_t sk, const AttentionParams& p, std::int64_t batch);
  std::int64_t key_len(std::int64_t b) const { return lens.empty() ? Sk : lens[static_cast<std::size_t>(b)]; }
};

/// A rank's contiguous copy of a [B,H,n,X] operand: element (b,h,s,x) at ((b H + h) n + s) X + x.
struct Packed {
  const void* data = nullptr;
  DType dtype = DType::f32;
  std::int64_t B = 0, H = 0, n = 0, X = 0;
  TensorView rows(std::int64_t b0, std::int64_t nb, std::int64_t s0, std::int64_t ns) const;
};
Tensor pack(const TensorView& t, DType dtype);  // C-contiguous copy, converted to dtype

/// The keys one step works on: K, V of the shard held (global positions `segs`, concatenated).
struct KVBlock {
  Packed k, v;
  std::vector<Segment> segs;
};

/// The forward accumulators of a rank: fp32 out [B,Hq,n,Dv] and lse [B,Hq,n] (init -inf).
struct FwdAcc {
  std::vector<float> out, lse;
  std::int64_t B = 0, H = 0, n = 0, Dv = 0;
  FwdAcc(std::int64_t b, std::int64_t h, std::int64_t rows, std::int64_t dv);
};

/// One step of the forward: every tile of local queries (packed q, positions q_segs) against
/// `kv`, merged into `acc`; `between` runs after every tile (progress polling); `pairs`, when
/// given, is increased by the (query, key, head) pairs of the tiles computed.
void forward_step(const Global& g, const Packed& q, const std::vector<Segment>& q_segs, const KVBlock& kv,
                  std::int64_t tile_rows, FwdAcc& acc, const std::function<void()>& between,
                  std::int64_t* pairs = nullptr);

/// One step of the backward: adds dQ of local queries into dq (fp32 [B,Hq,n,D]) and the block's
/// dK, dV into dk, dv (fp32 [B,Hkv,nk,D] / [..,Dv], zeroed by the caller).
void backward_step(const Global& g, const Packed& q, const Packed& out, const Packed& lse, const Packed& dout,
                   const std::vector<Segment>& q_segs, const KVBlock& kv, std::int64_t tile_rows, float* dq,
                   float* dk, float* dv, const std::function<void()>& between, std::int64_t* pairs = nullptr);

/// Joins each row's sink z_h to the merged accumulators, once: one more partial of lse z_h and
/// value 0 (a row no block admitted gets O = 0, lse = z_h). Nothing without sinks.
void join_sinks(const Global& g, FwdAcc& acc);

/// The sink's term of each row of packed out [B,Hq,n,Dv], lse [B,Hq,n,1] (fp32) and dout:
/// e^{z_h - lse} D with D = rowsum(dO * O) in float64 (0 where D = 0), [B,Hq,n] in that order.
std::vector<double> sink_terms(const Global& g, const Packed& out, const Packed& lse, const Packed& dout);

/// dz_h = - sum of the terms [B,Hq,Sq] of the GLOBAL rows, in float64 in the order b, i (that of
/// the single-process backward, so the bits depend on neither the ranks nor the placement),
/// written to grad_sinks (float32 [Hq]).
void write_sink_gradient(const std::vector<double>& terms, std::int64_t B, std::int64_t Hq, std::int64_t Sq,
                         const TensorView& grad_sinks);

/// Throws qkv::Error unless grad_sinks fits params as qkv::attention_backward's does (params.sinks
/// given; float32 [Hq], contiguous; no byte shared with `others` or the options' tensors).
void check_grad_sinks(const TensorView& grad_sinks, const AttentionParams& params, std::int64_t Hq,
                      std::initializer_list<std::pair<const TensorView*, const char*>> others);

/// Writes the accumulators to out (its dtype, rounded once) and softmax_lse (float32 view).
void write_result(const FwdAcc& acc, const TensorView& out, const std::optional<TensorView>& lse);

/// a[i] += b[i] for n floats (fp32, in order).
void add_into(float* a, const float* b, std::int64_t n);

/// Throws qkv::Error unless the local operands fit the shard and the global problem, in the
/// words of attention(): local shape, dtypes, options, the mask and the key lengths.
void check_local(const TensorView& q, const TensorView& k, const TensorView& v, std::int64_t sq_local,
                 std::int64_t sk_local, std::int64_t Sq, std::int64_t Sk, const AttentionParams& params);

std::int64_t total_length(const std::vector<Segment>& segs);

}  // namespace qkv::dist::detail
