// serving: attention of packed or paged sequences whose bits never depend on the batch.
//
// Algorithm: flash-decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for long-context
// inference") with the key splits fixed at absolute key positions: split c holds the keys
// [c * kServingSplit, (c + 1) * kServingSplit) of a sequence. For each query row and split the
// kernel forms the scores s_j = scale q.k_j (then softcap), m = max_j s_j, p_j = exp(s_j - m),
// l = sum_j p_j and the unnormalised O = sum_j p_j v_j, in fp32, keys in ascending order; the
// partials are merged in split order in float64 by log-sum-exp,
//   M = max_c m_c, L = sum_c l_c e^{m_c - M}, O = sum_c O_c e^{m_c - M} / L, lse = M + log L,
// and rounded once to the output (engine/lse_merge.hpp, as the decode kernel's merge).
//
// The position terms (score_rule.hpp) bias a row's scores and, with keep-first, add the splits of
// its first keys [0, first_hi) to its own (engine/serving_item.hpp, by the score rule).
//
// Batch invariance: every number a row computes depends only on its query vector, its key range
// (causal, window, keep-first, from its position) and the keys' values (engine/serving_item.hpp says how),
// split boundaries are absolute, and the merge order is fixed. Which other rows share a work item
// (tokens of the same sequence, the query heads of one KV head, sharing one read of each key),
// which thread runs it, and where a key is stored (packed, or any page) change no bit. Each ISA
// level has its own item body (fused multiply-adds, its vector width; on avx512bf16 the scores of
// bf16 queries and keys on bf16 dot products), so the bits are those of the level: the same for
// every batch at a given level. exp and log of the merge from libm.
//
// Threads: one work item per (sequence, KV head, tile of tokens, split), dynamic schedule, most
// work first, so that one long sequence uses every thread; then the merge, one row at a time.
// Workspace: the split partials of every row, and per thread the tile's queries in fp32, its
// scores of one split and a group of decoded keys or values, in the calling thread's reusable
// buffer (kernels/workspace.hpp).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/engine/lse_merge.hpp"
#include "kernels/isa_kernels.hpp"
#include "kernels/kernels.hpp"
#include "kernels/serving.hpp"
#include "kernels/workspace.hpp"
#include "platform/team.hpp"

