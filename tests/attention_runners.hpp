#pragma once
// Every path an attention call can take, for tests that must hold on all of them: the float64
// specification (qkv::reference::attention), the dispatcher (qkv::attention, automatic), and each
// kernel forced by AttentionParams::kernel. A forced kernel that is not compiled in, or whose
// gate refuses the call, reports "kernel: ..." and is skipped for that call only, so fast kernels
// are covered as soon as they are registered.
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/error.hpp"
#include "qkv/reference.hpp"

namespace qkv::test {

struct AttentionPath {
  std::string name;
  bool reference_api = false;   // qkv::reference::attention instead of qkv::attention
  KernelKind kernel = KernelKind::automatic;
};

// GoogleTest prints a parameter with this (instead of its bytes).
inline void PrintTo(const AttentionPath& p, std::ostream* os) { *os << p.name; }

inline std::vector<AttentionPath> attention_paths() {
  return {{"reference::attention", true, KernelKind::automatic},
          {"attention(automatic)", false, KernelKind::automatic},
          {"attention(kernel=reference)", false, KernelKind::reference},
          {"attention(kernel=flash)", false, KernelKind::flash},
          {"attention(kernel=decode)", false, KernelKind::decode}};
}

/// Runs one call on `path`. Returns false (and writes nothing) when the forced kernel is not
/// available for this call; any other qkv::Error propagates.
inline bool run_attention(const AttentionPath& path, const TensorView& q, const TensorView& k,
                          const TensorView& v, const TensorView& out, AttentionParams params = {},
                          const std::optional<TensorView>& lse = std::nullopt,
                          const std::optional<TensorView>& probs = std::nullopt) {
  if (path.reference_api) {
    reference::attention(q, k, v, out, params, lse, probs);
    return true;
  }
  params.kernel = path.kernel;
  try {
    attention(q, k, v, out, params, lse, probs);
  } catch (const Error& e) {
    if (path.kernel != KernelKind::automatic && std::string(e.what()).rfind("kernel:", 0) == 0) return false;
    throw;
  }
  return true;
}

}  // namespace qkv::test
