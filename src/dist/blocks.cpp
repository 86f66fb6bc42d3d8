// One block of context-parallel attention = the tiles of (local queries) x (a key shard), each a
// plain attention call (lowered and dispatched as qkv::attention does). The global diagonal of a
// tile sits at an arbitrary offset from the tile's own; trimming the tile to its first admissible
// row and first admissible key puts that offset where a top-left window of non-negative sides
// expresses it exactly (blocks.hpp). ALiBi's bias reads the global diagonal through
// Problem::alibi_diag_shift; keep-first's kept keys left of the window are a second tile of the
// same block (a causal-like band of its own); sinks join once per row after every block
// (join_sinks), so the tiles run without them.
#include "dist/blocks.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "core/validate.hpp"
#include "dispatch/dispatch.hpp"
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
  keep = p.window_keep_first;
  if (p.sinks) {
    const TensorView& z = *p.sinks;
    for (i64 h = 0; h < z.size(0); ++h) sinks.push_back(z.data_as<const float>()[h]);
  }
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

// Rows [i0, i1) and keys [j0, j1) of a tile that hold every admissible pair, the top-left
// window (L, R) that admits exactly those pairs in the trimmed tile's coordinates, and the
// global diagonal's offset from the tile's (row i' sits at key i' + shift: ALiBi's bias).
struct Tile {
  i64 i0 = 0, i1 = 0, j0 = 0, j1 = 0, L = -1, R = -1, shift = 0;
};

// The two parts of a block: the window's band, and with keep-first the kept keys left of it.
enum class Part { window, kept };

// Tile of nr query rows at global positions [g0, g0 + nr) against nk keys at [h0, h0 + nk), batch b.
// Row i's diagonal, in the key block's coordinates, is i + s; it admits [max(0, i + s - L),
// min(nk_eff, i + s + R + 1)). Both ends grow with i, so the admitting rows form one interval and
// its first row has the smallest lower end. After trimming, s' = s + i0 - j0 gives
// L' = L - s' = j0 - (i0 + s - L) >= 0 and R' = R + s' >= 0 (row i0 admits key j0).
// Part::kept: the keys below keep-first's bound the window leaves out on the left, [0, min(keep
// - h0, nke, d - L)) (d - L < d + R + 1: the right bound never cuts them further). That is the
// band of an unbounded left side and a right side of -L - 1, trimmed the same way (j0 = 0 and
// row i0 admits key 0, so R' = s + i0 - L - 1 >= 0). A window unbounded on the left has no such
// keys: it admits them already.
bool tile_geometry(const Global& g, i64 b, i64 g0, i64 nr, i64 h0, i64 nk, Part part, Tile& t) {
  const bool kept = part == Part::kept;
  if (kept && (g.L < 0 || g.keep <= h0)) return false;
  const i64 len = g.key_len(b);
  const i64 delta = g.params.align == Alignment::bottom_right ? len - g.Sq : 0;
  const i64 s = g0 + delta - h0;
  const i64 nke = std::clamp<i64>(len - h0, 0, nk);
  const i64 cap = kept ? std::min(nke, g.keep - h0) : nke;
  const i64 L = kept ? -1 : g.L;
  const i64 R = kept ? -g.L - 1 : g.R;
  const bool right = kept || g.R >= 0;  // a bounded right side
  i64 first = -1, last = -1, j0 = 0, j1 = 0;
  for (i64 i = 0; i < nr; ++i) {
    const i64 d = i + s;
    const i64 lo = L < 0 ? 0 : std::max<i64>(0, d - L);
    const i64 hi = right ? std::min<i64>(cap, d + R + 1) : cap;
    if (lo >= hi) continue;
    if (first < 0) { first = i; j0 = lo; }
    last = i;
    j1 = hi;
  }
  if (first < 0) return false;
  const i64 s2 = s + first - j0;
  t = {first, last + 1, j0, j1, L < 0 ? -1 : L - s2, right ? R + s2 : -1, s2};
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

// A tile's options: its window in its own coordinates, its slices of the mask and of per-batch
// ALiBi slopes; no key lengths (the trimmed tile holds no key beyond them), no kept keys (a tile
// of their own), no sinks (joined once per row after the merge: join_sinks).
AttentionParams tile_params(const Global& g, const Tile& t, i64 B, i64 b0, i64 nb, i64 gq, i64 gk) {
  AttentionParams p = g.params;
  p.causal = false;
  p.window_left = t.L;
  p.window_right = t.R;
  p.align = Alignment::top_left;
  p.kv_lens.reset();
  p.sinks.reset();
  p.window_keep_first = 0;
  p.mask = slice_mask(g, B, b0, nb, gq + t.i0, t.i1 - t.i0, gk + t.j0, t.j1 - t.j0);
  if (p.alibi_slopes && p.alibi_slopes->rank() == 2) {
    const TensorView& a = *p.alibi_slopes;
    p.alibi_slopes = TensorView(a.data_as<float>() + b0 * a.size(1), DType::f32, {nb, a.size(1)}, {a.size(1), 1});
  }
  return p;
}

// qkv::attention and attention_backward of one tile, with ALiBi's diagonal moved to the global
// one (the only thing the public options cannot say).
void tile_forward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                  const TensorView& l, const AttentionParams& p, const Tile& t) {
  qkv::detail::Problem pr = qkv::detail::lower_attention(q, k, v, o, p, l, std::nullopt);
  pr.alibi_diag_shift = t.shift;
  qkv::detail::run_call(qkv::detail::Call::forward(pr, p));
}

