// Batch invariance, bitwise (memcmp): a sequence's output and softmax_lse from attention_varlen and
// attention_paged are the same bits alone or in any batch (companions, their order, empty
// sequences as padding), on 1 or 2 threads, packed or paged under any block table, as one
// prefill or in chunks of any size (decode steps included), on every ISA level this machine
// supports; and the same bits on every ISA level (the serving kernel is portable C++).
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "attention_diff.hpp"  // test_isas, IsaCap
#include "serving_case.hpp"

using namespace qkv;
using namespace qkv::test;

namespace {

// One sequence X: Sx queries, Kx keys (its last Sx keys are its queries' own), [T, H, D] tensors.
struct Seq {
  i64 Sq, Sk;
  Tensor q, k, v;
};
Seq make_seq(i64 Sq, i64 Sk, i64 Hq, i64 Hkv, i64 D, DType dt, std::uint64_t seed) {
  Seq s{Sq, Sk, Tensor(dt, {Sq, Hq, D}), Tensor(dt, {Sk, Hkv, D}), Tensor(dt, {Sk, Hkv, D})};
  std::mt19937_64 rng(seed);
  fill_normal(s.q, rng);
  fill_normal(s.k, rng);
  fill_normal(s.v, rng);
  return s;
}

struct Result {
  Tensor out, lse;  // [Sq, Hq, D] f32, [Hq, Sq] f32
};

std::size_t rowbytes(const Tensor& t) { return static_cast<std::size_t>(t.numel() / t.shape()[0]) * dtype_size(t.dtype()); }

// Runs a batch of sequences through attention_varlen (packed) and returns sequence `which`'s rows.
Result run_packed(const std::vector<const Seq*>& batch, std::size_t which, const AttentionParams& p) {
  const i64 Hq = batch[which]->q.shape()[1], Hkv = batch[which]->k.shape()[1], D = batch[which]->q.shape()[2];
  const DType dt = batch[which]->q.dtype();
  std::vector<i64> lq, lk;
  i64 Tq = 0, Tk = 0;
  for (const Seq* s : batch) { lq.push_back(s->Sq); lk.push_back(s->Sk); Tq += s->Sq; Tk += s->Sk; }
  Tensor q(dt, {Tq, Hq, D}), k(dt, {Tk, Hkv, D}), v(dt, {Tk, Hkv, D});
  i64 tq = 0, tk = 0, q_at = 0;
  for (std::size_t b = 0; b < batch.size(); ++b) {
    const Seq* s = batch[b];
    if (b == which) q_at = tq;
    std::memcpy(static_cast<char*>(q.data()) + tq * rowbytes(q), s->q.data(), s->q.nbytes());
    std::memcpy(static_cast<char*>(k.data()) + tk * rowbytes(k), s->k.data(), s->k.nbytes());
    std::memcpy(static_cast<char*>(v.data()) + tk * rowbytes(v), s->v.data(), s->v.nbytes());
    tq += s->Sq;
    tk += s->Sk;
  }
  Tensor o(DType::f32, {Tq, Hq, D}), l(DType::f32, {Hq, Tq});
  attention_varlen(q, k, v, o, cu_seqlens(lq), cu_seqlens(lk), p, l.view());
  const Seq& x = *batch[which];
  Result r{Tensor(DType::f32, {x.Sq, Hq, D}), Tensor(DType::f32, {Hq, x.Sq})};
  std::memcpy(r.out.data(), o.data_as<float>() + q_at * Hq * D, r.out.nbytes());
  for (i64 h = 0; h < Hq; ++h)
    std::memcpy(r.lse.data_as<float>() + h * x.Sq, l.data_as<float>() + h * Tq + q_at, static_cast<std::size_t>(x.Sq) * 4);
  return r;
}

// Sequence x alone through attention_paged, its keys on the blocks `perm` (a permutation of a
// pool of 1024 blocks of bs keys), queries in chunks: chunk sizes cycle through `chunks`; a chunk of
// n queries starting at query a sees keys [0, Sk - Sq + a + n).
Result run_paged(const Seq& x, i64 bs, const std::vector<std::int32_t>& perm, const std::vector<i64>& chunks,
                 const AttentionParams& p) {
  const i64 Hq = x.q.shape()[1], Hkv = x.k.shape()[1], D = x.q.shape()[2];
  const DType dt = x.k.dtype();
  const i64 nb = 1024, used = (x.Sk + bs - 1) / bs;
  Tensor kp(dt, {nb, Hkv, bs, D}), vp(dt, {nb, Hkv, bs, D});
  Tensor table(DType::i32, {1, used + 3});
  std::fill_n(table.data_as<std::int32_t>(), table.numel(), 0);
  for (i64 c = 0; c < used; ++c) table.data_as<std::int32_t>()[c] = perm[static_cast<std::size_t>(c)];
  const std::size_t es = dtype_size(dt);
  for (i64 j = 0; j < x.Sk; ++j)
    for (i64 h = 0; h < Hkv; ++h) {
      const i64 dst = ((i64{perm[static_cast<std::size_t>(j / bs)]} * Hkv + h) * bs + j % bs) * D;
      std::memcpy(static_cast<char*>(kp.data()) + dst * es, static_cast<const char*>(x.k.data()) + (j * Hkv + h) * D * es, D * es);
      std::memcpy(static_cast<char*>(vp.data()) + dst * es, static_cast<const char*>(x.v.data()) + (j * Hkv + h) * D * es, D * es);
    }
  Result r{Tensor(DType::f32, {x.Sq, Hq, D}), Tensor(DType::f32, {Hq, x.Sq})};
  const i64 past = x.Sk - x.Sq;
  std::size_t ci = 0;
  for (i64 a = 0; a < x.Sq;) {
    const i64 n = std::min(chunks[ci++ % chunks.size()], x.Sq - a);
    Tensor o(DType::f32, {n, Hq, D}), l(DType::f32, {Hq, n}), lens(DType::i32, {1});
    lens.data_as<std::int32_t>()[0] = static_cast<std::int32_t>(past + a + n);
    const TensorView qv(static_cast<char*>(x.q.data()) + a * rowbytes(x.q), x.q.dtype(), {n, Hq, D});
    attention_paged(qv, kp, vp, o, cu_seqlens({n}), lens, table, p, l.view());
    std::memcpy(r.out.data_as<float>() + a * Hq * D, o.data(), o.nbytes());
    for (i64 h = 0; h < Hq; ++h)
      std::memcpy(r.lse.data_as<float>() + h * x.Sq + a, l.data_as<float>() + h * n, static_cast<std::size_t>(n) * 4);
    a += n;
  }
  return r;
}

void expect_same(const Result& a, const Result& b, const std::string& what) {
  EXPECT_TRUE(same_bits(a.out, b.out)) << what << ": out differs";
  EXPECT_TRUE(same_bits(a.lse, b.lse)) << what << ": softmax_lse differs";
}

std::vector<std::int32_t> random_perm(std::uint64_t seed) {
  std::vector<std::int32_t> v(1024);
  std::iota(v.begin(), v.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(v.begin(), v.end(), rng);
  return v;
}

void check_invariance(DType dt, const AttentionParams& params, const std::string& name) {
  // X crosses a split boundary (1024 keys): 1300 keys, its last 300 are its queries' own.
  const i64 Hq = 6, Hkv = 2, D = 64;
  const Seq x = make_seq(300, 1300, Hq, Hkv, D, dt, 1);
  const Seq a = make_seq(1, 2100, Hq, Hkv, D, dt, 2), b = make_seq(57, 57, Hq, Hkv, D, dt, 3);
  const Seq e0 = make_seq(0, 0, Hq, Hkv, D, dt, 4), e1 = make_seq(0, 33, Hq, Hkv, D, dt, 5);
  for (detail::Isa isa : test_isas(dt)) {
    IsaCap cap(isa);
    AttentionParams p1 = params, p2 = params;
    p1.num_threads = 1;
    p2.num_threads = 2;
    const std::string tag = name + " " + std::string(dtype_name(dt)) + " isa " + detail::isa_name(isa);
    Result alone = run_packed({&x}, 0, p1);
    expect_same(run_packed({&x}, 0, p2), alone, tag + " 2 threads");
    expect_same(run_packed({&a, &x, &b}, 1, p2), alone, tag + " with companions");
    expect_same(run_packed({&b, &e0, &a, &x}, 3, p1), alone, tag + " companions reordered, padding");
    expect_same(run_packed({&e1, &x, &e0}, 1, p2), alone, tag + " between empty sequences");
    // Paged: two block tables, 16- and 48-key blocks, as one prefill and in chunks; decode steps.
    AttentionParams pp = params;
    pp.num_threads = 2;
    expect_same(run_paged(x, 16, random_perm(10), {300}, pp), alone, tag + " paged bs16, one prefill");
    expect_same(run_paged(x, 48, random_perm(11), {300}, p1), alone, tag + " paged bs48 other table");
    if (params.causal) {  // without a causal mask, a chunk's queries would see the keys of later chunks
      expect_same(run_paged(x, 16, random_perm(12), {1, 7, 16, 17, 100}, pp), alone, tag + " paged chunks 1,7,16,17,100");
      expect_same(run_paged(x, 32, random_perm(13), {250, 1}, p1), alone, tag + " paged prefill 250 then decode steps");
    }
  }
}

}  // namespace

TEST(BatchInvariance, CausalFloat32) {
  AttentionParams p;
  p.causal = true;
  check_invariance(DType::f32, p, "causal");
}

TEST(BatchInvariance, WindowSoftcapBfloat16) {
  AttentionParams p;
  p.causal = true;
  p.window_left = 700;
  p.softcap = 5.0;
  check_invariance(DType::bf16, p, "window softcap");
}

TEST(BatchInvariance, CausalSinksFloat32) {
  Tensor z(DType::f32, {6});
  for (i64 h = 0; h < 6; ++h) z.data_as<float>()[h] = 0.5f * static_cast<float>(h) - 1.0f;
  AttentionParams p;
  p.causal = true;
  p.sinks = z.view();
  check_invariance(DType::f32, p, "causal sinks");
}

TEST(BatchInvariance, NoMaskFloat16) {
  check_invariance(DType::f16, {}, "no mask");
}
