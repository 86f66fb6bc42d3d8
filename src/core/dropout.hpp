#pragma once
// Attention dropout's keep decisions: one pure function of (seed, offset, b, h, i, j), so the
// reference, the kernels (later) and the backward regenerate the same mask instead of storing it
// (FlashAttention-2, Dao 2023, sec. 3.1, dropout in the fused kernel; dropout itself: Srivastava
// et al. 2014). The generator is Philox 4x32-10 (Salmon et al. 2011, "Parallel random numbers:
// as easy as 1, 2, 3", sec. 4.1), written from the paper's definition and checked against
// Random123's known-answer vectors (tests/test_dropout.cpp). The rule, in words, is in
// docs/semantics.md, "Dropout".
#include <array>
#include <cstdint>

namespace qkv::detail {

using Philox4x32 = std::array<std::uint32_t, 4>;

/// Philox 4x32 with `rounds` rounds (10 is the standard one) of counter `c` under key (k0, k1):
/// each round multiplies c0 by M0 and c2 by M1 (64-bit products split into hi, lo) and gives
/// (hi(M1 c2) ^ c1 ^ k0, lo(M1 c2), hi(M0 c0) ^ c3 ^ k1, lo(M0 c0)); the key is bumped by
/// (W0, W1) between rounds.
constexpr Philox4x32 philox4x32(Philox4x32 c, std::uint32_t k0, std::uint32_t k1, int rounds = 10) noexcept {
  constexpr std::uint64_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;
  constexpr std::uint32_t W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  for (int r = 0; r < rounds; ++r) {
    if (r > 0) {
      k0 += W0;
      k1 += W1;
    }
    const std::uint64_t p0 = M0 * c[0], p1 = M1 * c[2];
    c = {static_cast<std::uint32_t>(p1 >> 32) ^ c[1] ^ k0, static_cast<std::uint32_t>(p1),
         static_cast<std::uint32_t>(p0 >> 32) ^ c[3] ^ k1, static_cast<std::uint32_t>(p0)};
  }
  return c;
}

/// The dropout of one call, lowered (Problem::dropout). Off (p = 0) unless validate.cpp sets it.
///
/// The rule: the weight of key j in row i of (batch b, query head h) is kept iff
///   u >= threshold,  u = philox4x32(counter, key)[j % 4],
///   key     = (lo32(seed), hi32(seed)),
///   counter = (j / 4, i, lo32(n), hi32(n)),  n = offset + (b0 + b) * num_heads + h  (mod 2^64),
///   threshold = floor(p * 2^32 + 1/2)  (0 for p = 0: every key kept),
/// and a kept weight is multiplied by rescale = 1 / (1 - p) (float64). One Philox call gives the
/// decisions of the four keys 4m .. 4m + 3 of a row. b0 is the call's first batch index: 0,
/// except for one sequence of a packed call lowered on its own (its index in the batch). A call
/// uses the words n in [offset, offset + B * num_heads), so successive calls that advance the
/// offset by B * num_heads draw disjoint counters (as PyTorch advances its Philox offset).
struct Dropout {
  double p = 0.0;
  std::uint64_t seed = 0, offset = 0;
  std::int64_t num_heads = 1;   // Hq
  std::int64_t b0 = 0;          // batch index of this problem's b = 0
  std::uint64_t threshold = 0;  // keep iff u32 >= threshold (2^32: never)
  double rescale = 1.0;

  bool on() const noexcept { return p > 0.0; }

  /// threshold and rescale of probability p in [0, 1) (p * 2^32 is exact in float64).
  static Dropout make(double p, std::uint64_t seed, std::uint64_t offset, std::int64_t num_heads) noexcept {
    Dropout d;
    d.p = p;
    d.seed = seed;
    d.offset = offset;
    d.num_heads = num_heads;
    const double t = p * 4294967296.0 + 0.5;
    d.threshold = static_cast<std::uint64_t>(t);  // t >= 0.5: truncation is floor
    d.rescale = 1.0 / (1.0 - p);
    return d;
  }

  /// The four Philox words of keys 4 * quad .. 4 * quad + 3 of row (b, h, i).
  Philox4x32 words(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t quad) const noexcept {
    const std::uint64_t n = offset + static_cast<std::uint64_t>(b0 + b) * static_cast<std::uint64_t>(num_heads) +
                            static_cast<std::uint64_t>(h);
    return philox4x32({static_cast<std::uint32_t>(quad), static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(n),
                       static_cast<std::uint32_t>(n >> 32)},
                      static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
  }
  bool keep_word(std::uint32_t u) const noexcept { return u >= threshold; }

  /// Whether the weight of (b, h, i, j) is kept (always, with dropout off).
  bool keep(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const noexcept {
    if (!on()) return true;
    return keep_word(words(b, h, i, j / 4)[static_cast<std::size_t>(j % 4)]);
  }
  /// The factor of the weight of (b, h, i, j): rescale if kept, else 0 (1 with dropout off).
  double factor(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const noexcept {
    if (!on()) return 1.0;
    return keep(b, h, i, j) ? rescale : 0.0;
  }
};

}  // namespace qkv::detail
