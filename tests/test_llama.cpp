// Tests of the Llama-2 forward pass on the real stories260K model: the greedy continuation the
// model's README states, the float32 fast path against the float64 reference forward pass at
// every position, prefill/decode equivalence, the attention-inspection hook, and bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/llama.hpp"
#include "qkv/llama2c.hpp"
#include "qkv/sampler.hpp"
#include "qkv/tokenizer.hpp"

namespace fs = std::filesystem;
using namespace qkv;

namespace {

const fs::path kDir = fs::path(QKV_SOURCE_DIR) / "models/stories260K";
const std::string kStart =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.";

const Llama2cModel& v0() {
  static const Llama2cModel m = read_llama2c(kDir / "stories260K.bin");
  return m;
}
const Tokenizer& tok() {
  static const Tokenizer t = read_tokenizer(kDir / "tok512.bin", 512);
  return t;
}

int greedy(std::span<const float> logits) { return argmax(logits); }

std::string greedy_text(const Llama2cModel& weights, const LlamaOptions& opts, int steps) {
  Llama model(weights, opts);
  const std::vector<int> prompt = tok().encode("Once upon a time");
  const std::vector<int> seq = generate(model, prompt, steps, greedy);
  return tok().decode(seq);
}

// A greedy run through the fast path: prefill, then one token at a time.
struct GreedyRun {
  std::vector<int> seq;        // the fed tokens: prompt + greedy tokens
  std::vector<float> logits;   // [positions, vocab]: the logits of every fed position
  std::int64_t positions = 0;  // positions fed
};

// Prefills `prompt`, then greedily decodes until `n` positions have been fed; logits of every
// fed position are kept (the prefill with all_logits).
GreedyRun greedy_run(Llama& model, const std::vector<int>& prompt, int n) {
  const int V = model.config().vocab_size;
  GreedyRun r;
  r.seq = prompt;
  model.reset();
  TensorView lg = model.forward(prompt, /*all_logits=*/true);
  r.logits.assign(lg.data_as<const float>(), lg.data_as<const float>() + lg.numel());
  while (static_cast<int>(model.length()) < n) {
    const std::span<const float> last(r.logits.data() + r.logits.size() - V, static_cast<std::size_t>(V));
    r.seq.push_back(argmax(last));
    lg = model.forward(std::span<const int>(&r.seq.back(), 1));
    r.logits.insert(r.logits.end(), lg.data_as<const float>(), lg.data_as<const float>() + V);
  }
  r.positions = model.length();
  return r;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0.0;
  for (std::size_t i = 0; i < std::min(a.size(), b.size()); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

}  // namespace

TEST(Llama, GreedyContinuationOfOnceUponATime) {
  const std::string text = greedy_text(v0(), {}, 40);
  EXPECT_EQ(text.substr(0, kStart.size()), kStart) << text;
}

TEST(Llama, GreedyContinuationQ80Checkpoint) {
  const Llama2cModel q80 = read_llama2c(kDir / "stories260K_q80.bin");
  EXPECT_EQ(q80.config.version, 2);
  const std::string text = greedy_text(q80, {}, 40);
  EXPECT_EQ(text.substr(0, kStart.size()), kStart) << text;
}

TEST(Llama, GreedyContinuationWithReferenceKernel) {
  LlamaOptions o;
  o.attention_kernel = KernelKind::reference;
  const std::string text = greedy_text(v0(), o, 40);
  EXPECT_EQ(text.substr(0, kStart.size()), kStart) << text;
}

// The fast path (default kernels: prefill through Sq = prompt length, decode through Sq = 1)
// against the float64 forward pass, at every position of a 64-token run; the greedy choices
// of both must agree.
TEST(Llama, FastPathMatchesFloat64ReferenceOver64Tokens) {
  for (KernelKind kernel : {KernelKind::automatic, KernelKind::reference}) {
    LlamaOptions o;
    o.attention_kernel = kernel;
    Llama model(v0(), o);
    const GreedyRun r = greedy_run(model, tok().encode("Once upon a time"), 64);
    ASSERT_EQ(r.positions, 64);
    ASSERT_EQ(r.seq.size(), 64u);
    const std::vector<int>& fed = r.seq;
    const std::vector<double> ref = reference::llama_forward(v0(), fed);
    const double err = max_abs_diff(r.logits, ref);
    EXPECT_LE(err, 1e-3) << "kernel " << static_cast<int>(kernel);
    std::printf("attention kernel %s: max |logit diff| vs float64 over 64 positions = %.3e\n",
                kernel == KernelKind::reference ? "reference" : "automatic", err);
    EXPECT_GT(err, 0.0);  // float32 does round: a zero would mean the reference was not independent
    const int V = 512;
    for (std::size_t t = 4; t < fed.size(); ++t) {  // from the last prompt position on: greedy picks
      int best = 0;
      for (int j = 1; j < V; ++j)
        if (ref[t * V + j] > ref[t * V + best]) best = j;
      const int fast =
          t + 1 < fed.size() ? fed[t + 1] : argmax(std::span<const float>(r.logits.data() + t * V, V));
      EXPECT_EQ(best, fast) << "position " << t;
    }
  }
}

TEST(Llama, PrefillThenDecodeEqualsAllAtOnce) {
  Llama model(v0());
  const GreedyRun r = greedy_run(model, tok().encode("Once upon a time"), 48);
  const std::vector<int>& fed = r.seq;
  model.reset();
  const TensorView all = model.forward(fed, /*all_logits=*/true);
  ASSERT_EQ(all.shape(), (Shape{48, 512}));
  std::vector<double> a(all.data_as<const float>(), all.data_as<const float>() + all.numel());
  EXPECT_LE(max_abs_diff(r.logits, a), 1e-4);
  // Chunks of 7 (a prefill continuing a filled cache) give the same again.
  model.reset();
  std::vector<float> chunked;
  for (std::size_t i = 0; i < fed.size(); i += 7) {
    const std::size_t n = std::min<std::size_t>(7, fed.size() - i);
    const TensorView c = model.forward(std::span<const int>(fed.data() + i, n), true);
    chunked.insert(chunked.end(), c.data_as<const float>(), c.data_as<const float>() + c.numel());
  }
  EXPECT_LE(max_abs_diff(chunked, a), 1e-4);
  // Only the last row when all_logits is false, equal to the last row of the full run.
  model.reset();
  const TensorView last = model.forward(fed);
  ASSERT_EQ(last.shape(), (Shape{1, 512}));
  for (int j = 0; j < 512; ++j) EXPECT_NEAR(last.data_as<const float>()[j], a[47 * 512 + j], 1e-4);
}

TEST(Llama, Llama2cFloatAnglesAgreeWithExactAngles) {
  LlamaOptions o;
  o.rope_angles = RopeAngles::llama2c_f32;
  Llama a(v0()), b(v0(), o);
  const std::vector<int> t = tok().encode("Once upon a time, there was a little girl named Lily.");
  const TensorView la = a.forward(t, true), lb = b.forward(t, true);
  double err = 0.0;
  for (std::int64_t i = 0; i < la.numel(); ++i)
    err = std::max(err, std::fabs(double{la.data_as<const float>()[i]} - lb.data_as<const float>()[i]));
  EXPECT_LE(err, 1e-4);
  // A moved-from runner hands its state over.
  Llama c(std::move(b));
  EXPECT_EQ(c.length(), static_cast<std::int64_t>(t.size()));
  EXPECT_EQ(c.options().rope_angles, RopeAngles::llama2c_f32);
}

TEST(Llama, Q80AndFloat32CheckpointsGiveTheSameLogits) {
  const Llama2cModel q80 = read_llama2c(kDir / "stories260K_q80.bin");
  const std::vector<int> t = tok().encode("The cat sat on the mat.");
  Llama a(v0()), b(q80);
  const TensorView la = a.forward(t, true), lb = b.forward(t, true);
  ASSERT_EQ(la.numel(), lb.numel());
  for (std::int64_t i = 0; i < la.numel(); ++i)
    ASSERT_EQ(la.data_as<const float>()[i], lb.data_as<const float>()[i]);
}

// The inspection hook: q, k, v of every layer and position, and attention weights that are the
// softmax of q.k / sqrt(D) over the earlier positions (recomputed here from those views).
TEST(Llama, AttentionWeightsFromRecordedQueriesAndCachedKeys) {
  LlamaOptions o;
  o.record_queries = true;
  Llama model(v0(), o);
  const std::vector<int> t = tok().encode("Lily and Ben went to the park. Lily saw a big dog.");
  model.forward(t);
  const auto S = static_cast<std::int64_t>(t.size());
  const int Hq = 8, Hkv = 4, D = 8;
  for (int layer : {0, 4}) {
    const TensorView q = model.queries(layer), k = model.keys(layer), v = model.values(layer);
    ASSERT_EQ(q.shape(), (Shape{S, Hq, D}));
    ASSERT_EQ(k.shape(), (Shape{Hkv, S, D}));
    ASSERT_EQ(v.shape(), (Shape{Hkv, S, D}));
    for (std::int64_t pos : {std::int64_t{0}, S / 2, S - 1}) {
      const Tensor w = model.attention_weights(layer, pos);
      ASSERT_EQ(w.shape(), (Shape{Hq, pos + 1}));
      for (int h = 0; h < Hq; ++h) {
        const int g = h / (Hq / Hkv);
        std::vector<double> s(static_cast<std::size_t>(pos + 1));
        double mx = -INFINITY, sum = 0.0;
        for (std::int64_t j = 0; j <= pos; ++j) {
          double acc = 0.0;
          for (int d = 0; d < D; ++d)
            acc += static_cast<double>(q.data_as<const float>()[(pos * Hq + h) * D + d]) *
                   k.data_as<const float>()[g * k.stride(0) + j * D + d];
          s[static_cast<std::size_t>(j)] = acc / std::sqrt(double{D});
          mx = std::max(mx, s[static_cast<std::size_t>(j)]);
        }
        for (double& x : s) sum += x = std::exp(x - mx);
        double row = 0.0;
        for (std::int64_t j = 0; j <= pos; ++j) {
          EXPECT_NEAR(w.data_as<const double>()[h * (pos + 1) + j], s[static_cast<std::size_t>(j)] / sum,
                      1e-12);
          row += w.data_as<const double>()[h * (pos + 1) + j];
        }
        EXPECT_NEAR(row, 1.0, 1e-12);
      }
    }
  }
  // Position 0 attends only to itself.
  const Tensor w0 = model.attention_weights(2, 0);
  for (int h = 0; h < Hq; ++h) EXPECT_DOUBLE_EQ(w0.data_as<const double>()[h], 1.0);
  EXPECT_THROW(model.attention_weights(5, 0), Error);
  EXPECT_THROW(model.attention_weights(0, S), Error);
  Llama plain(v0());
  plain.forward(t);
  EXPECT_THROW(plain.queries(0), Error);
  EXPECT_THROW(plain.attention_weights(0, 0), Error);
}

TEST(Llama, GenerateStopsAtStepsAndReportsCounts) {
  Llama model(v0());
  const std::vector<int> prompt = tok().encode("Once upon a time");  // 5 tokens
  ASSERT_EQ(prompt.size(), 5u);
  std::vector<std::pair<int, int>> seen;
  GenerationStats st;
  const std::vector<int> seq = generate(
      model, prompt, 20, greedy, [&](int a, int b) { seen.emplace_back(a, b); }, &st);
  // 20 positions fed: 5 prompt + 15 decoded; 16 sampled tokens (the last one is not fed).
  EXPECT_EQ(model.length(), 20);
  EXPECT_EQ(seq.size(), 21u);
  EXPECT_EQ(st.prompt_tokens, 5);
  EXPECT_EQ(st.generated_tokens, 16);
  EXPECT_EQ(st.decode_steps, 15);
  ASSERT_EQ(seen.size(), 20u);  // every token after BOS, prompt included
  for (std::size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(seen[i].first, seq[i]);
    EXPECT_EQ(seen[i].second, seq[i + 1]);
  }
  // steps == prompt size: the prefill alone, one sampled token.
  EXPECT_EQ(generate(model, prompt, 5, greedy).size(), 6u);
  // A sampler returning BOS ends generation without keeping it.
  const std::vector<int> stopped = generate(model, prompt, 30, [](std::span<const float>) { return 1; });
  EXPECT_EQ(stopped, prompt);
}

TEST(Llama, SampledGenerationIsDeterministicForASeed) {
  Llama model(v0());
  const std::vector<int> prompt = tok().encode("Once upon a time");
  auto run = [&](std::uint64_t seed) {
    Sampler s({0.8, 0.9, seed});
    return generate(model, prompt, 60, [&](std::span<const float> l) { return s.sample(l); });
  };
  const auto a = run(42), b = run(42), c = run(7);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

TEST(Llama, BadInput) {
  Llama model(v0());
  const std::vector<int> prompt = tok().encode("Once upon a time");
  EXPECT_THROW(model.forward(std::vector<int>{}), Error);
  EXPECT_THROW(model.forward(std::vector<int>{1, 512}), Error);
  EXPECT_THROW(model.forward(std::vector<int>{-1}), Error);
  EXPECT_EQ(model.length(), 0);
  std::vector<int> long_seq(513, 5);
  long_seq[0] = 1;
  EXPECT_THROW(model.forward(long_seq), Error);
  EXPECT_EQ(model.length(), 0);
  model.forward(std::span<const int>(long_seq.data(), 512));
  EXPECT_THROW(model.forward(std::vector<int>{5}), Error);  // the cache is full
  EXPECT_THROW(generate(model, prompt, 513, greedy), Error);
  EXPECT_THROW(generate(model, prompt, 4, greedy), Error);  // fewer steps than prompt tokens
  EXPECT_THROW(generate(model, {}, 10, greedy), Error);
  EXPECT_THROW(generate(model, long_seq, 512, greedy), Error);
  EXPECT_THROW(Llama(Llama2cModel{}), Error);
  EXPECT_THROW(reference::llama_forward(v0(), long_seq), Error);
  EXPECT_THROW(reference::llama_forward(v0(), std::vector<int>{}), Error);
}

// ---- the sampler ---------------------------------------------------------------------------

TEST(Sampler, GreedyIsArgmaxWithLowestIndexOnTies) {
  Sampler s({0.0, 0.9, 1});
  const std::vector<float> l{0.1f, 3.0f, -2.0f, 3.0f};
  EXPECT_EQ(s.sample(l), 1);
  EXPECT_EQ(argmax(l), 1);
  EXPECT_THROW(argmax(std::vector<float>{}), Error);
  EXPECT_THROW(s.sample(std::vector<float>{}), Error);
}

TEST(Sampler, XorshiftMatchesLlama2c) {
  // llama2.c: state ^= state >> 12; ^= << 25; ^= >> 27; (state * 0x2545F4914F6CDD1D) >> 32.
  std::uint64_t st = 1234;
  Sampler s({1.0, 1.0, 1234});
  for (int i = 0; i < 100; ++i) {
    st ^= st >> 12;
    st ^= st << 25;
    st ^= st >> 27;
    const auto r = static_cast<std::uint32_t>((st * 0x2545F4914F6CDD1Dull) >> 32);
    const float f = static_cast<float>(r >> 8) / 16777216.0f;
    ASSERT_EQ(s.random_f32(), f);
    ASSERT_GE(f, 0.0f);
    ASSERT_LT(f, 1.0f);
  }
}

TEST(Sampler, FrequenciesFollowTheSoftmax) {
  // logits log(p): p = 0.5, 0.3, 0.15, 0.05; at temperature 1 the draws follow p.
  const std::vector<double> p{0.5, 0.3, 0.15, 0.05};
  std::vector<float> l;
  for (double x : p) l.push_back(static_cast<float>(std::log(x)));
  Sampler s({1.0, 1.0, 99});
  std::vector<int> count(4, 0);
  const int n = 40000;
  for (int i = 0; i < n; ++i) ++count[static_cast<std::size_t>(s.sample(l))];
  for (int j = 0; j < 4; ++j)
    EXPECT_NEAR(count[static_cast<std::size_t>(j)] / double(n), p[static_cast<std::size_t>(j)], 0.01);
  // Temperature 0.5 squares the odds: p^2 normalised.
  Sampler cold({0.5, 1.0, 5});
  std::fill(count.begin(), count.end(), 0);
  for (int i = 0; i < n; ++i) ++count[static_cast<std::size_t>(cold.sample(l))];
  double z = 0.0;
  for (double x : p) z += x * x;
  for (int j = 0; j < 4; ++j)
    EXPECT_NEAR(count[static_cast<std::size_t>(j)] / double(n),
                p[static_cast<std::size_t>(j)] * p[static_cast<std::size_t>(j)] / z, 0.01);
}

TEST(Sampler, TopPKeepsOnlyTheNucleus) {
  // p = 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0, 1} (0.5 + 0.3 > 0.7), renormalised 5:3.
  const std::vector<double> p{0.15, 0.5, 0.05, 0.3};
  std::vector<float> l;
  for (double x : p) l.push_back(static_cast<float>(std::log(x)));
  Sampler s({1.0, 0.7, 3});
  std::vector<int> count(4, 0);
  const int n = 40000;
  for (int i = 0; i < n; ++i) ++count[static_cast<std::size_t>(s.sample(l))];
  EXPECT_EQ(count[0], 0);
  EXPECT_EQ(count[2], 0);
  EXPECT_NEAR(count[1] / double(n), 0.5 / 0.8, 0.01);
  EXPECT_NEAR(count[3] / double(n), 0.3 / 0.8, 0.01);
  // A tiny top_p is greedy, even on a uniform row (every token under the cutoff).
  Sampler t({1.0, 1e-6, 3});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(t.sample(l), 1);
  const std::vector<float> flat(512, 0.0f);
  const int pick = t.sample(flat);
  EXPECT_GE(pick, 0);
  EXPECT_LT(pick, 512);
}

TEST(Sampler, RefusesBadSettings) {
  EXPECT_THROW(Sampler({-0.1, 0.9, 1}), Error);
  EXPECT_THROW(Sampler({NAN, 0.9, 1}), Error);
  EXPECT_THROW(Sampler({1.0, 0.0, 1}), Error);
  EXPECT_THROW(Sampler({1.0, 1.5, 1}), Error);
  EXPECT_THROW(Sampler({1.0, -0.5, 1}), Error);
  EXPECT_THROW(Sampler({1.0, 0.9, 0}), Error);
  EXPECT_NO_THROW(Sampler({0.0, 1.0, 1}));
}
