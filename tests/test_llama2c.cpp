// Tests of the llama2.c checkpoint reader: the real stories260K files, synthetic files of every
// version and classifier mode, and hostile files.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "byte_buffer.hpp"
#include "qkv/error.hpp"
#include "qkv/llama2c.hpp"

namespace fs = std::filesystem;
using qkv::Llama2cModel;
using qkv::test::ByteBuffer;
using qkv::test::file_bytes;
using qkv::test::TempDir;

namespace {

const fs::path kDir = fs::path(QKV_SOURCE_DIR) / "models/stories260K";
const fs::path kV0 = kDir / "stories260K.bin";
const fs::path kQ80 = kDir / "stories260K_q80.bin";

struct Cfg {
  int dim, hidden, layers, heads, kv_heads, vocab, seq;
  bool shared;
  int kv_dim() const { return kv_heads * (dim / heads); }
};

// A model's weights as flat arrays, layers stacked, in the order and shapes of the README.
struct Weights {
  Cfg c;
  std::vector<float> emb, rms_att, wq, wk, wv, wo, rms_ffn, w1, w2, w3, rms_final, rope, cls;
};

Weights random_weights(const Cfg& c, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const auto fill = [&](std::size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = nd(rng);
    return v;
  };
  const std::size_t d = c.dim, h = c.hidden, L = c.layers, kv = c.kv_dim(), V = c.vocab;
  Weights w{c,
            fill(V * d),
            fill(L * d),
            fill(L * d * d),
            fill(L * kv * d),
            fill(L * kv * d),
            fill(L * d * d),
            fill(L * d),
            fill(L * h * d),
            fill(L * d * h),
            fill(L * h * d),
            fill(d),
            fill(static_cast<std::size_t>(c.seq) * (d / c.heads)),
            c.shared ? std::vector<float>{} : fill(V * d)};
  return w;
}

void put_floats(ByteBuffer& b, const std::vector<float>& v) { b.raw(v.data(), v.size() * 4); }

std::vector<std::byte> write_v0(const Weights& w) {
  ByteBuffer b;
  const Cfg& c = w.c;
  for (int f : {c.dim, c.hidden, c.layers, c.heads, c.kv_heads, c.shared ? c.vocab : -c.vocab, c.seq})
    b.i32(f);
  for (const auto* v : {&w.emb, &w.rms_att, &w.wq, &w.wk, &w.wv, &w.wo, &w.rms_ffn, &w.w1, &w.w2, &w.w3,
                        &w.rms_final, &w.rope, &w.cls})
    put_floats(b, *v);
  return b.bytes;
}

void put_header(ByteBuffer& b, const Cfg& c, int version, int group_size) {
  b.u32(0x616b3432);
  b.i32(version);
  for (int f : {c.dim, c.hidden, c.layers, c.heads, c.kv_heads, c.vocab, c.seq}) b.i32(f);
  b.u8(c.shared ? 1 : 0);
  if (version == 2) b.i32(group_size);
  b.pad_to(256);
}

// Slices of one layer's matrix inside a stacked array.
std::vector<float> layer_slice(const std::vector<float>& v, int layers, int l) {
  const std::size_t n = v.size() / static_cast<std::size_t>(layers);
  return {v.begin() + static_cast<std::ptrdiff_t>(n * l),
          v.begin() + static_cast<std::ptrdiff_t>(n * (l + 1))};
}

std::vector<std::byte> write_v1(const Weights& w) {
  ByteBuffer b;
  put_header(b, w.c, 1, 0);
  for (const auto* v : {&w.rms_att, &w.rms_ffn, &w.rms_final, &w.emb, &w.wq, &w.wk, &w.wv, &w.wo, &w.w1,
                        &w.w2, &w.w3, &w.cls})
    put_floats(b, *v);
  return b.bytes;
}

// Quantises every matrix to Q8_0 (symmetric, scale = max|w| / 127 per group, as llama2.c's
// export.py) and writes a version-2 file; `w` is replaced by the dequantised weights the reader
// must return: float(q) * scale in float32.
std::vector<std::byte> write_v2(Weights& w, int gs) {
  ByteBuffer b;
  put_header(b, w.c, 2, gs);
  for (const auto* v : {&w.rms_att, &w.rms_ffn, &w.rms_final}) put_floats(b, *v);
  const auto quant = [&](std::vector<float>& m, std::size_t per_layer) {
    for (std::size_t base = 0; base < m.size(); base += per_layer) {
      std::vector<float> scales;
      std::vector<std::int8_t> q(per_layer);
      for (std::size_t g = 0; g < per_layer; g += static_cast<std::size_t>(gs)) {
        float mx = 0;
        for (int i = 0; i < gs; ++i) mx = std::max(mx, std::fabs(m[base + g + i]));
        const float s = mx / 127.0f;
        scales.push_back(s);
        for (int i = 0; i < gs; ++i) {
          q[g + i] = static_cast<std::int8_t>(std::lround(s > 0 ? m[base + g + i] / s : 0.0f));
          m[base + g + i] = static_cast<float>(q[g + i]) * s;
        }
      }
      b.raw(q.data(), q.size());
      put_floats(b, scales);
    }
  };
  const std::size_t L = w.c.layers;
  quant(w.emb, w.emb.size());
  for (auto* m : {&w.wq, &w.wk, &w.wv, &w.wo, &w.w1, &w.w2, &w.w3}) quant(*m, m->size() / L);
  if (!w.c.shared) quant(w.cls, w.cls.size());
  return b.bytes;
}

void expect_view(const qkv::TensorView& v, const qkv::Shape& shape, const std::vector<float>& want,
                 const char* what) {
  ASSERT_EQ(v.dtype(), qkv::DType::f32) << what;
  ASSERT_EQ(v.shape(), shape) << what;
  ASSERT_TRUE(v.is_contiguous()) << what;
  ASSERT_EQ(static_cast<std::size_t>(v.numel()), want.size()) << what;
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(v.data()) % 64, 0u) << what;
  EXPECT_EQ(std::memcmp(v.data(), want.data(), want.size() * 4), 0) << what << " differs";
}