namespace qkv::detail {
namespace {

using i64 = std::int64_t;
constexpr i64 P = kServingSplit;

// Row r's split partials (pf floats each: O, then m, l) of splits [0, nf) and [c_lo, c_hi)
// merged in split order (lse_merge.hpp), head h's sink (if any) joined once as one more partial.
void merge_row(const Problem& p, const float* parts, i64 nf, i64 c_lo, i64 c_hi, i64 Dv, i64 pf, double* accd,
               i64 out_off, i64 lse_off, i64 h) {
  LseMerge merge(accd, Dv);
  const float sink = p.sinks.empty() ? -std::numeric_limits<float>::infinity()
                                     : static_cast<float>(p.sinks[static_cast<std::size_t>(h)]);
  merge.run(nf + c_hi - c_lo, pf - 2, [&](i64 c) { return parts + (c < nf ? c : c_lo + c - nf) * pf; }, sink);
  for (i64 d = 0; d < Dv; ++d) store_from_float(p.out.data, p.out.dtype, out_off + d * p.out.sx, merge.out(d));
  if (p.lse.data) store_from_float(p.lse.data, p.lse.dtype, lse_off, merge.lse());
}

}  // namespace

void serving_kernel(const VarlenProblem& vp) {
  const Problem& p = vp.p;
  if (p.Hq == 0 || p.Sq == 0) return;
  const i64 G = p.group(), B = vp.batch();
  // Rows of an item: tokens x query heads of its KV heads, up to kServingRows. Few tokens per
  // sequence (decode) take several KV heads per item, which a packed cache stores side by side.
  i64 max_sq = 0;
  for (i64 b = 0; b < B; ++b) max_sq = std::max(max_sq, vp.seq_q(b));
  const i64 TT = std::max<i64>(1, kServingRows / std::max<i64>(G, 1));
  const i64 NH = std::clamp<i64>(kServingRows / (std::min(TT, std::max<i64>(max_sq, 1)) * std::max<i64>(G, 1)), 1, std::max<i64>(p.Hkv, 1));
  const i64 Dvp = (p.Dv + 15) / 16 * 16, pf = Dvp + 2;
  // Sequence b's partials: seq_q(b) x Hq rows of NS[b] splits, from part_base[b] (floats).
  std::vector<i64> NS(static_cast<std::size_t>(B)), part_base(static_cast<std::size_t>(B) + 1, 0);
  std::vector<ServingItem> items;
  double macs = 0;
  for (i64 b = 0; b < B; ++b) {
    const i64 sq = vp.seq_q(b), sk = vp.seq_k[static_cast<std::size_t>(b)];
    const i64 ns = (sk + P - 1) / P;
    NS[static_cast<std::size_t>(b)] = ns;
    part_base[static_cast<std::size_t>(b) + 1] = part_base[static_cast<std::size_t>(b)] + sq * p.Hq * ns * pf;
    macs += static_cast<double>(sq) * static_cast<double>(sk) * static_cast<double>(p.Hq * (p.D + p.Dv));
    for (i64 t0 = 0; t0 < sq; t0 += TT) {
      const i64 nt = std::min(TT, sq - t0);
      // The union of the tile's key ranges (each row's range is checked again in the item), and
      // of keep-first's keys [0, kf).
      i64 klo = sk, khi = 0, kf = 0;
      for (i64 t = t0; t < t0 + nt; ++t) {
        i64 lo, hi;
        vp.key_range(b, t, lo, hi);
        if (lo < hi) { klo = std::min(klo, lo); khi = std::max(khi, hi); }
        if (p.keep_first > 0) kf = std::max(kf, vp.first_hi(b, t));
      }
      for (i64 hk = 0; hk < p.Hkv; hk += NH)
        for (i64 c = 0; c < ns; ++c) {
          const i64 a = std::max(klo, c * P), e = std::min(khi, (c + 1) * P), nh = std::min(NH, p.Hkv - hk);
          const i64 first = std::min(kf, (c + 1) * P) - c * P;  // keep-first's keys in the split
          if (a < e || first > 0)
            items.push_back({b, hk, nh, t0, nt, c, nh * nt * (std::max<i64>(e - a, 0) + std::max<i64>(first, 0))});
        }
    }
  }
  // Most work first (the order of items changes no result).
  std::stable_sort(items.begin(), items.end(), [](const ServingItem& x, const ServingItem& y) { return x.cost > y.cost; });
  const ServingLayout L{TT * G * NH, p.D, p.Dv};
  const i64 n = static_cast<i64>(items.size());
  int threads = p.num_threads > 0 ? p.num_threads : (macs < (1 << 20) ? 1 : omp_get_max_threads());
  threads = static_cast<int>(std::max<i64>(1, std::min<i64>(threads, std::max<i64>(n, 1))));
  // The item body of the active ISA level, from the one ISA table (kernels/isa_select.cpp).
  bool dot = false;
  const IsaKernels& isa = active_isa_kernels(dot);
  const std::size_t per = static_cast<std::size_t>(std::max(L.bytes(), static_cast<i64>(p.Dv) * 8 + 64) + 63) / 64 * 64;
  const std::size_t parts_bytes = static_cast<std::size_t>(part_base.back()) * 4;
  char* ws = thread_workspace(parts_bytes + per * static_cast<std::size_t>(threads));
  float* parts = reinterpret_cast<float*>(ws);
  char* tws = ws + (parts_bytes + 63) / 64 * 64;
  const i64 rows_total = vp.cu_q[static_cast<std::size_t>(B)] * p.Hq;
  run_team(threads, [&](const TeamLoops& team) {
    char* mine = tws + per * static_cast<std::size_t>(team.thread());
    team.dynamic(n, [&](i64 x) {
      const ServingItem& it = items[static_cast<std::size_t>(x)];
      isa.serving_item(vp, it, L, parts + part_base[static_cast<std::size_t>(it.b)], NS[static_cast<std::size_t>(it.b)],
                       mine, dot);
    });
    // Merge: row (token tok, head h), whatever thread takes it.
    double* accd = reinterpret_cast<double*>(mine);
    team.fixed(rows_total, [&](i64 row) {
      const i64 tok = row / p.Hq, h = row % p.Hq;
      const i64 b = static_cast<i64>(std::upper_bound(vp.cu_q.begin(), vp.cu_q.end(), tok) - vp.cu_q.begin()) - 1;
      const i64 t = tok - vp.cu_q[static_cast<std::size_t>(b)], ns = NS[static_cast<std::size_t>(b)];
      i64 lo, hi;
      vp.key_range(b, t, lo, hi);
      const float* rp = parts + part_base[static_cast<std::size_t>(b)] + (t * p.Hq + h) * ns * pf;
      i64 c_lo = lo < hi ? lo / P : 0, c_hi = lo < hi ? (hi + P - 1) / P : 0;
      // Keep-first: splits [0, c_f) too, those below c_lo first (every split of a row ascending,
      // each once).
      const i64 c_f = p.keep_first > 0 ? (vp.first_hi(b, t) + P - 1) / P : 0, nf = std::min(c_f, c_lo);
      if (c_f >= c_lo) c_hi = std::max(c_hi, c_f);
      merge_row(p, rp, nf, c_lo, c_hi, p.Dv, pf, accd, h * p.out.sh + tok * p.out.ss, h * p.lse.sh + tok * p.lse.ss,
                h);
    });
  });
}

}  // namespace qkv::detail
