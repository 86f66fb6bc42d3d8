// Ring attention over MPI, forward and backward, and the same schedules run in one process.
//
// Step t of P: rank r holds the K, V shard of rank src = (r - t) mod P. While it computes its
// tiles against that shard, the shard moves on to rank r + 1 and the next one arrives from
// r - 1 into the second buffer (MPI_Isend / MPI_Irecv, progressed by MPI_Testall between tiles
// with Progress::poll, or by a second thread with Progress::thread). The backward also passes
// fp32 dK, dV accumulators: rank r adds its contribution to the accumulator of src and sends it on; after P steps each is home.
#include <algorithm>
#include <climits>
#include <cstring>
#include <string>

#include "dist/blocks.hpp"
#include "core/validate.hpp"
#include "dist/comm.hpp"
#include "qkv/dist.hpp"
#include "qkv/error.hpp"

namespace qkv::dist {

using i64 = std::int64_t;
using detail::FwdAcc;
using detail::Global;
using detail::KVBlock;
using detail::Packed;

std::vector<Segment> shard(i64 seqlen, int ranks, int rank, Placement placement) {
  if (ranks < 1) throw Error("ranks: expected >= 1, got " + std::to_string(ranks));
  if (rank < 0 || rank >= ranks)
    throw Error("rank: expected in [0, " + std::to_string(ranks) + "), got " + std::to_string(rank));
  if (seqlen < 0) throw Error("seqlen: expected >= 0, got " + std::to_string(seqlen));
  if (placement == Placement::automatic)
    throw Error("placement: expected contiguous or zigzag (resolve automatic first), got automatic");
  auto chunk = [&](i64 c, i64 n) { return Segment{c * seqlen / n, (c + 1) * seqlen / n - c * seqlen / n}; };
  if (placement == Placement::contiguous) return {chunk(rank, ranks)};
  return {chunk(rank, 2 * i64{ranks}), chunk(2 * i64{ranks} - 1 - rank, 2 * i64{ranks})};
}

Placement resolve_placement(Placement placement, const AttentionParams& params) noexcept {
  if (placement != Placement::automatic) return placement;
  return params.causal ? Placement::zigzag : Placement::contiguous;
}

std::vector<i64> ring_bytes_model(int ranks, int rank, i64 B, i64 Hkv, i64 seqlen_k, i64 D, i64 Dv, DType dtype,
                                  Placement placement, bool backward) {
  std::vector<i64> bytes;
  const int steps = ranks;
  for (int t = 0; t < steps; ++t) {
    const int src = ((rank - t) % ranks + ranks) % ranks;
    const i64 n = detail::total_length(shard(seqlen_k, ranks, src, placement));
    i64 b = t < ranks - 1 ? B * Hkv * n * (D + Dv) * static_cast<i64>(dtype_size(dtype)) : 0;
    if (backward) b += B * Hkv * n * (D + Dv) * 4;
    bytes.push_back(b);
  }
  return bytes;
}

namespace {

// The K, V shard of one rank as it travels: K [B,Hkv,n,D] then V [B,Hkv,n,Dv], contiguous.
KVBlock kv_view(const void* buf, DType dt, i64 B, i64 Hkv, i64 D, i64 Dv, const std::vector<Segment>& segs) {
  const i64 n = detail::total_length(segs);
  KVBlock kv;
  kv.k = {buf, dt, B, Hkv, n, D};
  kv.v = {static_cast<const char*>(buf) + B * Hkv * n * D * static_cast<i64>(dtype_size(dt)), dt, B, Hkv, n, Dv};
  kv.segs = segs;
  return kv;
}

void pack_kv(const TensorView& k, const TensorView& v, char* buf) {
  const Tensor kp = detail::pack(k, k.dtype()), vp = detail::pack(v, v.dtype());
  std::memcpy(buf, kp.data(), kp.nbytes());
  std::memcpy(buf + kp.nbytes(), vp.data(), vp.nbytes());
}

Packed packed(const Tensor& t) { return {t.data(), t.dtype(), t.shape()[0], t.shape()[1], t.shape()[2], t.shape()[3]}; }

TensorView as4d(const TensorView& lse) {
  return TensorView(lse.data(), lse.dtype(), {lse.size(0), lse.size(1), lse.size(2), 1},
                    {lse.stride(0), lse.stride(1), lse.stride(2), 1});
}

struct Layout {
  int P = 1, r = 0;
  Placement pl = Placement::contiguous;
  i64 B = 0, Hq = 0, Hkv = 0, D = 0, Dv = 0, es = 0;
  std::vector<std::vector<Segment>> qsegs, ksegs;
  i64 kv_bytes(int s) const { return B * Hkv * detail::total_length(ksegs[static_cast<std::size_t>(s)]) * (D + Dv) * es; }
  i64 dkv_floats(int s) const { return B * Hkv * detail::total_length(ksegs[static_cast<std::size_t>(s)]) * (D + Dv); }
};

Layout layout(int P, int r, const TensorView& q, const TensorView& v, i64 Hkv, i64 Sq, i64 Sk, Placement pl) {
  Layout l;
  l.P = P; l.r = r; l.pl = pl;
  l.B = q.size(0); l.Hq = q.size(1); l.Hkv = Hkv; l.D = q.size(3); l.Dv = v.size(3);
  l.es = static_cast<i64>(dtype_size(q.dtype()));
  for (int s = 0; s < P; ++s) {
    l.qsegs.push_back(shard(Sq, P, s, pl));
    l.ksegs.push_back(shard(Sk, P, s, pl));
  }
  return l;
}

void check_out(const TensorView& t, const char* name, const Shape& want, bool any_float) {
  if (t.shape() != want)
    throw Error(std::string(name) + ": expected this rank's shape " + shape_str(want) + ", got " + shape_str(t.shape()));
  if (any_float ? (t.dtype() != DType::f32 && t.dtype() != DType::f64 && t.dtype() != DType::f16 && t.dtype() != DType::bf16)
                : t.dtype() != DType::f32)
    throw Error(std::string(name) + ": expected dtype " + (any_float ? "float32, float64, float16 or bfloat16" : "float32") +
                ", got " + std::string(dtype_name(t.dtype())));
  if (t.rank() == 4 && t.size(3) > 1 && t.stride(3) != 1)
    throw Error(std::string(name) + ": expected a contiguous last dimension (stride 1), got stride " + std::to_string(t.stride(3)));
}

// The common checks of both ring calls; returns the error text ("" when the call is valid).
std::string check_ring(int P, int r, const TensorView& q, const TensorView& k, const TensorView& v, i64 Sq, i64 Sk,
                       const AttentionParams& params, const RingOptions& o, Placement pl, bool backward) {
  try {
    if (o.tile_rows < 1) throw Error("tile_rows: expected >= 1, got " + std::to_string(o.tile_rows));
    if (Sq < 0 || Sk < 0)
      throw Error("seqlen: expected seqlen_q, seqlen_k >= 0, got " + std::to_string(Sq) + ", " + std::to_string(Sk));
    if (o.progress == Progress::thread) {
      int init = 0, level = MPI_THREAD_SINGLE;
      MPI_Initialized(&init);
      if (init) MPI_Query_thread(&level);
      if (init && level < MPI_THREAD_MULTIPLE)
        throw Error("progress: Progress::thread needs MPI_Init_thread with MPI_THREAD_MULTIPLE, got thread level " +
                    std::to_string(level));
    }
    const i64 sq = detail::total_length(shard(Sq, P, r, pl)), sk = detail::total_length(shard(Sk, P, r, pl));
    detail::check_local(q, k, v, sq, sk, Sq, Sk, params);
    const i64 es = static_cast<i64>(dtype_size(q.dtype()));
    const i64 per = (Sk / P + 2) * 2 * k.size(0) * k.size(1) * (k.size(3) + v.size(3)) * (backward ? es + 4 : es);
    if (per > INT_MAX)
      throw Error("k: expected a K/V shard below 2 GiB per message (MPI int counts), got about " + std::to_string(per) +
                  " bytes: use more ranks");
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

std::vector<i64> agreed_values(const TensorView& q, const TensorView& k, const TensorView& v, i64 Sq, i64 Sk,
                               const AttentionParams& p, const RingOptions& o, Placement pl, bool grad_sinks = false) {
  return {Sq, Sk, q.size(0), q.size(1), k.size(1), q.size(3), v.size(3), static_cast<i64>(q.dtype()),
          static_cast<i64>(pl), o.tile_rows, p.sinks ? 1 : 0, p.alibi_slopes ? p.alibi_slopes->rank() : 0,
          p.window_keep_first, grad_sinks ? 1 : 0};
}
const std::vector<const char*> kAgreedNames = {"seqlen_q", "seqlen_k", "q.B", "q.Hq", "k.Hkv", "q.D", "v.Dv",
                                               "q.dtype", "options.placement", "options.tile_rows",
                                               "params.sinks (given)", "params.alibi_slopes (rank)",
                                               "params.window_keep_first", "grad_sinks (given)"};

// The sink terms of every rank (each [B,Hq,n_s] for its rows), placed at their global rows:
// [B,Hq,Sq].
std::vector<double> place_terms(const std::vector<double>& all, const Layout& L, i64 Sq) {
  std::vector<double> g(static_cast<std::size_t>(L.B * L.Hq * Sq));
  std::size_t off = 0;
  for (int s = 0; s < L.P; ++s) {
    const auto& segs = L.qsegs[static_cast<std::size_t>(s)];
    const i64 n = detail::total_length(segs);
    for (i64 bh = 0; bh < L.B * L.Hq; ++bh) {
      i64 i = 0;
      for (const Segment& seg : segs)
        for (i64 x = 0; x < seg.length; ++x, ++i)
          g[static_cast<std::size_t>(bh * Sq + seg.start + x)] = all[off + static_cast<std::size_t>(bh * n + i)];
    }
    off += static_cast<std::size_t>(L.B * L.Hq * n);
  }
  return g;
}

}  // namespace

void ring_attention(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                    const TensorView& softmax_lse, i64 Sq, i64 Sk, const AttentionParams& params,
                    const RingOptions& options, RingStats* stats) {
  const double t_start = detail::now();
  int P = 1, r = 0;
  MPI_Comm_size(comm, &P);
  MPI_Comm_rank(comm, &r);
  const Placement pl = resolve_placement(options.placement, params);
  std::string err = check_ring(P, r, q, k, v, Sq, Sk, params, options, pl, false);
  if (err.empty()) {
    try {
      check_out(out, "out", {q.size(0), q.size(1), q.size(2), v.size(3)}, true);
      check_out(softmax_lse, "softmax_lse", {q.size(0), q.size(1), q.size(2)}, false);
    } catch (const Error& e) {
      err = e.what();
    }
  }
  const bool ranks_ok = err.empty();
  detail::agree(comm, err, ranks_ok ? agreed_values(q, k, v, Sq, Sk, params, options, pl) : std::vector<i64>{},
                kAgreedNames);

  const Layout L = layout(P, r, q, v, k.size(1), Sq, Sk, pl);
  const Global g(Sq, Sk, params, L.B);
  const Tensor qp = detail::pack(q, q.dtype());
  i64 maxb = 0;
  for (int s = 0; s < P; ++s) maxb = std::max(maxb, L.kv_bytes(s));
  Tensor buf[2] = {Tensor(DType::b8, {maxb}), Tensor(DType::b8, {maxb})};
  pack_kv(k, v, static_cast<char*>(buf[0].data()));
  FwdAcc acc(L.B, L.Hq, q.size(2), L.Dv);
  if (stats) *stats = {};
  const int right = (r + 1) % P, left = (r - 1 + P) % P;
  for (int t = 0; t < P; ++t) {
    const int src = ((r - t) % P + P) % P, next = ((src - 1) % P + P) % P;
    MPI_Request req[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    i64 sent = 0;
    if (t < P - 1) {
      MPI_Irecv(buf[(t + 1) % 2].data(), static_cast<int>(L.kv_bytes(next)), MPI_BYTE, left, t, comm, &req[0]);
      MPI_Isend(buf[t % 2].data(), static_cast<int>(L.kv_bytes(src)), MPI_BYTE, right, t, comm, &req[1]);
      sent = L.kv_bytes(src);
    }
    auto poll = [&] {
      int done = 0;
      if (options.progress == Progress::poll) MPI_Testall(2, req, &done, MPI_STATUSES_IGNORE);
    };
    i64 pairs = 0;
    const double t0 = detail::now(), c0 = detail::thread_cpu();
    {
      const detail::ProgressThread progress(req, 2, options.progress == Progress::thread && t < P - 1);
      detail::forward_step(g, packed(qp), L.qsegs[static_cast<std::size_t>(r)],
                           kv_view(buf[t % 2].data(), q.dtype(), L.B, L.Hkv, L.D, L.Dv, L.ksegs[static_cast<std::size_t>(src)]),
                           options.tile_rows, acc, poll, &pairs);
    }
    const double t1 = detail::now(), c1 = detail::thread_cpu();
    MPI_Waitall(2, req, MPI_STATUSES_IGNORE);
    const double t2 = detail::now();
    if (stats) {
      stats->bytes_sent.push_back(sent);
      stats->busy_s.push_back(t1 - t0);
      stats->busy_cpu_s.push_back(c1 - c0);
      stats->pairs.push_back(pairs);
      stats->wait_s.push_back(t2 - t1);
    }
  }
  detail::join_sinks(g, acc);
  detail::write_result(acc, out, softmax_lse);
  if (stats) stats->total_s = detail::now() - t_start;
}

namespace {

void ring_backward(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                   const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                   const TensorView& grad_k, const TensorView& grad_v, const TensorView* grad_sinks, i64 Sq, i64 Sk,
                   const AttentionParams& params, const RingOptions& options, RingStats* stats) {
  const double t_start = detail::now();
  int P = 1, r = 0;
  MPI_Comm_size(comm, &P);
  MPI_Comm_rank(comm, &r);
  const Placement pl = resolve_placement(options.placement, params);
  std::string err = check_ring(P, r, q, k, v, Sq, Sk, params, options, pl, true);
  if (err.empty()) {
    try {
      const Shape os{q.size(0), q.size(1), q.size(2), v.size(3)};
      check_out(out, "out", os, true);
      check_out(softmax_lse, "softmax_lse", {q.size(0), q.size(1), q.size(2)}, false);
      check_out(grad_out, "grad_out", os, true);
      check_out(grad_q, "grad_q", q.shape(), false);
      check_out(grad_k, "grad_k", k.shape(), false);
      check_out(grad_v, "grad_v", v.shape(), false);
      if (grad_sinks)
        detail::check_grad_sinks(*grad_sinks, params, q.size(1),
                                 {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&softmax_lse, "softmax_lse"},
                                  {&grad_out, "grad_out"}, {&grad_q, "grad_q"}, {&grad_k, "grad_k"}, {&grad_v, "grad_v"}});
    } catch (const Error& e) {
      err = e.what();
    }
  }
  const bool ranks_ok = err.empty();
  detail::agree(comm, err,
                ranks_ok ? agreed_values(q, k, v, Sq, Sk, params, options, pl, grad_sinks != nullptr) : std::vector<i64>{},
                kAgreedNames);

  const Layout L = layout(P, r, q, v, k.size(1), Sq, Sk, pl);
  const Global g(Sq, Sk, params, L.B);
  const Tensor qp = detail::pack(q, q.dtype()), op = detail::pack(out, out.dtype()),
               lp = detail::pack(as4d(softmax_lse), DType::f32), dop = detail::pack(grad_out, grad_out.dtype());
  i64 maxb = 0, maxf = 0;
  for (int s = 0; s < P; ++s) {
    maxb = std::max(maxb, L.kv_bytes(s));
    maxf = std::max(maxf, L.dkv_floats(s));
  }
  Tensor buf[2] = {Tensor(DType::b8, {maxb}), Tensor(DType::b8, {maxb})};
  Tensor dsend[2] = {Tensor(DType::f32, {maxf}), Tensor(DType::f32, {maxf})};
  Tensor drecv[2] = {Tensor(DType::f32, {maxf}), Tensor(DType::f32, {maxf})};
  std::vector<float> delta(static_cast<std::size_t>(maxf));
  pack_kv(k, v, static_cast<char*>(buf[0].data()));
  Tensor dq(DType::f32, q.shape());
  if (stats) *stats = {};
  const int right = (r + 1) % P, left = (r - 1 + P) % P;
  // req: 0 KV in, 1 KV out, 2/3 dKV in (by step parity), 4/5 dKV out (by step parity).
  MPI_Request req[6];
  std::fill(std::begin(req), std::end(req), MPI_REQUEST_NULL);
  for (int t = 0; t < P; ++t) {
    const int src = ((r - t) % P + P) % P, next = ((src - 1) % P + P) % P;
    i64 sent = 0;
    if (t < P - 1) {
      MPI_Irecv(buf[(t + 1) % 2].data(), static_cast<int>(L.kv_bytes(next)), MPI_BYTE, left, 2 * t, comm, &req[0]);
      MPI_Isend(buf[t % 2].data(), static_cast<int>(L.kv_bytes(src)), MPI_BYTE, right, 2 * t, comm, &req[1]);
      sent += L.kv_bytes(src);
    }
    // The accumulator that rank r - 1 sends at the end of its step t: for `next`.
    MPI_Irecv(drecv[t % 2].data(), static_cast<int>(L.dkv_floats(next)), MPI_FLOAT, left, 2 * t + 1, comm, &req[2 + t % 2]);
    auto poll = [&] {
      int done = 0;
      if (options.progress == Progress::poll) MPI_Testall(6, req, &done, MPI_STATUSES_IGNORE);
    };
    i64 pairs = 0;
    const double t0 = detail::now(), c0 = detail::thread_cpu();
    const i64 nf = L.dkv_floats(src), nkd = L.B * L.Hkv * detail::total_length(L.ksegs[static_cast<std::size_t>(src)]) * L.D;
    std::fill(delta.begin(), delta.begin() + nf, 0.0f);
    {
      const detail::ProgressThread progress(req, 6, options.progress == Progress::thread);
      detail::backward_step(g, packed(qp), packed(op), packed(lp), packed(dop), L.qsegs[static_cast<std::size_t>(r)],
                            kv_view(buf[t % 2].data(), q.dtype(), L.B, L.Hkv, L.D, L.Dv, L.ksegs[static_cast<std::size_t>(src)]),
                            options.tile_rows, dq.data_as<float>(), delta.data(), delta.data() + nkd, poll, &pairs);
    }
    const double c1 = detail::thread_cpu();
    double waited = 0;
    const double w0 = detail::now();
    MPI_Wait(&req[4 + t % 2], MPI_STATUS_IGNORE);  // the send of step t - 2 from this buffer
    float* acc = dsend[t % 2].data_as<float>();
    if (t == 0) {
      std::fill(acc, acc + nf, 0.0f);
    } else {
      MPI_Wait(&req[2 + (t - 1) % 2], MPI_STATUS_IGNORE);
      std::memcpy(acc, drecv[(t - 1) % 2].data(), static_cast<std::size_t>(nf) * sizeof(float));
    }
    waited += detail::now() - w0;
    detail::add_into(acc, delta.data(), nf);
    MPI_Isend(acc, static_cast<int>(nf), MPI_FLOAT, right, 2 * t + 1, comm, &req[4 + t % 2]);
    sent += nf * 4;
    const double t1 = detail::now();
    MPI_Waitall(2, req, MPI_STATUSES_IGNORE);
    const double t2 = detail::now();
    if (stats) {
      stats->bytes_sent.push_back(sent);
      stats->busy_s.push_back(t1 - t0 - waited);
      stats->busy_cpu_s.push_back(c1 - c0);
      stats->pairs.push_back(pairs);
      stats->wait_s.push_back(t2 - t1 + waited);
    }
  }
  // This rank's own accumulator, sent by rank r - 1 at its last step.
  MPI_Waitall(6, req, MPI_STATUSES_IGNORE);
  const float* mine = drecv[(P - 1) % 2].data_as<float>();
  const i64 nk = k.size(2);
  const Tensor dkl(DType::f32, k.shape()), dvl(DType::f32, v.shape());
  std::memcpy(dkl.data(), mine, dkl.nbytes());
  std::memcpy(dvl.data(), mine + L.B * L.Hkv * nk * L.D, dvl.nbytes());
  const std::vector<Segment> all_q{{0, q.size(2)}}, all_k{{0, nk}};
  detail::scatter(dq, all_q, grad_q);
  detail::scatter(dkl, all_k, grad_k);
  detail::scatter(dvl, all_k, grad_v);
  if (grad_sinks) {
    // Every rank's per-row terms to every rank, summed there in the global row order.
    const std::vector<double> mine = detail::sink_terms(g, packed(op), packed(lp), packed(dop));
    std::vector<int> counts(static_cast<std::size_t>(P)), displs(static_cast<std::size_t>(P));
    int total = 0;
    for (int s = 0; s < P; ++s) {
      counts[static_cast<std::size_t>(s)] =
          static_cast<int>(L.B * L.Hq * detail::total_length(L.qsegs[static_cast<std::size_t>(s)]));
      displs[static_cast<std::size_t>(s)] = total;
      total += counts[static_cast<std::size_t>(s)];
    }
    std::vector<double> all(static_cast<std::size_t>(total));
    MPI_Allgatherv(mine.data(), static_cast<int>(mine.size()), MPI_DOUBLE, all.data(), counts.data(), displs.data(),
                   MPI_DOUBLE, comm);
    detail::write_sink_gradient(place_terms(all, L, Sq), L.B, L.Hq, Sq, *grad_sinks);
  }
  if (stats) stats->total_s = detail::now() - t_start;
}

}  // namespace

void ring_attention_backward(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& softmax_lse, const TensorView& grad_out,
                             const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v, i64 Sq,
                             i64 Sk, const AttentionParams& params, const RingOptions& options, RingStats* stats) {
  ring_backward(comm, q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, nullptr, Sq, Sk, params, options,
                stats);
}

void ring_attention_backward(MPI_Comm comm, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& softmax_lse, const TensorView& grad_out,
                             const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                             const TensorView& grad_sinks, i64 Sq, i64 Sk, const AttentionParams& params,
                             const RingOptions& options, RingStats* stats) {
  ring_backward(comm, q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, &grad_sinks, Sq, Sk, params,
                options, stats);
}

void simulate_ring_attention(int ranks, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& softmax_lse, const AttentionParams& params,
                             const RingOptions& options) {
  const Placement pl = resolve_placement(options.placement, params);
  qkv::detail::check_rank4(q, "q", "[B,Hq,Sq,D]");
  qkv::detail::check_rank4(k, "k", "[B,Hkv,Sk,D]");
  qkv::detail::check_rank4(v, "v", "[B,Hkv,Sk,Dv]");
  const i64 Sq = q.size(2), Sk = k.size(2);
  for (int r = 0; r < ranks; ++r) {
    // Each simulated rank's checks, on its own slice.
    const std::string err = check_ring(ranks, r, detail::gather(q, shard(Sq, ranks, r, pl)),
                                       detail::gather(k, shard(Sk, ranks, r, pl)), detail::gather(v, shard(Sk, ranks, r, pl)),
                                       Sq, Sk, params, options, pl, false);
    if (!err.empty()) throw Error(err);
  }
  check_out(out, "out", {q.size(0), q.size(1), Sq, v.size(3)}, true);
  check_out(softmax_lse, "softmax_lse", {q.size(0), q.size(1), Sq}, false);
  const Layout L = layout(ranks, 0, q, v, k.size(1), Sq, Sk, pl);
  const Global g(Sq, Sk, params, L.B);
  std::vector<Tensor> qp, kvb;
  std::vector<FwdAcc> acc;
  for (int r = 0; r < ranks; ++r) {
    qp.push_back(detail::gather(q, L.qsegs[static_cast<std::size_t>(r)]));
    kvb.emplace_back(DType::b8, Shape{L.kv_bytes(r)});
    pack_kv(detail::gather(k, L.ksegs[static_cast<std::size_t>(r)]), detail::gather(v, L.ksegs[static_cast<std::size_t>(r)]),
            static_cast<char*>(kvb.back().data()));
    acc.emplace_back(L.B, L.Hq, qp.back().shape()[2], L.Dv);
  }
  for (int t = 0; t < ranks; ++t)
    for (int r = 0; r < ranks; ++r) {
      const int src = ((r - t) % ranks + ranks) % ranks;
      detail::forward_step(g, packed(qp[static_cast<std::size_t>(r)]), L.qsegs[static_cast<std::size_t>(r)],
                           kv_view(kvb[static_cast<std::size_t>(src)].data(), q.dtype(), L.B, L.Hkv, L.D, L.Dv,
                                   L.ksegs[static_cast<std::size_t>(src)]),
                           options.tile_rows, acc[static_cast<std::size_t>(r)], nullptr);
    }
  for (int r = 0; r < ranks; ++r) {
    const auto& segs = L.qsegs[static_cast<std::size_t>(r)];
    const i64 n = detail::total_length(segs);
    Tensor o(out.dtype(), {L.B, L.Hq, n, L.Dv}), l(DType::f32, {L.B, L.Hq, n});
    detail::join_sinks(g, acc[static_cast<std::size_t>(r)]);
    detail::write_result(acc[static_cast<std::size_t>(r)], o, l.view());
    detail::scatter(o, segs, out);
    detail::scatter(as4d(l), segs, as4d(softmax_lse));
  }
}

namespace {

void simulate_backward(int ranks, const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                       const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                       const TensorView& grad_k, const TensorView& grad_v, const TensorView* grad_sinks,
                       const AttentionParams& params, const RingOptions& options) {
  const Placement pl = resolve_placement(options.placement, params);
  qkv::detail::check_rank4(q, "q", "[B,Hq,Sq,D]");
  qkv::detail::check_rank4(k, "k", "[B,Hkv,Sk,D]");
  qkv::detail::check_rank4(v, "v", "[B,Hkv,Sk,Dv]");
  const i64 Sq = q.size(2), Sk = k.size(2);
  for (int r = 0; r < ranks; ++r) {
    const std::string err = check_ring(ranks, r, detail::gather(q, shard(Sq, ranks, r, pl)),
                                       detail::gather(k, shard(Sk, ranks, r, pl)), detail::gather(v, shard(Sk, ranks, r, pl)),
                                       Sq, Sk, params, options, pl, true);
    if (!err.empty()) throw Error(err);
  }
  const Shape os{q.size(0), q.size(1), Sq, v.size(3)};
  check_out(out, "out", os, true);
  check_out(softmax_lse, "softmax_lse", {q.size(0), q.size(1), Sq}, false);
  check_out(grad_out, "grad_out", os, true);
  check_out(grad_q, "grad_q", q.shape(), false);
  check_out(grad_k, "grad_k", k.shape(), false);
  check_out(grad_v, "grad_v", v.shape(), false);
  if (grad_sinks)
    detail::check_grad_sinks(*grad_sinks, params, q.size(1),
                             {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&softmax_lse, "softmax_lse"},
                              {&grad_out, "grad_out"}, {&grad_q, "grad_q"}, {&grad_k, "grad_k"}, {&grad_v, "grad_v"}});
  const Layout L = layout(ranks, 0, q, v, k.size(1), Sq, Sk, pl);
  const Global g(Sq, Sk, params, L.B);
  std::vector<Tensor> qp, op, lp, dop, kvb, dq, dacc;
  for (int r = 0; r < ranks; ++r) {
    const auto& qs = L.qsegs[static_cast<std::size_t>(r)];
    const auto& ks = L.ksegs[static_cast<std::size_t>(r)];
    qp.push_back(detail::gather(q, qs));
    op.push_back(detail::gather(out, qs));
    lp.push_back(detail::pack(detail::gather(as4d(softmax_lse), qs), DType::f32));
    dop.push_back(detail::gather(grad_out, qs));
    kvb.emplace_back(DType::b8, Shape{L.kv_bytes(r)});
    pack_kv(detail::gather(k, ks), detail::gather(v, ks), static_cast<char*>(kvb.back().data()));
    dq.emplace_back(DType::f32, Shape{L.B, L.Hq, detail::total_length(qs), L.D});
    dacc.emplace_back(DType::f32, Shape{std::max<i64>(L.dkv_floats(r), 1)});
  }
  i64 maxf = 0;
  for (int s = 0; s < ranks; ++s) maxf = std::max(maxf, L.dkv_floats(s));
  std::vector<float> delta(static_cast<std::size_t>(maxf));
  for (int t = 0; t < ranks; ++t)
    for (int r = 0; r < ranks; ++r) {
      const int src = ((r - t) % ranks + ranks) % ranks;
      const i64 nf = L.dkv_floats(src), nkd = L.B * L.Hkv * detail::total_length(L.ksegs[static_cast<std::size_t>(src)]) * L.D;
      std::fill(delta.begin(), delta.begin() + nf, 0.0f);
      const auto rr = static_cast<std::size_t>(r);
      detail::backward_step(g, packed(qp[rr]), packed(op[rr]), packed(lp[rr]), packed(dop[rr]), L.qsegs[rr],
                            kv_view(kvb[static_cast<std::size_t>(src)].data(), q.dtype(), L.B, L.Hkv, L.D, L.Dv,
                                    L.ksegs[static_cast<std::size_t>(src)]),
                            options.tile_rows, dq[rr].data_as<float>(), delta.data(), delta.data() + nkd, nullptr);
      detail::add_into(dacc[static_cast<std::size_t>(src)].data_as<float>(), delta.data(), nf);
    }
  for (int r = 0; r < ranks; ++r) {
    const auto rr = static_cast<std::size_t>(r);
    const i64 nk = detail::total_length(L.ksegs[rr]);
    Tensor dkl(DType::f32, {L.B, L.Hkv, nk, L.D}), dvl(DType::f32, {L.B, L.Hkv, nk, L.Dv});
    std::memcpy(dkl.data(), dacc[rr].data(), dkl.nbytes());
    std::memcpy(dvl.data(), dacc[rr].data_as<float>() + L.B * L.Hkv * nk * L.D, dvl.nbytes());
    detail::scatter(dq[rr], L.qsegs[rr], grad_q);
    detail::scatter(dkl, L.ksegs[rr], grad_k);
    detail::scatter(dvl, L.ksegs[rr], grad_v);
  }
  if (grad_sinks) {
    // The terms of the global rows directly: the same per-row arithmetic as each rank's.
    const Tensor op = detail::pack(out, out.dtype()), lp = detail::pack(as4d(softmax_lse), DType::f32),
                 dop = detail::pack(grad_out, grad_out.dtype());
    detail::write_sink_gradient(detail::sink_terms(g, packed(op), packed(lp), packed(dop)), L.B, L.Hq, Sq, *grad_sinks);
  }
}

}  // namespace

void simulate_ring_attention_backward(int ranks, const TensorView& q, const TensorView& k, const TensorView& v,
                                      const TensorView& out, const TensorView& softmax_lse, const TensorView& grad_out,
                                      const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                                      const AttentionParams& params, const RingOptions& options) {
  simulate_backward(ranks, q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, nullptr, params, options);
}

void simulate_ring_attention_backward(int ranks, const TensorView& q, const TensorView& k, const TensorView& v,
                                      const TensorView& out, const TensorView& softmax_lse, const TensorView& grad_out,
                                      const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                                      const TensorView& grad_sinks, const AttentionParams& params,
                                      const RingOptions& options) {
  simulate_backward(ranks, q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, &grad_sinks, params, options);
}

}  // namespace qkv::dist
