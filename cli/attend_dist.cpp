// `qkv attend --distributed` under mpirun, and `--simulate-ranks P` in one process: the sequence
// split across ranks (qkv::dist, docs/distributed.md). Each rank memory-maps the .npy files and
// copies only its rows; rank 0 gathers the results and writes the same files `attend` writes.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "attend.hpp"
#include "options.hpp"
#include "qkv/error.hpp"
#include "qkv/npy.hpp"

#ifdef QKV_HAVE_DIST
#include <mpi.h>

#include <climits>

#include "dist/comm.hpp"
#include "qkv/dist.hpp"
#endif

namespace qkv::cli {

#ifndef QKV_HAVE_DIST
void run_attend_distributed(const AttendOptions&) {
  throw Error("--distributed: this qkv was built without MPI (install libopenmpi-dev and rebuild)");
}
#else
namespace {

using i64 = std::int64_t;

// MPI_Init for this command, MPI_Finalize when it ends (also on an error).
struct MpiSession {
  bool mine = false;
  explicit MpiSession(int level) {
    int init = 0;
    MPI_Initialized(&init);
    if (!init) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, level, &provided);
      mine = true;
    }
  }
  ~MpiSession() {
    if (mine) MPI_Finalize();
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
};

struct Inputs {
  NpyArray qa, ka, va, mask, lens, dout;
  ScoreFiles score;
  TensorView q, k, v, grad_out;
  AttentionParams p;
  bool grads = false, bshd = false;
  TensorView to_bhsd(const TensorView& t) const { return bshd ? t.permute({0, 2, 1, 3}) : t; }
};

Inputs load(const AttendOptions& o) {
  Inputs in;
  if (o.threads < 0)
    throw Error("--threads: expected an integer >= 0 (0 = all cores), got " + std::to_string(o.threads));
  if (!o.probs.empty()) throw Error("--probs: not available with --distributed (no rank holds whole rows of keys)");
  if (o.tile_rows < 1) throw Error("--tile-rows: expected an integer >= 1, got " + std::to_string(o.tile_rows));
  in.grads = !o.grad_q.empty() || !o.grad_k.empty() || !o.grad_v.empty() || !o.grad_sinks.empty();
  if (in.grads && o.grad_out.empty())
    throw Error("--grad-out: expected dO (.npy, the shape of out) to compute --grad-q/--grad-k/--grad-v/--grad-sinks, got none");
  if (!o.grad_out.empty() && !in.grads)
    throw Error("--grad-out: expected at least one of --grad-q, --grad-k, --grad-v, --grad-sinks to write, got none");
  if (!o.grad_sinks.empty() && o.sinks.empty())
    throw Error("--grad-sinks: expected --sinks (the sink logits whose gradient it is), got none");
  if (in.grads && o.decode) throw Error("--decode: the gradients are computed by the ring (--distributed without --decode)");
  in.bshd = o.layout == "bshd";
  in.qa = read_input("--q", o.q);
  in.ka = read_input("--k", o.k);
  in.va = read_input("--v", o.v);
  in.q = in.to_bhsd(in.qa.view());
  in.k = in.to_bhsd(in.ka.view());
  in.v = in.to_bhsd(in.va.view());
  in.p = attention_params(o);
  in.p.kernel = o.reference ? KernelKind::reference : KernelKind::automatic;
  in.p.num_threads = o.threads;
  if (!o.mask.empty()) {
    try { in.mask = read_npy(o.mask); } catch (const Error& e) { throw Error(std::string("--mask: ") + e.what()); }
    in.p.mask = in.mask.view();
  }
  if (!o.kv_lens.empty()) {
    try { in.lens = read_npy(o.kv_lens); } catch (const Error& e) { throw Error(std::string("--kv-lens: ") + e.what()); }
    in.p.kv_lens = in.lens.view();
  }
  read_score_options(o, in.p, in.score);
  if (in.grads) {
    in.dout = read_input("--grad-out", o.grad_out);
    in.grad_out = in.to_bhsd(in.dout.view());
  }
  return in;
}

dist::RingOptions ring_options(const AttendOptions& o) {
  dist::RingOptions r;
  r.placement = o.placement == "zigzag" ? dist::Placement::zigzag
                : o.placement == "contiguous" ? dist::Placement::contiguous : dist::Placement::automatic;
  r.progress = o.progress == "none"     ? dist::Progress::none
               : o.progress == "thread" ? dist::Progress::thread : dist::Progress::poll;
  r.tile_rows = o.tile_rows;
  return r;
}

// The results on rank 0, in the files' layout (float32): out, lse, and the gradients.
struct Results {
  Tensor out, lse, dq, dk, dv, dz;
};

Shape file_shape(const Inputs& in, const TensorView& like_bhsd, i64 X) {
  const Shape s{like_bhsd.size(0), like_bhsd.size(1), like_bhsd.size(2), X};
  return in.bshd ? Shape{s[0], s[2], s[1], s[3]} : s;
}

void write_results(const AttendOptions& o, const Inputs& in, const Results& r) {
  std::vector<std::string> written;
  auto write = [&](const std::string& path, const TensorView& t) {
    try {
      write_npy(path, t);
      written.push_back(path);
    } catch (...) {
      std::error_code ec;
      for (const auto& w : written) std::filesystem::remove(w, ec);
      throw;
    }
  };
  write(o.out, r.out.view());
  if (!o.lse.empty()) write(o.lse, r.lse.view());
  if (in.grads) {
    if (!o.grad_q.empty()) write(o.grad_q, r.dq.view());
    if (!o.grad_k.empty()) write(o.grad_k, r.dk.view());
    if (!o.grad_v.empty()) write(o.grad_v, r.dv.view());
    if (!o.grad_sinks.empty()) write(o.grad_sinks, r.dz.view());
  }
}

Results allocate(const Inputs& in) {
  Results r;
  const i64 B = in.q.size(0), Hq = in.q.size(1), Sq = in.q.size(2);
  r.out = Tensor(DType::f32, file_shape(in, in.q, in.v.size(3)));
  r.lse = Tensor(DType::f32, {B, Hq, Sq});
  if (in.grads) {
    r.dq = Tensor(DType::f32, file_shape(in, in.q, in.q.size(3)));
    r.dk = Tensor(DType::f32, file_shape(in, in.k, in.k.size(3)));
    r.dv = Tensor(DType::f32, file_shape(in, in.v, in.v.size(3)));
    r.dz = Tensor(DType::f32, {Hq});
  }
  return r;
}

// One process: the schedule of P ranks (the files a `mpirun -np P ... --distributed` run writes).
void run_simulated(const AttendOptions& o) {
  const Inputs in = load(o);
  Results r = allocate(in);
  const dist::RingOptions ro = ring_options(o);
  if (o.decode) {
    dist::simulate_decode_attention(o.simulate_ranks, in.q, in.k, in.v, in.to_bhsd(r.out.view()), in.p, r.lse.view());
  } else {
    dist::simulate_ring_attention(o.simulate_ranks, in.q, in.k, in.v, in.to_bhsd(r.out.view()), r.lse.view(), in.p, ro);
    if (in.grads && !o.grad_sinks.empty())
      dist::simulate_ring_attention_backward(o.simulate_ranks, in.q, in.k, in.v, in.to_bhsd(r.out.view()), r.lse.view(),
                                             in.grad_out, in.to_bhsd(r.dq.view()), in.to_bhsd(r.dk.view()),
                                             in.to_bhsd(r.dv.view()), r.dz.view(), in.p, ro);
    else if (in.grads)
      dist::simulate_ring_attention_backward(o.simulate_ranks, in.q, in.k, in.v, in.to_bhsd(r.out.view()), r.lse.view(),
                                             in.grad_out, in.to_bhsd(r.dq.view()), in.to_bhsd(r.dk.view()),
                                             in.to_bhsd(r.dv.view()), in.p, ro);
  }
  write_results(o, in, r);
}

// Rank 0 receives every rank's rows (C-contiguous [B,H,n_s,X]) and places them at the rank's
// positions of `target` (a [B,H,S,X] view); `segs[s]` are rank s's positions.
void assemble(MPI_Comm comm, const Tensor& local, const std::vector<std::vector<dist::Segment>>& segs,
              const TensorView* target) {
  int P = 1, r = 0;
  MPI_Comm_size(comm, &P);
  MPI_Comm_rank(comm, &r);
  const i64 B = local.shape()[0], H = local.shape()[1], X = local.shape()[3];
  const i64 es = static_cast<i64>(dtype_size(local.dtype()));
  std::vector<int> counts(static_cast<std::size_t>(P)), displs(static_cast<std::size_t>(P));
  i64 total = 0;
  for (int s = 0; s < P; ++s) {
    i64 n = 0;
    for (const auto& g : segs[static_cast<std::size_t>(s)]) n += g.length;
    const i64 bytes = B * H * n * X * es;
    if (bytes > INT_MAX || total > INT_MAX) throw Error("--distributed: a rank's results exceed 2 GiB (MPI int counts): use more ranks");
    counts[static_cast<std::size_t>(s)] = static_cast<int>(bytes);
    displs[static_cast<std::size_t>(s)] = static_cast<int>(total);
    total += bytes;
  }
  std::vector<char> all(r == 0 ? static_cast<std::size_t>(total) : 0);
  MPI_Gatherv(local.data(), counts[static_cast<std::size_t>(r)], MPI_BYTE, all.data(), counts.data(), displs.data(), MPI_BYTE,
              0, comm);
  if (r != 0) return;
  for (int s = 0; s < P; ++s) {
    const i64 n = counts[static_cast<std::size_t>(s)] / std::max<i64>(B * H * X * es, 1);
    const TensorView part(all.data() + displs[static_cast<std::size_t>(s)], local.dtype(), {B, H, n, X});
    dist::detail::scatter(part, segs[static_cast<std::size_t>(s)], *target);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

void run_mpi(const AttendOptions& o) {
  // --progress thread calls MPI from a second thread.
  MpiSession session(o.progress == "thread" ? MPI_THREAD_MULTIPLE : MPI_THREAD_FUNNELED);
  const MPI_Comm comm = MPI_COMM_WORLD;
  int P = 1, rank = 0;
  MPI_Comm_size(comm, &P);
  MPI_Comm_rank(comm, &rank);
  int phase = 0;  // 0: checks and computation, 1: gathering on rank 0, 2: writing the files
  try {
    Inputs in;
    std::string err;
    try {
      in = load(o);
    } catch (const Error& e) {
      err = e.what();
    }
    dist::detail::agree(comm, err, {}, {});
    const dist::RingOptions ro = ring_options(o);
    const dist::Placement pl = dist::resolve_placement(ro.placement, in.p);
    const i64 Sq = in.q.size(2), Sk = in.k.size(2), B = in.q.size(0), Hq = in.q.size(1);
    std::vector<std::vector<dist::Segment>> qsegs, ksegs;
    for (int s = 0; s < P; ++s) {
      qsegs.push_back(o.decode ? std::vector<dist::Segment>{{0, Sq}} : dist::shard(Sq, P, s, pl));
      ksegs.push_back(dist::shard(Sk, P, s, o.decode ? dist::Placement::contiguous : pl));
    }
    const auto& mq = qsegs[static_cast<std::size_t>(rank)];
    const auto& mk = ksegs[static_cast<std::size_t>(rank)];
    // This rank's rows: the memory-mapped files are read only there.
    const Tensor ql = dist::detail::gather(in.q, mq), kl = dist::detail::gather(in.k, mk),
                 vl = dist::detail::gather(in.v, mk);
    const i64 nq = ql.shape()[2];
    Tensor out_l(DType::f32, {B, Hq, nq, in.v.size(3)}), lse_l(DType::f32, {B, Hq, nq});
    Tensor dq_l, dk_l, dv_l, dz(DType::f32, {Hq});
    std::vector<double> walls, busy, wait;
    std::vector<i64> bytes;
    const int runs = std::max(1, o.bench);
    for (int run = 0; run < runs; ++run) {
      dist::RingStats st, sb;
      MPI_Barrier(comm);
      const double t0 = MPI_Wtime();
      if (o.decode) {
        dist::decode_attention(comm, ql, kl, vl, out_l, mk[0].start, Sk, in.p, lse_l.view());
      } else {
        dist::ring_attention(comm, ql, kl, vl, out_l, lse_l, Sq, Sk, in.p, ro, &st);
        if (in.grads) {
          const Tensor dol = dist::detail::gather(in.grad_out, mq);
          dq_l = Tensor(DType::f32, ql.shape());
          dk_l = Tensor(DType::f32, kl.shape());
          dv_l = Tensor(DType::f32, vl.shape());
          if (!o.grad_sinks.empty())
            dist::ring_attention_backward(comm, ql, kl, vl, out_l, lse_l, dol, dq_l, dk_l, dv_l, dz, Sq, Sk, in.p, ro, &sb);
          else
            dist::ring_attention_backward(comm, ql, kl, vl, out_l, lse_l, dol, dq_l, dk_l, dv_l, Sq, Sk, in.p, ro, &sb);
        }
      }
      double wall = MPI_Wtime() - t0;
      MPI_Allreduce(MPI_IN_PLACE, &wall, 1, MPI_DOUBLE, MPI_MAX, comm);
      walls.push_back(wall);
      double b = 0, w = 0;
      for (std::size_t t = 0; t < st.busy_s.size(); ++t) { b += st.busy_s[t]; w += st.wait_s[t]; }
      for (std::size_t t = 0; t < sb.busy_s.size(); ++t) { b += sb.busy_s[t]; w += sb.wait_s[t]; }
      busy.push_back(b);
      wait.push_back(w);
      bytes = st.bytes_sent;
    }
    // From here on a failure is one rank's own (the checks above are agreed by all): abort the
    // job rather than leave the others waiting in a collective.
    phase = 1;
    Results res;
    TensorView out_t, lse_t, tq, tk, tv;
    if (rank == 0) {
      res = allocate(in);
      out_t = in.to_bhsd(res.out.view());
      lse_t = TensorView(res.lse.data(), DType::f32, {B, Hq, Sq, 1});
      if (in.grads) {
        tq = in.to_bhsd(res.dq.view());
        tk = in.to_bhsd(res.dk.view());
        tv = in.to_bhsd(res.dv.view());
      }
    }
    if (o.decode) {
      if (rank == 0) {
        dist::detail::scatter(out_l, {{0, Sq}}, out_t);
        std::memcpy(res.lse.data(), lse_l.data(), lse_l.nbytes());
      }
    } else {
      assemble(comm, out_l, qsegs, rank == 0 ? &out_t : nullptr);
      const Tensor lse4(DType::f32, {B, Hq, nq, 1});
      std::memcpy(lse4.data(), lse_l.data(), lse_l.nbytes());
      assemble(comm, lse4, qsegs, rank == 0 ? &lse_t : nullptr);
      if (in.grads) {
        assemble(comm, dq_l, qsegs, rank == 0 ? &tq : nullptr);
        assemble(comm, dk_l, ksegs, rank == 0 ? &tk : nullptr);
        assemble(comm, dv_l, ksegs, rank == 0 ? &tv : nullptr);
        if (rank == 0) std::memcpy(res.dz.data(), dz.data(), dz.nbytes());  // the same on every rank
      }
    }
    if (o.bench > 0) {
      const double mb = median(busy), mw = median(wait);
      std::vector<double> all_b(static_cast<std::size_t>(P)), all_w(static_cast<std::size_t>(P));
      MPI_Gather(&mb, 1, MPI_DOUBLE, all_b.data(), 1, MPI_DOUBLE, 0, comm);
      MPI_Gather(&mw, 1, MPI_DOUBLE, all_w.data(), 1, MPI_DOUBLE, 0, comm);
      if (rank == 0) {
        std::string bs;
        for (i64 b : bytes) bs += (bs.empty() ? "" : ",") + std::to_string(b);
        std::printf("{\"ranks\": %d, \"runs\": %d, \"mode\": \"%s\", \"seconds_median\": %.6f, \"busy_s_max\": %.6f, "
                    "\"busy_s_min\": %.6f, \"wait_s_max\": %.6f, \"rank0_bytes_per_step\": [%s]}\n",
                    P, runs, o.decode ? "decode" : in.grads ? "forward+backward" : "forward", median(walls),
                    *std::max_element(all_b.begin(), all_b.end()), *std::min_element(all_b.begin(), all_b.end()),
                    *std::max_element(all_w.begin(), all_w.end()), bs.c_str());
      }
    }
    phase = 2;
    if (rank == 0) write_results(o, in, res);
  } catch (const std::exception& e) {
    if (phase == 1) {
      std::fprintf(stderr, "qkv: error: rank %d: %s\n", rank, e.what());
      MPI_Abort(comm, 2);
    }
    if (phase == 2) throw;  // rank 0 alone writes; the others are done
    // Every rank refuses together (dist::detail::agree): one line on stderr, rank 0's, printed
    // before any rank exits, since mpirun stops the job at the first non-zero exit.
    if (rank == 0) {
      std::string line = e.what();
      std::replace(line.begin(), line.end(), '\n', ' ');
      std::fprintf(stderr, "qkv: error: %s\n", line.c_str());
      std::fflush(stderr);
    }
    MPI_Barrier(comm);
    MPI_Finalize();
    std::exit(2);
  }
}

}  // namespace

void run_attend_distributed(const AttendOptions& o) {
  if (o.simulate_ranks < 0)
    throw Error("--simulate-ranks: expected an integer >= 1, got " + std::to_string(o.simulate_ranks));
  if (o.simulate_ranks > 0) {
    if (o.distributed) throw Error("--simulate-ranks: runs in one process, expected without --distributed");
    return run_simulated(o);
  }
  run_mpi(o);
}
#endif

}  // namespace qkv::cli
