#include "qkv/info.hpp"

#include <cstdio>

#include "platform/cpu_features.hpp"
#include "dispatch/dispatch.hpp"
#include "kernels/isa_kernels.hpp"

namespace qkv {

std::string cpu_features_string() { return detail::cpu_features().to_string(); }

std::string active_isa_string() { return detail::isa_name(detail::active_isa()); }

std::string bf16_dot_string() {
  if (detail::active_isa() == detail::Isa::avx512amx) return "used, on AMX tiles (avx512amx)";
  if (detail::active_isa() != detail::Isa::avx512bf16) return "not available at this ISA level";
  char rate[96];
  std::snprintf(rate, sizeof rate, "measured %.2fx the fp32 FMA rate", detail::bf16_dot_rate());
  if (detail::bf16_dot_enabled())
    return std::string("used (") + rate +
           (detail::bf16_dot_requested() ? ", asked for by QKV_ISA=avx512bf16)" : "; a CPU without AMX hardware)");
  return std::string("not used: ") + rate + "; a CPU with AMX hardware, where they run at half the FMA rate " +
         "(QKV_ISA=avx512bf16 forces them)";
}

bool bf16_dot_used() { return detail::bf16_dot_enabled() && detail::active_isa() == detail::Isa::avx512bf16; }

std::vector<KernelInfo> compiled_kernels() {
  std::vector<KernelInfo> out;
  // The kernels of qkv::attention: those that describe their compiled ISA variants.
  for (const auto& k : detail::kernel_registry())
    if (k.describe) out.push_back({k.name, k.describe()});
  return out;
}

}  // namespace qkv
