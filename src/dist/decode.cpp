// Decoding across ranks: each rank attends the query tokens to its slice of the KV cache; the
// partials meet in two collectives, a max of softmax_lse and a gather of the weighted partials
// summed in rank order (MPI's own reduction order is not fixed, and float sums depend on it).
// Sinks join the combined row once, on every rank alike (detail::join_sinks).
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "core/validate.hpp"
#include "dist/blocks.hpp"
#include "dist/comm.hpp"
#include "kernels/engine/lse_merge.hpp"
#include "qkv/dist.hpp"
#include "qkv/error.hpp"

namespace qkv::dist {

using i64 = std::int64_t;

namespace {

constexpr i64 kTile = 64;

// This rank's partial: rows of [B,Hq,Sq] with their (O, lse) over keys [key_offset, +nk).
detail::FwdAcc partial(const detail::Global& g, const TensorView& q, const TensorView& k, const TensorView& v,
                       i64 key_offset) {
  const Tensor qp = detail::pack(q, q.dtype()), kp = detail::pack(k, k.dtype()), vp = detail::pack(v, v.dtype());
  detail::KVBlock kv;
  kv.k = {kp.data(), kp.dtype(), k.size(0), k.size(1), k.size(2), k.size(3)};
  kv.v = {vp.data(), vp.dtype(), v.size(0), v.size(1), v.size(2), v.size(3)};
  kv.segs = {{key_offset, k.size(2)}};
  detail::FwdAcc acc(q.size(0), q.size(1), q.size(2), v.size(3));
  const detail::Packed qv{qp.data(), qp.dtype(), q.size(0), q.size(1), q.size(2), q.size(3)};
  detail::forward_step(g, qv, {{0, q.size(2)}}, kv, kTile, acc, nullptr);
  return acc;
}

// Row x of a partial, weighted by w = e^{lse - M} (0 for a row that admitted nothing): Dv values
// w O then w, into dst.
void weigh(const detail::FwdAcc& a, const std::vector<float>& M, float* dst) {
  const i64 rows = a.B * a.H * a.n;
  for (i64 x = 0; x < rows; ++x) {
    const float w = qkv::detail::lse_weight(a.lse[static_cast<std::size_t>(x)], M[static_cast<std::size_t>(x)]);
    float* d = dst + x * (a.Dv + 1);
    for (i64 c = 0; c < a.Dv; ++c) d[c] = w * a.out[static_cast<std::size_t>(x * a.Dv + c)];
    d[a.Dv] = w;
  }
}

// Sums the P weighted partials in rank order into `res` (O = sum w O / sum w, lse = M + log sum w;
// no admitted key anywhere gives O = 0, lse = -inf).
void combine(const std::vector<float>& all, int P, const std::vector<float>& M, detail::FwdAcc& res) {
  const i64 rows = res.B * res.H * res.n, Dv = res.Dv, stride = rows * (Dv + 1);
  std::vector<float> sum(static_cast<std::size_t>(Dv + 1));
  for (i64 x = 0; x < rows; ++x) {
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int r = 0; r < P; ++r) {
      const float* p = all.data() + r * stride + x * (Dv + 1);
      for (i64 c = 0; c <= Dv; ++c) sum[static_cast<std::size_t>(c)] += p[c];
    }
    const float w = sum[static_cast<std::size_t>(Dv)];
    float* o = res.out.data() + x * Dv;
    if (w == 0.0f) {
      std::fill(o, o + Dv, 0.0f);
      res.lse[static_cast<std::size_t>(x)] = -std::numeric_limits<float>::infinity();
      continue;
    }
    for (i64 c = 0; c < Dv; ++c) o[c] = sum[static_cast<std::size_t>(c)] / w;
    res.lse[static_cast<std::size_t>(x)] = static_cast<float>(M[static_cast<std::size_t>(x)] + std::log(static_cast<double>(w)));
  }
}

void check_decode(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out, i64 key_offset,
                  i64 Sk, const AttentionParams& params, const std::optional<TensorView>& lse) {
  qkv::detail::check_rank4(k, "k", "[B,Hkv,Sk,D]");
  if (key_offset < 0 || Sk < 0 || key_offset + k.size(2) > Sk)
    throw Error("key_offset: expected this rank's keys [key_offset, key_offset + " + std::to_string(k.size(2)) +
                ") inside [0, seqlen_k = " + std::to_string(Sk) + "), got key_offset = " + std::to_string(key_offset));
  qkv::detail::check_rank4(q, "q", "[B,Hq,Sq,D]");
  detail::check_local(q, k, v, q.size(2), k.size(2), q.size(2), Sk, params);
  const Shape os{q.size(0), q.size(1), q.size(2), v.size(3)};
  if (out.shape() != os) throw Error("out: expected shape [B,Hq,Sq,Dv] = " + shape_str(os) + ", got " + shape_str(out.shape()));
  if (lse && (lse->shape() != Shape{q.size(0), q.size(1), q.size(2)} || lse->dtype() != DType::f32))
    throw Error("softmax_lse: expected float32 [B,Hq,Sq] = " + shape_str({q.size(0), q.size(1), q.size(2)}) + ", got " +
                std::string(dtype_name(lse->dtype())) + " " + shape_str(lse->shape()));
}

}  // namespace