void expect_weights(const Llama2cModel& m, const Weights& w) {
  const Cfg& c = w.c;
  const std::int64_t d = c.dim, h = c.hidden, kv = c.kv_dim(), V = c.vocab;
  EXPECT_EQ(m.config.dim, c.dim);
  EXPECT_EQ(m.config.hidden_dim, c.hidden);
  EXPECT_EQ(m.config.n_layers, c.layers);
  EXPECT_EQ(m.config.n_heads, c.heads);
  EXPECT_EQ(m.config.n_kv_heads, c.kv_heads);
  EXPECT_EQ(m.config.vocab_size, c.vocab);
  EXPECT_EQ(m.config.max_seq_len, c.seq);
  EXPECT_EQ(m.config.head_dim, c.dim / c.heads);
  EXPECT_EQ(m.config.kv_dim, c.kv_dim());
  EXPECT_EQ(m.config.shared_classifier, c.shared);
  expect_view(m.token_embedding, {V, d}, w.emb, "token_embedding");
  ASSERT_EQ(m.layers.size(), static_cast<std::size_t>(c.layers));
  for (int l = 0; l < c.layers; ++l) {
    SCOPED_TRACE("layer " + std::to_string(l));
    const auto& L = m.layers[static_cast<std::size_t>(l)];
    expect_view(L.rms_att, {d}, layer_slice(w.rms_att, c.layers, l), "rms_att");
    expect_view(L.wq, {d, d}, layer_slice(w.wq, c.layers, l), "wq");
    expect_view(L.wk, {kv, d}, layer_slice(w.wk, c.layers, l), "wk");
    expect_view(L.wv, {kv, d}, layer_slice(w.wv, c.layers, l), "wv");
    expect_view(L.wo, {d, d}, layer_slice(w.wo, c.layers, l), "wo");
    expect_view(L.rms_ffn, {d}, layer_slice(w.rms_ffn, c.layers, l), "rms_ffn");
    expect_view(L.w1, {h, d}, layer_slice(w.w1, c.layers, l), "w1");
    expect_view(L.w2, {d, h}, layer_slice(w.w2, c.layers, l), "w2");
    expect_view(L.w3, {h, d}, layer_slice(w.w3, c.layers, l), "w3");
  }
  expect_view(m.rms_final, {d}, w.rms_final, "rms_final");
  if (c.shared) {
    EXPECT_EQ(m.wcls.data(), m.token_embedding.data());
    EXPECT_EQ(m.wcls.shape(), (qkv::Shape{V, d}));
  } else {
    EXPECT_NE(m.wcls.data(), m.token_embedding.data());
    expect_view(m.wcls, {V, d}, w.cls, "wcls");
  }
}

