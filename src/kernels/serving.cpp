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
// order (8 partial sums, one reduction tree), each row has its own max, sum and accumulator,
// split boundaries are absolute, and the merge order is fixed. Which other rows share a work
// item (tokens of the same sequence, the query heads of one KV head, sharing one read of each
// key), which thread runs it, and where a key is stored (packed, or any page) change no bit.
// Portable C++ (compiled once, without ISA-specific flags, -ffp-contract=off): the same bits on
// every QKV_ISA level; expf, tanhf and exp/log of libm.
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
#include "kernels/workspace.hpp"

namespace qkv::detail {
namespace {

using i64 = std::int64_t;
constexpr i64 P = kServingSplit;

void to_f32(const void* data, DType dt, i64 off, float* dst, i64 n) {
  switch (dt) {
    case DType::f32: std::memcpy(dst, static_cast<const float*>(data) + off, static_cast<std::size_t>(n) * 4); break;
    case DType::bf16: {
      const auto* s = static_cast<const std::uint16_t*>(data) + off;
      for (i64 i = 0; i < n; ++i) dst[i] = bf16_to_float(s[i]);
      break;
    }
    case DType::f16: {
      const auto* s = static_cast<const std::uint16_t*>(data) + off;
      for (i64 i = 0; i < n; ++i) dst[i] = half_to_float(s[i]);
      break;
    }
    default: {
      const auto* s = static_cast<const double*>(data) + off;
      for (i64 i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
    }
  }
}

// q.k with 8 partial sums (lane l takes d = l mod 8) and one fixed reduction tree.
float dot(const float* a, const float* b, i64 n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  i64 d = 0;
  for (; d + 8 <= n; d += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[d + l] * b[d + l];
  for (int l = 0; d + l < n; ++l) acc[l] += a[d + l] * b[d + l];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

void store(void* data, DType dt, i64 off, float x) {
  switch (dt) {
    case DType::f32: static_cast<float*>(data)[off] = x; break;
    case DType::f64: static_cast<double*>(data)[off] = x; break;
    case DType::bf16: static_cast<std::uint16_t*>(data)[off] = float_to_bf16(x); break;
    case DType::f16: static_cast<std::uint16_t*>(data)[off] = float_to_half(x); break;
    default: break;
  }
}

struct Item { i64 b, hk, t0, nt, cost; };
struct RowInfo { i64 q_off, out_off, lse_off, lo, hi; };

// Tokens per work item: the query heads of one KV head times the tokens make up to 16 rows.
i64 tile_tokens(const Problem& p) { return std::max<i64>(1, 16 / std::max<i64>(p.group(), 1)); }

struct Layout {
  i64 rows, nsplit, D, Dv;
  i64 bytes() const {
    const i64 floats = rows * D + rows * P + rows * nsplit * (Dv + 2) + D + Dv + 2 * (Dv + 2);
    return (floats * 4 + rows * static_cast<i64>(sizeof(RowInfo)) + 8 * 64 + 63) / 64 * 64;
  }
};

// The rows (tokens t0 .. t0 + nt - 1 of sequence b, query heads of KV head hk) of one item.
void run_item(const VarlenProblem& vp, const Item& it, const Layout& L, char* ws) {
  const Problem& p = vp.p;
  const i64 G = p.group(), D = p.D, Dv = p.Dv, R = it.nt * G;
  const i64 b = it.b, hk = it.hk;
  auto carve = [&ws](i64 bytes) { char* r = ws; ws += (bytes + 63) / 64 * 64; return r; };
  RowInfo* rows = reinterpret_cast<RowInfo*>(carve(R * static_cast<i64>(sizeof(RowInfo))));
  float* qf = reinterpret_cast<float*>(carve(R * D * 4));
  float* s = reinterpret_cast<float*>(carve(R * P * 4));
  float* parts = reinterpret_cast<float*>(carve(R * L.nsplit * (Dv + 2) * 4));
  float* kf = reinterpret_cast<float*>(carve(D * 4));
  float* vf = reinterpret_cast<float*>(carve(Dv * 4));
  double* accd = reinterpret_cast<double*>(carve((Dv + 2) * 8));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float scale = static_cast<float>(p.scale), cap = static_cast<float>(p.softcap);

  i64 klo = std::numeric_limits<i64>::max(), khi = 0;
  for (i64 r = 0; r < R; ++r) {
    const i64 t = it.t0 + r / G, h = hk * G + r % G, tok = vp.cu_q[b] + t;
    RowInfo& ri = rows[r];
    ri.q_off = h * p.q.sh + tok * p.q.ss;
    ri.out_off = h * p.out.sh + tok * p.out.ss;
    ri.lse_off = h * p.lse.sh + tok * p.lse.ss;
    vp.key_range(b, t, ri.lo, ri.hi);
    if (ri.lo < ri.hi) { klo = std::min(klo, ri.lo); khi = std::max(khi, ri.hi); }
    to_f32(p.q.data, p.q.dtype, ri.q_off, qf + r * D, D);
  }
  const i64 c0 = klo < khi ? klo / P : 0, c1 = klo < khi ? (khi + P - 1) / P : 0, NS = c1 - c0;
  const i64 pf = Dv + 2;
  for (i64 x = 0; x < R * NS; ++x) { parts[x * pf + Dv] = neg_inf; parts[x * pf + Dv + 1] = 0.0f; }

  for (i64 c = c0; c < c1; ++c) {
    const i64 a = std::max(klo, c * P), e = std::min(khi, (c + 1) * P);
    // Scores: each key read once for all rows that admit it.
    for (i64 j = a; j < e; ++j) {
      const i64 off = vp.key_off(p.k, b, hk, j);
      const float* kp;
      if (p.k.dtype == DType::f32) kp = static_cast<const float*>(p.k.data) + off;
      else { to_f32(p.k.data, p.k.dtype, off, kf, D); kp = kf; }
      for (i64 r = 0; r < R; ++r)
        if (j >= rows[r].lo && j < rows[r].hi) s[r * P + (j - c * P)] = dot(qf + r * D, kp, D);
    }
    // Per row: scale, softcap, max, exp, sum.
    for (i64 r = 0; r < R; ++r) {
      const i64 ra = std::max(rows[r].lo, c * P), rb = std::min(rows[r].hi, (c + 1) * P);
      float* part = parts + (r * NS + (c - c0)) * pf;
      for (i64 d = 0; d < Dv; ++d) part[d] = 0.0f;
      if (ra >= rb) continue;
      float* sr = s + r * P - c * P;
      float m = neg_inf;
      for (i64 j = ra; j < rb; ++j) {
        float x = sr[j] * scale;
        if (cap > 0.0f) x = cap * std::tanh(x / cap);
        sr[j] = x;
        if (x > m) m = x;
      }
      const float ms = m == neg_inf ? 0.0f : m;  // nothing but -inf: every weight 0, the split empty
      float l = 0.0f;
      for (i64 j = ra; j < rb; ++j) {
        const float w = std::exp(sr[j] - ms);
        sr[j] = w;
        l += w;
      }
      part[Dv] = ms;
      part[Dv + 1] = l;
    }
    // O_c = sum_j p_j v_j, keys ascending.
    for (i64 j = a; j < e; ++j) {
      const i64 off = vp.key_off(p.v, b, hk, j);
      const float* vv;
      if (p.v.dtype == DType::f32) vv = static_cast<const float*>(p.v.data) + off;
      else { to_f32(p.v.data, p.v.dtype, off, vf, Dv); vv = vf; }
      for (i64 r = 0; r < R; ++r) {
        if (j < rows[r].lo || j >= rows[r].hi) continue;
        const float w = s[r * P + (j - c * P)];
        float* acc = parts + (r * NS + (c - c0)) * pf;
        for (i64 d = 0; d < Dv; ++d) acc[d] += w * vv[d];
      }
    }
  }

  // Merge each row's split partials in split order.
  for (i64 r = 0; r < R; ++r) {
    double mx = -std::numeric_limits<double>::infinity();
    bool any = false, nan = false;
    for (i64 c = 0; c < NS; ++c) {
      const float* part = parts + (r * NS + c) * pf;
      if (part[Dv + 1] == 0.0f) continue;  // a split with no admissible key
      any = true;
      nan = nan || std::isnan(part[Dv + 1]);
      mx = std::max(mx, static_cast<double>(part[Dv]));
    }
    for (i64 d = 0; d < Dv; ++d) accd[d] = 0.0;
    double lsum = 0.0;
    if (any && !nan)
      for (i64 c = 0; c < NS; ++c) {
        const float* part = parts + (r * NS + c) * pf;
        if (part[Dv + 1] == 0.0f) continue;
        const double w = std::exp(static_cast<double>(part[Dv]) - mx);
        lsum += w * part[Dv + 1];
        for (i64 d = 0; d < Dv; ++d) accd[d] += w * part[d];
      }
    const float qnan = std::numeric_limits<float>::quiet_NaN();
    for (i64 d = 0; d < Dv; ++d)
      store(p.out.data, p.out.dtype, rows[r].out_off + d * p.out.sx,
            nan ? qnan : any ? static_cast<float>(accd[d] / lsum) : 0.0f);
    if (p.lse.data)
      store(p.lse.data, p.lse.dtype, rows[r].lse_off,
            !any ? neg_inf : nan ? qnan : static_cast<float>(mx + std::log(lsum)));
  }
}

}  // namespace

void serving_kernel(const VarlenProblem& vp) {
  const Problem& p = vp.p;
  if (p.Hq == 0 || p.Sq == 0) return;
  const i64 TT = tile_tokens(p), G = p.group();
  std::vector<Item> items;
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
  std::stable_sort(items.begin(), items.end(), [](const Item& x, const Item& y) { return x.cost > y.cost; });
  const Layout L{TT * G, std::max<i64>(1, (max_len + P - 1) / P), p.D, p.Dv};
  const i64 n = static_cast<i64>(items.size());
  int threads = p.num_threads > 0 ? p.num_threads : (macs < (1 << 20) ? 1 : omp_get_max_threads());
  threads = static_cast<int>(std::max<i64>(1, std::min<i64>(threads, n)));
  const std::size_t per = static_cast<std::size_t>(L.bytes());
  char* ws = thread_workspace(per * static_cast<std::size_t>(threads));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (i64 x = 0; x < n; ++x) run_item(vp, items[static_cast<std::size_t>(x)], L, ws + per * static_cast<std::size_t>(omp_get_thread_num()));
}

}  // namespace qkv::detail
