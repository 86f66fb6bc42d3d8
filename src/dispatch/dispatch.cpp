#include "dispatch/dispatch.hpp"

#include <array>

#include "qkv/error.hpp"
#include "platform/cpu_features.hpp"
#include "kernels/kernels.hpp"
#include "reference/reference_kernel.hpp"

namespace qkv::detail {
namespace {

const char* kind_name(KernelKind k) {
  switch (k) {
    case KernelKind::automatic: return "automatic";
    case KernelKind::reference: return "reference";
    case KernelKind::flash: return "flash";
    case KernelKind::decode: return "decode";
  }
  return "?";
}

std::string reference_refuse(const Problem&) { return {}; }
std::string reference_describe() { return "float64 loops, always usable"; }

const std::array<KernelEntry, 3> kRegistry = {{
    {"decode", KernelKind::decode, decode_refuse, decode_kernel, decode_describe},
    {"flash", KernelKind::flash, flash_refuse, flash_kernel, flash_describe},
    {"reference", KernelKind::reference, reference_refuse, reference_kernel, reference_describe},
}};

}  // namespace

std::span<const KernelEntry> kernel_registry() { return kRegistry; }

Choice choose_kernel(const Problem& p, KernelKind requested) {
  Choice c;
  for (const KernelEntry& k : kRegistry) {
    if (requested != KernelKind::automatic && k.kind != requested) {
      c.explanation += std::string(k.name) + ": not requested\n";
      continue;
    }
    const std::string why = k.refuse(p);
    if (!why.empty()) {
      if (requested != KernelKind::automatic)
        throw Error(std::string("kernel: the requested kernel '") + k.name + "' cannot run this call: " + why);
      c.explanation += std::string(k.name) + ": refused (" + why + ")\n";
      continue;
    }
    if (!c.kernel) {
      c.kernel = &k;
      // The fast kernels also say which instruction-set level runs them.
      c.explanation += std::string(k.name) + ": chosen" +
                       (k.kind == KernelKind::reference ? std::string() : std::string(" (") + isa_name(active_isa()) + ")") +
                       "\n";
    } else {
      c.explanation += std::string(k.name) + ": usable, lower priority\n";
    }
  }
  if (c.kernel && p.probs.data && c.kernel->kind != KernelKind::reference)
    c.explanation += "probs: the fast kernels never form the Sq x Sk weights; the reference fills them in a second pass\n";
  if (!c.kernel) {
    std::string names;
    for (const KernelEntry& k : kRegistry) names += std::string(names.empty() ? "" : ", ") + k.name;
    throw Error(std::string("kernel: expected a kernel compiled into this build (") + names + "), got '" +
                kind_name(requested) + "'");
  }
  return c;
}

void run_backward(const BackwardProblem& bp, KernelKind requested) {
  if (requested == KernelKind::decode)
    throw Error("kernel: expected automatic, flash or reference for the backward pass, got 'decode'");
  if (requested != KernelKind::reference) {
    const std::string why = flash_backward_refuse(bp);
    if (why.empty()) return flash_backward_kernel(bp);
    if (requested == KernelKind::flash)
      throw Error("kernel: the requested kernel 'flash' cannot run this backward call: " + why);
  }
  reference_backward(bp);
}

}  // namespace qkv::detail
