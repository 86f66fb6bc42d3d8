// libFuzzer target: the safetensors reader (SafetensorsFile::parse, then load of every tensor).
// Oracle: malformed input is refused with qkv::Error; nothing reads outside the input
// (AddressSanitizer) and loaded tensors have the element count of their declared shape.
#include <cstddef>
#include <cstdint>
#include <span>

#include "qkv/error.hpp"
#include "qkv/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    const qkv::SafetensorsFile f = qkv::SafetensorsFile::parse(bytes, "fuzz.safetensors");
    for (const std::string& name : f.names()) {
      const qkv::SafetensorsEntry& e = f.entry(name);
      try {
        const qkv::Tensor t = f.load(name);
        std::int64_t n = 1;
        for (auto d : e.shape) n *= d;
        if (t.numel() != n) __builtin_trap();
        double sum = 0;
        for (std::int64_t i = 0; i < n; ++i) sum += qkv::load_as_double(t.data(), t.dtype(), i);
        if (sum == 1.2345e-300) __builtin_trap();
      } catch (const qkv::Error&) {
        // load() refuses the dtypes it does not convert; the header was valid.
      }
    }
  } catch (const qkv::Error&) {
  }
  return 0;
}