void decode_attention(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                      i64 key_offset, i64 Sk, const AttentionParams& params, const std::optional<TensorView>& softmax_lse) {
  int P = 1, r = 0;
  MPI_Comm_size(comm, &P);
  MPI_Comm_rank(comm, &r);
  std::string err;
  try {
    check_decode(q, k, v, out, key_offset, Sk, params, softmax_lse);
  } catch (const Error& e) {
    err = e.what();
  }
  const bool ok = err.empty();
  detail::agree(comm, err,
                ok ? std::vector<i64>{Sk, q.size(0), q.size(1), q.size(2), k.size(1), q.size(3), v.size(3)} : std::vector<i64>{},
                {"seqlen_k", "q.B", "q.Hq", "q.Sq", "k.Hkv", "q.D", "v.Dv"});
  const detail::Global g(q.size(2), Sk, params, q.size(0));
  detail::FwdAcc acc = partial(g, q, k, v, key_offset);
  const i64 rows = acc.B * acc.H * acc.n, stride = rows * (acc.Dv + 1);
  std::vector<float> M(acc.lse);
  MPI_Allreduce(MPI_IN_PLACE, M.data(), static_cast<int>(rows), MPI_FLOAT, MPI_MAX, comm);
  std::vector<float> mine(static_cast<std::size_t>(stride)), all(static_cast<std::size_t>(stride * P));
  weigh(acc, M, mine.data());
  MPI_Allgather(mine.data(), static_cast<int>(stride), MPI_FLOAT, all.data(), static_cast<int>(stride), MPI_FLOAT, comm);
  combine(all, P, M, acc);
  detail::join_sinks(g, acc);
  detail::write_result(acc, out, softmax_lse);
}

void simulate_decode_attention(int ranks, const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const AttentionParams& params,
                               const std::optional<TensorView>& softmax_lse) {
  qkv::detail::check_rank4(k, "k", "[B,Hkv,Sk,D]");
  qkv::detail::check_rank4(v, "v", "[B,Hkv,Sk,Dv]");
  const i64 Sk = k.size(2);
  std::vector<detail::FwdAcc> parts;
  for (int r = 0; r < ranks; ++r) {
    const Segment s = shard(Sk, ranks, r, Placement::contiguous)[0];
    const Tensor kl = detail::gather(k, {s}), vl = detail::gather(v, {s});
    check_decode(q, kl, vl, out, s.start, Sk, params, softmax_lse);
    const detail::Global g(q.size(2), Sk, params, q.size(0));
    parts.push_back(partial(g, q, kl, vl, s.start));
  }
  detail::FwdAcc& res = parts[0];
  const i64 rows = res.B * res.H * res.n, stride = rows * (res.Dv + 1);
  std::vector<float> M(res.lse);
  for (int r = 1; r < ranks; ++r)
    for (i64 x = 0; x < rows; ++x)
      M[static_cast<std::size_t>(x)] = std::max(M[static_cast<std::size_t>(x)], parts[static_cast<std::size_t>(r)].lse[static_cast<std::size_t>(x)]);
  std::vector<float> all(static_cast<std::size_t>(stride * ranks));
  for (int r = 0; r < ranks; ++r) weigh(parts[static_cast<std::size_t>(r)], M, all.data() + r * stride);
  combine(all, ranks, M, res);
  detail::join_sinks(detail::Global(q.size(2), Sk, params, q.size(0)), res);
  detail::write_result(res, out, softmax_lse);
}

}  // namespace qkv::dist