// The README's version-0 layout, transcribed independently of the reader: split the raw floats.
Weights split_v0(const std::vector<std::byte>& b) {
  std::int32_t h[7];
  std::memcpy(h, b.data(), 28);
  Cfg c{h[0], h[1], h[2], h[3], h[4], std::abs(h[5]), h[6], h[5] > 0};
  std::size_t pos = 28;
  const auto take = [&](std::size_t n) {
    std::vector<float> v(n);
    std::memcpy(v.data(), b.data() + pos, n * 4);
    pos += n * 4;
    return v;
  };
  const std::size_t d = c.dim, hd = c.hidden, L = c.layers, kv = c.kv_dim(), V = c.vocab;
  Weights w{c};
  w.emb = take(V * d);
  w.rms_att = take(L * d);
  w.wq = take(L * d * d);
  w.wk = take(L * kv * d);
  w.wv = take(L * kv * d);
  w.wo = take(L * d * d);
  w.rms_ffn = take(L * d);
  w.w1 = take(L * hd * d);
  w.w2 = take(L * d * hd);
  w.w3 = take(L * hd * d);
  w.rms_final = take(d);
  w.rope = take(static_cast<std::size_t>(c.seq) * (d / c.heads));
  if (!c.shared) w.cls = take(V * d);
  EXPECT_EQ(pos, b.size());
  return w;
}

// Expects a qkv::Error whose message names the input and contains `what`.
void expect_refused(const std::vector<std::byte>& b, const std::string& what) {
  try {
    (void)qkv::parse_llama2c(b, "hostile.bin");
    ADD_FAILURE() << "accepted; expected an error containing '" << what << "'";
  } catch (const qkv::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("hostile.bin"), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  }
}

const Cfg kSmall{8, 12, 2, 2, 1, 6, 5, true};

}  // namespace

TEST(Llama2c, Stories260KConfigMatchesTheReadme) {
  const Llama2cModel m = qkv::read_llama2c(kV0);
  const auto& c = m.config;
  EXPECT_EQ(c.version, 0);
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.max_seq_len, 512);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.kv_dim, 32);
  EXPECT_TRUE(c.shared_classifier);
  EXPECT_EQ(c.group_size, 0);
  const auto cfg = qkv::parse_llama2c_config(file_bytes(kV0), "stories260K.bin");
  EXPECT_EQ(cfg.kv_dim, 32);
}

TEST(Llama2c, Stories260KVersion0WeightsFollowTheReadmeLayout) {
  const auto bytes = file_bytes(kV0);
  const Weights want = split_v0(bytes);
  expect_weights(qkv::read_llama2c(kV0), want);
  // Sanity of the data itself: finite, and RMSNorm gains are not all zero.
  const Llama2cModel m = qkv::parse_llama2c(bytes);
  double sum = 0;
  for (std::int64_t i = 0; i < m.rms_final.numel(); ++i) {
    ASSERT_TRUE(std::isfinite(m.rms_final.data_as<float>()[i]));
    sum += std::fabs(m.rms_final.data_as<float>()[i]);
  }
  EXPECT_GT(sum, 0.0);
}

