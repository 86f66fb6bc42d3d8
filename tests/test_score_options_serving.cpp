// ALiBi (alibi_slopes [Hq] and [batch, Hq]) and window_keep_first on the serving kernel: packed
// (attention_varlen), paged (attention_paged, blocks shuffled) and int8-quantized caches against
// the float64 reference sequence by sequence, with sinks, softcap, GQA, odd head_dim, both
// alignments, on every ISA level and 1 and 2 threads; the bits invariant to threads, to the
// batch's other sequences and to where the keys are stored. Keep-first reaching across the
// kernel's 1024-key splits, past the window, past the sequence, or 0 (ALiBi alone).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>

#include "attention_diff.hpp"  // test_isas, IsaCap
#include "qkv/kv_quant.hpp"
#include "qkv/paged_kv_cache.hpp"
#include "serving_case.hpp"

using namespace qkv;
using namespace qkv::test;

namespace {

struct Options {
  int alibi = 0;  // 0 none, 1 [Hq], 2 [batch, Hq]
  i64 keep_first = 0, wl = -1;
  bool causal = true, sinks = false, top_left = false;
  double softcap = 0.0;
  std::string str() const {
    return "alibi" + std::to_string(alibi) + " keep_first" + std::to_string(keep_first) + " wl" + std::to_string(wl) +
           (causal ? " causal" : "") + (sinks ? " sinks" : "") + (top_left ? " top_left" : "") + " cap" +
           std::to_string(softcap);
  }
};

// The call's parameters; slopes and sinks owned by the caller's tensors.
AttentionParams params_of(const Options& o, i64 B, i64 Hq, Tensor& slopes, Tensor& sinks, std::mt19937_64& rng) {
  AttentionParams p;
  p.causal = o.causal;
  p.window_left = o.wl;
  p.window_keep_first = o.keep_first;
  p.softcap = o.softcap;
  p.align = o.top_left ? Alignment::top_left : Alignment::bottom_right;
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  if (o.alibi) {
    // Small slopes: the first keys, far from the diagonal, keep weights that count.
    slopes = o.alibi == 1 ? Tensor(DType::f32, {Hq}) : Tensor(DType::f32, {B, Hq});
    for (i64 x = 0; x < slopes.numel(); ++x) slopes.data_as<float>()[x] = 0.02f * u(rng);
    p.alibi_slopes = slopes.view();
  }
  if (o.sinks) {
    sinks = Tensor(DType::f32, {Hq});
    for (i64 h = 0; h < Hq; ++h) sinks.data_as<float>()[h] = 4.0f * u(rng) - 2.0f;
    p.sinks = sinks.view();
  }
  return p;
}

// Sequence b's parameters: its row of [batch, Hq] slopes.
AttentionParams seq_params(const AttentionParams& p, i64 b) {
  AttentionParams s = p;
  if (p.alibi_slopes && p.alibi_slopes->rank() == 2) {
    const TensorView& a = *p.alibi_slopes;
    s.alibi_slopes = TensorView(a.data_as<float>() + b * a.stride(0), DType::f32, {a.size(1)}, {a.stride(1)});
  }
  return s;
}

// The float64 reference, sequence by sequence, over k and v (packed [Tk, Hkv, X]).
void reference_seqs(const Packed& pk, const Tensor& k, const Tensor& v, const AttentionParams& params, Tensor& out,
                    Tensor& lse) {
  out = Tensor(DType::f64, {pk.Tq, pk.Hq, pk.Dv});
  lse = Tensor(DType::f64, {pk.Hq, pk.Tq});
  for (std::size_t b = 0; b < pk.seqs.size(); ++b) {
    const auto [sq, sk] = pk.seqs[b];
    AttentionParams rp = seq_params(params, static_cast<i64>(b));
    rp.kernel = KernelKind::reference;
    reference::attention(seq_view(pk.q, pk.q0(b), sq), seq_view(k, pk.k0(b), sk), seq_view(v, pk.k0(b), sk),
                         seq_view(out, pk.q0(b), sq), rp, lse_view(lse, pk.q0(b), sq));
  }
}

// max |got - ref| / (1 + |ref|) (an lse of -50 is an fp32 number of ulp 4e-6), non-finite alike.
double rel_err(const Tensor& got, const Tensor& ref, const std::string& what) { return max_err(got, ref, what, true); }

// The packed keys and values in pools of bs-key blocks, in shuffled order: k and v pools
// [num_blocks, Hkv, bs, X], the block table [batch, max_blocks], seq_lens [batch].
struct Pools {
  Tensor k, v, table, lens;
};
Pools to_pools(const Packed& pk, i64 bs, std::uint64_t seed) {
  const i64 B = static_cast<i64>(pk.seqs.size());
  i64 maxb = 1, nb = 0;
  for (const auto& s : pk.seqs) { maxb = std::max(maxb, (s.second + bs - 1) / bs); nb += (s.second + bs - 1) / bs; }
  nb += 3;
  std::vector<std::int32_t> perm(static_cast<std::size_t>(nb));
  std::iota(perm.begin(), perm.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(perm.begin(), perm.end(), rng);
  Pools P{Tensor(pk.dtype, {nb, pk.Hkv, bs, pk.D}), Tensor(pk.dtype, {nb, pk.Hkv, bs, pk.Dv}), Tensor(DType::i32, {B, maxb}),
          Tensor(DType::i32, {B})};
  std::fill_n(P.table.data_as<std::int32_t>(), P.table.numel(), 0);
  const std::size_t es = dtype_size(pk.dtype);
  std::size_t next = 0;
  for (i64 b = 0; b < B; ++b) {
    const i64 sk = pk.seqs[static_cast<std::size_t>(b)].second;
    P.lens.data_as<std::int32_t>()[b] = static_cast<std::int32_t>(sk);
    for (i64 j = 0; j < sk; ++j) {
      if (j % bs == 0) P.table.data_as<std::int32_t>()[b * maxb + j / bs] = perm[next++];
      const i64 blk = P.table.data_as<std::int32_t>()[b * maxb + j / bs];
      for (i64 h = 0; h < pk.Hkv; ++h) {
        const i64 src = (pk.k0(static_cast<std::size_t>(b)) + j) * pk.Hkv + h;
        const i64 dst = (blk * pk.Hkv + h) * bs + j % bs;
        std::memcpy(static_cast<char*>(P.k.data()) + dst * pk.D * es, static_cast<const char*>(pk.k.data()) + src * pk.D * es,
                    static_cast<std::size_t>(pk.D) * es);
        std::memcpy(static_cast<char*>(P.v.data()) + dst * pk.Dv * es,
                    static_cast<const char*>(pk.v.data()) + src * pk.Dv * es, static_cast<std::size_t>(pk.Dv) * es);
      }
    }
  }
  return P;
}

// Rows of sequence b of a packed [T, H, X] output (or [H, T] lse) as their own tensor.
Tensor rows_of(const Tensor& t, i64 q0, i64 n, bool lse) {
  if (!lse) {
    const i64 row = t.numel() / t.shape()[0];
    Tensor r(t.dtype(), {n, row});
    std::memcpy(r.data(), t.data_as<float>() + q0 * row, r.nbytes());
    return r;
  }
  const i64 H = t.shape()[0], T = t.shape()[1];
  Tensor r(t.dtype(), {H, n});
  for (i64 h = 0; h < H; ++h) std::memcpy(r.data_as<float>() + h * n, t.data_as<float>() + h * T + q0, static_cast<std::size_t>(n) * 4);
  return r;
}

// One configuration: every ISA level, 1 and 2 threads; the reference bound; packed = paged
// (shuffled blocks; bottom-right alignment, the only one paged takes); sequence `alone` run by
// itself gives the bits it has in the batch.
void run_serving_case(const Seqs& seqs, i64 Hq, i64 Hkv, i64 D, DType dt, const Options& opt, std::uint64_t seed,
                      std::size_t alone) {
  const Packed pk = make_packed(seqs, Hq, Hkv, D, D, dt, seed);
  std::mt19937_64 rng(seed + 1);
  Tensor slopes, sinks;
  const AttentionParams params = params_of(opt, static_cast<i64>(seqs.size()), Hq, slopes, sinks, rng);
  Tensor ref_o, ref_l;
  reference_seqs(pk, pk.k, pk.v, params, ref_o, ref_l);
  const Pools pools = to_pools(pk, 16, seed + 2);
  // Sequence `alone` by itself (its slopes row).
  const auto [sq_a, sk_a] = seqs[alone];
  const Packed one = make_packed({seqs[alone]}, Hq, Hkv, D, D, dt, seed);  // shapes; data copied below
  const std::size_t es = dtype_size(dt);
  std::memcpy(one.q.data(), static_cast<const char*>(pk.q.data()) + pk.q0(alone) * Hq * D * es, one.q.nbytes());
  std::memcpy(one.k.data(), static_cast<const char*>(pk.k.data()) + pk.k0(alone) * Hkv * D * es, one.k.nbytes());
  std::memcpy(one.v.data(), static_cast<const char*>(pk.v.data()) + pk.k0(alone) * Hkv * D * es, one.v.nbytes());
  const double tol = dt == DType::f32 ? 5e-6 : 2e-5;
  const std::string what = std::string(dtype_name(dt)) + " Hq" + std::to_string(Hq) + " Hkv" + std::to_string(Hkv) + " D" +
                           std::to_string(D) + " " + opt.str();
  for (detail::Isa isa : test_isas(dt)) {
    IsaCap cap(isa);
    SCOPED_TRACE(std::string(detail::isa_name(isa)) + " " + what);
    Tensor o1(DType::f32, {pk.Tq, Hq, D}), l1(DType::f32, {Hq, pk.Tq});
    Tensor o2(DType::f32, {pk.Tq, Hq, D}), l2(DType::f32, {Hq, pk.Tq});
    for (int threads : {1, 2}) {
      AttentionParams p = params;
      p.num_threads = threads;
      const Tensor& o = threads == 1 ? o1 : o2;
      const Tensor& l = threads == 1 ? l1 : l2;
      attention_varlen(pk.q, pk.k, pk.v, o, pk.cu_q, pk.cu_k, p, l.view());
      EXPECT_LE(rel_err(o, ref_o, "out"), tol);
      EXPECT_LE(rel_err(l, ref_l, "lse"), tol);
      if (threads == 2) {
        EXPECT_TRUE(same_bits(o2, o1)) << "1 vs 2 threads";
        EXPECT_TRUE(same_bits(l2, l1)) << "1 vs 2 threads (lse)";
      }
      if (!opt.top_left) {
        Tensor po(DType::f32, {pk.Tq, Hq, D}), pl(DType::f32, {Hq, pk.Tq});
        attention_paged(pk.q, pools.k, pools.v, po, pk.cu_q, pools.lens, pools.table, p, pl.view());
        EXPECT_TRUE(same_bits(po, o)) << "paged differs from packed";
        EXPECT_TRUE(same_bits(pl, l)) << "paged lse differs from packed";
      }
    }
    AttentionParams p1 = seq_params(params, static_cast<i64>(alone));
    Tensor oa(DType::f32, {sq_a, Hq, D}), la(DType::f32, {Hq, sq_a});
    attention_varlen(one.q, one.k, one.v, oa, one.cu_q, one.cu_k, p1, la.view());
    EXPECT_TRUE(same_bits(oa, rows_of(o1, pk.q0(alone), sq_a, false))) << "alone differs from in the batch";
    EXPECT_TRUE(same_bits(la, rows_of(l1, pk.q0(alone), sq_a, true))) << "alone differs from in the batch (lse)";
  }
}

}  // namespace

// A decode step beside a sequence across the 1024-key split, a prefill, a chunk, no query, one
// key: keep-first within one split, across it, past the window, past every sequence, 0.
TEST(ScoreOptionsServing, RandomizedGrid) {
  const Seqs seqs[] = {{{1, 1100}, {9, 300}, {0, 5}, {1, 1}},
                       {{4, 2500}, {17, 17}, {1, 40}},
                       {{1, 2100}, {3, 3}}};
  const struct { i64 hq, hkv, d; } shapes[] = {{4, 2, 16}, {3, 3, 17}, {8, 1, 64}, {2, 1, 40}};
  const i64 keeps[] = {0, 3, 40, 1100, 5000};
  std::mt19937_64 rng(20261206);
  for (int n = 0; n < 14; ++n) {
    Options o;
    o.alibi = static_cast<int>(rng() % 3);
    o.keep_first = keeps[rng() % 5];
    if (!o.alibi && !o.keep_first) o.alibi = 2;
    o.causal = rng() % 4 != 0;
    o.wl = rng() % 3 == 0 ? -1 : static_cast<i64>(rng() % 64);
    if (o.keep_first && o.wl < 0) o.wl = 20;
    o.sinks = rng() % 2;
    o.softcap = rng() % 4 == 0 ? 5.0 : 0.0;
    o.top_left = rng() % 4 == 0;
    const DType dts[] = {DType::f32, DType::f32, DType::bf16, DType::f16};
    const DType dt = dts[rng() % 4];
    const auto& sh = shapes[rng() % 4];
    const std::size_t which = rng() % 3;
    run_serving_case(seqs[which], sh.hq, sh.hkv, sh.d, dt, o, 100 + n, 0);
    if (HasFailure()) return;
  }
}

// Rows whose window is empty but whose first keys stay admitted (top-left rows past the keys),
// keep-first overlapping the window, and the first keys a split apart from the window.
TEST(ScoreOptionsServing, EdgeRows) {
  Options o;
  o.alibi = 1;
  o.keep_first = 4;
  o.wl = 3;
  o.sinks = true;
  o.top_left = true;  // the first rows' windows start at key 0: keep-first overlaps
  run_serving_case({{5, 300}, {40, 7}}, 2, 1, 16, DType::f32, o, 7, 1);
  o.top_left = false;
  o.keep_first = 1030;  // across the first split, the window near key 3000
  run_serving_case({{2, 3000}, {1, 1030}}, 4, 2, 32, DType::f32, o, 8, 0);
  o.alibi = 0;
  o.keep_first = 2;
  o.wl = 0;
  run_serving_case({{33, 33}}, 4, 4, 8, DType::bf16, o, 9, 0);
}

// int8 keys and values (one scale per token and head), packed and in a PagedKVCache whose
// blocks interleave the sequences', against the reference over the dequantized values.
TEST(ScoreOptionsServing, QuantizedInt8) {
  const Seqs seqs = {{1, 1100}, {13, 513}, {0, 5}};
  const i64 Hq = 4, Hkv = 2, D = 64;
  Packed pk = make_packed(seqs, Hq, Hkv, D, D, DType::f32, 55);
  auto quant = [](const Tensor& x, Tensor& codes, Tensor& scales, Tensor& deq) {
    codes = Tensor(DType::i8, x.shape());
    scales = Tensor(DType::f32, kv_scales_shape(KVFormat::int8, x.shape()));
    const QuantizedKV qv{KVFormat::int8, codes.view(), scales.view()};
    quantize_kv(x, qv, "x");
    deq = Tensor(DType::f32, x.shape());
    dequantize_kv(qv, deq);
  };
  Tensor kc, ks, kd, vc, vs, vd;
  quant(pk.k, kc, ks, kd);
  quant(pk.v, vc, vs, vd);
  const QuantizedKV K{KVFormat::int8, kc.view(), ks.view()}, V{KVFormat::int8, vc.view(), vs.view()};
  PagedKVCache cache(256, 16, Hkv, D, KVFormat::int8, KVFormat::int8);
  std::vector<i64> ids;
  for (std::size_t b = 0; b < seqs.size(); ++b) ids.push_back(cache.add_sequence());
  for (i64 j = 0; j < 1100; j += 16)
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const i64 cnt = std::min<i64>(16, seqs[b].second - j);
      if (cnt <= 0) continue;
      const std::vector<i64> slots = cache.allocate_slots(ids[b], cnt);
      Tensor sm(DType::i64, {cnt});
      for (i64 t = 0; t < cnt; ++t) sm.data_as<i64>()[t] = slots[static_cast<std::size_t>(t)];
      const i64 r0 = pk.k0(b) + j;
      cache.write(TensorView(pk.k.data_as<float>() + r0 * Hkv * D, DType::f32, {cnt, Hkv, D}),
                  TensorView(pk.v.data_as<float>() + r0 * Hkv * D, DType::f32, {cnt, Hkv, D}), sm);
    }
  const Tensor table = cache.block_table(ids), lens = cache.seq_lens(ids);
  for (const int alibi : {1, 2})
    for (const i64 keep : {0, 5, 1050}) {
      Options o;
      o.alibi = alibi;
      o.keep_first = keep;
      o.wl = keep ? 30 : -1;
      o.sinks = keep == 5;
      std::mt19937_64 rng(alibi * 10 + keep);
      Tensor slopes, sinks;
      const AttentionParams params = params_of(o, static_cast<i64>(seqs.size()), Hq, slopes, sinks, rng);
      Tensor ref_o, ref_l;
      reference_seqs(pk, kd, vd, params, ref_o, ref_l);
      for (detail::Isa isa : test_isas(DType::bf16)) {
        IsaCap cap(isa);
        SCOPED_TRACE(std::string(detail::isa_name(isa)) + " int8 " + o.str());
        Tensor o1(DType::f32, {pk.Tq, Hq, D}), l1(DType::f32, {Hq, pk.Tq});
        for (int threads : {1, 2}) {
          AttentionParams p = params;
          p.num_threads = threads;
          Tensor out(DType::f32, {pk.Tq, Hq, D}), l(DType::f32, {Hq, pk.Tq});
          attention_varlen(pk.q, K, V, out, pk.cu_q, pk.cu_k, p, l.view());
          EXPECT_LE(rel_err(out, ref_o, "out"), 5e-6);
          EXPECT_LE(rel_err(l, ref_l, "lse"), 5e-6);
          if (threads == 1) {
            std::memcpy(o1.data(), out.data(), out.nbytes());
            std::memcpy(l1.data(), l.data(), l.nbytes());
          } else {
            EXPECT_TRUE(same_bits(out, o1)) << "1 vs 2 threads";
            EXPECT_TRUE(same_bits(l, l1)) << "1 vs 2 threads (lse)";
          }
          Tensor po(DType::f32, {pk.Tq, Hq, D}), pl(DType::f32, {Hq, pk.Tq});
          attention_paged(pk.q, cache.keys(), cache.values(), po, pk.cu_q, lens, table, p, pl.view());
          EXPECT_TRUE(same_bits(po, out)) << "paged differs from packed";
          EXPECT_TRUE(same_bits(pl, l)) << "paged lse differs from packed";
        }
      }
    }
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Packed and paged calls with ALiBi and keep-first go to the serving kernel.
TEST(ScoreOptionsServing, ExplainNamesServing) {
  const Packed pk = make_packed({{1, 40}, {3, 20}}, 2, 1, 8, 8, DType::f32, 3);
  const Pools pools = to_pools(pk, 16, 4);
  Tensor slopes(DType::f32, {2, 2}), out(DType::f32, {pk.Tq, 2, 8});
  AttentionParams p;
  p.alibi_slopes = slopes.view();
  p.window_left = 4;
  p.window_keep_first = 2;
  const std::string e = explain_dispatch(pk.q, pk.k, pk.v, out, pk.cu_q, pk.cu_k, p);
  EXPECT_TRUE(contains(e, "serving: chosen")) << e;
  const std::string ep = explain_dispatch(pk.q, pools.k, pools.v, out, pk.cu_q, pools.lens, pools.table, p);
  EXPECT_TRUE(contains(ep, "serving: chosen")) << ep;
}
