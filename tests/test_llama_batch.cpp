// LlamaBatch (continuous batching over paged KV caches) against Llama with batch_invariant on
// the stories260K model: every sequence's logits bitwise equal to those of the same sequence run
// alone with the same calls, whatever else is in the step (prefills beside decode steps, sequences
// joining and leaving, pages reused), on every ISA level; generate_batch equal to generate() one
// prompt at a time; Llama's batch_invariant logits close to its default kernels'.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "attention_diff.hpp"  // test_isas, IsaCap
#include "qkv/error.hpp"
#include "qkv/llama.hpp"
#include "qkv/sampler.hpp"

using namespace qkv;
using namespace qkv::test;
namespace fs = std::filesystem;

namespace {

const Llama2cModel& model() {
  static const Llama2cModel m = read_llama2c(fs::path(QKV_SOURCE_DIR) / "models/stories260K/stories260K.bin");
  return m;
}

std::vector<int> random_tokens(int n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int> t(static_cast<std::size_t>(n));
  for (int& x : t) x = 2 + static_cast<int>(rng() % 500);
  t[0] = 1;  // BOS
  return t;
}

}  // namespace

// Four sequences: prompts of 9, 30, 2 and 17 tokens; each step prefills the newly joined ones and
// decodes one token of the others; sequence 2 leaves early and 3 joins in its pages.
TEST(LlamaBatch, LogitsBitwiseEqualToOneSequenceAlone) {
  const std::vector<int> lens = {9, 30, 2, 17};
  const int decode = 25;
  std::vector<std::vector<int>> toks;
  for (std::size_t s = 0; s < lens.size(); ++s) toks.push_back(random_tokens(lens[s] + decode, 40 + s));
  LlamaOptions lo;
  lo.batch_invariant = true;
  for (detail::Isa isa : test_isas(DType::f32)) {
    IsaCap cap(isa);
    // Alone: the prompt in one forward(), then one token per call; keep every call's logits.
    std::vector<std::vector<std::vector<float>>> want(lens.size());
    {
      Llama one(model(), lo);
      for (std::size_t s = 0; s < lens.size(); ++s) {
        one.reset();
        const int vocab = one.config().vocab_size;
        TensorView l = one.forward(std::span<const int>(toks[s].data(), static_cast<std::size_t>(lens[s])));
        want[s].emplace_back(l.data_as<float>(), l.data_as<float>() + vocab);
        for (int t = lens[s]; t < lens[s] + decode - 1; ++t) {
          l = one.forward(std::span<const int>(&toks[s][static_cast<std::size_t>(t)], 1));
          want[s].emplace_back(l.data_as<float>(), l.data_as<float>() + vocab);
        }
      }
    }
    LlamaBatch batch(model(), 3);
    const int vocab = batch.config().vocab_size;
    std::vector<std::int64_t> id(lens.size(), -1);
    std::vector<int> pos(lens.size(), 0), calls(lens.size(), 0);
    id[0] = batch.add_sequence();
    id[1] = batch.add_sequence();
    id[2] = batch.add_sequence();
    for (int step = 0; step < 200; ++step) {
      if (calls[2] == 4 && id[2] >= 0) { batch.free_sequence(id[2]); id[2] = -2; id[3] = batch.add_sequence(); }
      std::vector<std::int64_t> seqs, counts;
      std::vector<int> tokens, which;
      for (std::size_t s = 0; s < lens.size(); ++s) {
        if (id[s] < 0 || calls[s] == decode) continue;
        const int n = pos[s] == 0 ? lens[s] : 1;
        seqs.push_back(id[s]); counts.push_back(n); which.push_back(static_cast<int>(s));
        tokens.insert(tokens.end(), toks[s].begin() + pos[s], toks[s].begin() + pos[s] + n);
      }
      if (seqs.empty()) break;
      const TensorView l = batch.step(seqs, counts, tokens);
      for (std::size_t b = 0; b < seqs.size(); ++b) {
        const std::size_t s = static_cast<std::size_t>(which[b]);
        EXPECT_EQ(std::memcmp(l.data_as<float>() + b * vocab, want[s][static_cast<std::size_t>(calls[s])].data(), vocab * 4), 0)
            << "sequence " << s << " call " << calls[s] << " isa " << detail::isa_name(isa);
        pos[s] += static_cast<int>(counts[b]);
        ++calls[s];
      }
    }
    EXPECT_EQ(calls[3], decode);
  }
}

TEST(LlamaBatch, GenerateBatchEqualsOneAtATime) {
  const std::vector<std::vector<int>> prompts = {random_tokens(5, 1), random_tokens(12, 2), {1}, random_tokens(3, 4),
                                                 random_tokens(20, 5)};
  SamplerConfig sc;
  sc.temperature = 0.9;
  sc.seed = 1234;
  LlamaOptions lo;
  lo.batch_invariant = true;
  LlamaBatch batch(model(), 2);
  std::vector<Sampler> samplers(prompts.size(), Sampler(sc));
  GenerationStats st;
  const auto got = generate_batch(batch, prompts, 60, 2,
                                  [&](std::size_t i, std::span<const float> l) { return samplers[i].sample(l); }, &st);
  Llama one(model(), lo);
  std::int64_t generated = 0;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    Sampler s(sc);
    const auto want = generate(one, prompts[i], 60, [&](std::span<const float> l) { return s.sample(l); });
    EXPECT_EQ(got[i], want) << "prompt " << i;
    generated += static_cast<std::int64_t>(want.size() - prompts[i].size());
  }
  EXPECT_EQ(st.generated_tokens, generated);
  EXPECT_THROW(generate_batch(batch, prompts, 10, 2, [](std::size_t, std::span<const float>) { return 2; }), Error);  // 20 > 10
}

// The serving kernel moves the logits by rounding only.
TEST(LlamaBatch, BatchInvariantLlamaCloseToDefault) {
  const std::vector<int> t = random_tokens(40, 9);
  LlamaOptions inv;
  inv.batch_invariant = true;
  Llama a(model()), b(model(), inv);
  const TensorView la = a.forward(t, true), lb = b.forward(t, true);
  double worst = 0;
  for (std::int64_t i = 0; i < la.numel(); ++i)
    worst = std::max(worst, std::abs(double(la.data_as<float>()[i]) - lb.data_as<float>()[i]));
  EXPECT_LT(worst, 1e-3);
}
