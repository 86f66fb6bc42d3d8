// attention_paged and PagedKVCache: random block tables over a pool of 1024 blocks against the
// float64 reference (and bitwise against attention_varlen on the same keys packed), block sizes
// 16, 32 and 48, float32/bfloat16/float16 pools, head pairs (4,4), (8,2), (9,3), D 64/96/128;
// the cache's allocation, freeing and reuse of pages; its step (RoPE, write, attend) against one
// prefill of each sequence; argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>

#include "attention_diff.hpp"  // test_isas, IsaCap
#include "qkv/error.hpp"
#include "qkv/paged_kv_cache.hpp"
#include "qkv/rope.hpp"
#include "serving_case.hpp"
#include "tensor/convert.hpp"

using namespace qkv;
using namespace qkv::test;

namespace {

constexpr i64 kPool = 1024;

// Keys and values of `pk` scattered over a pool of kPool blocks, each sequence on blocks drawn at
// random (vLLM-style: any block anywhere), the rest of the pool NaN (a read outside a sequence's
// blocks shows up).
struct Paged {
  Tensor k_pool, v_pool, table, lens;
};
Paged scatter(const Packed& pk, i64 bs, DType pool_dt, std::uint64_t seed) {
  Paged pg;
  pg.k_pool = Tensor(pool_dt, {kPool, pk.Hkv, bs, pk.D});
  pg.v_pool = Tensor(pool_dt, {kPool, pk.Hkv, bs, pk.Dv});
  const std::uint16_t nan16 = pool_dt == DType::bf16 ? 0x7fc0 : 0x7e00;
  for (const Tensor* t : {&pg.k_pool, &pg.v_pool})
    for (i64 i = 0; i < t->numel(); ++i) {
      if (pool_dt == DType::f32) t->data_as<float>()[i] = std::numeric_limits<float>::quiet_NaN();
      else t->data_as<std::uint16_t>()[i] = nan16;
    }
  std::vector<std::int32_t> blocks(kPool);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::mt19937_64 rng(seed);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  i64 max_blocks = 1;
  for (const auto& [sq, sk] : pk.seqs) max_blocks = std::max(max_blocks, (sk + bs - 1) / bs + 2);  // 2 spare columns
  const i64 nseq = static_cast<i64>(pk.seqs.size());
  pg.table = Tensor(DType::i32, {nseq, max_blocks});
  pg.lens = Tensor(DType::i32, {nseq});
  std::size_t next = 0;
  for (i64 b = 0; b < nseq; ++b) {
    const i64 sk = pk.seqs[static_cast<std::size_t>(b)].second;
    pg.lens.data_as<std::int32_t>()[b] = static_cast<std::int32_t>(sk);
    for (i64 c = 0; c < max_blocks; ++c)
      pg.table.data_as<std::int32_t>()[b * max_blocks + c] = c < (sk + bs - 1) / bs ? blocks.at(next++) : -7;  // never read
    for (i64 j = 0; j < sk; ++j) {
      const i64 blk = pg.table.data_as<std::int32_t>()[b * max_blocks + j / bs];
      for (i64 h = 0; h < pk.Hkv; ++h) {
        const i64 src = ((pk.k0(static_cast<std::size_t>(b)) + j) * pk.Hkv + h);
        const i64 dst = (blk * pk.Hkv + h) * bs + j % bs;
        detail::convert_row(static_cast<const char*>(pk.k.data()) + src * pk.D * dtype_size(pk.dtype), pk.dtype,
                            static_cast<char*>(pg.k_pool.data()) + dst * pk.D * dtype_size(pool_dt), pool_dt, pk.D);
        detail::convert_row(static_cast<const char*>(pk.v.data()) + src * pk.Dv * dtype_size(pk.dtype), pk.dtype,
                            static_cast<char*>(pg.v_pool.data()) + dst * pk.Dv * dtype_size(pool_dt), pool_dt, pk.Dv);
      }
    }
  }
  return pg;
}

}  // namespace

