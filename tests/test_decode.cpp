// The decode kernel (flash-decoding, Sq <= 16) against the float64 reference: randomized grid
// (GQA 1/2/8, long KV caches split in chunks, masks, key lengths, windows, outliers), every ISA
// level this machine supports, 1 and 2 threads bitwise identical.
// Soak: build/test_decode --gtest_also_run_disabled_tests --gtest_filter='*Soak*'
#include <cstdlib>

#include "attention_diff.hpp"

using namespace qkv;
using namespace qkv::test;


TEST(Decode, RandomGrid) { run_random_grid(100, 4242, 4e6, true); }

// Long caches split in several chunks (at least 4096 keys each): 4 chunks with per-batch key
// lengths (chunks past a length are empty), 2 chunks of which the last holds 1904 keys.
TEST(Decode, LongCacheGqa) {
  for (std::int64_t hkv : {8, 2}) {
    Config c;
    c.Hq = 8; c.Hkv = hkv; c.Sq = 1; c.D = c.Dv = 128;
    c.kv_lens = true; c.B = 2; c.Sk = hkv == 8 ? 13000 : 6000; c.seed = 11 + hkv;
    run_case(c, KernelKind::decode);
  }
  Config c;
  c.Hq = 8; c.Hkv = 1; c.Sq = 16; c.Sk = 3000; c.D = c.Dv = 64; c.causal = true; c.dtype = DType::bf16;
  run_case(c, KernelKind::decode);
}

// One query row per KV head (Sq = 1, Hq = Hkv), the MHA decode step, through each of its passes:
// q and the output row in registers (D = Dv, at most 8 vectors), 32-key steps (D = 256, or
// Dv != D), with a tail tile (4100 keys), per-batch key lengths and a window (partially admitted
// tiles), NaN in a key only some rows admit, padded BSHD strides, every storage dtype.
TEST(Decode, OneRowPasses) {
  const std::int64_t dims[][2] = {{16, 16}, {64, 64}, {128, 128}, {256, 256}, {64, 128}};
  std::uint64_t seed = 300;
  for (const auto& dd : dims)
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      Config c;
      c.B = 2; c.Hq = c.Hkv = 2; c.Sq = 1; c.Sk = 4100; c.D = dd[0]; c.Dv = dd[1]; c.dtype = dt;
      c.kv_lens = true; c.partial_nan = true; c.layout = 1; c.seed = ++seed;
      if (dt == DType::f16) c.wl = 700;  // a window: the first admitted tile is partial
      run_case(c, KernelKind::decode);
    }
}

TEST(Decode, DISABLED_Soak) {
  const char* e = std::getenv("QKV_SOAK_N");
  const int n = e ? std::atoi(e) : 2000;
  // Bound 4 x naive (see Flash.DISABLED_Soak), with the count of configurations above 2.
  run_random_grid(n, 13579, 8e6, true, 4.0);
}

// Groups of 4 query rows per KV head score W / 4 keys at a time with one reduction tree for all
// their scores; the rest of a tile (its last kt mod W / 4 keys) and the rows past the last group
// of 4 go one key at a time. Here: 4, 5, 8 and 12 rows per KV head (GQA 4 with Sq = 1, GQA 5,
// GQA 4 with Sq = 2 and 3), tiles ending 1-3 keys past a group, D = 8, 16, 48, 128 (the fast path
// takes D = 16 and up on AVX-512: 1, 3, 8 vectors; D = 8 and up on AVX2: 1, 2, 6, 16 vectors),
// every dtype, padded strides, per-batch key lengths and NaN in a key only some rows admit.
TEST(Decode, GroupedScores) {
  struct G { std::int64_t hq, hkv, sq, sk, d; DType dt; };
  const G cases[] = {
      {8, 2, 1, 4099, 128, DType::f32}, {8, 2, 1, 4097, 48, DType::bf16}, {8, 2, 1, 4098, 16, DType::f16},
      {5, 1, 1, 131, 128, DType::f32},  {8, 2, 2, 67, 48, DType::f32},    {8, 2, 3, 4101, 128, DType::bf16},
      {8, 2, 1, 4099, 8, DType::f32},   {8, 1, 1, 66, 8, DType::f16},
  };
  std::uint64_t seed = 500;
  for (const G& g : cases)
    for (bool extras : {false, true}) {
      Config c;
      c.B = 2; c.Hq = g.hq; c.Hkv = g.hkv; c.Sq = g.sq; c.Sk = g.sk; c.D = c.Dv = g.d; c.dtype = g.dt;
      c.seed = ++seed;
      if (extras) { c.kv_lens = true; c.partial_nan = true; c.layout = 1; }
      run_case(c, KernelKind::decode);
    }
}

// Grouping is only a schedule on the decode fast path (no explicit mask, no softcap, D and Dv
// multiples of the vector width, at most 16 rows per KV head; 8 on the scalar level): GQA decode
// (4 and 8 query rows per KV head, scored W / 4 keys at a time) gives the same bits as MHA decode
// (one row per KV head, scored one key at a time) on the KV heads repeated, on every ISA level,
// for every storage dtype, with tile tails. (Outside the fast path the row blocks differ and so
// can the last bits.)
TEST(Decode, GqaEqualsRepeatedKvHeads) {
  struct G { std::int64_t hkv, sk, d; };
  for (const G g : {G{2, 4099, 128}, G{1, 4101, 48}, G{2, 70, 16}})
    for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
      const std::int64_t B = 2, Hq = 8, group = Hq / g.hkv;
      Tensor q(dt, {B, Hq, 1, g.d}), k(dt, {B, g.hkv, g.sk, g.d}), v(dt, {B, g.hkv, g.sk, g.d});
      Tensor kr(dt, {B, Hq, g.sk, g.d}), vr(dt, {B, Hq, g.sk, g.d});
      std::mt19937_64 rng(g.sk + g.d);
      std::normal_distribution<float> nd(0.0f, 2.0f);
      for (Tensor* t : {&q, &k, &v})
        for (std::int64_t x = 0; x < t->numel(); ++x) put(t->view(), x, round_to(dt, nd(rng)));
      const std::int64_t head = g.sk * g.d * dtype_size(dt);
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t h = 0; h < Hq; ++h) {
          const std::int64_t src = (b * g.hkv + h / group) * head, dst = (b * Hq + h) * head;
          std::memcpy(static_cast<char*>(kr.data()) + dst, static_cast<const char*>(k.data()) + src, head);
          std::memcpy(static_cast<char*>(vr.data()) + dst, static_cast<const char*>(v.data()) + src, head);
        }
      for (detail::Isa isa : test_isas(dt)) {
        IsaCap cap(isa);
        SCOPED_TRACE(std::string("isa ") + detail::isa_name(isa) + " " + std::string(dtype_name(dt)) +
                     " Hkv " + std::to_string(g.hkv) + " Sk " + std::to_string(g.sk) + " D " + std::to_string(g.d));
        Tensor o1(DType::f32, {B, Hq, 1, g.d}), o2(DType::f32, {B, Hq, 1, g.d});
        Tensor l1(DType::f32, {B, Hq, 1}), l2(DType::f32, {B, Hq, 1});
        AttentionParams p;
        p.kernel = KernelKind::decode;
        qkv::attention(q, k, v, o1, p, l1.view());
        qkv::attention(q, kr, vr, o2, p, l2.view());
        EXPECT_EQ(0, std::memcmp(o1.data(), o2.data(), o1.nbytes())) << "outputs differ";
        EXPECT_EQ(0, std::memcmp(l1.data(), l2.data(), l1.nbytes())) << "softmax_lse differs";
      }
    }
}