TEST(Llama2c, Stories260KQ80DequantisesBitIdenticallyToTheFloat32File) {
  const Llama2cModel a = qkv::read_llama2c(kV0);
  const Llama2cModel q = qkv::read_llama2c(kQ80);
  EXPECT_EQ(q.config.version, 2);
  EXPECT_EQ(q.config.group_size, 32);
  EXPECT_TRUE(q.config.shared_classifier);
  const auto fields = [](const qkv::Llama2cConfig& c) {
    return std::vector<int>{c.dim,        c.hidden_dim,  c.n_layers, c.n_heads, c.n_kv_heads,
                            c.vocab_size, c.max_seq_len, c.head_dim, c.kv_dim};
  };
  EXPECT_EQ(fields(a.config), fields(q.config));
  const auto same = [](const qkv::TensorView& x, const qkv::TensorView& y, const std::string& what) {
    ASSERT_EQ(x.shape(), y.shape()) << what;
    EXPECT_EQ(std::memcmp(x.data(), y.data(), static_cast<std::size_t>(x.numel()) * 4), 0) << what;
  };
  same(a.token_embedding, q.token_embedding, "token_embedding");
  same(a.rms_final, q.rms_final, "rms_final");
  same(a.wcls, q.wcls, "wcls");
  for (std::size_t l = 0; l < a.layers.size(); ++l) {
    const auto &x = a.layers[l], &y = q.layers[l];
    const std::string L = "layer " + std::to_string(l) + " ";
    same(x.rms_att, y.rms_att, L + "rms_att");
    same(x.wq, y.wq, L + "wq");
    same(x.wk, y.wk, L + "wk");
    same(x.wv, y.wv, L + "wv");
    same(x.wo, y.wo, L + "wo");
    same(x.rms_ffn, y.rms_ffn, L + "rms_ffn");
    same(x.w1, y.w1, L + "w1");
    same(x.w2, y.w2, L + "w2");
    same(x.w3, y.w3, L + "w3");
  }
}

TEST(Llama2c, CopiesKeepTheWeightsAlive) {
  Llama2cModel copy;
  std::vector<float> first(8);
  {
    const Llama2cModel m = qkv::read_llama2c(kQ80);
    std::memcpy(first.data(), m.layers[4].w3.data(), 32);
    copy = m;
  }
  EXPECT_EQ(std::memcmp(copy.layers[4].w3.data(), first.data(), 32), 0);
}

TEST(Llama2c, SyntheticVersion0SharedAndUnshared) {
  for (bool shared : {true, false}) {
    SCOPED_TRACE(shared ? "shared" : "unshared");
    Cfg c = kSmall;
    c.shared = shared;
    const Weights w = random_weights(c, 7);
    const auto bytes = write_v0(w);
    expect_weights(qkv::parse_llama2c(bytes, "v0.bin"), w);
    EXPECT_EQ(split_v0(bytes).emb, w.emb);
  }
}

TEST(Llama2c, SyntheticVersion1SharedAndUnshared) {
  for (bool shared : {true, false}) {
    SCOPED_TRACE(shared ? "shared" : "unshared");
    Cfg c = kSmall;
    c.shared = shared;
    const Weights w = random_weights(c, 8);
    const Llama2cModel m = qkv::parse_llama2c(write_v1(w), "v1.bin");
    EXPECT_EQ(m.config.version, 1);
    expect_weights(m, w);
  }
}

TEST(Llama2c, SyntheticVersion2GroupsSpanRows) {
  // group_size 16 with hidden_dim 12: the groups of w2 [dim, 12] run across row boundaries.
  for (bool shared : {true, false}) {
    SCOPED_TRACE(shared ? "shared" : "unshared");
    Cfg c = kSmall;
    c.shared = shared;
    Weights w = random_weights(c, 9);
    const auto bytes = write_v2(w, 16);
    const Llama2cModel m = qkv::parse_llama2c(bytes, "v2.bin");
    EXPECT_EQ(m.config.version, 2);
    EXPECT_EQ(m.config.group_size, 16);
    expect_weights(m, w);
  }
}

TEST(Llama2c, Stories260KAsVersion1AndUnsharedVersion0) {
  const auto bytes = file_bytes(kV0);
  Weights w = split_v0(bytes);
  expect_weights(qkv::parse_llama2c(write_v1(w), "v1.bin"), w);
  // The same model with a separate classifier: negative vocab_size, wcls after the RoPE tables.
  w.c.shared = false;
  w.cls = w.emb;
  for (auto& x : w.cls) x = -x;
  expect_weights(qkv::parse_llama2c(write_v0(w), "unshared.bin"), w);
}

