// Attention directly on quantized keys and values: attention_varlen and attention_paged over
// QuantizedKV against the float64 reference on the dequantized values (the exact meaning of a
// quantized call), on every ISA and 1 and 2 threads; paged bitwise equal to packed; bitwise equal
// to the serving kernel over float32 copies of the dequantized values where no format has one
// scale per row (int8 and fp8 multiply a key's score and a value's weight by the row's scale
// instead); chunked prefill and decode steps of a quantized
// PagedKVCache equal to one prefill; KVCache in quantized formats; errors.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>

#include "attention_diff.hpp"  // test_isas, IsaCap
#include "qkv/error.hpp"
#include "qkv/kv_cache.hpp"
#include "qkv/kv_quant.hpp"
#include "qkv/paged_kv_cache.hpp"
#include "serving_case.hpp"
#include "tensor/kv_codec.hpp"  // e4m3_to_float

using namespace qkv;
using namespace qkv::test;

namespace {

// A packed [T, H, X] float32 tensor quantized to `f`, and its dequantized float32 copy.
struct Quant {
  Tensor codes, scales, deq;
  QuantizedKV view(KVFormat f) const { return {f, codes.view(), scales.view()}; }
};
Quant quantize(const Tensor& x, KVFormat f, std::uint64_t seed) {
  Quant q;
  q.codes = Tensor(kv_format_dtype(f), x.shape());
  const Shape ss = kv_scales_shape(f, x.shape());
  q.scales = Tensor(kv_scales_dtype(f), ss.empty() ? Shape{1} : ss);
  if (f == KVFormat::fp8) {  // per-head scales other than 1
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(0.01f, 0.5f);
    for (i64 h = 0; h < q.scales.numel(); ++h) q.scales.data_as<float>()[h] = u(rng);
  }
  const QuantizedKV v{f, q.codes.view(), ss.empty() ? TensorView() : q.scales.view()};
  quantize_kv(x, v, "x");
  q.deq = Tensor(DType::f32, x.shape());
  dequantize_kv(v, q.deq);
  if (ss.empty()) q.scales = Tensor();
  return q;
}

// int8 (per token and head) and fp8 (per head): the kernel applies the scale once per row.
bool row_scaled(KVFormat f) { return f == KVFormat::int8 || f == KVFormat::fp8; }

std::string name(KVFormat k, KVFormat v) { return "K " + std::string(kv_format_name(k)) + " V " + std::string(kv_format_name(v)); }

const std::pair<KVFormat, KVFormat> kCombos[] = {
    {KVFormat::int8, KVFormat::int8}, {KVFormat::q8_0, KVFormat::q8_0}, {KVFormat::fp8, KVFormat::fp8},
    {KVFormat::int8, KVFormat::bf16}, {KVFormat::f32, KVFormat::q8_0}, {KVFormat::fp8, KVFormat::int8}};

}  // namespace

