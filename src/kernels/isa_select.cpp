// Run-time choice of the engine instantiation (src/kernels/simd/<isa>/) for every fast kernel:
// flash, decode, the backward and the serving kernel's items all reach their ISA's code through
// the IsaKernels table chosen here.
#include <omp.h>

#include "platform/cpu_features.hpp"
#include "kernels/isa_kernels.hpp"

namespace qkv::detail {

const IsaKernels& active_isa_kernels(bool& bf16_dot) noexcept {
  const Isa isa = active_isa();
  bf16_dot = (isa == Isa::avx512bf16 || isa == Isa::avx512amx) && bf16_dot_enabled();
  switch (isa) {
#if defined(QKV_HAVE_AVX512AMX)
    case Isa::avx512amx: return kIsaKernelsAvx512Amx;
#endif
#if defined(QKV_HAVE_AVX512)
    case Isa::avx512bf16:
    case Isa::avx512: return kIsaKernelsAvx512;
#endif
#if defined(QKV_HAVE_AVX2)
    case Isa::avx2: return kIsaKernelsAvx2;
#endif
    default: bf16_dot = false; return kIsaKernelsScalar;
  }
}

double bf16_dot_rate() noexcept {
#if defined(QKV_HAVE_AVX512)
  static const double rate = isa_supported(Isa::avx512bf16) ? kIsaKernelsAvx512.bf16_dot_rate() : 0.0;
  return rate;
#else
  return 0.0;
#endif
}

bool bf16_dot_enabled() noexcept {
  // Which form computes a bf16 call depends on the CPU, as the ISA level does, and never on a
  // timing: processes that exchange results (ranks of one context-parallel call) must agree,
  // and a rate measured on a busy machine does not (0.69x seen where the CPU runs 2x). The
  // CPUs that run vdpbf16ps at half the FMA rate are those with AMX hardware (Sapphire Rapids
  // and later; 0.5x measured); the others run it at twice the rate (Zen 4: 2.0x measured).
  // AMX tiles are always the fastest form where they exist.
  const Isa isa = active_isa();
  if (isa == Isa::avx512amx) return true;
  return isa == Isa::avx512bf16 && (bf16_dot_requested() || !cpu_features().amx_hw);
}

int call_threads(const Problem& p) noexcept {
  if (p.num_threads > 0) return p.num_threads;
  // A call too small to repay waking a thread team (microseconds, far more on a busy machine)
  // runs on the calling thread: one decode step of a small model, say. The result does not
  // depend on the thread count, so this changes only the time.
  constexpr double kMinParallelMacs = 1 << 20;
  const double macs = static_cast<double>(p.B) * static_cast<double>(p.Hq) * static_cast<double>(p.Sq) *
                      static_cast<double>(p.Sk) * static_cast<double>(p.D + p.Dv);
  return macs < kMinParallelMacs ? 1 : omp_get_max_threads();
}

std::string active_isa_form(bool bf16_operands) {
  const Isa isa = active_isa();
  std::string s = isa_name(isa);
  bool dot = false;
  active_isa_kernels(dot);
  if (bf16_operands && dot) s += isa == Isa::avx512amx ? ", bf16 AMX tiles" : ", bf16 dot products";
  return s;
}

std::string isa_summary() {
  std::string s;
  for (int l = static_cast<int>(Isa::avx512amx); l >= 0; --l) {
    const Isa isa = static_cast<Isa>(l);
    if (!isa_compiled(isa)) continue;
    if (!s.empty()) s += ", ";
    s += isa_name(isa);
    s += isa_supported(isa) ? (isa == active_isa() ? " (active)" : " (usable)") : " (not supported by this CPU)";
  }
  return s;
}

}  // namespace qkv::detail