TEST(Llama2cHostile, EveryHeaderTruncationIsRefused) {
  const auto v0 = file_bytes(kV0);
  const auto q80 = file_bytes(kQ80);
  for (std::size_t n = 0; n < 300; ++n) {
    EXPECT_THROW((void)qkv::parse_llama2c({v0.data(), n}, "cut.bin"), qkv::Error) << n;
    EXPECT_THROW((void)qkv::parse_llama2c({q80.data(), n}, "cut.bin"), qkv::Error) << n;
  }
  expect_refused({v0.begin(), v0.begin() + 27}, "shorter than the 28-byte version-0 header");
  expect_refused({q80.begin(), q80.begin() + 255}, "shorter than the 256-byte version-2 header");
  expect_refused({q80.begin(), q80.begin() + 6}, "truncated inside the header");
  expect_refused({q80.begin(), q80.begin() + 3}, "too short for a header");
}

TEST(Llama2cHostile, EveryDataTruncationIsRefused) {
  for (const auto& path : {kV0, kQ80}) {
    const auto b = file_bytes(path);
    // Every length from the header to the end in steps that hit every alignment, plus the last
    // 512 lengths one by one.
    for (std::size_t n = 256; n < b.size(); n += (n + 600 < b.size() ? 61 : 1))
      ASSERT_THROW((void)qkv::parse_llama2c({b.data(), n}, "cut.bin"), qkv::Error) << path << " " << n;
    auto longer = b;
    longer.push_back(std::byte{0});
    expect_refused(longer, "(trailing data?)");
    expect_refused({b.begin(), b.end() - 1}, "(truncated?)");
  }
}

TEST(Llama2cHostile, BadMagicVersionAndFlags) {
  auto q = file_bytes(kQ80);
  auto bad = q;
  bad[3] = std::byte{'3'};  // "ak43" is no magic: read as a legacy header whose dim is absurd
  expect_refused(bad, "dim");
  for (int v : {0, 3, -1, 1000}) {
    bad = q;
    ByteBuffer b{bad};
    b.put_at<std::int32_t>(4, v);
    expect_refused(b.bytes, "unsupported version " + std::to_string(v));
  }
  bad = q;
  bad[36] = std::byte{2};
  expect_refused(bad, "shared_classifier byte must be 0 or 1, got 2");
  bad[36] = std::byte{0};  // claims a separate classifier that the file does not hold
  expect_refused(bad, "(truncated?)");
  for (int g : {0, -32}) {
    ByteBuffer b{q};
    b.put_at<std::int32_t>(37, g);
    expect_refused(b.bytes, "group_size must be positive, got " + std::to_string(g));
  }
  for (int g : {7, 64, 1 << 20}) {  // 64 divides every matrix but changes the length
    ByteBuffer b{q};
    b.put_at<std::int32_t>(37, g);
    EXPECT_THROW((void)qkv::parse_llama2c(b.bytes, "g.bin"), qkv::Error) << g;
  }
  ByteBuffer b{q};
  b.put_at<std::int32_t>(37, 7);
  expect_refused(b.bytes, "group_size 7 does not divide");
  ByteBuffer vneg{q};
  vneg.put_at<std::int32_t>(28, -512);  // version 2 flags sharing with its own byte
  expect_refused(vneg.bytes, "vocab_size must be positive, got -512");
}