TEST(KVQuantAttention, PackedAndPagedAgainstReferenceOnDequantized) {
  // A decode step beside a sequence across the 1024-key split, a prefill, a chunk, no query.
  const Seqs seqs = {{1, 1100}, {37, 37}, {13, 513}, {0, 5}, {1, 1}};
  const struct { i64 hq, hkv, d; } shapes[] = {{8, 2, 128}, {4, 4, 40}, {6, 3, 64}};
  int n = 0;
  for (const auto& sh : shapes)
    for (const auto& [kf, vf] : kCombos) {
      ++n;
      Packed pk = make_packed(seqs, sh.hq, sh.hkv, sh.d, sh.d, DType::f32, 300 + n);
      Quant kq = quantize(pk.k, kf, 7 + n), vq = quantize(pk.v, vf, 8 + n);
      const QuantizedKV K = kq.scales.numel() ? kq.view(kf) : QuantizedKV{kf, kq.codes.view(), {}};
      const QuantizedKV V = vq.scales.numel() ? vq.view(vf) : QuantizedKV{vf, vq.codes.view(), {}};
      Packed dq = make_packed(seqs, sh.hq, sh.hkv, sh.d, sh.d, DType::f32, 300 + n);  // the same q
      dq.k = std::move(kq.deq);
      dq.v = std::move(vq.deq);
      // Every third case: bf16 queries over the quantized cache (and their values as float32 q
      // for the reference and the float32 copies).
      const bool bf16_q = n % 3 == 0;
      Tensor qb(DType::bf16, pk.q.shape());
      if (bf16_q)
        for (i64 i = 0; i < pk.q.numel(); ++i) {
          qb.data_as<std::uint16_t>()[i] = float_to_bf16(pk.q.data_as<float>()[i]);
          pk.q.data_as<float>()[i] = dq.q.data_as<float>()[i] = bf16_to_float(qb.data_as<std::uint16_t>()[i]);
        }
      const Tensor& q = bf16_q ? qb : pk.q;
      AttentionParams params;
      params.causal = n % 3 != 0;
      if (n % 4 == 1) params.window_left = 200;
      if (n % 5 == 2) params.softcap = 5.0;
      Tensor ref_o, ref_l;
      reference_packed(dq, params, ref_o, ref_l);
      // The same keys in a paged cache of 16-key blocks (sequences interleaved block by block).
      PagedKVCache cache(256, 16, sh.hkv, sh.d, kf, vf);
      if (kf == KVFormat::fp8 || vf == KVFormat::fp8) {
        std::vector<float> ks(static_cast<std::size_t>(sh.hkv)), vs(ks.size());
        for (i64 h = 0; h < sh.hkv; ++h) {
          ks[static_cast<std::size_t>(h)] = kf == KVFormat::fp8 ? kq.scales.data_as<float>()[h] : 1.0f;
          vs[static_cast<std::size_t>(h)] = vf == KVFormat::fp8 ? vq.scales.data_as<float>()[h] : 1.0f;
        }
        cache.set_fp8_scales(ks, vs);
      }
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
          const TensorView k3(pk.k.data_as<float>() + r0 * sh.hkv * sh.d, DType::f32, {cnt, sh.hkv, sh.d});
          const TensorView v3(pk.v.data_as<float>() + r0 * sh.hkv * sh.d, DType::f32, {cnt, sh.hkv, sh.d});
          cache.write(k3, v3, sm);
        }
      const Tensor table = cache.block_table(ids), lens = cache.seq_lens(ids);
      const std::string what = name(kf, vf) + " Hq" + std::to_string(sh.hq) + " Hkv" + std::to_string(sh.hkv) + " D" +
                               std::to_string(sh.d) + (bf16_q ? " bf16 q" : "");
      for (detail::Isa isa : test_isas(DType::bf16)) {  // every level: each compiles its own item
        IsaCap cap(isa);
        // The float32 dequantized keys at the same ISA level (each level has its own bits).
        Tensor float_o(DType::f32, {pk.Tq, sh.hq, sh.d}), float_l(DType::f32, {sh.hq, pk.Tq});
        attention_varlen(pk.q, dq.k, dq.v, float_o, dq.cu_q, dq.cu_k, params, float_l.view());  // float32 q
        for (int threads : {1, 2}) {
          AttentionParams p = params;
          p.num_threads = threads;
          Tensor o(DType::f32, {pk.Tq, sh.hq, sh.d}), l(DType::f32, {sh.hq, pk.Tq});
          attention_varlen(q, K, V, o, pk.cu_q, pk.cu_k, p, l.view());
          EXPECT_LE(max_err(o, ref_o, what + " out"), 5e-6) << what;
          EXPECT_LE(max_err(l, ref_l, what + " lse"), 5e-6) << what;
          // A row scale applied once per key rounds apart from the float32 copies: the
          // reference bound above covers it.
          if (!row_scaled(kf) && !row_scaled(vf)) {
            EXPECT_TRUE(same_bits(o, float_o)) << what << ": not the bits of the float32 dequantized keys";
            EXPECT_TRUE(same_bits(l, float_l)) << what;
          }
          Tensor po(DType::f32, {pk.Tq, sh.hq, sh.d}), pl(DType::f32, {sh.hq, pk.Tq});
          attention_paged(q, cache.keys(), cache.values(), po, pk.cu_q, lens, table, p, pl.view());
          EXPECT_TRUE(same_bits(po, o)) << what << ": paged differs from packed";
          EXPECT_TRUE(same_bits(pl, l)) << what << ": paged lse differs from packed";
        }
      }
      // The reference kernel over the quantized operands: the float64 specification on the dequantized values.
      AttentionParams rp = params;
      rp.kernel = KernelKind::reference;
      Tensor o(DType::f64, {pk.Tq, sh.hq, sh.d});
      attention_varlen(pk.q, K, V, o, pk.cu_q, pk.cu_k, rp);
      EXPECT_LE(max_err(o, ref_o, what + " reference"), 1e-12) << what;
      attention_paged(pk.q, cache.keys(), cache.values(), o, pk.cu_q, lens, table, rp);
      EXPECT_LE(max_err(o, ref_o, what + " paged reference"), 1e-12) << what;
    }
}

