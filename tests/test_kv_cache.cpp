// KV cache: token by token, in chunks and all at once agree with a full recomputation; slots
// beyond a sequence's length are never read; capacity is enforced; attend_varlen gives the bits of
// a PagedKVCache over the same keys in every format.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/error.hpp"
#include "qkv/kv_cache.hpp"
#include "qkv/paged_kv_cache.hpp"
#include "qkv/reference.hpp"

namespace {

using qkv::DType;
using qkv::KVCache;
using qkv::Tensor;
using qkv::TensorView;

Tensor random_f32(const qkv::Shape& shape, std::uint32_t seed) {
  Tensor t(DType::f32, shape);
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = nd(rng);
  return t;
}

// Rows [t0, t0+n) of a contiguous [B,H,S,X] tensor as a strided view.
TensorView rows(const Tensor& t, std::int64_t t0, std::int64_t n) {
  const auto& s = t.shape();
  return TensorView(t.data_as<float>() + t0 * s[3], DType::f32, {s[0], s[1], n, s[3]},
                    {s[1] * s[2] * s[3], s[2] * s[3], s[3], 1});
}

double max_abs_diff(const Tensor& a, const Tensor& b) {
  double m = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double d = std::abs(static_cast<double>(a.data_as<float>()[i]) - b.data_as<float>()[i]);
    if (!(d <= m)) m = std::isnan(d) ? INFINITY : d;
  }
  return m;
}

struct Problem {
  std::int64_t B = 2, Hq = 4, Hkv = 2, T = 5, D = 8;
  Tensor q = random_f32({B, Hq, T, D}, 1), k = random_f32({B, Hkv, T, D}, 2),
         v = random_f32({B, Hkv, T, D}, 3);
  Tensor full() const {
    Tensor out(DType::f32, {B, Hq, T, D});
    qkv::AttentionParams p;
    p.causal = true;
    qkv::attention(q, k, v, out, p);
    return out;
  }
  // Runs the cache over chunks of the given sizes; returns the concatenated outputs.
  Tensor chunked(const std::vector<std::int64_t>& sizes, std::int64_t capacity, bool fill_nan,
                 DType storage = DType::f32) const {
    KVCache cache(B, Hkv, capacity, D, storage);
    if (fill_nan) {
      for (const TensorView& s : {cache.keys(), cache.values()})
        for (std::int64_t i = 0; i < s.numel(); ++i) {
          if (storage == DType::f32)
            s.data_as<float>()[i] = std::numeric_limits<float>::quiet_NaN();
          else
            s.data_as<std::uint16_t>()[i] = 0x7fc0;  // bfloat16 NaN
        }
    }
    Tensor out(DType::f32, {B, Hq, T, D});
    std::int64_t t0 = 0;
    qkv::AttentionParams p;
    p.causal = true;
    for (std::int64_t n : sizes) {
      cache.append(rows(k, t0, n), rows(v, t0, n));
      EXPECT_EQ(cache.length(0), t0 + n);
      cache.attend(rows(q, t0, n), rows(out, t0, n), p);
      t0 += n;
    }
    return out;
  }
};

TEST(KVCache, TokenByTokenChunkedAndAllAtOnceAgree) {
  const Problem pr;
  const Tensor full = pr.full();
  const Tensor one = pr.chunked({1, 1, 1, 1, 1}, 5, false);
  const Tensor two_three = pr.chunked({2, 3}, 5, false);
  const Tensor all = pr.chunked({5}, 5, false);
  EXPECT_LE(max_abs_diff(one, full), 1e-5);
  EXPECT_LE(max_abs_diff(two_three, full), 1e-5);
  EXPECT_LE(max_abs_diff(all, full), 1e-5);
}

TEST(KVCache, UnusedSlotsHoldingNaNAreNeverRead) {
  const Problem pr;
  const Tensor full = pr.full();
  for (auto sizes : {std::vector<std::int64_t>{1, 1, 1, 1, 1}, std::vector<std::int64_t>{2, 3}}) {
    const Tensor out = pr.chunked(sizes, 64, true);
    for (std::int64_t i = 0; i < out.numel(); ++i) ASSERT_TRUE(std::isfinite(out.data_as<float>()[i]));
    EXPECT_LE(max_abs_diff(out, full), 1e-5);
  }
}

TEST(KVCache, MatchesTheFloat64Reference) {
  const Problem pr;
  Tensor want(DType::f32, {pr.B, pr.Hq, pr.T, pr.D});
  qkv::AttentionParams p;
  p.causal = true;
  qkv::reference::attention(pr.q, pr.k, pr.v, want, p);
  EXPECT_LE(max_abs_diff(pr.chunked({3, 1, 1}, 9, true), want), 1e-5);
}