TEST(Paged, RandomBlockTablesAgainstReference) {
  // New tokens per sequence against their keys (the last Sq of Sk are the new ones): a decode
  // step beside a long sequence, a whole prefill, a prefill chunk, a sequence with no new token.
  const Seqs seqs = {{1, 781}, {234, 234}, {13, 513}, {0, 40}, {1, 1}};
  const std::pair<i64, i64> heads[] = {{4, 4}, {8, 2}, {9, 3}};
  const i64 dims[] = {64, 96, 128};
  const i64 sizes[] = {16, 32, 48};
  const DType dts[] = {DType::f32, DType::bf16, DType::f16};
  int n = 0;
  for (const auto& [hq, hkv] : heads)
    for (i64 d : dims) {
      const DType dt = dts[n % 3];
      const i64 bs = sizes[(n / 3 + n) % 3];
      ++n;
      const Packed pk = make_packed(seqs, hq, hkv, d, d, dt, 500 + n);
      const Paged pg = scatter(pk, bs, dt, 900 + n);
      AttentionParams params;
      params.causal = n % 2 == 1;
      if (n % 4 == 0) params.window_left = 100;
      if (n % 3 == 0) params.softcap = 4.0;
      Tensor ref_o, ref_l;
      reference_packed(pk, params, ref_o, ref_l);
      const std::string what = "Hq" + std::to_string(hq) + " Hkv" + std::to_string(hkv) + " D" + std::to_string(d) +
                               " bs" + std::to_string(bs) + " " + std::string(dtype_name(dt));
      for (detail::Isa isa : test_isas(dt)) {
        IsaCap cap(isa);
        // Each ISA level has its own bits: paged must equal packed at the same level.
        Tensor packed_o(DType::f32, {pk.Tq, hq, d}), packed_l(DType::f32, {hq, pk.Tq});
        attention_varlen(pk.q, pk.k, pk.v, packed_o, pk.cu_q, pk.cu_k, params, packed_l.view());
        for (int threads : {1, 2}) {
          Tensor o(DType::f32, {pk.Tq, hq, d}), l(DType::f32, {hq, pk.Tq});
          AttentionParams p = params;
          p.num_threads = threads;
          attention_paged(pk.q, pg.k_pool, pg.v_pool, o, pk.cu_q, pg.lens, pg.table, p, l.view());
          EXPECT_LE(max_err(o, ref_o, what + " out"), 5e-6) << what;
          EXPECT_LE(max_err(l, ref_l, what + " lse"), 5e-6) << what;
          EXPECT_TRUE(same_bits(o, packed_o)) << what << ": paged and packed outputs differ";
          EXPECT_TRUE(same_bits(l, packed_l)) << what << ": paged and packed softmax_lse differ";
        }
      }
      // The paged reference path (keys gathered into float64).
      Tensor o(DType::f64, {pk.Tq, hq, d});
      AttentionParams rp = params;
      rp.kernel = KernelKind::reference;
      attention_paged(pk.q, pg.k_pool, pg.v_pool, o, pk.cu_q, pg.lens, pg.table, rp);
      EXPECT_LE(max_err(o, ref_o, what + " reference out"), 1e-12) << what;
    }
}

// float32 queries over a bfloat16 pool: the keys as stored (rounded), the queries unrounded.
TEST(Paged, QueriesOfAnotherDtypeThanThePool) {
  const Packed pk = make_packed({{5, 70}, {1, 33}}, 4, 2, 64, 64, DType::f32, 77);
  const Paged pg = scatter(pk, 16, DType::bf16, 78);
  Tensor o(DType::f32, {pk.Tq, 4, 64}), ref(DType::f64, {pk.Tq, 4, 64});
  AttentionParams p;
  p.causal = true;
  attention_paged(pk.q, pg.k_pool, pg.v_pool, o, pk.cu_q, pg.lens, pg.table, p);
  p.kernel = KernelKind::reference;
  attention_paged(pk.q, pg.k_pool, pg.v_pool, ref, pk.cu_q, pg.lens, pg.table, p);
  EXPECT_LE(max_err(o, ref, "out"), 5e-6);
}

