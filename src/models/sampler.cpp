// Token sampling as llama2.c's run.c (sample_argmax, sample_mult, sample_topp), in float32 as
// there, with a stable order for equal probabilities so that a seed fixes the result.
#include "qkv/sampler.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "qkv/error.hpp"

namespace qkv {

int argmax(std::span<const float> values) {
  if (values.empty()) throw Error("argmax: values: expected at least one element, got none");
  int best = 0;
  for (std::size_t i = 1; i < values.size(); ++i)
    if (values[i] > values[static_cast<std::size_t>(best)]) best = static_cast<int>(i);
  return best;
}

Sampler::Sampler(const SamplerConfig& config) : cfg_(config), state_(config.seed) {
  if (!std::isfinite(cfg_.temperature) || cfg_.temperature < 0)
    throw Error("temperature: expected a finite number >= 0 (0 = greedy), got " +
                std::to_string(cfg_.temperature));
  if (!(cfg_.top_p > 0 && cfg_.top_p <= 1))
    throw Error("top_p: expected a number in (0, 1], got " + std::to_string(cfg_.top_p));
  if (cfg_.seed == 0) throw Error("seed: expected a nonzero seed (xorshift state), got 0");
}

float Sampler::random_f32() noexcept {
  // xorshift64* exactly as llama2.c's random_u32(), then its 24-bit float.
  state_ ^= state_ >> 12;
  state_ ^= state_ << 25;
  state_ ^= state_ >> 27;
  const auto r = static_cast<std::uint32_t>((state_ * 0x2545F4914F6CDD1Dull) >> 32);
  return static_cast<float>(r >> 8) / 16777216.0f;
}

int Sampler::sample(std::span<const float> logits) {
  if (logits.empty()) throw Error("sampler: logits: expected at least one element, got none");
  if (cfg_.temperature == 0) return argmax(logits);
  const std::size_t n = logits.size();
  const auto temp = static_cast<float>(cfg_.temperature);
  probs_.resize(n);
  float mx = -INFINITY;
  for (std::size_t i = 0; i < n; ++i) mx = std::max(mx, probs_[i] = logits[i] / temp);
  float sum = 0.0f;
  for (float& p : probs_) sum += p = std::exp(p - mx);
  for (float& p : probs_) p /= sum;
  const float coin = random_f32();
  if (cfg_.top_p >= 1.0) {
    float cdf = 0.0f;
    for (std::size_t i = 0; i < n; ++i) {
      cdf += probs_[i];
      if (coin < cdf) return static_cast<int>(i);
    }
    return static_cast<int>(n - 1);  // rounding: the cdf may end just below 1
  }
  // Nucleus: tokens below (1 - top_p) / (n - 1) cannot be in it, so they are dropped before the
  // sort (llama2.c's shortcut); then the smallest prefix whose mass exceeds top_p.
  const auto top_p = static_cast<float>(cfg_.top_p);
  const float cutoff = n > 1 ? (1.0f - top_p) / static_cast<float>(n - 1) : 0.0f;
  order_.clear();
  for (std::size_t i = 0; i < n; ++i)
    if (probs_[i] >= cutoff) order_.push_back(static_cast<int>(i));
  if (order_.empty()) order_.push_back(argmax(probs_));  // a near-uniform row with top_p < 1/n
  std::stable_sort(order_.begin(), order_.end(), [&](int a, int b) {
    return probs_[static_cast<std::size_t>(a)] > probs_[static_cast<std::size_t>(b)];
  });
  float cumulative = 0.0f;
  std::size_t last = order_.size() - 1;
  for (std::size_t i = 0; i < order_.size(); ++i) {
    cumulative += probs_[static_cast<std::size_t>(order_[i])];
    if (cumulative > top_p) {
      last = i;
      break;
    }
  }
  const float r = coin * cumulative;
  float cdf = 0.0f;
  for (std::size_t i = 0; i <= last; ++i) {
    cdf += probs_[static_cast<std::size_t>(order_[i])];
    if (r < cdf) return order_[i];
  }
  return order_[last];
}

}  // namespace qkv
