#pragma once
// CPU feature detection (x86-64 CPUID + XGETBV; other architectures report nothing).
#include <string>

namespace qkv::detail {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false;
  bool avx512bf16 = false, avx512fp16 = false;
  /// AVX-512 F/BW/DQ/VL with the OS saving ZMM state: what the avx512 kernels need.
  bool avx512() const noexcept { return avx512f && avx512bw && avx512dq && avx512vl; }
  bool avx2_fma() const noexcept { return avx2 && fma && f16c; }
  /// Space-separated list of the features found, e.g. "avx2 fma f16c avx512f ...".
  std::string to_string() const;
};

/// Detected once; QKV_ISA=avx512|avx2|scalar in the environment caps what is reported usable.
const CpuFeatures& cpu_features() noexcept;

}  // namespace qkv::detail
