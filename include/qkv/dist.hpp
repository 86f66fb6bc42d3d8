#pragma once
/// @file dist.hpp
/// Context-parallel attention over MPI: the sequence split across the ranks of a communicator.
///
/// Sources: ring attention, Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise
/// Transformers for Near-Infinite Context", sec. 3 (K/V blocks passed around a ring, partial
/// results merged by log-sum-exp); the zigzag placement for causal masks as in Brandon et al.
/// 2023, "Striped Attention" (sec. 3) and the ring-flash-attention "zigzag" variant; split-KV
/// decoding as in Dao et al. 2023, "Flash-Decoding". docs/distributed.md has the algorithm, the
/// bytes each rank sends per step and a cost model.
///
/// Shapes. Every rank holds the rows of q, k and v at the positions that shard() gives it, in
/// that order (the local sequence is the concatenation of its segments):
///   q   [B, Hq,  sq_r, D]    float32 | float64 | float16 | bfloat16 (sq_r = sum of the lengths
///                            of shard(seqlen_q, P, r)), any strides, last dimension contiguous
///   k   [B, Hkv, sk_r, D]    the dtype of q, sk_r from shard(seqlen_k, P, r)
///   v   [B, Hkv, sk_r, Dv]
///   out [B, Hq,  sq_r, Dv]   any float dtype; rounded once from the fp32 merged result
///   softmax_lse [B, Hq, sq_r] float32 (natural log; -inf for a row with no admissible key)
/// AttentionParams apply to the GLOBAL sequence (seqlen_q x seqlen_k): causal in both
/// alignments, window, softcap, scale, GQA; params.kv_lens holds the global key lengths [B];
/// params.mask is the global mask, broadcastable to [B, Hq, seqlen_q, seqlen_k], present on
/// every rank (each block reads its slice). The score options too, each the same on every rank:
///   sinks [Hq]: each row's sink joins its merged result once, after every block (one more
///     partial of lse z_h and value 0), so softmax_lse includes it and a row no key admits gets
///     O = 0, lse = z_h; the blocks run without it. Its gradient: the grad_sinks overloads.
///   alibi_slopes [Hq] or [B, Hq]: every block's bias is that of the global positions,
///     -slope |i + offset - j| with i, j global and offset the global diagonal's.
///   window_keep_first N: global keys [0, N) are admitted to every query besides its window
///     (below the right bound); every block holding such keys computes them.
/// params.dropout_p must be 0: dropout decides by global (b, h, i, j) and the blocks are local
/// calls, so qkv::dist refuses it by name ("dropout_p: expected 0 ...") on every rank.
/// Results are bitwise those of simulate_ring_attention (the same block schedule run in one
/// process), for every number of threads; against qkv::attention they differ by the rounding of
/// the merges (docs/distributed.md).
///
/// Requires MPI_Init (MPI_THREAD_FUNNELED suffices); every rank of `comm` calls collectively.

#include <mpi.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/tensor.hpp"

