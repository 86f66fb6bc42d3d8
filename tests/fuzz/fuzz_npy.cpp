// libFuzzer target: the .npy reader (parse_npy) on arbitrary bytes.
// Oracle: a malformed file is refused with qkv::Error; an accepted one owns exactly
// numel * itemsize readable bytes (AddressSanitizer checks every element is touched in bounds).
#include <cstddef>
#include <cstdint>
#include <span>

#include "qkv/error.hpp"
#include "qkv/npy.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  try {
    const qkv::NpyArray a = qkv::parse_npy(bytes, "fuzz.npy");
    const qkv::TensorView v = a.view();
    const std::int64_t n = v.numel();
    double sum = 0;
    for (std::int64_t i = 0; i < n; ++i) sum += qkv::load_as_double(v.data(), v.dtype(), i);
    // A sum of NaN is fine; this only keeps the loads from being optimised away.
    if (sum == 1.2345e-300) __builtin_trap();
    // A 4-D float array must also survive a contiguous copy in every float dtype.
    if (v.rank() == 4 && (v.dtype() == qkv::DType::f32 || v.dtype() == qkv::DType::f16) && n <= 4096)
      (void)qkv::to_contiguous(v, qkv::DType::f64);
  } catch (const qkv::Error&) {
  }
  return 0;
}