TEST(Llama2cHostile, ZeroNegativeAndAbsurdFields) {
  const auto v0 = file_bytes(kV0);
  const auto q80 = file_bytes(kQ80);
  const char* names[7] = {"dim",        "hidden_dim", "n_layers",   "n_heads",
                          "n_kv_heads", "vocab_size", "max_seq_len"};
  for (int f = 0; f < 7; ++f) {
    for (std::int32_t v : {0, -1, -64, INT_MIN, INT_MAX, (1 << 24) + 1, 1 << 24, 3, 1000000}) {
      for (int version : {0, 2}) {
        ByteBuffer b{version == 0 ? v0 : q80};
        b.put_at<std::int32_t>((version == 0 ? 0 : 8) + 4 * static_cast<std::size_t>(f), v);
        SCOPED_TRACE(std::string(names[f]) + " = " + std::to_string(v) + ", version " +
                     std::to_string(version));
        // Version 2 stores no RoPE tables: any sane max_seq_len leaves the length unchanged.
        if (version == 2 && f == 6 && v > 0 && v <= (1 << 24)) {
          EXPECT_EQ(qkv::parse_llama2c(b.bytes, "fields.bin").config.max_seq_len, v);
          continue;
        }
        try {
          (void)qkv::parse_llama2c(b.bytes, "fields.bin");
          ADD_FAILURE() << "accepted";
        } catch (const qkv::Error& e) {
          const std::string msg = e.what();
          EXPECT_NE(msg.find("fields.bin"), std::string::npos) << msg;
          const bool legacy_sign = version == 0 && f == 5 && v < 0 && v != INT_MIN;
          if ((v <= 0 && !legacy_sign) || v > (1 << 24))
            EXPECT_NE(msg.find(names[f]), std::string::npos) << msg;
        }
      }
    }
  }
}

TEST(Llama2cHostile, InconsistentHeadCounts) {
  const auto header = [](std::vector<std::int32_t> f) {
    ByteBuffer b;
    for (auto x : f) b.i32(x);
    b.pad_to(4096);
    return b.bytes;
  };
  expect_refused(header({64, 172, 5, 7, 7, 512, 512}), "dim (64) is not a multiple of n_heads (7)");
  expect_refused(header({64, 172, 5, 8, 3, 512, 512}), "n_heads (8) is not a multiple of n_kv_heads (3)");
  expect_refused(header({24, 172, 5, 8, 4, 512, 512}), "head_dim = dim / n_heads = 3 is odd");
  expect_refused(header({64, 172, 5, 8, 4, 512, 512}), "implies a version-0 file of 1056540 bytes, got 4096");
  // Every field at the limit: the sizes overflow 64 bits and are refused before any allocation.
  expect_refused(header({1 << 24, 1 << 24, 1 << 24, 2, 1, 1 << 24, 1 << 24}), "overflow 64 bits");
  // Large but representable: a plain length mismatch, nothing allocated.
  expect_refused(header({1 << 20, 1 << 20, 1 << 10, 1 << 10, 1 << 10, 1 << 20, 1 << 20}), "got 4096");
}

TEST(Llama2cHostile, RandomHeaderCorruptionIsRefusedOrConsistent) {
  const auto v0 = file_bytes(kV0);
  const auto q80 = file_bytes(kQ80);
  std::mt19937 rng(5);
  for (int trial = 0; trial < 3000; ++trial) {
    const bool is_v2 = trial % 2 == 1;
    auto b = is_v2 ? q80 : v0;
    const std::size_t span = is_v2 ? 48 : 28;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) b[rng() % span] = static_cast<std::byte>(rng() & 0xff);
    try {
      const Llama2cModel m = qkv::parse_llama2c(b, "corrupt.bin");
      // Accepted only if the header still describes exactly this file.
      EXPECT_EQ(m.layers.size(), static_cast<std::size_t>(m.config.n_layers));
      EXPECT_EQ(m.config.dim % m.config.n_heads, 0);
    } catch (const qkv::Error&) {
    }
  }
}

TEST(Llama2cHostile, FilesOnDiskAreCheckedAndNamed) {
  const TempDir dir("llama2c");
  auto b = file_bytes(kQ80);
  b.resize(100000);
  const fs::path p = dir.write("cut_q80.bin", b);
  try {
    (void)qkv::read_llama2c(p);
    ADD_FAILURE() << "accepted a truncated checkpoint";
  } catch (const qkv::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("got 100000 (truncated?)"), std::string::npos) << msg;
  }
  EXPECT_THROW((void)qkv::read_llama2c(dir.path() / "missing.bin"), qkv::Error);
  EXPECT_THROW((void)qkv::read_llama2c(dir.path()), qkv::Error);
  EXPECT_THROW((void)qkv::read_llama2c(dir.write("empty.bin", {})), qkv::Error);
  Weights w = random_weights(kSmall, 3);
  const Llama2cModel m = qkv::read_llama2c(dir.write("v2.bin", write_v2(w, 8)));
  expect_weights(m, w);
}