TEST(KVCache, Bf16StorageEqualsAttentionOnRoundedKeysAndValues) {
  Problem pr;
  for (Tensor* t : {&pr.k, &pr.v})
    for (std::int64_t i = 0; i < t->numel(); ++i)
      t->data_as<float>()[i] = qkv::bf16_to_float(qkv::float_to_bf16(t->data_as<float>()[i]));
  const Tensor full = pr.full();
  const Tensor out = pr.chunked({2, 1, 2}, 12, true, DType::bf16);
  EXPECT_LE(max_abs_diff(out, full), 1e-5);
}

TEST(KVCache, Bf16CopyFollowsTruncateAndOverwrite) {
  // Append 3, attend, roll back to 1, append different tokens: the float32 copy must follow.
  Problem pr;
  for (Tensor* t : {&pr.k, &pr.v})
    for (std::int64_t i = 0; i < t->numel(); ++i)
      t->data_as<float>()[i] = qkv::bf16_to_float(qkv::float_to_bf16(t->data_as<float>()[i]));
  KVCache cache(pr.B, pr.Hkv, 8, pr.D, DType::bf16);
  qkv::AttentionParams p;
  p.causal = true;
  Tensor scratch(DType::f32, {pr.B, pr.Hq, 3, pr.D});
  cache.append(rows(pr.v, 0, 3), rows(pr.k, 0, 3));  // deliberately the wrong tokens
  cache.attend(rows(pr.q, 0, 3), scratch, p);
  cache.truncate(1);
  Tensor out(DType::f32, {pr.B, pr.Hq, pr.T, pr.D});
  // Token 0 must be replaced too: roll back to 0 and replay the right tokens 2 + 3.
  cache.truncate(0);
  cache.append(rows(pr.k, 0, 2), rows(pr.v, 0, 2));
  cache.attend(rows(pr.q, 0, 2), rows(out, 0, 2), p);
  cache.append(rows(pr.k, 2, 3), rows(pr.v, 2, 3));
  cache.attend(rows(pr.q, 2, 3), rows(out, 2, 3), p);
  EXPECT_LE(max_abs_diff(out, pr.full()), 1e-5);
}

