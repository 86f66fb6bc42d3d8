// One block of context-parallel attention = the tiles of (local queries) x (a key shard), each a
// plain qkv::attention call. The global diagonal of a tile sits at an arbitrary offset from the
// tile's own; trimming the tile to its first admissible row and first admissible key puts that
// offset where a top-left window of non-negative sides expresses it exactly (blocks.hpp).
#include "dist/blocks.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "core/validate.hpp"
#include "kernels/engine/lse_merge.hpp"
#include "qkv/backward.hpp"
#include "qkv/error.hpp"
#include "tensor/convert.hpp"

namespace qkv::dist::detail {

using i64 = std::int64_t;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

Global::Global(i64 sq, i64 sk, const AttentionParams& p, i64 batch) : Sq(sq), Sk(sk), params(p) {
  const EffectiveWindow w = effective_window(p);
  const i64 wide = Sq + Sk + 1;
  L = w.left < 0 ? -1 : std::min(w.left, wide);
  R = w.right < 0 ? -1 : std::min(w.right, wide);
  if (p.kv_lens) {
    const TensorView& l = *p.kv_lens;
    lens.resize(static_cast<std::size_t>(batch));
    for (i64 b = 0; b < batch; ++b)
      lens[static_cast<std::size_t>(b)] = l.dtype() == DType::i32 ? l.data_as<const std::int32_t>()[b * l.stride(0)]
                                                                  : l.data_as<const std::int64_t>()[b * l.stride(0)];
  }
}

TensorView Packed::rows(i64 b0, i64 nb, i64 s0, i64 ns) const {
  const auto es = static_cast<i64>(dtype_size(dtype));
  char* base = static_cast<char*>(const_cast<void*>(data)) + ((b0 * H) * n + s0) * X * es;
  return TensorView(base, dtype, {nb, H, ns, X}, {H * n * X, n * X, X, 1});
}

Tensor pack(const TensorView& t, DType dtype) {
  Tensor out(dtype, t.shape());
  const i64 X = t.size(3), es = static_cast<i64>(dtype_size(t.dtype()));
  char* dst = static_cast<char*>(out.data());
  for (i64 b = 0; b < t.size(0); ++b)
    for (i64 h = 0; h < t.size(1); ++h)
      for (i64 s = 0; s < t.size(2); ++s) {
        const char* src = static_cast<const char*>(t.data()) + (b * t.stride(0) + h * t.stride(1) + s * t.stride(2)) * es;
        qkv::detail::convert_row(src, t.dtype(), dst, dtype, X);
        dst += X * static_cast<i64>(dtype_size(dtype));
      }
  return out;
}

FwdAcc::FwdAcc(i64 b, i64 h, i64 rows, i64 dv)
    : out(static_cast<std::size_t>(b * h * rows * dv), 0.0f), lse(static_cast<std::size_t>(b * h * rows), kNegInf),
      B(b), H(h), n(rows), Dv(dv) {}

i64 total_length(const std::vector<Segment>& segs) {
  i64 n = 0;
  for (const Segment& s : segs) n += s.length;
  return n;
}

void add_into(float* a, const float* b, i64 n) {
  for (i64 i = 0; i < n; ++i) a[i] += b[i];
}

namespace {

// Rows [i0, i1) and keys [j0, j1) of a tile that hold every admissible pair, and the top-left
// window (L, R) that admits exactly those pairs in the trimmed tile's coordinates.
struct Tile {
  i64 i0 = 0, i1 = 0, j0 = 0, j1 = 0, L = -1, R = -1;
};

// Tile of nr query rows at global positions [g0, g0 + nr) against nk keys at [h0, h0 + nk), batch b.
// Row i's diagonal, in the key block's coordinates, is i + s; it admits [max(0, i + s - L),
// min(nk_eff, i + s + R + 1)). Both ends grow with i, so the admitting rows form one interval and
// its first row has the smallest lower end. After trimming, s' = s + i0 - j0 gives
// L' = L - s' = j0 - (i0 + s - L) >= 0 and R' = R + s' >= 0 (row i0 admits key j0).
bool tile_geometry(const Global& g, i64 b, i64 g0, i64 nr, i64 h0, i64 nk, Tile& t) {
  const i64 len = g.key_len(b);
  const i64 delta = g.params.align == Alignment::bottom_right ? len - g.Sq : 0;
  const i64 s = g0 + delta - h0;
  const i64 nke = std::clamp<i64>(len - h0, 0, nk);
  i64 first = -1, last = -1, j0 = 0, j1 = 0;
  for (i64 i = 0; i < nr; ++i) {
    const i64 d = i + s;
    const i64 lo = g.L < 0 ? 0 : std::max<i64>(0, d - g.L);
    const i64 hi = g.R < 0 ? nke : std::min<i64>(nke, d + g.R + 1);
    if (lo >= hi) continue;
    if (first < 0) { first = i; j0 = lo; }
    last = i;
    j1 = hi;
  }
  if (first < 0) return false;
  const i64 s2 = s + first - j0;
  t = {first, last + 1, j0, j1, g.L < 0 ? -1 : g.L - s2, g.R < 0 ? -1 : g.R + s2};
  return true;
}

// The global mask's slice for batches [b0, b0 + nb), query positions [q0, q0 + nq), key
// positions [k0, k0 + nk), as a view broadcastable to [nb, Hq, nq, nk].
std::optional<TensorView> slice_mask(const Global& g, i64 B, i64 b0, i64 nb, i64 q0, i64 nq, i64 k0, i64 nk) {
  if (!g.params.mask) return std::nullopt;
  const TensorView& m = *g.params.mask;
  Shape shape(4, 1), strides(4, 0);
  const int off = 4 - m.rank();
  for (int a = 0; a < m.rank(); ++a) {
    shape[static_cast<std::size_t>(a + off)] = m.size(a);
    strides[static_cast<std::size_t>(a + off)] = m.size(a) == 1 ? 0 : m.stride(a);
  }
  const i64 start[4] = {b0, 0, q0, k0}, count[4] = {nb, shape[1], nq, nk};
  const i64 full[4] = {B, shape[1], g.Sq, g.Sk};
  i64 elem = 0;
  for (std::size_t a = 0; a < 4; ++a) {
    if (shape[a] == 1 && full[a] != 1) continue;  // broadcast axis
    elem += start[a] * strides[a];
    shape[a] = count[a];
  }
  char* base = static_cast<char*>(m.data()) + elem * static_cast<i64>(dtype_size(m.dtype()));
  return TensorView(base, m.dtype(), shape, strides);
}

AttentionParams tile_params(const Global& g, const Tile& t, i64 B, i64 b0, i64 nb, i64 gq, i64 gk) {
  AttentionParams p = g.params;
  p.causal = false;
  p.window_left = t.L;
  p.window_right = t.R;
  p.align = Alignment::top_left;
  p.kv_lens.reset();
  p.mask = slice_mask(g, B, b0, nb, gq + t.i0, t.i1 - t.i0, gk + t.j0, t.j1 - t.j0);
  return p;
}

// Merges a tile's partial (o, l) rows into the accumulators, row by row (see dist.hpp).
void merge(FwdAcc& acc, i64 b0, i64 nb, i64 row0, i64 nr, const float* o, const float* l) {
  const i64 Dv = acc.Dv;
  for (i64 bb = 0; bb < nb; ++bb)
    for (i64 h = 0; h < acc.H; ++h)
      for (i64 i = 0; i < nr; ++i) {
        const i64 src = (bb * acc.H + h) * nr + i;
        const i64 dst = ((b0 + bb) * acc.H + h) * acc.n + row0 + i;
        qkv::detail::lse_merge_pair(acc.out.data() + dst * Dv, acc.lse[static_cast<std::size_t>(dst)], o + src * Dv, l[src], Dv);
      }
}

// Calls fn(b0, nb, tile) for each batch group of one tile: one call for all batches when the
// geometry does not depend on the batch (no key lengths), else one per batch.
template <class Fn>
void for_batches(const Global& g, i64 B, i64 g0, i64 nr, i64 h0, i64 nk, Fn&& fn) {
  if (g.lens.empty()) {
    Tile t;
    if (tile_geometry(g, 0, g0, nr, h0, nk, t)) fn(i64{0}, B, t);
    return;
  }
  for (i64 b = 0; b < B; ++b) {
    Tile t;
    if (tile_geometry(g, b, g0, nr, h0, nk, t)) fn(b, i64{1}, t);
  }
}

}  // namespace

void forward_step(const Global& g, const Packed& q, const std::vector<Segment>& q_segs, const KVBlock& kv,
                  i64 tile_rows, FwdAcc& acc, const std::function<void()>& between, i64* pairs) {
  const i64 B = q.B, Hq = q.H, Dv = kv.v.X;
  i64 qrow = 0;
  for (const Segment& qs : q_segs) {
    for (i64 r0 = 0; r0 < qs.length; r0 += tile_rows) {
      const i64 nr = std::min(tile_rows, qs.length - r0);
      i64 kcol = 0;
      for (const Segment& ks : kv.segs) {
        for_batches(g, B, qs.start + r0, nr, ks.start, ks.length, [&](i64 b0, i64 nb, const Tile& t) {
          const i64 rows = t.i1 - t.i0, keys = t.j1 - t.j0;
          if (pairs) *pairs += nb * Hq * rows * keys;
          Tensor o(DType::f32, {nb, Hq, rows, Dv}), l(DType::f32, {nb, Hq, rows});
          attention(q.rows(b0, nb, qrow + r0 + t.i0, rows), kv.k.rows(b0, nb, kcol + t.j0, keys),
                    kv.v.rows(b0, nb, kcol + t.j0, keys), o,
                    tile_params(g, t, B, b0, nb, qs.start + r0, ks.start), l.view());
          merge(acc, b0, nb, qrow + r0 + t.i0, rows, o.data_as<float>(), l.data_as<float>());
        });
        kcol += ks.length;
      }
      if (between) between();
    }
    qrow += qs.length;
  }
}

void backward_step(const Global& g, const Packed& q, const Packed& out, const Packed& lse, const Packed& dout,
                   const std::vector<Segment>& q_segs, const KVBlock& kv, i64 tile_rows, float* dq, float* dk,
                   float* dv, const std::function<void()>& between, i64* pairs) {
  const i64 B = q.B, Hq = q.H, D = q.X, Hkv = kv.k.H, Dv = kv.v.X, nq = q.n, nk = kv.k.n;
  i64 qrow = 0;
  for (const Segment& qs : q_segs) {
    for (i64 r0 = 0; r0 < qs.length; r0 += tile_rows) {
      const i64 nr = std::min(tile_rows, qs.length - r0);
      i64 kcol = 0;
      for (const Segment& ks : kv.segs) {
        for_batches(g, B, qs.start + r0, nr, ks.start, ks.length, [&](i64 b0, i64 nb, const Tile& t) {
          const i64 rows = t.i1 - t.i0, keys = t.j1 - t.j0, row0 = qrow + r0 + t.i0, key0 = kcol + t.j0;
          if (pairs) *pairs += nb * Hq * rows * keys;
          Tensor tdq(DType::f32, {nb, Hq, rows, D}), tdk(DType::f32, {nb, Hkv, keys, D}),
              tdv(DType::f32, {nb, Hkv, keys, Dv});
          const TensorView lse_rows(static_cast<float*>(const_cast<void*>(lse.data)) + (b0 * Hq) * nq + row0,
                                    DType::f32, {nb, Hq, rows}, {Hq * nq, nq, 1});
          attention_backward(q.rows(b0, nb, row0, rows), kv.k.rows(b0, nb, key0, keys), kv.v.rows(b0, nb, key0, keys),
                             out.rows(b0, nb, row0, rows), lse_rows, dout.rows(b0, nb, row0, rows), tdq, tdk, tdv,
                             tile_params(g, t, B, b0, nb, qs.start + r0, ks.start));
          for (i64 bb = 0; bb < nb; ++bb) {
            for (i64 h = 0; h < Hq; ++h)
              add_into(dq + (((b0 + bb) * Hq + h) * nq + row0) * D, tdq.data_as<float>() + ((bb * Hq + h) * rows) * D,
                       rows * D);
            for (i64 h = 0; h < Hkv; ++h) {
              add_into(dk + (((b0 + bb) * Hkv + h) * nk + key0) * D, tdk.data_as<float>() + ((bb * Hkv + h) * keys) * D,
                       keys * D);
              add_into(dv + (((b0 + bb) * Hkv + h) * nk + key0) * Dv,
                       tdv.data_as<float>() + ((bb * Hkv + h) * keys) * Dv, keys * Dv);
            }
          }
        });
        kcol += ks.length;
      }
      if (between) between();
    }
    qrow += qs.length;
  }
}

void write_result(const FwdAcc& acc, const TensorView& out, const std::optional<TensorView>& lse) {
  const i64 es = static_cast<i64>(dtype_size(out.dtype()));
  for (i64 b = 0; b < acc.B; ++b)
    for (i64 h = 0; h < acc.H; ++h)
      for (i64 i = 0; i < acc.n; ++i) {
        const i64 row = (b * acc.H + h) * acc.n + i;
        char* dst = static_cast<char*>(out.data()) + (b * out.stride(0) + h * out.stride(1) + i * out.stride(2)) * es;
        qkv::detail::convert_row(acc.out.data() + row * acc.Dv, DType::f32, dst, out.dtype(), acc.Dv);
        if (lse)
          lse->data_as<float>()[b * lse->stride(0) + h * lse->stride(1) + i * lse->stride(2)] =
              acc.lse[static_cast<std::size_t>(row)];
      }
}

void check_local(const TensorView& q, const TensorView& k, const TensorView& v, i64 sq_local, i64 sk_local, i64 Sq,
                 i64 Sk, const AttentionParams& params) {
  // The ring and decode merges know no sink term, ALiBi bias or kept first keys yet: refused by
  // name rather than computed without them.
  if (params.sinks)
    throw Error("sinks: expected none (qkv::dist does not take attention sinks yet; qkv::attention does), got a tensor of shape " +
                shape_str(params.sinks->shape()));
  if (params.alibi_slopes)
    throw Error("alibi_slopes: expected none (qkv::dist does not take ALiBi yet; qkv::attention does), got a tensor of shape " +
                shape_str(params.alibi_slopes->shape()));
  if (params.window_keep_first != 0)
    throw Error("window_keep_first: expected 0 (qkv::dist does not keep first keys yet; qkv::attention does), got " +
                std::to_string(params.window_keep_first));
  qkv::detail::check_rank4(q, "q", "[B,Hq,Sq,D]");
  qkv::detail::check_rank4(k, "k", "[B,Hkv,Sk,D]");
  qkv::detail::check_rank4(v, "v", "[B,Hkv,Sk,Dv]");
  if (q.size(2) != sq_local)
    throw Error("q: expected this rank's " + std::to_string(sq_local) + " query rows (its shard of seqlen_q = " +
                std::to_string(Sq) + "), got Sq = " + std::to_string(q.size(2)) + " in shape " + shape_str(q.shape()));
  if (k.size(2) != sk_local)
    throw Error("k: expected this rank's " + std::to_string(sk_local) + " key rows (its shard of seqlen_k = " +
                std::to_string(Sk) + "), got Sk = " + std::to_string(k.size(2)) + " in shape " + shape_str(k.shape()));
  // The remaining checks of attention() (dtypes, B/D/Hkv/Dv agreement, GQA, scale, softcap,
  // window, threads), on the first row of the local operands (the number of rows is checked
  // above) with a small scratch output; mask and key lengths are global and checked below
  // against the global shape.
  AttentionParams p = params;
  p.mask.reset();
  p.kv_lens.reset();
  auto first_row = [](const TensorView& t) {
    return TensorView(t.data(), t.dtype(), {t.size(0), t.size(1), std::min<i64>(t.size(2), 1), t.size(3)}, t.strides());
  };
  Tensor scratch(DType::f32, {q.size(0), q.size(1), std::min<i64>(q.size(2), 1), v.size(3)});
  (void)qkv::detail::lower_attention(first_row(q), first_row(k), first_row(v), scratch, p, std::nullopt, std::nullopt);
  const i64 B = q.size(0), Hq = q.size(1);
  if (params.mask) {
    const TensorView& m = *params.mask;
    const Shape target{B, Hq, Sq, Sk};
    bool ok = m.rank() >= 1 && m.rank() <= 4;
    for (int a = 0; ok && a < m.rank(); ++a) {
      const i64 want = target[static_cast<std::size_t>(a + 4 - m.rank())];
      ok = m.size(a) == want || m.size(a) == 1;
    }
    if (!ok)
      throw Error("mask: shape " + shape_str(m.shape()) + " is not broadcastable to the global [B,Hq,seqlen_q,seqlen_k] = " +
                  shape_str(target));
    if (m.dtype() != DType::b8 && m.dtype() != DType::f32 && m.dtype() != DType::f64)
      throw Error("mask: expected dtype bool (true = attend) or float32/float64 (additive), got " +
                  std::string(dtype_name(m.dtype())));
    if (m.size(m.rank() - 1) > 1 && m.stride(m.rank() - 1) != 1)
      throw Error("mask: expected a contiguous last dimension (stride 1), got stride " +
                  std::to_string(m.stride(m.rank() - 1)));
  }
  if (params.kv_lens) {
    const TensorView& l = *params.kv_lens;
    if (l.rank() != 1 || l.size(0) != B)
      throw Error("kv_lens: expected shape [B] = " + shape_str({B}) + ", got " + shape_str(l.shape()));
    if (l.dtype() != DType::i32 && l.dtype() != DType::i64)
      throw Error("kv_lens: expected dtype int32 or int64, got " + std::string(dtype_name(l.dtype())));
    for (i64 b = 0; b < B; ++b) {
      const i64 len = l.dtype() == DType::i32 ? l.data_as<const std::int32_t>()[b * l.stride(0)]
                                              : l.data_as<const std::int64_t>()[b * l.stride(0)];
      if (len < 0 || len > Sk)
        throw Error("kv_lens: expected each length in [0, seqlen_k] = [0, " + std::to_string(Sk) + "], got " +
                    std::to_string(len) + " at batch " + std::to_string(b));
    }
  }
}

}  // namespace qkv::dist::detail
