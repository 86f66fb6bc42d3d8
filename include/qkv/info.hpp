#pragma once
/// @file info.hpp
/// What this build of qkv can run on this machine (for `qkv info` and bug reports).
#include <string>
#include <vector>

namespace qkv {

/// One compiled kernel and whether it is usable on this CPU.
struct KernelInfo {
  std::string name;         ///< "flash", "decode", "reference"
  std::string description;  ///< compiled ISA variants and which of them this CPU can run
};

/// CPU features detected at run time, e.g. "avx2 fma f16c avx512f ... avx512_bf16".
std::string cpu_features_string();
/// The instruction-set level the fast kernels use here ("scalar", "avx2", "avx512" or
/// "avx512bf16" or "avx512amx"): the best one compiled and supported, capped by QKV_ISA if set.
std::string active_isa_string();
/// How bf16 inputs are multiplied here: on AMX tiles ("used, on AMX tiles (avx512amx)"), with
/// the AVX512_BF16 dot products (vdpbf16ps), or widened to fp32, and why: e.g.
/// "used (measured 1.92x the fp32 FMA rate; a CPU without AMX hardware)" or "not used: measured
/// 0.50x the fp32 FMA rate; a CPU with AMX hardware, where they run at half the FMA rate
/// (QKV_ISA=avx512bf16 forces them)". The choice comes from CPUID; the rate shown is measured
/// when this is called (about 10 ms, once per process).
std::string bf16_dot_string();
/// Whether bf16 inputs use the AVX512_BF16 dot products (vdpbf16ps) here (see
/// bf16_dot_string()); false where they use AMX tiles.
bool bf16_dot_used();
/// The kernels compiled into this build, in dispatch priority order.
std::vector<KernelInfo> compiled_kernels();

}  // namespace qkv