// A block table may name one block several times, so a sequence can be longer than the pool. A
// window wider than the pool (but not than the sequence) must still admit every key it covers:
// it was once clamped to the pool's size, and the serving kernel then dropped the oldest keys.
TEST(Paged, WindowWiderThanThePoolOfARepeatingTable) {
  const i64 bs = 4, nb = 2, len = 30, Hq = 2, Hkv = 1, D = 8;
  Tensor k_pool(DType::f32, {nb, Hkv, bs, D}), v_pool(DType::f32, {nb, Hkv, bs, D});
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  for (Tensor* t : {&k_pool, &v_pool})
    for (i64 i = 0; i < t->numel(); ++i) t->data_as<float>()[i] = nd(rng);
  const i64 cols = (len + bs - 1) / bs;
  Tensor table(DType::i32, {1, cols}), lens(DType::i32, {1}), cu_q(DType::i32, {2});
  for (i64 c = 0; c < cols; ++c) table.data_as<std::int32_t>()[c] = static_cast<std::int32_t>(c % nb);
  lens.data_as<std::int32_t>()[0] = len;
  cu_q.data_as<std::int32_t>()[0] = 0;
  cu_q.data_as<std::int32_t>()[1] = 1;
  Tensor q(DType::f32, {1, Hq, D});
  for (i64 i = 0; i < q.numel(); ++i) q.data_as<float>()[i] = nd(rng);
  AttentionParams wide;
  wide.window_left = 100;  // wider than the sequence: every key
  Tensor o(DType::f32, {1, Hq, D}), o_plain(DType::f32, {1, Hq, D}), ref(DType::f64, {1, Hq, D});
  attention_paged(q, k_pool, v_pool, o, cu_q, lens, table, wide);
  attention_paged(q, k_pool, v_pool, o_plain, cu_q, lens, table, AttentionParams{});
  AttentionParams rp = wide;
  rp.kernel = KernelKind::reference;
  attention_paged(q, k_pool, v_pool, ref, cu_q, lens, table, rp);
  EXPECT_TRUE(same_bits(o, o_plain)) << "a window wider than the sequence changed the output";
  EXPECT_LE(max_err(o, ref, "out"), 5e-6);
}

