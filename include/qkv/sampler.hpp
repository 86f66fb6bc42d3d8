#pragma once
/// @file sampler.hpp
/// Next-token sampling from logits, as llama2.c's run.c (https://github.com/karpathy/llama2.c,
/// MIT licence): greedy (argmax) at temperature 0; otherwise softmax(logits / temperature) and a
/// draw, restricted to the nucleus when 0 < top_p < 1 (Holtzman et al. 2020, "The Curious Case of
/// Neural Text Degeneration", sec. 3.1: the smallest set of most probable tokens whose
/// cumulative probability exceeds top_p).
///
/// The random numbers come from llama2.c's xorshift64* generator (Marsaglia 2003; Vigna 2016),
/// seeded with `seed`: for a given seed, the same logits always give the same tokens.

#include <cstdint>
#include <span>
#include <vector>

namespace qkv {

struct SamplerConfig {
  double temperature = 1.0;  ///< >= 0; 0 = greedy (argmax, lowest index on ties)
  double top_p = 0.9;        ///< in (0, 1]; 1 = sample from the whole distribution
  std::uint64_t seed = 1;    ///< xorshift state; must be != 0 (a zero state never changes)
};

class Sampler {
 public:
  /// @throws qkv::Error for a negative or non-finite temperature, top_p outside (0, 1], seed 0.
  explicit Sampler(const SamplerConfig& config = {});
  const SamplerConfig& config() const noexcept { return cfg_; }

  /// The next token id in [0, logits.size()).
  /// @throws qkv::Error for empty logits.
  int sample(std::span<const float> logits);

  /// llama2.c's random_f32(): a float in [0, 1) from 24 random bits; advances the state.
  float random_f32() noexcept;

 private:
  SamplerConfig cfg_;
  std::uint64_t state_;
  std::vector<float> probs_;
  std::vector<int> order_;
};

/// Index of the largest value (lowest index on ties). @throws qkv::Error for empty input.
int argmax(std::span<const float> values);

}  // namespace qkv
