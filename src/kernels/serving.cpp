// serving: attention of packed or paged sequences whose bits never depend on the batch.
//
// Algorithm: flash-decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context
// inference") with the key splits fixed at absolute key positions: split c holds the keys
// [c * kServingSplit, (c + 1) * kServingSplit) of a sequence. For each query row and split the
// kernel forms the scores s_j = scale q.k_j (then softcap), m = max_j s_j, p_j = exp(s_j - m),
// l = sum_j p_j and the unnormalised O = sum_j p_j v_j, in fp32, keys in ascending order; the
// partials are merged in split order in float64 by log-sum-exp,
//   M = max_c m_c, L = sum_c l_c e^{m_c - M}, O = sum_c O_c e^{m_c - M} / L, lse = M + log L,
// and rounded once to the output (as the decode kernel's merge, engine/drivers.hpp).
//
// Batch invariance: every number a row computes depends only on its query vector, its key range
// (causal, window, from its position) and the keys' values: a row's dot products use a fixed
// order (16 partial sums, one reduction tree), each row has its own max, sum and accumulator,
// split boundaries are absolute, and the merge order is fixed. Which other rows share a work
// item (tokens of the same sequence, the query heads of one KV head, sharing one read of each
// key), which thread runs it, and where a key is stored (packed, or any page) change no bit.
// The item body (serving_item.hpp) is plain C++ with every operation written out
// (-ffp-contract=off, sequential sums besides the 16 partial sums), compiled once per ISA level
// for speed: vectorizing it changes no bit, so every QKV_ISA level gives the same bits (tested).
// expf, tanhf, exp and log from libm.
//
// Threads: one work item per (sequence, KV head, tile of tokens), dynamic schedule, most work
// first. Workspace: per thread, the tile's queries in fp32, its scores of one split and its
// split partials, in the calling thread's reusable buffer (kernels/workspace.hpp).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/kernels.hpp"
#include "kernels/serving.hpp"
#include "kernels/workspace.hpp"
#include "platform/cpu_features.hpp"

namespace qkv::detail {
namespace {

using i64 = std::int64_t;
constexpr i64 P = kServingSplit;

// The item body of the active ISA level; every level gives the same bits (serving_item.hpp).
ServingItemFn serving_item_fn() {
  // By order, so that every level above avx512 takes the avx512 body.
  const Isa isa = active_isa();
  (void)isa;
#if defined(QKV_HAVE_AVX512)
  if (isa >= Isa::avx512) return serving_item_avx512;
#endif
#if defined(QKV_HAVE_AVX2)
  if (isa >= Isa::avx2) return serving_item_avx2;
#endif
  return serving_item_scalar;
}

}  // namespace

void serving_kernel(const VarlenProblem& vp) {
  const Problem& p = vp.p;
  if (p.Hq == 0 || p.Sq == 0) return;
  const i64 TT = tile_tokens(p), G = p.group();
  std::vector<ServingItem> items;
  i64 max_len = 0;
  double macs = 0;
  for (i64 b = 0; b < vp.batch(); ++b) {
    const i64 sq = vp.seq_q(b), sk = vp.seq_k[static_cast<std::size_t>(b)];
    max_len = std::max(max_len, sk);
    macs += static_cast<double>(sq) * static_cast<double>(sk) * static_cast<double>(p.Hq * (p.D + p.Dv));
    for (i64 hk = 0; hk < p.Hkv; ++hk)
      for (i64 t0 = 0; t0 < sq; t0 += TT) {
        const i64 nt = std::min(TT, sq - t0);
        items.push_back({b, hk, t0, nt, nt * (sk + 1)});
      }
  }
  // Most work first (the order of items changes no result).
  std::stable_sort(items.begin(), items.end(), [](const ServingItem& x, const ServingItem& y) { return x.cost > y.cost; });
  const ServingLayout L{TT * G, std::max<i64>(1, (max_len + P - 1) / P), p.D, p.Dv};
  const i64 n = static_cast<i64>(items.size());
  int threads = p.num_threads > 0 ? p.num_threads : (macs < (1 << 20) ? 1 : omp_get_max_threads());
  threads = static_cast<int>(std::max<i64>(1, std::min<i64>(threads, n)));
  const ServingItemFn item = serving_item_fn();
  const std::size_t per = static_cast<std::size_t>(L.bytes());
  char* ws = thread_workspace(per * static_cast<std::size_t>(threads));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (i64 x = 0; x < n; ++x) item(vp, items[static_cast<std::size_t>(x)], L, ws + per * static_cast<std::size_t>(omp_get_thread_num()));
}

}  // namespace qkv::detail
