#include "platform/cpu_features.hpp"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <string_view>

namespace qkv::detail {
namespace {

CpuFeatures detect() noexcept {
  CpuFeatures f;
#if defined(__x86_64__) || defined(_M_X64)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = (c >> 27) & 1u;
  f.fma = (c >> 12) & 1u;
  f.f16c = (c >> 29) & 1u;
  unsigned xcr0 = 0;
  if (osxsave) {
    unsigned lo, hi;
    __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = lo;
  }
  const bool ymm_os = (xcr0 & 0x6u) == 0x6u;
  const bool zmm_os = (xcr0 & 0xe6u) == 0xe6u;
  if (!ymm_os) { f.fma = f.f16c = false; return f; }
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf >= 7) {
    __cpuid_count(7, 0, a, b, c, d);
    const unsigned max_subleaf = a;
    f.avx2 = (b >> 5) & 1u;
    if (zmm_os) {
      f.avx512f = (b >> 16) & 1u;
      f.avx512dq = (b >> 17) & 1u;
      f.avx512bw = (b >> 30) & 1u;
      f.avx512vl = (b >> 31) & 1u;
      f.avx512fp16 = (d >> 23) & 1u;
      // AMX: the CPU's tiles, the OS saving their state (XCR0 bits 17, 18), and on Linux the
      // process's permission to use the 8 KiB of tile data (asked for once, here).
      f.amx_hw = ((d >> 24) & 1u) && ((d >> 22) & 1u);
      const bool amx_cpu = f.amx_hw && (xcr0 & 0x60000u) == 0x60000u;
#if defined(__linux__) && defined(SYS_arch_prctl)
      constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
      f.amx = amx_cpu && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
      f.amx = false;
      (void)amx_cpu;
#endif
      if (max_subleaf >= 1) {  // leaf 7 subleaf 1 exists only when subleaf 0 says so
        unsigned a1, b1, c1, d1;
        __cpuid_count(7, 1, a1, b1, c1, d1);
        f.avx512bf16 = (a1 >> 5) & 1u;
      }
    }
  }
#endif
  return f;
}

}  // namespace

std::string CpuFeatures::to_string() const {
  std::string s;
  auto add = [&](bool on, const char* n) { if (on) { if (!s.empty()) s += ' '; s += n; } };
  add(avx2, "avx2"); add(fma, "fma"); add(f16c, "f16c");
  add(avx512f, "avx512f"); add(avx512bw, "avx512bw"); add(avx512dq, "avx512dq");
  add(avx512vl, "avx512vl"); add(avx512bf16, "avx512_bf16"); add(avx512fp16, "avx512_fp16");
  add(amx, "amx_bf16 amx_tile");
  return s.empty() ? "none" : s;
}

const CpuFeatures& cpu_features() noexcept {
  static const CpuFeatures f = detect();
  return f;
}

const char* isa_name(Isa isa) noexcept {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::avx512bf16: return "avx512bf16";
    case Isa::avx512amx: return "avx512amx";
  }
  return "?";
}

bool isa_compiled(Isa isa) noexcept {
  switch (isa) {
    case Isa::scalar: return true;
#if defined(QKV_HAVE_AVX2)
    case Isa::avx2: return true;
#endif
#if defined(QKV_HAVE_AVX512)
    case Isa::avx512: return true;
    case Isa::avx512bf16: return true;
#endif
#if defined(QKV_HAVE_AVX512AMX)
    case Isa::avx512amx: return true;
#endif
    default: return false;
  }
}

bool isa_supported(Isa isa) noexcept {
  const CpuFeatures& f = cpu_features();
  switch (isa) {
    case Isa::scalar: return true;
    case Isa::avx2: return f.avx2_fma();
    case Isa::avx512: return f.avx512() && f.avx2_fma();
    case Isa::avx512bf16: return f.avx512() && f.avx2_fma() && f.avx512bf16;
    case Isa::avx512amx: return f.avx512() && f.avx2_fma() && f.avx512bf16 && f.amx;
  }
  return false;
}

namespace {

constexpr int kTop = static_cast<int>(Isa::avx512amx), kNoCap = kTop + 1;

// The cap from QKV_ISA, read once; an unknown value is ignored (no cap).
int env_cap() noexcept {
  static const int cap = [] {
    const char* e = std::getenv("QKV_ISA");
    if (!e) return kNoCap;
    if (!std::strcmp(e, "scalar")) return 0;
    if (!std::strcmp(e, "avx2")) return 1;
    if (!std::strcmp(e, "avx512")) return 2;
    if (!std::strcmp(e, "avx512bf16")) return 3;  // asked for by name: the dot products too
    if (!std::strcmp(e, "avx512amx")) return 4;
    return kNoCap;
  }();
  return cap;
}

std::atomic<int> g_cap{kNoCap};

}  // namespace

Isa active_isa() noexcept {
  const int cap = std::min({env_cap(), g_cap.load(std::memory_order_relaxed), kTop});
  for (int l = cap; l > 0; --l)
    if (isa_compiled(static_cast<Isa>(l)) && isa_supported(static_cast<Isa>(l))) return static_cast<Isa>(l);
  return Isa::scalar;
}

Isa set_isa_cap(Isa cap) noexcept {
  const Isa before = active_isa();
  g_cap.store(static_cast<int>(cap), std::memory_order_relaxed);
  return before;
}

void reset_isa_cap() noexcept { g_cap.store(kNoCap, std::memory_order_relaxed); }

bool bf16_dot_requested() noexcept {
  return std::min(env_cap(), g_cap.load(std::memory_order_relaxed)) == 3;
}

}  // namespace qkv::detail