namespace qkv::dist {

/// How positions are dealt to ranks. contiguous: rank r holds the r-th of P equal chunks.
/// zigzag: the sequence is cut into 2P chunks and rank r holds chunks r and 2P-1-r, so that
/// under a causal mask every rank has the same number of (query, key) pairs to compute.
enum class Placement { automatic, contiguous, zigzag };

/// How the nonblocking transfers of the next K/V block progress while this rank computes.
/// none: only when MPI_Wait is called after the step's compute; poll: MPI_Testall between tiles;
/// thread: a second thread calls MPI_Testall (yielding between calls) until the transfers end
/// (needs MPI_Init_thread with MPI_THREAD_MULTIPLE, and a core to run on).
enum class Progress { none, poll, thread };

/// A run of consecutive positions [start, start + length) of the global sequence.
struct Segment {
  std::int64_t start = 0;
  std::int64_t length = 0;
};

/// The segments rank `rank` of `ranks` holds of a sequence of `seqlen` positions. Chunk c of n
/// spans [c*seqlen/n, (c+1)*seqlen/n) (integer division), so lengths differ by at most one.
/// Placement::automatic must have been resolved (resolve_placement).
/// @throws qkv::Error for ranks < 1, rank outside [0, ranks), seqlen < 0 or automatic.
std::vector<Segment> shard(std::int64_t seqlen, int ranks, int rank, Placement placement);

/// automatic -> zigzag when params.causal, else contiguous; others unchanged.
Placement resolve_placement(Placement placement, const AttentionParams& params) noexcept;

struct RingOptions {
  Placement placement = Placement::automatic;
  Progress progress = Progress::poll;
  /// Query rows per tile: the unit of computation between two progress polls. Part of the
  /// schedule (results depend on it only through the order of floating-point merges).
  std::int64_t tile_rows = 64;
};

/// What one rank measured, one entry per ring step.
struct RingStats {
  std::vector<std::int64_t> bytes_sent;   // bytes this rank sent during the step
  std::vector<double> busy_s;             // seconds computing tiles (and merging) in the step
  std::vector<double> busy_cpu_s;         // the same as CPU time of the calling thread (the
                                          // busy time when ranks share cores; OpenMP's other
                                          // threads, if any, not counted)
  std::vector<double> wait_s;             // seconds blocked in MPI_Wait after the compute
  std::vector<std::int64_t> pairs;        // (query, key, query head) pairs of the tiles computed
                                          // in the step: the work, as the schedule sees it
  double total_s = 0;                     // wall time of the whole call
};

/// Ring attention forward. `out` and `softmax_lse` are this rank's rows (see the file comment).
/// Partial (out, lse) pairs of each block are merged in fp32:
///   M = max(l_a, l_b), w = e^{l - M}, O = (w_a O_a + w_b O_b) / (w_a + w_b), l = M + log(w_a + w_b),
/// a block in which a row admits no key leaving it untouched, so a row no block admits ends with
/// O = 0 and softmax_lse = -inf (the empty-row rule of attention()).
/// @throws qkv::Error naming the argument for: a local shape other than the shard's, the
///   errors of attention() for a block, mismatched seqlen/B/H/D across ranks (checked with a
///   collective, so every rank throws), tile_rows < 1.
void ring_attention(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
                    const TensorView& out, const TensorView& softmax_lse, std::int64_t seqlen_q,
                    std::int64_t seqlen_k, const AttentionParams& params = {}, const RingOptions& options = {},
                    RingStats* stats = nullptr);

/// Ring attention backward: dQ of this rank's queries, dK and dV of this rank's keys. `out` and
/// `softmax_lse` are this rank's rows of the forward's results; K, V travel around the ring with
/// float32 accumulators of dK, dV, which return home after P steps. Each block runs
/// qkv::attention_backward (which takes the global out and softmax_lse rows; with sinks, the
/// lse that includes them, so P and D are the single-process backward's).
/// grad_q, grad_k, grad_v: the local shapes of q, k, v; float32.
void ring_attention_backward(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& softmax_lse, const TensorView& grad_out,
                             const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                             std::int64_t seqlen_q, std::int64_t seqlen_k, const AttentionParams& params = {},
                             const RingOptions& options = {}, RingStats* stats = nullptr);

/// ring_attention_backward that also writes grad_sinks = dL/dz (float32 [Hq], contiguous; the
/// same on every rank) for params.sinks:
///   dz_h = - sum over b and the global rows i of e^{z_h - lse_i} D_i,  D_i = rowsum(dO_i * O_i).
/// Each rank computes the float64 term of each of its rows; MPI_Allgatherv gives every rank all
/// of them, summed in float64 in the order b, i of global rows (the single-process order). So
/// for given out, softmax_lse and grad_out the bits depend on neither the number of ranks nor
/// the placement, and equal those of qkv::attention_backward's grad_sinks on the same tensors.
/// The gather (8 B Hq seqlen_q bytes in all) comes after the ring steps; RingStats leaves it out.
/// @throws qkv::Error as above, and for grad_sinks without params.sinks, not float32 [Hq], not
///   contiguous or overlapping another operand (on every rank), as attention_backward does.
void ring_attention_backward(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& softmax_lse, const TensorView& grad_out,
                             const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                             const TensorView& grad_sinks, std::int64_t seqlen_q, std::int64_t seqlen_k,
                             const AttentionParams& params, const RingOptions& options = {},
                             RingStats* stats = nullptr);

/// The same schedules run in one process for `ranks` simulated ranks, on the GLOBAL tensors
/// ([B,H,S,X]): the results equal, bitwise, the rows each rank of ring_attention /
/// ring_attention_backward writes. softmax_lse [B,Hq,Sq] float32; grads float32.
void simulate_ring_attention(int ranks, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& softmax_lse,
                             const AttentionParams& params = {}, const RingOptions& options = {});
void simulate_ring_attention_backward(int ranks, const TensorView& q, const TensorView& k, const TensorView& v,
                                      const TensorView& out, const TensorView& softmax_lse,
                                      const TensorView& grad_out, const TensorView& grad_q,
                                      const TensorView& grad_k, const TensorView& grad_v,
                                      const AttentionParams& params = {}, const RingOptions& options = {});
void simulate_ring_attention_backward(int ranks, const TensorView& q, const TensorView& k, const TensorView& v,
                                      const TensorView& out, const TensorView& softmax_lse,
                                      const TensorView& grad_out, const TensorView& grad_q,
                                      const TensorView& grad_k, const TensorView& grad_v,
                                      const TensorView& grad_sinks, const AttentionParams& params,
                                      const RingOptions& options = {});

/// Decoding across ranks: the KV cache sharded by position (this rank holds keys
/// [key_offset, key_offset + k.size(2)) of a cache of seqlen_k), q [B,Hq,Sq,D] the same on every
/// rank. Each rank computes its partial (O_r, l_r); MPI_Allreduce(MAX) gives M = max_r l_r; every
/// rank then gathers the weighted partials (e^{l_r - M} O_r, e^{l_r - M}) and sums them in rank
/// order (so every rank and every run get the same bits), O = sum / sum w, lse = M + log sum w;
/// then each row's sink (params.sinks) joins once. ALiBi and keep-first as in ring_attention.
/// out [B,Hq,Sq,Dv] and softmax_lse [B,Hq,Sq] (float32, optional) are written on every rank.
void decode_attention(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
                      const TensorView& out, std::int64_t key_offset, std::int64_t seqlen_k,
                      const AttentionParams& params = {},
                      const std::optional<TensorView>& softmax_lse = std::nullopt);

/// decode_attention of `ranks` simulated ranks holding the contiguous shards of k, v [B,Hkv,Sk,X].
void simulate_decode_attention(int ranks, const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const AttentionParams& params = {},
                               const std::optional<TensorView>& softmax_lse = std::nullopt);

/// The bytes rank `rank` sends in each ring step (the model behind RingStats::bytes_sent):
/// forward, steps 0..P-2: B Hkv n_src (D + Dv) e, with n_src the key count of the shard it holds
/// and e the element size; backward adds 4 B Hkv n_src (D + Dv) for the fp32 dK, dV and has one
/// more step sending those alone.
std::vector<std::int64_t> ring_bytes_model(int ranks, int rank, std::int64_t B, std::int64_t Hkv,
                                           std::int64_t seqlen_k, std::int64_t D, std::int64_t Dv,
                                           DType dtype, Placement placement, bool backward);

}  // namespace qkv::dist
