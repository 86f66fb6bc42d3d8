// Run under `mpirun -np P` (P = 1..4, registered by tests/CMakeLists.txt): every rank's output,
// softmax_lse and gradients of ring attention (forward, backward) and of decoding across ranks
// are bitwise those of the same schedule run in one process (qkv::dist::simulate_*), and that
// is within the fp32 rule of the float64 reference; bytes sent per step equal the model's;
// a rank that refuses a call makes every rank throw (no hang). The score options (sinks, ALiBi,
// keep-first) alone and combined with causal, window, softcap, GQA, masks and uneven shards;
// dL/dz of the sinks bitwise independent of the number of ranks for given out and lse. Exit
// status 0 when all pass.
#include <mpi.h>

#include <cstdio>
#include <string>
#include <vector>

#include "dist/comm.hpp"
#include "dist_check.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/dist.hpp"
#include "qkv/error.hpp"
#include "qkv/reference.hpp"

using namespace qkv;
using namespace qkv::dist;
using namespace qkv::dist::test;
using i64 = std::int64_t;

namespace {

struct Case {
  std::string name;
  i64 B = 1, Hq = 2, Hkv = 1, Sq = 37, Sk = 37, D = 16, Dv = 16;
  DType dt = DType::f32;
  bool causal = false;
  Alignment align = Alignment::bottom_right;
  i64 wl = -1, wr = -1;
  double softcap = 0;
  std::vector<i64> lens;  // empty: none
  int mask = 0;           // 0 none, 1 bool [B,1,Sq,Sk] with fully masked rows, 2 additive [Sq,Sk]
  i64 tile_rows = 64;
  Placement placement = Placement::automatic;
  Progress progress = Progress::poll;
  bool sinks = false;  // sink logits [Hq], some far above the scores
  int alibi = 0;       // 0 none, 1 the standard slopes [Hq], 2 per-batch slopes [B,Hq] of both signs
  i64 keep = 0;        // window_keep_first
};

struct Inputs {
  Tensor q, k, v, dout, mask, lens, sinks, slopes;
  AttentionParams p;
};

Inputs make_inputs(const Case& c, std::uint64_t seed) {
  Inputs in;
  in.q = random_tensor(c.dt, {c.B, c.Hq, c.Sq, c.D}, seed + 1, 1.5);
  in.k = random_tensor(c.dt, {c.B, c.Hkv, c.Sk, c.D}, seed + 2, 1.5);
  in.v = random_tensor(c.dt, {c.B, c.Hkv, c.Sk, c.Dv}, seed + 3);
  in.dout = random_tensor(DType::f32, {c.B, c.Hq, c.Sq, c.Dv}, seed + 4);
  in.p.causal = c.causal;
  in.p.align = c.align;
  in.p.window_left = c.wl;
  in.p.window_right = c.wr;
  in.p.softcap = c.softcap;
  if (!c.lens.empty()) {
    in.lens = Tensor(DType::i64, {c.B});
    for (i64 b = 0; b < c.B; ++b) in.lens.data_as<i64>()[b] = c.lens[static_cast<std::size_t>(b)];
    in.p.kv_lens = in.lens.view();
  }
  if (c.sinks) {
    in.sinks = Tensor(DType::f32, {c.Hq});
    const float z[4] = {0.5f, -2.0f, 3.0f, 9.0f};
    for (i64 h = 0; h < c.Hq; ++h) in.sinks.data_as<float>()[h] = z[h % 4];
    in.p.sinks = in.sinks.view();
  }
  if (c.alibi == 1) {
    const std::vector<float> a = alibi_slopes(c.Hq);
    in.slopes = Tensor(DType::f32, {c.Hq});
    std::memcpy(in.slopes.data(), a.data(), a.size() * sizeof(float));
    in.p.alibi_slopes = in.slopes.view();
  } else if (c.alibi == 2) {
    in.slopes = random_tensor(DType::f32, {c.B, c.Hq}, seed + 6, 0.4);
    in.p.alibi_slopes = in.slopes.view();
  }
  in.p.window_keep_first = c.keep;
  std::mt19937_64 rng(seed + 5);
  if (c.mask == 1) {
    in.mask = Tensor(DType::b8, {c.B, 1, c.Sq, c.Sk});
    auto* m = in.mask.data_as<bool>();
    for (i64 i = 0; i < in.mask.numel(); ++i) m[i] = rng() % 8 != 0;
    for (i64 b = 0; b < c.B; ++b)  // rows 3 and Sq - 2 admit nothing: empty rows
      for (i64 row : {i64{3}, c.Sq - 2})
        if (row >= 0 && row < c.Sq)
          for (i64 j = 0; j < c.Sk; ++j) m[(b * c.Sq + row) * c.Sk + j] = false;
    in.p.mask = in.mask.view();
  } else if (c.mask == 2) {
    in.mask = Tensor(DType::f32, {c.Sq, c.Sk});
    auto* m = in.mask.data_as<float>();
    for (i64 i = 0; i < in.mask.numel(); ++i)
      m[i] = rng() % 5 == 0 ? -INFINITY : static_cast<float>(static_cast<double>(rng() % 1000) / 500.0 - 1.0);
    in.p.mask = in.mask.view();
  }
  return in;
}

// softmax_lse [B,H,S] as [B,H,S,1] (to gather rows) and back.
Tensor lse4_of(const Tensor& l) {
  Tensor t(DType::f32, {l.shape()[0], l.shape()[1], l.shape()[2], 1});
  std::memcpy(t.data(), l.data(), l.nbytes());
  return t;
}
Tensor flat3(const Tensor& l) {
  Tensor t(DType::f32, {l.shape()[0], l.shape()[1], l.shape()[2]});
  std::memcpy(t.data(), l.data(), l.nbytes());
  return t;
}

std::string tag(const Case& c, int P, const char* what) { return c.name + " P=" + std::to_string(P) + ": " + what; }

// The forward and backward of one case: MPI vs simulation bitwise, simulation vs reference.
void run_ring(const Case& c, MPI_Comm comm) {
  int P = 1, r = 0;
  MPI_Comm_size(comm, &P);
  MPI_Comm_rank(comm, &r);
  Inputs in = make_inputs(c, 1000 + static_cast<std::uint64_t>(c.Sq * 31 + c.Sk));
  RingOptions opt;
  opt.placement = c.placement;
  opt.tile_rows = c.tile_rows;
  opt.progress = c.progress;
  const Placement pl = resolve_placement(c.placement, in.p);

  // One process: the same schedule.
  Tensor out_s(DType::f32, {c.B, c.Hq, c.Sq, c.Dv}), lse_s(DType::f32, {c.B, c.Hq, c.Sq});
  simulate_ring_attention(P, in.q, in.k, in.v, out_s, lse_s, in.p, opt);

  // The ranks.
  const auto qs = shard(c.Sq, P, r, pl), ks = shard(c.Sk, P, r, pl);
  const Tensor ql = detail::gather(in.q, qs), kl = detail::gather(in.k, ks), vl = detail::gather(in.v, ks);
  Tensor out_l(DType::f32, {c.B, c.Hq, ql.shape()[2], c.Dv}), lse_l(DType::f32, {c.B, c.Hq, ql.shape()[2]});
  RingStats st;
  ring_attention(comm, ql, kl, vl, out_l, lse_l, c.Sq, c.Sk, in.p, opt, &st);
  const Tensor lse4(DType::f32, {c.B, c.Hq, c.Sq, 1});
  std::memcpy(lse4.data(), lse_s.data(), lse_s.nbytes());
  const Tensor lse_l4(DType::f32, {c.B, c.Hq, ql.shape()[2], 1});
  std::memcpy(lse_l4.data(), lse_l.data(), lse_l.nbytes());
  check(same_bits(out_l, detail::gather(out_s, qs)), tag(c, P, "forward out bitwise = simulation"));
  check(same_bits(lse_l4, detail::gather(lse4, qs)), tag(c, P, "forward softmax_lse bitwise = simulation"));
  const auto model = ring_bytes_model(P, r, c.B, c.Hkv, c.Sk, c.D, c.Dv, c.dt, pl, false);
  check(st.bytes_sent == model, tag(c, P, "forward bytes per step = model"));

  // Against the float64 reference, with the single-process kernel's error as the yardstick.
  Tensor out_r(DType::f64, {c.B, c.Hq, c.Sq, c.Dv}), lse_r(DType::f64, {c.B, c.Hq, c.Sq});
  reference::attention(in.q, in.k, in.v, out_r, in.p, lse_r.view());
  Tensor out_1(DType::f32, {c.B, c.Hq, c.Sq, c.Dv}), lse_1(DType::f32, {c.B, c.Hq, c.Sq});
  attention(in.q, in.k, in.v, out_1, in.p, lse_1.view());
  const double e_out = max_diff(out_s, out_r), e1_out = max_diff(out_1, out_r);
  const double e_lse = max_diff(lse_s, lse_r), e1_lse = max_diff(lse_1, lse_r);
  const double ulp_lse = std::ldexp(max_abs(lse_r), -23);
  // bfloat16 tiles may take the block path that rounds P to bfloat16 before P V (docs/accuracy.md),
  // which a whole-problem call on the same inputs need not: allow that rounding, 2^-8 max |v|.
  const double p_round = c.dt == DType::bf16 ? std::ldexp(max_abs(in.v), -8) : 0.0;
  check(e_out <= 2 * e1_out + 1e-6 + p_round, tag(c, P, "out within the fp32 rule of the reference: ") + std::to_string(e_out) +
                                        " vs single-process " + std::to_string(e1_out));
  check(e_lse <= 2 * e1_lse + 1e-6 + ulp_lse, tag(c, P, "softmax_lse within the fp32 rule: ") + std::to_string(e_lse) +
                                                  " vs single-process " + std::to_string(e1_lse));

  // Backward.
  Tensor dq_s(DType::f32, in.q.shape()), dk_s(DType::f32, in.k.shape()), dv_s(DType::f32, in.v.shape());
  Tensor dz_s(DType::f32, {c.Hq}), dz_l(DType::f32, {c.Hq});
  if (c.sinks)
    simulate_ring_attention_backward(P, in.q, in.k, in.v, out_s, lse_s, in.dout, dq_s, dk_s, dv_s, dz_s, in.p, opt);
  else
    simulate_ring_attention_backward(P, in.q, in.k, in.v, out_s, lse_s, in.dout, dq_s, dk_s, dv_s, in.p, opt);
  const Tensor dol = detail::gather(in.dout, qs);
  Tensor dq_l(DType::f32, ql.shape()), dk_l(DType::f32, kl.shape()), dv_l(DType::f32, vl.shape());
  RingStats sb;
  if (c.sinks)
    ring_attention_backward(comm, ql, kl, vl, out_l, lse_l, dol, dq_l, dk_l, dv_l, dz_l, c.Sq, c.Sk, in.p, opt, &sb);
  else
    ring_attention_backward(comm, ql, kl, vl, out_l, lse_l, dol, dq_l, dk_l, dv_l, c.Sq, c.Sk, in.p, opt, &sb);
  if (c.sinks) check(same_bits(dz_l, dz_s), tag(c, P, "d sinks bitwise = simulation"));
  check(same_bits(dq_l, detail::gather(dq_s, qs)), tag(c, P, "dQ bitwise = simulation"));
  check(same_bits(dk_l, detail::gather(dk_s, ks)), tag(c, P, "dK bitwise = simulation"));
  check(same_bits(dv_l, detail::gather(dv_s, ks)), tag(c, P, "dV bitwise = simulation"));
  check(sb.bytes_sent == ring_bytes_model(P, r, c.B, c.Hkv, c.Sk, c.D, c.Dv, c.dt, pl, true),
        tag(c, P, "backward bytes per step = model"));
  Tensor rdq(DType::f64, in.q.shape()), rdk(DType::f64, in.k.shape()), rdv(DType::f64, in.v.shape());
  reference::attention_backward(in.q, in.k, in.v, out_r, lse_r, in.dout, rdq, rdk, rdv, in.p);
  Tensor dq1(DType::f32, in.q.shape()), dk1(DType::f32, in.k.shape()), dv1(DType::f32, in.v.shape());
  attention_backward(in.q, in.k, in.v, out_1, lse_1, in.dout, dq1, dk1, dv1, in.p);
  const std::pair<const Tensor*, const Tensor*> grads[3][2] = {
      {{&dq_s, &rdq}, {&dq1, &rdq}}, {{&dk_s, &rdk}, {&dk1, &rdk}}, {{&dv_s, &rdv}, {&dv1, &rdv}}};
  const char* names[3] = {"dQ", "dK", "dV"};
  for (int gi = 0; gi < 3; ++gi) {
    const double e = max_diff(*grads[gi][0].first, *grads[gi][0].second);
    const double e1 = max_diff(*grads[gi][1].first, *grads[gi][1].second);
    const double g_round = c.dt == DType::bf16 ? std::ldexp(max_abs(*grads[gi][0].second), -7) : 0.0;
    check(e <= 2 * e1 + 1e-5 + g_round, tag(c, P, names[gi]) + " within the fp32 rule: " + std::to_string(e) +
                                  " vs single-process " + std::to_string(e1));
  }
  if (c.sinks) {
    Tensor rdz(DType::f32, {c.Hq}), dz1(DType::f32, {c.Hq});
    reference::attention_backward(in.q, in.k, in.v, out_r, lse_r, in.dout, rdq, rdk, rdv, rdz, in.p);
    attention_backward(in.q, in.k, in.v, out_1, lse_1, in.dout, dq1, dk1, dv1, dz1, in.p);
    const double e = max_diff(dz_s, rdz), e1 = max_diff(dz1, rdz);
    const double g_round = c.dt == DType::bf16 ? std::ldexp(max_abs(rdz), -7) : 0.0;
    check(e <= 2 * e1 + 1e-5 + std::ldexp(max_abs(rdz), -20) + g_round,
          tag(c, P, "d sinks within the fp32 rule: ") + std::to_string(e) + " vs single-process " + std::to_string(e1));
    // Given the same out and softmax_lse (the single-process ones), dL/dz is bitwise that of
    // qkv::attention_backward whatever the number of ranks and the placement.
    Tensor dz_f(DType::f32, {c.Hq});
    const Tensor o1l = detail::gather(out_1, qs), l1l = detail::gather(lse4_of(lse_1), qs);
    const Tensor l1 = flat3(l1l);
    ring_attention_backward(comm, ql, kl, vl, o1l, l1, dol, dq_l, dk_l, dv_l, dz_f, c.Sq, c.Sk, in.p, opt);
    check(same_bits(dz_f, dz1), tag(c, P, "d sinks from the single-process out, lse: bitwise = attention_backward's"));
  }
}

void run_decode(const Case& c, MPI_Comm comm) {
  int P = 1, r = 0;
  MPI_Comm_size(comm, &P);
  MPI_Comm_rank(comm, &r);
  Inputs in = make_inputs(c, 7000 + static_cast<std::uint64_t>(c.Sq * 31 + c.Sk));
  Tensor out_s(DType::f32, {c.B, c.Hq, c.Sq, c.Dv}), lse_s(DType::f32, {c.B, c.Hq, c.Sq});
  simulate_decode_attention(P, in.q, in.k, in.v, out_s, in.p, lse_s.view());
  const Segment s = shard(c.Sk, P, r, Placement::contiguous)[0];
  const Tensor kl = detail::gather(in.k, {s}), vl = detail::gather(in.v, {s});
  Tensor out_l(DType::f32, {c.B, c.Hq, c.Sq, c.Dv}), lse_l(DType::f32, {c.B, c.Hq, c.Sq});
  decode_attention(comm, in.q, kl, vl, out_l, s.start, c.Sk, in.p, lse_l.view());
  check(same_bits(out_l, out_s), tag(c, P, "decode out bitwise = simulation"));
  check(same_bits(lse_l, lse_s), tag(c, P, "decode softmax_lse bitwise = simulation"));
  Tensor out_r(DType::f64, {c.B, c.Hq, c.Sq, c.Dv}), lse_r(DType::f64, {c.B, c.Hq, c.Sq});
  reference::attention(in.q, in.k, in.v, out_r, in.p, lse_r.view());
  Tensor out_1(DType::f32, {c.B, c.Hq, c.Sq, c.Dv}), lse_1(DType::f32, {c.B, c.Hq, c.Sq});
  attention(in.q, in.k, in.v, out_1, in.p, lse_1.view());
  const double e = max_diff(out_s, out_r), e1 = max_diff(out_1, out_r);
  const double el = max_diff(lse_s, lse_r), el1 = max_diff(lse_1, lse_r);
  const double p_round = c.dt == DType::bf16 ? std::ldexp(max_abs(in.v), -8) : 0.0;
  check(e <= 2 * e1 + 1e-6 + p_round, tag(c, P, "decode out within the fp32 rule: ") + std::to_string(e) + " vs " + std::to_string(e1));
  check(el <= 2 * el1 + 1e-6 + std::ldexp(max_abs(lse_r), -23),
        tag(c, P, "decode softmax_lse within the fp32 rule: ") + std::to_string(el) + " vs " + std::to_string(el1));
}

// A rank passing a wrong shape: every rank throws, none waits forever.
void run_refusal(MPI_Comm comm) {
  int P = 1, r = 0;
  MPI_Comm_size(comm, &P);
  MPI_Comm_rank(comm, &r);
  const i64 S = 20;
  const auto qs = shard(S, P, r, Placement::contiguous);
  const i64 n = qs[0].length + (r == P - 1 ? 1 : 0);  // the last rank holds one row too many
  Tensor q(DType::f32, {1, 1, n, 4}), k(DType::f32, {1, 1, n, 4}), v(DType::f32, {1, 1, n, 4});
  Tensor out(DType::f32, {1, 1, n, 4}), lse(DType::f32, {1, 1, n});
  std::string msg;
  try {
    ring_attention(comm, q, k, v, out, lse, S, S);
  } catch (const Error& e) {
    msg = e.what();
  }
  check(!msg.empty(), "refusal: every rank throws");
  if (r == P - 1)
    check(msg.find("q: expected this rank's") != std::string::npos, "refusal: the faulty rank names q: " + msg);
}

// Refused by name on every rank, the ring and its simulation alike: grad_sinks without sinks, and
// dropout (it decides by global positions, which the blocks do not have).
void run_refusals(MPI_Comm comm) {
  int P = 1, r = 0;
  MPI_Comm_size(comm, &P);
  MPI_Comm_rank(comm, &r);
  const i64 S = 12;
  const i64 n = shard(S, P, r, Placement::contiguous)[0].length;
  Tensor q(DType::f32, {1, 2, n, 4}), out(DType::f32, {1, 2, n, 4}), lse(DType::f32, {1, 2, n});
  Tensor zq(DType::f32, {1, 2, S, 4}), zl(DType::f32, {1, 2, S}), dz(DType::f32, {2});
  RingOptions o;
  o.placement = Placement::contiguous;
  AttentionParams dropout;
  dropout.dropout_p = 0.1;
  for (int call = 0; call < 4; ++call) {
    std::string msg;
    try {
      if (call == 0) ring_attention_backward(comm, q, q, q, out, lse, out, q, q, q, dz, S, S, {}, o);
      if (call == 1) simulate_ring_attention_backward(2, zq, zq, zq, zq, zl, zq, zq, zq, zq, dz, {}, o);
      if (call == 2) ring_attention(comm, q, q, q, out, lse, S, S, dropout, o);
      if (call == 3) simulate_ring_attention(2, zq, zq, zq, zq, zl, dropout, o);
    } catch (const Error& e) {
      msg = e.what();
    }
    if (call < 2)
      check(msg.rfind("grad_sinks: expected params.sinks", 0) == 0,
            "grad_sinks without sinks refused by name (call " + std::to_string(call) + "): " + msg);
    else
      check(msg.find("dropout_p: expected 0") != std::string::npos,
            "dropout refused by name (call " + std::to_string(call) + "): " + msg);
  }
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;  // Progress::thread calls MPI from a second thread
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int P = 1, r = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &P);
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  std::vector<Case> cases;
  {
    Case c; c.name = "plain GQA odd"; c.B = 2; c.Hq = 4; c.Hkv = 2; c.Sq = 37; c.Sk = 37; c.D = 12; c.Dv = 9;
    cases.push_back(c);
    Case z = c; z.name = "causal zigzag Sq<Sk"; z.causal = true; z.Sq = 29; z.Sk = 41; z.tile_rows = 4;
    cases.push_back(z);
    Case t = z; t.name = "causal top-left Sq>Sk"; t.align = Alignment::top_left; t.Sq = 41; t.Sk = 29;
    cases.push_back(t);
    Case zc = z; zc.name = "causal contiguous"; zc.placement = Placement::contiguous; zc.Sq = 33; zc.Sk = 33;
    cases.push_back(zc);
    Case w; w.name = "window spanning ranks"; w.Sq = 53; w.Sk = 53; w.wl = 5; w.wr = 3; w.tile_rows = 8;
    cases.push_back(w);
    Case ww; ww.name = "wide window across several ranks"; ww.Sq = 61; ww.Sk = 61; ww.wl = 30; ww.wr = 17;
    ww.tile_rows = 16;
    cases.push_back(ww);
    Case tiny; tiny.name = "ranks holding no rows"; tiny.Sq = 3; tiny.Sk = 5; tiny.causal = true; tiny.Hq = 2;
    tiny.Hkv = 2;
    cases.push_back(tiny);
    Case wl = w; wl.name = "window right only, progress none"; wl.wl = -1; wl.wr = 2; wl.progress = Progress::none;
    cases.push_back(wl);
    Case th = zc; th.name = "progress thread, causal contiguous"; th.progress = Progress::thread; th.tile_rows = 8;
    cases.push_back(th);
    Case cw; cw.name = "causal window softcap key lengths"; cw.B = 2; cw.Hq = 3; cw.Hkv = 1; cw.Sq = 31; cw.Sk = 43;
    cw.causal = true; cw.wl = 7; cw.softcap = 4.0; cw.lens = {43, 17}; cw.tile_rows = 5;
    cases.push_back(cw);
    Case m; m.name = "bool mask, empty rows"; m.B = 2; m.Sq = 23; m.Sk = 30; m.mask = 1; m.causal = true;
    m.align = Alignment::top_left;
    cases.push_back(m);
    Case a; a.name = "additive mask"; a.Sq = 19; a.Sk = 26; a.mask = 2; a.wl = 9; a.wr = 9;
    cases.push_back(a);
    Case bf = z; bf.name = "bfloat16 causal"; bf.dt = DType::bf16; bf.Sq = 35; bf.Sk = 35;
    cases.push_back(bf);
    // The score options, alone and combined.
    Case s1 = c; s1.name = "sinks GQA"; s1.sinks = true;
    cases.push_back(s1);
    Case s2 = m; s2.name = "sinks, bool mask with empty rows"; s2.sinks = true; s2.Hq = 4; s2.Hkv = 2;
    cases.push_back(s2);
    Case a1 = z; a1.name = "alibi causal zigzag Sq<Sk"; a1.alibi = 1; a1.Hq = 4; a1.Hkv = 2;
    cases.push_back(a1);
    Case a2 = c; a2.name = "alibi [B,Hq] window key lengths top-left Sq>Sk"; a2.alibi = 2; a2.Sq = 41; a2.Sk = 29;
    a2.align = Alignment::top_left; a2.wl = 6; a2.wr = 4; a2.lens = {29, 13}; a2.tile_rows = 7;
    cases.push_back(a2);
    Case a3 = c; a3.name = "alibi bottom-right Sq<Sk contiguous softcap"; a3.alibi = 1; a3.Sq = 23; a3.Sk = 44;
    a3.softcap = 5.0; a3.placement = Placement::contiguous;
    cases.push_back(a3);
    Case k1 = w; k1.name = "keep-first window spanning ranks"; k1.keep = 7;
    cases.push_back(k1);
    Case k2 = zc; k2.name = "keep-first causal window contiguous Sq<Sk"; k2.Sq = 27; k2.Sk = 45; k2.wl = 6; k2.keep = 10;
    cases.push_back(k2);
    Case k3 = z; k3.name = "keep-first causal zigzag without left bound (no effect), keep > Sk"; k3.keep = 50;
    cases.push_back(k3);
    Case k4 = ww; k4.name = "keep-first wide window, tiles of 3, top-left"; k4.keep = 25; k4.tile_rows = 3;
    k4.align = Alignment::top_left; k4.Sq = 50;
    cases.push_back(k4);
    Case all = cw; all.name = "sinks alibi keep-first causal window softcap key lengths GQA"; all.sinks = true;
    all.alibi = 2; all.keep = 5;
    cases.push_back(all);
    Case am = a; am.name = "sinks alibi keep-first additive mask uneven"; am.sinks = true; am.alibi = 1; am.keep = 3;
    am.Hq = 4; am.Hkv = 2; am.wl = 4; am.wr = 2;
    cases.push_back(am);
    Case ab = bf; ab.name = "bfloat16 sinks alibi keep-first causal window"; ab.sinks = true; ab.alibi = 1; ab.keep = 4;
    ab.wl = 9;
    cases.push_back(ab);
    Case at = th; at.name = "sinks alibi keep-first, progress thread, no rows on some ranks"; at.Sq = 3; at.Sk = 5;
    at.sinks = true; at.alibi = 1; at.keep = 2; at.wl = 1;
    cases.push_back(at);
  }
  for (const Case& c : cases) {
    try {
      run_ring(c, MPI_COMM_WORLD);
    } catch (const std::exception& e) {
      check(false, c.name + ": threw " + e.what());
    }
  }
  std::vector<Case> dec;
  {
    Case d; d.name = "decode GQA"; d.Hq = 4; d.Hkv = 2; d.Sq = 1; d.Sk = 50;
    dec.push_back(d);
    Case d2 = d; d2.name = "decode 3 tokens causal window lens"; d2.B = 2; d2.Sq = 3; d2.causal = true; d2.wl = 11;
    d2.lens = {50, 9};
    dec.push_back(d2);
    Case d3 = d; d3.name = "decode bf16 softcap"; d3.dt = DType::bf16; d3.softcap = 3.0; d3.Sk = 7;
    dec.push_back(d3);
    Case d4 = d2; d4.name = "decode sinks alibi keep-first causal window lens"; d4.sinks = true; d4.alibi = 2; d4.keep = 4;
    dec.push_back(d4);
    Case d5 = d; d5.name = "decode sinks, shards with no key"; d5.sinks = true; d5.Sk = 2; d5.alibi = 1;
    dec.push_back(d5);
  }
  for (const Case& c : dec) {
    try {
      run_decode(c, MPI_COMM_WORLD);
    } catch (const std::exception& e) {
      check(false, c.name + ": threw " + e.what());
    }
  }
  run_refusal(MPI_COMM_WORLD);
  run_refusals(MPI_COMM_WORLD);

  int fails = 0;
  MPI_Allreduce(&g_failures, &fails, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (r == 0)
    std::printf("test_dist P=%d: %d checks per rank, %d failures over all ranks\n", P, g_checks, fails);
  MPI_Finalize();
  return fails == 0 ? 0 : 1;
}