// forward() checks the attention call before it rotates q and k: a refused call leaves them, and
// the cache, as they were (they were once rotated, so a retry rotated them twice).
TEST(PagedKVCache, ForwardRefusedBeforeRotating) {
  const i64 Hq = 2, Hkv = 1, D = 8;
  PagedKVCache cache(4, 16, Hkv, D);
  const i64 seq = cache.add_sequence(), n = 2;
  std::mt19937_64 rng(9);
  std::normal_distribution<float> nd;
  const auto random = [&](Shape shape) {
    Tensor t(DType::f32, shape);
    for (i64 i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = nd(rng);
    return t;
  };
  Tensor q = random({n, Hq, D}), k = random({n, Hkv, D}), v = random({n, Hkv, D});
  Tensor q0(DType::f32, q.shape()), k0(DType::f32, k.shape());
  std::memcpy(q0.data(), q.data(), q.nbytes());
  std::memcpy(k0.data(), k.data(), k.nbytes());
  Tensor bad_out(DType::f32, {n, Hq, 4});  // Dv 4, the pool's is 8
  RopeConfig rope;
  EXPECT_THROW(cache.forward(std::span<const i64>(&seq, 1), std::span<const i64>(&n, 1), q, k, v, bad_out, {}, rope),
               Error);
  EXPECT_TRUE(same_bits(q, q0)) << "q was rotated by a refused call";
  EXPECT_TRUE(same_bits(k, k0)) << "k was rotated by a refused call";
  EXPECT_EQ(cache.length(seq), 0);
  EXPECT_EQ(cache.num_free_blocks(), 4);
}

TEST(PagedKVCache, PagesAreFreedAndReused) {
  PagedKVCache c(8, 16, 2, 8);
  EXPECT_EQ(c.num_free_blocks(), 8);
  const i64 a = c.add_sequence(), b = c.add_sequence();
  EXPECT_EQ(c.allocate_slots(a, 17).size(), 17u);  // two blocks
  EXPECT_EQ(c.blocks(a).size(), 2u);
  EXPECT_EQ(c.allocate_slots(a, 15).size(), 15u);  // fills the second block exactly
  EXPECT_EQ(c.blocks(a).size(), 2u);
  const std::vector<i64> sb = c.allocate_slots(b, 1);
  EXPECT_EQ(sb[0], i64{c.blocks(b)[0]} * 16);
  EXPECT_EQ(c.num_free_blocks(), 5);
  const std::vector<std::int32_t> freed(c.blocks(a).begin(), c.blocks(a).end());
  c.free_sequence(a);
  EXPECT_EQ(c.num_free_blocks(), 7);
  const i64 a2 = c.add_sequence();
  EXPECT_EQ(a2, a);  // the id is reused
  EXPECT_EQ(c.length(a2), 0);
  c.allocate_slots(a2, 32);
  EXPECT_EQ(std::vector<std::int32_t>(c.blocks(a2).begin(), c.blocks(a2).end()), freed);  // and the pages
  EXPECT_THROW(c.allocate_slots(b, 16 * 6), Error);  // 6 more blocks, 5 free
  EXPECT_EQ(c.length(b), 1);                          // nothing changed
  EXPECT_EQ(c.num_free_blocks(), 5);
  EXPECT_THROW(c.length(99), Error);
  c.free_sequence(b);
  EXPECT_THROW(c.free_sequence(b), Error);
}

// Several sequences served step by step with continuous batching (prefill chunks and decode steps
// mixed, one sequence freed and its pages taken by a new one): every token's output equals, bit for
// bit, that of one prefill of its whole sequence alone through attention_varlen (RoPE at the same
// positions), which the reference checks.
TEST(PagedKVCache, ContinuousBatchingMatchesOnePrefill) {
  const i64 Hq = 8, Hkv = 2, D = 64, bs = 16;
  const std::vector<i64> lens = {70, 1100, 33, 150};
  RopeConfig rope;
  std::mt19937_64 rng(31);
  std::vector<Tensor> q, k, v;  // per sequence [S, H, D], unrotated
  for (i64 S : lens) {
    q.emplace_back(DType::f32, std::initializer_list<i64>{S, Hq, D});
    k.emplace_back(DType::f32, std::initializer_list<i64>{S, Hkv, D});
    v.emplace_back(DType::f32, std::initializer_list<i64>{S, Hkv, D});
    fill_normal(q.back(), rng); fill_normal(k.back(), rng); fill_normal(v.back(), rng);
  }
  AttentionParams params;
  params.causal = true;
  for (detail::Isa isa : test_isas(DType::f32)) {
    IsaCap cap(isa);
    // Expected: each sequence alone, one prefill.
    std::vector<Tensor> want;
    for (std::size_t s = 0; s < lens.size(); ++s) {
      const i64 S = lens[s];
      Tensor qr(DType::f32, {S, Hq, D}), kr(DType::f32, {S, Hkv, D});
      std::memcpy(qr.data(), q[s].data(), q[s].nbytes());
      std::memcpy(kr.data(), k[s].data(), k[s].nbytes());
      apply_rope(seq_view(qr, 0, S), 0, rope);
      apply_rope(seq_view(kr, 0, S), 0, rope);
      want.emplace_back(DType::f32, std::initializer_list<i64>{S, Hq, D});
      const Tensor cu = cu_seqlens({S});
      attention_varlen(qr, kr, v[s], want.back(), cu, cu, params);
      if (s == 0) {  // and the prefill itself against the reference
        Tensor ref(DType::f64, {S, Hq, D});
        AttentionParams rp = params;
        rp.kernel = KernelKind::reference;
        reference::attention(seq_view(qr, 0, S), seq_view(kr, 0, S), seq_view(v[s], 0, S), seq_view(ref, 0, S), rp);
        EXPECT_LE(max_err(want.back(), ref, "prefill"), 5e-6);
      }
    }
    PagedKVCache cache(kPool, bs, Hkv, D);
    // A filler sequence takes and frees pages first, so the sequences get scattered blocks.
    const i64 filler = cache.add_sequence();
    cache.allocate_slots(filler, 37 * bs);
    std::vector<i64> id(lens.size(), -1), done(lens.size(), 0);
    std::vector<Tensor> got;
    for (i64 S : lens) got.emplace_back(DType::f32, std::initializer_list<i64>{S, Hq, D});
    id[0] = cache.add_sequence();
    id[1] = cache.add_sequence();
    cache.free_sequence(filler);
    const i64 chunk_sizes[] = {1, 7, 64, 1, 300, 2, 1};
    for (int step = 0; ; ++step) {
      if (step == 3) id[2] = cache.add_sequence();
      if (done[2] == lens[2] && id[2] >= 0 && id[3] < 0) {  // sequence 2 ends: 3 takes its pages
        cache.free_sequence(id[2]);
        id[3] = cache.add_sequence();
      }
      std::vector<i64> seqs, counts, which;
      for (std::size_t s = 0; s < lens.size(); ++s) {
        if (id[s] < 0 || done[s] == lens[s]) continue;
        const i64 n = std::min(lens[s] - done[s], chunk_sizes[(step + s) % 7]);
        seqs.push_back(id[s]); counts.push_back(n); which.push_back(static_cast<i64>(s));
      }
      if (seqs.empty()) break;
      i64 T = 0;
      for (i64 n : counts) T += n;
      Tensor qs(DType::f32, {T, Hq, D}), ks(DType::f32, {T, Hkv, D}), vs(DType::f32, {T, Hkv, D}), os(DType::f32, {T, Hq, D});
      i64 t = 0;
      for (std::size_t x = 0; x < seqs.size(); ++x) {
        const std::size_t s = static_cast<std::size_t>(which[x]);
        std::memcpy(qs.data_as<float>() + t * Hq * D, q[s].data_as<float>() + done[s] * Hq * D, counts[x] * Hq * D * 4);
        std::memcpy(ks.data_as<float>() + t * Hkv * D, k[s].data_as<float>() + done[s] * Hkv * D, counts[x] * Hkv * D * 4);
        std::memcpy(vs.data_as<float>() + t * Hkv * D, v[s].data_as<float>() + done[s] * Hkv * D, counts[x] * Hkv * D * 4);
        t += counts[x];
      }
      AttentionParams p = params;
      p.num_threads = 1 + step % 2;
      cache.forward(seqs, counts, qs, ks, vs, os, p, rope);
      t = 0;
      for (std::size_t x = 0; x < seqs.size(); ++x) {
        const std::size_t s = static_cast<std::size_t>(which[x]);
        std::memcpy(got[s].data_as<float>() + done[s] * Hq * D, os.data_as<float>() + t * Hq * D, counts[x] * Hq * D * 4);
        done[s] += counts[x];
        t += counts[x];
      }
    }
    for (std::size_t s = 0; s < lens.size(); ++s)
      EXPECT_TRUE(same_bits(got[s], want[s])) << "sequence " << s << " isa " << detail::isa_name(isa);
  }
}

// attend(): the newest tokens of each sequence attend again over the stored keys with the bits
// forward() gave them (quantized pools, two sequences); its argument errors.
TEST(PagedKVCache, AttendRepeatsTheStepsAttention) {
  const i64 Hq = 4, Hkv = 2, D = 40;
  PagedKVCache c(8, 16, Hkv, D, KVFormat::int8, KVFormat::q8_0);
  const i64 a = c.add_sequence(), b = c.add_sequence();
  std::mt19937_64 rng(5);
  AttentionParams p;
  p.causal = true;
  for (const std::vector<i64>& counts : {std::vector<i64>{20, 3}, std::vector<i64>{1, 2}}) {
    const i64 T = counts[0] + counts[1];
    Tensor q(DType::f32, {T, Hq, D}), k(DType::f32, {T, Hkv, D}), v(DType::f32, {T, Hkv, D});
    fill_normal(q, rng); fill_normal(k, rng); fill_normal(v, rng);
    Tensor o(DType::f32, {T, Hq, D}), l(DType::f32, {Hq, T}), o2(DType::f32, {T, Hq, D}), l2(DType::f32, {Hq, T});
    const std::vector<i64> seqs = {a, b};
    c.forward(seqs, counts, q, k, v, o, p, std::nullopt, l.view());
    c.attend(seqs, counts, q, o2, p, l2.view());
    EXPECT_TRUE(same_bits(o2, o));
    EXPECT_TRUE(same_bits(l2, l));
  }
  Tensor q(DType::f32, {3, Hq, D}), o(DType::f32, {3, Hq, D});
  const std::vector<i64> one = {b}, six = {6}, two = {2};
  try {
    c.attend(one, six, q, o);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "counts: expected a count in [0, length(seq)] = [0, 5], got 6 at 0");
  }
  try {
    c.attend(one, two, q, o);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "q: expected T = sum(counts) = 2 tokens, got 3");
  }
}

