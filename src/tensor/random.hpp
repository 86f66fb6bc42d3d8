#pragma once
// Reproducible random numbers for what qkv generates from a seed (the trainer's data and weights,
// the figures of the scaling study): std::mt19937_64 (output fixed by the standard), unbiased
// integers by rejection, normals by Box-Muller, all written out so that a seed gives the same
// numbers on any standard library (the standard distributions are implementation-defined).
#include <cmath>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace qkv::detail {

// SplitMix64's finaliser (Steele et al. 2014) of seed + golden-ratio multiples of `stream`:
// independent-looking seeds for the weights, the data and each batch.
inline std::uint64_t mix(std::uint64_t seed, std::uint64_t stream) {
  std::uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (stream + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : gen_(seed) {}
  // Uniform in [0, n), n >= 1.
  std::uint64_t below(std::uint64_t n) {
    const std::uint64_t limit = ~std::uint64_t{0} - (~std::uint64_t{0} % n);
    std::uint64_t x;
    do x = gen_();
    while (x >= limit);
    return x % n;
  }
  // Fisher-Yates on the first k entries: v[0..k) becomes a uniform sample without replacement.
  template <class T>
  void shuffle_prefix(std::vector<T>& v, std::int64_t k) {
    const auto n = static_cast<std::uint64_t>(v.size());
    for (std::uint64_t i = 0; i < static_cast<std::uint64_t>(k) && i + 1 < n; ++i)
      std::swap(v[i], v[i + below(n - i)]);
  }
  double normal() {
    if (have_) {
      have_ = false;
      return spare_;
    }
    const double u1 = (static_cast<double>(gen_() >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]: log finite
    const double u2 = static_cast<double>(gen_() >> 11) * 0x1.0p-53;
    const double r = std::sqrt(-2.0 * std::log(u1)), a = 2.0 * 3.14159265358979323846 * u2;
    spare_ = r * std::sin(a);
    have_ = true;
    return r * std::cos(a);
  }

 private:
  std::mt19937_64 gen_;
  double spare_ = 0.0;
  bool have_ = false;
};

}  // namespace qkv::detail