// A sequence of 1300 tokens through a quantized PagedKVCache as one prefill, or as chunks and
// decode steps (across the 1024-key split boundary), 1 or 2 threads: the same bits.
TEST(KVQuantAttention, ChunkedPrefillAndDecodeEqualOnePrefill) {
  const i64 Hq = 8, Hkv = 2, D = 64, S = 1300;
  std::mt19937_64 rng(11);
  Tensor q(DType::f32, {S, Hq, D}), k(DType::f32, {S, Hkv, D}), v(DType::f32, {S, Hkv, D});
  fill_normal(q, rng);
  fill_normal(k, rng);
  fill_normal(v, rng);
  AttentionParams p;
  p.causal = true;
  for (const auto& [kf, vf] : {std::pair{KVFormat::int8, KVFormat::q8_0}, std::pair{KVFormat::fp8, KVFormat::fp8},
                               std::pair{KVFormat::q8_0, KVFormat::int8}}) {
    PagedKVCache one(200, 16, Hkv, D, kf, vf);
    Tensor ref(DType::f32, {S, Hq, D});
    const i64 a = one.add_sequence();
    const i64 all[] = {S};
    one.forward(std::span<const i64>(&a, 1), all, q, k, v, ref, p);
    for (int threads : {1, 2}) {
      PagedKVCache c(200, 16, Hkv, D, kf, vf);
      const i64 other = c.add_sequence(), s = c.add_sequence();  // a companion holding pages first
      Tensor junk(DType::f32, {5, Hq, D});
      const i64 five[] = {5};
      const auto first5 = [&](const Tensor& x) { return TensorView(x.data(), DType::f32, {5, x.shape()[1], x.shape()[2]}); };
      c.forward(std::span<const i64>(&other, 1), five, first5(q), first5(k), first5(v), junk, p);
      Tensor out(DType::f32, {S, Hq, D});
      AttentionParams pt = p;
      pt.num_threads = threads;
      i64 t = 0;
      for (i64 chunk : {500, 1, 300, 1, 1, 450, 47}) {
        const auto rows = [&](const Tensor& x, i64 n) {
          return TensorView(static_cast<char*>(x.data()) + t * x.shape()[1] * x.shape()[2] * 4, DType::f32,
                            {n, x.shape()[1], x.shape()[2]});
        };
        const i64 cnt[] = {chunk};
        c.forward(std::span<const i64>(&s, 1), cnt, rows(q, chunk), rows(k, chunk), rows(v, chunk), rows(out, chunk), pt);
        t += chunk;
      }
      ASSERT_EQ(t, S);
      EXPECT_TRUE(same_bits(out, ref)) << name(kf, vf) << " threads " << threads;
    }
  }
}