TEST(PagedKVCache, Errors) {
  EXPECT_THROW(PagedKVCache(8, 8, 1, 4), Error);  // block_size < 16
  EXPECT_THROW(PagedKVCache(8, 16, 1, 4, DType::f64), Error);
  PagedKVCache c(2, 16, 1, 4);
  const i64 a = c.add_sequence();
  Tensor q(DType::f32, {3, 2, 4}), k(DType::f32, {3, 1, 4}), v(DType::f32, {3, 1, 4}), o(DType::f32, {3, 2, 4});
  const std::vector<i64> seqs = {a}, bad_counts = {2}, big = {3};
  try {
    c.forward(seqs, bad_counts, q, k, v, o);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("q: expected T = sum(counts) = 2", 0), 0u) << e.what();
  }
  AttentionParams tl;
  tl.align = Alignment::top_left;
  EXPECT_THROW(c.forward(seqs, big, q, k, v, o, tl), Error);
  EXPECT_EQ(c.length(a), 0);  // rolled back
  EXPECT_EQ(c.num_free_blocks(), 2);
  Tensor slots(DType::i32, {3});
  slots.data_as<std::int32_t>()[0] = 0; slots.data_as<std::int32_t>()[1] = 32; slots.data_as<std::int32_t>()[2] = -1;
  try {
    c.write(k, v, slots);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("slot_mapping: expected slots in [-1, num_blocks * block_size) = [-1, 32), got 32 at 1", 0), 0u) << e.what();
  }
  // attention_paged: a block table entry outside the pool.
  Tensor table(DType::i32, {1, 1}), lens(DType::i32, {1});
  table.data_as<std::int32_t>()[0] = 5;
  lens.data_as<std::int32_t>()[0] = 3;
  const Tensor cu = cu_seqlens({3});
  try {
    attention_paged(q, c.key_pool(), c.value_pool(), o, cu, lens, table);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("block_table: expected entries in [0, num_blocks) = [0, 2)", 0), 0u) << e.what();
  }
  lens.data_as<std::int32_t>()[0] = 2;
  try {
    attention_paged(q, c.key_pool(), c.value_pool(), o, cu, lens, table);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("seq_lens: expected each length in [Sq, max_blocks * block_size] = [3, 16], got 2", 0), 0u) << e.what();
  }
}
