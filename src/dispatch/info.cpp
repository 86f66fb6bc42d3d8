#include "qkv/info.hpp"

#include "platform/cpu_features.hpp"
#include "dispatch/dispatch.hpp"

namespace qkv {

std::string cpu_features_string() { return detail::cpu_features().to_string(); }

std::string active_isa_string() { return detail::isa_name(detail::active_isa()); }

std::vector<KernelInfo> compiled_kernels() {
  std::vector<KernelInfo> out;
  for (const auto& k : detail::kernel_registry()) out.push_back({k.name, k.describe()});
  return out;
}

}  // namespace qkv