TEST(KVCache, RefusesToOverflowAndLeavesTheCacheUnchanged) {
  const Problem pr;
  KVCache cache(pr.B, pr.Hkv, 4, pr.D);
  cache.append(rows(pr.k, 0, 3), rows(pr.v, 0, 3));
  try {
    cache.append(rows(pr.k, 3, 2), rows(pr.v, 3, 2));
    FAIL() << "expected qkv::Error";
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("capacity 4"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cache.length(0), 3);
  EXPECT_EQ(cache.length(1), 3);
  cache.append(rows(pr.k, 3, 1), rows(pr.v, 3, 1));  // exactly full is fine
  EXPECT_EQ(cache.max_length(), 4);
  EXPECT_THROW(cache.append(rows(pr.k, 4, 1), rows(pr.v, 4, 1)), qkv::Error);
}

TEST(KVCache, RaggedAppendsKeepPerSequenceLengths) {
  // Sequence 0 takes 3 tokens, sequence 1 only its last 1 (left padding); attention of each
  // sequence's real queries equals attention computed for that sequence alone.
  const Problem pr;
  KVCache cache(pr.B, pr.Hkv, 8, pr.D);
  // Sequence 1's slots 1 and 2 lie inside the [0, max_length) views but beyond its length.
  for (const TensorView& s : {cache.keys(), cache.values()})
    for (std::int64_t i = 0; i < s.numel(); ++i)
      s.data_as<float>()[i] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<std::int64_t> counts{3, 1};
  const auto pos = cache.next_positions(3, counts);
  EXPECT_EQ(pos, (std::vector<std::int64_t>{0, 1, 2, 0, 0, 0}));
  cache.append(rows(pr.k, 0, 3), rows(pr.v, 0, 3), counts);
  EXPECT_EQ(cache.length(0), 3);
  EXPECT_EQ(cache.length(1), 1);
  Tensor out(DType::f32, {pr.B, pr.Hq, 3, pr.D});
  qkv::AttentionParams p;
  p.causal = true;
  cache.attend(rows(pr.q, 0, 3), out, p);
  for (std::int64_t i = 0; i < out.numel(); ++i) ASSERT_TRUE(std::isfinite(out.data_as<float>()[i])) << i;
  // Sequence 1 holds only token 2 of the input; its last query row sees exactly that key.
  for (std::int64_t h = 0; h < pr.Hq; ++h)
    for (std::int64_t d = 0; d < pr.D; ++d) {
      const float want = pr.v.data_as<float>()[((1 * pr.Hkv + h / 2) * pr.T + 2) * pr.D + d];
      EXPECT_NEAR(out.data_as<float>()[((1 * pr.Hq + h) * 3 + 2) * pr.D + d], want, 1e-6);
    }
  EXPECT_EQ(cache.next_positions(1), (std::vector<std::int64_t>{3, 1}));
}

TEST(KVCache, TruncateClearAndViews) {
  const Problem pr;
  KVCache cache(pr.B, pr.Hkv, 6, pr.D);
  cache.append(rows(pr.k, 0, 5), rows(pr.v, 0, 5));
  EXPECT_EQ(cache.active_keys().shape(), (qkv::Shape{pr.B, pr.Hkv, 5, pr.D}));
  EXPECT_EQ(cache.active_keys().stride(1), 6 * pr.D);
  EXPECT_EQ(cache.keys().data_as<float>()[pr.D], pr.k.data_as<float>()[pr.D]);  // token 1 of head 0
  cache.truncate(2);
  EXPECT_EQ(cache.max_length(), 2);
  std::vector<std::int64_t> l{1, 5};
  cache.truncate(l);
  EXPECT_EQ(cache.length(0), 1);
  EXPECT_EQ(cache.length(1), 2);
  cache.clear();
  EXPECT_EQ(cache.max_length(), 0);
  EXPECT_THROW(cache.truncate(-1), qkv::Error);
  EXPECT_THROW(cache.length(2), qkv::Error);
}

// attend_varlen, the serving kernel over each sequence's stored rows, in every format: the bits of
// a PagedKVCache holding the same keys (another addressing of the same storage code, the same
// kernel); rows before a sequence's first position (ragged padding) get 0 and -inf.
TEST(KVCache, AttendVarlenGivesThePagedCachesBits) {
  using qkv::KVFormat;
  const Problem pr;
  const std::vector<std::int64_t> counts{5, 3};
  const std::int64_t T = pr.T, Hq = pr.Hq, Hkv = pr.Hkv, D = pr.D;
  // Rows [T - n, T) of batch b of a [B, H, T, D] tensor, packed [n, H, D].
  const auto pack = [&](const Tensor& x, std::int64_t b, std::int64_t n) {
    const std::int64_t H = x.shape()[1];
    Tensor r(DType::f32, {n, H, D});
    for (std::int64_t t = 0; t < n; ++t)
      for (std::int64_t h = 0; h < H; ++h)
        std::memcpy(r.data_as<float>() + (t * H + h) * D, x.data_as<float>() + ((b * H + h) * T + T - n + t) * D,
                    static_cast<std::size_t>(D) * sizeof(float));
    return r;
  };
  for (const KVFormat f : {KVFormat::f32, KVFormat::bf16, KVFormat::f16, KVFormat::int8, KVFormat::q8_0, KVFormat::fp8}) {
    KVCache cache(pr.B, Hkv, 16, D, f, f);
    cache.append(pr.k, pr.v, counts);
    Tensor out(DType::f32, {pr.B, Hq, T, D}), lse(DType::f32, {pr.B, Hq, T});
    qkv::AttentionParams p;
    p.causal = true;
    cache.attend_varlen(pr.q, out, p, lse.view());
    qkv::PagedKVCache paged(4, 16, Hkv, D, f, f);
    for (std::int64_t b = 0; b < pr.B; ++b) {
      const std::int64_t n = counts[static_cast<std::size_t>(b)], seq = paged.add_sequence();
      const Tensor q = pack(pr.q, b, n), k = pack(pr.k, b, n), v = pack(pr.v, b, n);
      Tensor o(DType::f32, {n, Hq, D}), l(DType::f32, {Hq, n});
      paged.forward(std::span<const std::int64_t>(&seq, 1), std::span<const std::int64_t>(&n, 1), q, k, v, o, p,
                    std::nullopt, l.view());
      for (std::int64_t h = 0; h < Hq; ++h)
        for (std::int64_t i = 0; i < T; ++i) {
          const float* got = out.data_as<float>() + ((b * Hq + h) * T + i) * D;
          const float got_lse = lse.data_as<float>()[(b * Hq + h) * T + i];
          if (i < T - n) {  // padding
            for (std::int64_t d = 0; d < D; ++d) ASSERT_EQ(got[d], 0.0f);
            ASSERT_EQ(got_lse, -std::numeric_limits<float>::infinity());
            continue;
          }
          const std::int64_t t = i - (T - n);
          ASSERT_EQ(std::memcmp(got, o.data_as<float>() + (t * Hq + h) * D, static_cast<std::size_t>(D) * sizeof(float)), 0)
              << qkv::kv_format_name(f) << " batch " << b << " head " << h << " row " << i;
          ASSERT_EQ(std::memcmp(&got_lse, l.data_as<float>() + h * n + t, sizeof(float)), 0);
        }
    }
  }
  KVCache wide(1, Hkv, 4, D, DType::f64);
  Tensor q1(DType::f64, {1, Hq, 1, D}), o1(DType::f64, {1, Hq, 1, D});
  try {
    wide.attend_varlen(q1, o1);
    FAIL() << "expected qkv::Error";
  } catch (const qkv::Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "kv_cache: attend_varlen: expected a cache in a KVFormat (f32, bf16, f16, int8, q8_0, fp8), got float64");
  }
}