// Every code of int8 and fp8 (all 256 bytes, written directly) through the kernel, on every ISA
// level, for a head dim of whole vectors (256) and one that is not (40: codes staged). T keys of D
// elements hold the codes in turn (key t, element d: code t D + d mod 256), scale 1, 2^-8 or 2^6
// (int8: times 1, 2 or 4 from key to key), softmax scale 1/8 (every product exact):
// - value side: with one key each output row is that key's values, code times scale, the bits of
//   dequantize_kv (a -0 value comes out +0: the output is the sum 0 + 1 x (-0));
// - key side: a query one-hot at element d scores, and with one key has the lse,
//   scale x code_d / 8, exact; a key code decoded wrong, or its scale applied twice or not at all,
//   moves it.
// As T x D decode sequences of one query each over their own copy of their key (rows read in
// place where D is whole vectors), and as T prefills of D queries over one key each (staged).
TEST(KVQuantAttention, EveryCodeDecodesExactly) {
  for (const i64 D : {i64{256}, i64{40}}) {
    const i64 T = (256 + D - 1) / D, N = T * D;  // keys, and queries (one per key element)
    for (const KVFormat f : {KVFormat::int8, KVFormat::fp8})
      for (const float scale : {1.0f, 0x1p-8f, 0x1p6f}) {
        // int8 scales differ from key to key (by powers of 2), so a scale read from the wrong row shows.
        const auto key_scale = [&](i64 t) { return f == KVFormat::int8 ? std::ldexp(scale, static_cast<int>(t % 3)) : scale; };
        // Decode: key row n (a copy of key n / D) for query n; prefill: key t for queries t D ..
        const auto make_kv = [&](i64 rows, i64 per, Tensor& codes, Tensor& sc) {
          codes = Tensor(kv_format_dtype(f), {rows, 1, D});
          for (i64 r = 0; r < rows; ++r)
            for (i64 d = 0; d < D; ++d)
              static_cast<std::uint8_t*>(codes.data())[r * D + d] = static_cast<std::uint8_t>((r / per * D + d) % 256);
          sc = Tensor(kv_scales_dtype(f), kv_scales_shape(f, codes.shape()));  // int8: [rows, 1]; fp8: [1]
          for (i64 i = 0; i < sc.numel(); ++i) sc.data_as<float>()[i] = key_scale(i / per);
          return QuantizedKV{f, codes.view(), sc.view()};
        };
        Tensor dec_codes, dec_sc, pre_codes, pre_sc;
        const QuantizedKV dec = make_kv(N, D, dec_codes, dec_sc), pre = make_kv(T, 1, pre_codes, pre_sc);
        Tensor deq(DType::f32, pre_codes.shape());
        dequantize_kv(pre, deq);
        const float* want = deq.data_as<float>();  // key t's values at want + t D
        for (i64 i = 0; i < N; ++i) {
          const auto c = static_cast<std::uint8_t>(i % 256);
          const float code = f == KVFormat::int8 ? static_cast<float>(static_cast<std::int8_t>(c)) : detail::e4m3_to_float(c);
          ASSERT_EQ(std::bit_cast<std::uint32_t>(want[i]), std::bit_cast<std::uint32_t>(code * key_scale(i / D))) << i;
        }
        Tensor q(DType::f32, {N, 1, D});  // query n one-hot at element n mod D
        for (i64 n = 0; n < N; ++n) q.data_as<float>()[n * D + n % D] = 1.0f;
        AttentionParams params;
        params.scale = 0.125;
        for (const bool decode : {true, false}) {
          const i64 batch = decode ? N : T;
          Tensor cq(DType::i32, {batch + 1}), ck(DType::i32, {batch + 1});
          for (i64 b = 0; b <= batch; ++b) {
            cq.data_as<std::int32_t>()[b] = static_cast<std::int32_t>(decode ? b : b * D);
            ck.data_as<std::int32_t>()[b] = static_cast<std::int32_t>(b);
          }
          for (detail::Isa isa : test_isas(DType::bf16)) {  // every level: each compiles its own item
            IsaCap cap(isa);
            Tensor out(DType::f32, {N, 1, D}), lse(DType::f32, {1, N});
            const QuantizedKV& kv = decode ? dec : pre;
            attention_varlen(q, kv, kv, out, cq, ck, params, lse.view());
            const std::string what = std::string(kv_format_name(f)) + " D " + std::to_string(D) + " scale " +
                                     std::to_string(scale) + (decode ? " decode" : " prefill") + " isa " +
                                     detail::isa_name(isa);
            for (i64 n = 0; n < N; ++n) {
              const float* key = want + n / D * D;
              for (i64 d = 0; d < D; ++d)
                ASSERT_EQ(std::bit_cast<std::uint32_t>(out.data_as<float>()[n * D + d]),
                          std::bit_cast<std::uint32_t>(key[d] + 0.0f))
                    << what << " query " << n << " element " << d;
              ASSERT_EQ(lse.data_as<float>()[n], key[n % D] * 0.125f) << what << " query " << n;
            }
          }
        }
      }
  }
}

