// libFuzzer target: the llama2.c checkpoint reader (parse_llama2c_config and parse_llama2c).
// Oracle: malformed input is refused with qkv::Error; an accepted file yields views whose every
// element lies inside the owned storage (AddressSanitizer) and whose shapes match the config.
#include <cstddef>
#include <cstdint>
#include <span>

#include "qkv/error.hpp"
#include "qkv/llama2c.hpp"

namespace {
double touch(const qkv::TensorView& v) {
  double s = 0;
  const std::int64_t n = v.numel();
  const float* p = v.data_as<const float>();
  for (std::int64_t i = 0; i < n; ++i) s += p[i];
  return s;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    const qkv::Llama2cConfig c = qkv::parse_llama2c_config(bytes, "fuzz.bin");
    const qkv::Llama2cModel m = qkv::parse_llama2c(bytes, "fuzz.bin");
    if (m.config.dim != c.dim || static_cast<int>(m.layers.size()) != c.n_layers) __builtin_trap();
    if (m.token_embedding.numel() != static_cast<std::int64_t>(c.vocab_size) * c.dim) __builtin_trap();
    double s = touch(m.token_embedding) + touch(m.rms_final) + touch(m.wcls);
    for (const qkv::Llama2cLayer& l : m.layers)
      for (const qkv::TensorView* v : {&l.rms_att, &l.wq, &l.wk, &l.wv, &l.wo, &l.rms_ffn, &l.w1, &l.w2, &l.w3})
        s += touch(*v);
    if (s == 1.2345e-300) __builtin_trap();
  } catch (const qkv::Error&) {
  }
  return 0;
}
