// qkv::dropout_keep_mask: the dropout decisions of core/dropout.hpp written out, one per weight.
#include "qkv/dropout.hpp"

#include <string>

#include "core/dropout.hpp"
#include "core/validate.hpp"
#include "qkv/error.hpp"

namespace qkv {

Tensor dropout_keep_mask(std::uint64_t dropout_seed, std::uint64_t dropout_offset, double dropout_p, std::int64_t B,
                         std::int64_t num_heads, std::int64_t seqlen_q, std::int64_t seqlen_k) {
  detail::check_dropout_p(dropout_p);
  const struct { const char* name; std::int64_t n; } sizes[] = {
      {"B", B}, {"num_heads", num_heads}, {"seqlen_q", seqlen_q}, {"seqlen_k", seqlen_k}};
  std::int64_t total = 1;
  for (const auto& s : sizes) {
    if (s.n < 0) throw Error(std::string(s.name) + ": expected >= 0, got " + std::to_string(s.n));
    if (__builtin_mul_overflow(total, s.n, &total))
      throw Error(std::string(s.name) + ": the mask's size overflows int64 (B = " + std::to_string(B) +
                  ", num_heads = " + std::to_string(num_heads) + ", seqlen_q = " + std::to_string(seqlen_q) +
                  ", seqlen_k = " + std::to_string(seqlen_k) + ")");
  }
  Tensor mask(DType::u8, {B, num_heads, seqlen_q, seqlen_k});
  const detail::Dropout d = detail::Dropout::make(dropout_p, dropout_seed, dropout_offset, num_heads);
  std::uint8_t* z = mask.data_as<std::uint8_t>();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < num_heads; ++h)
      for (std::int64_t i = 0; i < seqlen_q; ++i)
        for (std::int64_t j = 0; j < seqlen_k; ++j) *z++ = d.keep(b, h, i, j) ? 1 : 0;
  return mask;
}

}  // namespace qkv