// KVCache in quantized formats: prefill, ragged appends and decode steps against the float64
// reference over the dequantized cache.
TEST(KVQuantAttention, KVCacheAgainstReference) {
  const i64 B = 2, Hq = 4, Hkv = 2, D = 40, cap = 64;
  for (const auto& [kf, vf] : kCombos) {
    KVCache c(B, Hkv, cap, D, kf, vf), f(B, Hkv, cap, D);  // f: the dequantized values in float32
    std::mt19937_64 rng(21);
    for (const i64 S : {9, 1, 3, 1}) {
      Tensor q(DType::f32, {B, Hq, S, D}), k(DType::f32, {B, Hkv, S, D}), v(DType::f32, {B, Hkv, S, D});
      fill_normal(q, rng);
      fill_normal(k, rng);
      fill_normal(v, rng);
      const std::vector<i64> counts = S == 3 ? std::vector<i64>{3, 2} : std::vector<i64>{};
      const std::vector<i64> before = {c.length(0), c.length(1)};
      c.append(k, v, counts);
      // Dequantize the positions just written into the float cache.
      Tensor kd(DType::f32, {B, Hkv, S, D}), vd(DType::f32, {B, Hkv, S, D});
      for (i64 b = 0; b < B; ++b) {
        const i64 n = counts.empty() ? S : counts[static_cast<std::size_t>(b)];
        const auto deq = [&](const QuantizedKV& x, const Tensor& dst) {
          Tensor rows(DType::f32, {c.length(b), Hkv, D});
          dequantize_kv(x, rows);
          for (i64 h = 0; h < Hkv; ++h)
            for (i64 t = 0; t < n; ++t)
              for (i64 d = 0; d < D; ++d)
                dst.data_as<float>()[((b * Hkv + h) * S + S - n + t) * D + d] =
                    rows.data_as<float>()[((before[static_cast<std::size_t>(b)] + t) * Hkv + h) * D + d];
        };
        deq(c.sequence_keys(b), kd);
        deq(c.sequence_values(b), vd);
      }
      f.append(kd, vd, counts);
      AttentionParams p;
      p.causal = true;
      Tensor o(DType::f32, {B, Hq, S, D}), ref(DType::f32, {B, Hq, S, D});
      c.attend(q, o, p);
      p.kernel = KernelKind::reference;
      f.attend(q, ref, p);
      for (i64 b = 0; b < B; ++b) {
        const i64 n = counts.empty() ? S : counts[static_cast<std::size_t>(b)];
        for (i64 h = 0; h < Hq; ++h)
          for (i64 i = S - n; i < S; ++i)
            for (i64 d = 0; d < D; ++d) {
              const i64 x = ((b * Hq + h) * S + i) * D + d;
              ASSERT_NEAR(o.data_as<float>()[x], ref.data_as<float>()[x], 5e-6) << name(kf, vf) << " S " << S;
            }
      }
    }
  }
}

TEST(KVQuantAttention, Errors) {
  KVCache c(1, 2, 16, 8, KVFormat::int8, KVFormat::int8);
  Tensor k(DType::f32, {1, 2, 3, 8}), v(DType::f32, {1, 2, 3, 8});
  for (i64 i = 0; i < k.numel(); ++i) k.data_as<float>()[i] = v.data_as<float>()[i] = 1.0f;
  v.data_as<float>()[(1 * 3 + 2) * 8 + 4] = std::numeric_limits<float>::infinity();
  try {
    c.append(k, v);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "kv_cache: v: expected finite values for the int8 cache, got inf at batch 0, token 2, head 1");
  }
  EXPECT_EQ(c.length(0), 0);
  PagedKVCache pc(4, 16, 2, 8, KVFormat::fp8, KVFormat::q8_0);
  const i64 s = pc.add_sequence();
  Tensor q3(DType::f32, {3, 2, 8}), k3(DType::f32, {3, 2, 8}), v3(DType::f32, {3, 2, 8}), o3(DType::f32, {3, 2, 8});
  for (i64 i = 0; i < k3.numel(); ++i) q3.data_as<float>()[i] = k3.data_as<float>()[i] = v3.data_as<float>()[i] = 0.5f;
  k3.data_as<float>()[(1 * 2 + 0) * 8 + 0] = std::numeric_limits<float>::quiet_NaN();
  const i64 three[] = {3};
  try {
    pc.forward(std::span<const i64>(&s, 1), three, q3, k3, v3, o3);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "k: expected finite values for the fp8 cache, got nan at token 1, head 0");
  }
  EXPECT_EQ(pc.length(s), 0);
  EXPECT_EQ(pc.num_free_blocks(), 4);
  // Forced tiled kernels cannot read codes.
  AttentionParams p;
  p.kernel = KernelKind::flash;
  k3.data_as<float>()[0] = 0.5f;
  k3.data_as<float>()[16] = 0.5f;
  EXPECT_THROW(pc.forward(std::span<const i64>(&s, 1), three, q3, k3, v3, o3, p), Error);
  EXPECT_EQ(pc.length(s), 0);
  const float one[] = {1.0f, 1.0f}, zero[] = {1.0f, 0.0f};
  EXPECT_THROW(pc.set_fp8_scales(one, zero), Error);
  pc.forward(std::span<const i64>(&s, 1), three, q3, k3, v3, o3);
  EXPECT_THROW(pc.set_fp8_scales(one, one), Error);  // keys are stored
}
