#pragma once
// CPU feature detection (x86-64 CPUID + XGETBV; other architectures report nothing).
#include <string>

namespace qkv::detail {

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512dq = false, avx512vl = false;
  bool avx512bf16 = false, avx512fp16 = false;
  /// AMX-TILE and AMX-BF16, their state saved by the OS, and (Linux) permission to use them.
  bool amx = false;
  /// AMX-TILE and AMX-BF16 in CPUID, whatever the OS allows: the CPUs (Sapphire Rapids and later)
  /// whose vdpbf16ps runs at half the fp32 FMA rate.
  bool amx_hw = false;
  /// AVX-512 F/BW/DQ/VL with the OS saving ZMM state: what the avx512 kernels need.
  bool avx512() const noexcept { return avx512f && avx512bw && avx512dq && avx512vl; }
  bool avx2_fma() const noexcept { return avx2 && fma && f16c; }
  /// Space-separated list of the features found, e.g. "avx2 fma f16c avx512f ...".
  std::string to_string() const;
};

/// Detected once (the CPU as it is, whatever QKV_ISA says).
const CpuFeatures& cpu_features() noexcept;

/// Instruction-set levels of the fast kernels, lowest first. avx512bf16 is avx512 plus the
/// AVX512_BF16 dot product (vdpbf16ps) for bfloat16 inputs; avx512amx computes the bf16 matrix
/// products on AMX tiles instead.
enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2, avx512bf16 = 3, avx512amx = 4 };

/// "scalar", "avx2", "avx512", "avx512bf16", "avx512amx".
const char* isa_name(Isa isa) noexcept;
/// Whether this build contains code for `isa` (avx2/avx512 only on x86-64 builds).
bool isa_compiled(Isa isa) noexcept;
/// Whether this CPU can run `isa` (ignoring caps).
bool isa_supported(Isa isa) noexcept;
/// The level the fast kernels use: the best level compiled and supported, capped by the
/// environment variable QKV_ISA=scalar|avx2|avx512|avx512bf16|avx512amx (read once) and by
/// set_isa_cap(). Never above what the CPU supports.
Isa active_isa() noexcept;
/// Caps active_isa() for this process (tests use it to run every level in turn); nullopt-like
/// reset with `reset_isa_cap()`. Returns the previous effective level. Not meant to be changed
/// while attention calls run on other threads.
Isa set_isa_cap(Isa cap) noexcept;
void reset_isa_cap() noexcept;
/// Whether avx512bf16 was asked for by name (QKV_ISA=avx512bf16 or set_isa_cap(avx512bf16)):
/// the kernels then use the bf16 dot products even where they are slower than fp32 FMAs
/// (otherwise kernels/isa_select.cpp uses them only where they pay).
bool bf16_dot_requested() noexcept;

}  // namespace qkv::detail