// A call that fails writes nothing: the attention calls of every sequence are checked before any
// output row (padding included) is written. Each case once wrote part of `out` before throwing.
TEST(KVCache, AttendVarlenWritesNothingWhenACallFails) {
  const std::int64_t Hkv = 1, D = 8;
  KVCache cache(2, Hkv, 64, D, qkv::KVFormat::int8, qkv::KVFormat::int8);
  const std::vector<std::int64_t> counts{5, 40};
  cache.append(random_f32({2, Hkv, 40, D}, 4), random_f32({2, Hkv, 40, D}, 5), counts);
  const auto untouched = [](const Tensor& out) {
    for (std::int64_t i = 0; i < out.numel(); ++i)
      if (out.data_as<float>()[i] != 7.0f) return false;
    return true;
  };
  const auto sevens = [](qkv::Shape shape) {
    Tensor t(DType::f32, shape);
    std::fill_n(t.data_as<float>(), t.numel(), 7.0f);
    return t;
  };
  // Forced decode refuses sequence 1 (20 rows > 16), not sequence 0 (5 rows).
  Tensor out = sevens({2, 1, 20, D});
  qkv::AttentionParams p;
  p.kernel = qkv::KernelKind::decode;
  EXPECT_THROW(cache.attend(random_f32({2, 1, 20, D}, 6), out, p), qkv::Error);
  EXPECT_TRUE(untouched(out)) << "forced decode wrote rows before refusing a later sequence";
  // q of another head_dim than the cache's: named in the cache's terms, nothing written.
  Tensor out4 = sevens({2, 1, 3, D});
  try {
    cache.attend(random_f32({2, 1, 3, 4}, 7), out4);
    FAIL() << "expected qkv::Error";
  } catch (const qkv::Error& e) {
    EXPECT_EQ(std::string(e.what()), "kv_cache: q: expected [B,Hq,Sq,D] with D == cache D (8), got shape [2,1,3,4]");
  }
  EXPECT_TRUE(untouched(out4));
  // An empty cache still checks the call's options.
  KVCache empty(1, Hkv, 8, D, qkv::KVFormat::int8, qkv::KVFormat::int8);
  qkv::AttentionParams bad;
  bad.softcap = -1.0;
  Tensor out0 = sevens({1, 1, 2, D});
  EXPECT_THROW(empty.attend(random_f32({1, 1, 2, D}, 8), out0, bad), qkv::Error);
  EXPECT_TRUE(untouched(out0));
}

TEST(KVCache, RefusesBadArguments) {
  const Problem pr;
  EXPECT_THROW(KVCache(1, 1, 4, 0), qkv::Error);
  EXPECT_THROW(KVCache(-1, 1, 4, 8), qkv::Error);
  EXPECT_THROW(KVCache(1, 1, 4, 8, DType::i32), qkv::Error);
  KVCache cache(pr.B, pr.Hkv, 8, pr.D);
  Tensor wrong_d = random_f32({pr.B, pr.Hkv, 1, pr.D + 1}, 1);
  EXPECT_THROW(cache.append(wrong_d, wrong_d), qkv::Error);
  Tensor wrong_h = random_f32({pr.B, pr.Hkv + 1, 1, pr.D}, 1);
  EXPECT_THROW(cache.append(wrong_h, wrong_h), qkv::Error);
  EXPECT_THROW(cache.append(rows(pr.k, 0, 2), rows(pr.v, 0, 1)), qkv::Error);
  cache.append(rows(pr.k, 0, 2), rows(pr.v, 0, 2));
  Tensor out(DType::f32, {pr.B, pr.Hq, 1, pr.D});
  qkv::AttentionParams p;
  p.align = qkv::Alignment::top_left;
  EXPECT_THROW(cache.attend(rows(pr.q, 1, 1), out, p), qkv::Error);
  std::vector<std::int64_t> lens{1, 1};
  qkv::AttentionParams p2;
  p2.kv_lens = TensorView(lens.data(), DType::i64, {2});
  EXPECT_THROW(cache.attend(rows(pr.q, 1, 1), out, p2), qkv::Error);
  std::vector<std::int64_t> bad_counts{3, 0};
  EXPECT_THROW(cache.append(rows(pr.k, 0, 2), rows(pr.v, 0, 2), bad_counts), qkv::Error);
}

}  // namespace