void tile_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& o,
                   const TensorView& l, const TensorView& dout, const TensorView& dq, const TensorView& dk,
                   const TensorView& dv, const AttentionParams& p, const Tile& t) {
  qkv::detail::BackwardProblem bp = qkv::detail::lower_attention_backward(q, k, v, o, l, dout, dq, dk, dv, p);
  bp.fwd.alibi_diag_shift = t.shift;
  qkv::detail::run_call(qkv::detail::Call::backward(bp, p));
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

// Calls fn(b0, nb, tile) for each batch group of one tile and each part of the block (the
// window's band, then the kept keys): one call for all batches when the geometry does not depend
// on the batch (no key lengths, no per-batch ALiBi slopes), else one per batch.
template <class Fn>
void for_batches(const Global& g, i64 B, i64 g0, i64 nr, i64 h0, i64 nk, Fn&& fn) {
  const bool per_batch = !g.lens.empty() || (g.params.alibi_slopes && g.params.alibi_slopes->rank() == 2);
  for (const Part part : {Part::window, Part::kept}) {
    if (part == Part::kept && g.keep <= 0) break;
    if (!per_batch) {
      Tile t;
      if (tile_geometry(g, 0, g0, nr, h0, nk, part, t)) fn(i64{0}, B, t);
      continue;
    }
    for (i64 b = 0; b < B; ++b) {
      Tile t;
      if (tile_geometry(g, b, g0, nr, h0, nk, part, t)) fn(b, i64{1}, t);
    }
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
          tile_forward(q.rows(b0, nb, qrow + r0 + t.i0, rows), kv.k.rows(b0, nb, kcol + t.j0, keys),
                       kv.v.rows(b0, nb, kcol + t.j0, keys), o, l, tile_params(g, t, B, b0, nb, qs.start + r0, ks.start),
                       t);
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
          tile_backward(q.rows(b0, nb, row0, rows), kv.k.rows(b0, nb, key0, keys), kv.v.rows(b0, nb, key0, keys),
                        out.rows(b0, nb, row0, rows), lse_rows, dout.rows(b0, nb, row0, rows), tdq, tdk, tdv,
                        tile_params(g, t, B, b0, nb, qs.start + r0, ks.start), t);
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

void join_sinks(const Global& g, FwdAcc& acc) {
  if (g.sinks.empty()) return;
  const std::vector<float> zero(static_cast<std::size_t>(acc.Dv), 0.0f);
  for (i64 b = 0; b < acc.B; ++b)
    for (i64 h = 0; h < acc.H; ++h)
      for (i64 i = 0; i < acc.n; ++i) {
        const i64 row = (b * acc.H + h) * acc.n + i;
        qkv::detail::lse_merge_pair(acc.out.data() + row * acc.Dv, acc.lse[static_cast<std::size_t>(row)], zero.data(),
                                    g.sinks[static_cast<std::size_t>(h)], acc.Dv);
      }
}

std::vector<double> sink_terms(const Global& g, const Packed& out, const Packed& lse, const Packed& dout) {
  const i64 rows = out.B * out.H * out.n, Dv = out.X;
  std::vector<double> terms(static_cast<std::size_t>(rows), 0.0);
  if (g.sinks.empty()) return terms;
  for (i64 x = 0; x < rows; ++x) {
    double d = 0.0;
    for (i64 c = 0; c < Dv; ++c)
      d += load_as_double(dout.data, dout.dtype, x * Dv + c) * load_as_double(out.data, out.dtype, x * Dv + c);
    const double z = g.sinks[static_cast<std::size_t>((x / out.n) % out.H)];
    // An empty row (O = 0) adds nothing, whatever its lse (the single-process backward's rule).
    if (d != 0.0) terms[static_cast<std::size_t>(x)] = std::exp(z - load_as_double(lse.data, DType::f32, x)) * d;
  }
  return terms;
}

void write_sink_gradient(const std::vector<double>& terms, i64 B, i64 Hq, i64 Sq, const TensorView& grad_sinks) {
  for (i64 h = 0; h < Hq; ++h) {
    double dz = 0.0;
    for (i64 b = 0; b < B; ++b)
      for (i64 i = 0; i < Sq; ++i) dz -= terms[static_cast<std::size_t>((b * Hq + h) * Sq + i)];
    grad_sinks.data_as<float>()[h * grad_sinks.stride(0)] = static_cast<float>(dz);
  }
}

void check_grad_sinks(const TensorView& grad_sinks, const AttentionParams& params, i64 Hq,
                      std::initializer_list<std::pair<const TensorView*, const char*>> others) {
  // The single-process backward's checks and messages (only the result of the lowering is unused).
  qkv::detail::BackwardProblem bp;
  bp.fwd.Hq = Hq;
  qkv::detail::lower_grad_sinks(bp, grad_sinks, params, others);
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
  // Dropout decides by global (b, h, i, j); the blocks are local calls that would draw their own.
  if (params.dropout_p != 0.0)
    throw Error("dropout_p: expected 0 (qkv::dist does not apply attention dropout; qkv::attention does), got " +
                std::to_string(params.dropout_p));
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
