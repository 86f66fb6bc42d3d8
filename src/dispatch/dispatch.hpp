#pragma once
// The kernel registry: the one place where a call of any public entry point (src/api), lowered
// once by src/core, is given a kernel. Each entry of the registry names the entry points it
// serves, the KernelKind that forces it, a gate that says why it cannot run a call (empty string
// = it can) and its run function; the table order is the priority order. choose_kernel() takes the
// first entry that serves the call's entry point and request and whose gate is empty, and
// explains the choice: one line per entry considered.
#include <cstdint>
#include <span>
#include <string>

#include "core/problem.hpp"
#include "core/varlen_problem.hpp"

namespace qkv::detail {

/// The public entry points, as the registry tells their calls apart.
enum class Entry : std::uint8_t {
  forward,          ///< qkv::attention
  backward,         ///< qkv::attention_backward
  varlen,           ///< qkv::attention_varlen: float K and V, or QuantizedKV in any format
  varlen_backward,  ///< qkv::attention_varlen_backward
  paged,            ///< qkv::attention_paged: float or QuantizedKV pools
};

/// One call as src/core lowered it. `params` are the options as given: params->kernel is the
/// request, and the paths of packed calls derive each sequence's problem from them.
struct Call {
  Entry entry = Entry::forward;
  const AttentionParams* params = nullptr;
  const Problem* p = nullptr;                  // forward; backward: &bp->fwd; packed or paged: &vp->p
  const BackwardProblem* bp = nullptr;         // backward
  const VarlenProblem* vp = nullptr;           // varlen, paged; varlen_backward: &vbp->vp
  const VarlenBackwardProblem* vbp = nullptr;  // varlen_backward

  KernelKind requested() const noexcept { return params->kernel; }
  static Call forward(const Problem& p, const AttentionParams& params) { return {Entry::forward, &params, &p}; }
  static Call backward(const BackwardProblem& bp, const AttentionParams& params) {
    return {Entry::backward, &params, &bp.fwd, &bp};
  }
  static Call varlen(const VarlenProblem& vp, const AttentionParams& params) {
    return {Entry::varlen, &params, &vp.p, nullptr, &vp};
  }
  static Call varlen_backward(const VarlenBackwardProblem& vbp, const AttentionParams& params) {
    return {Entry::varlen_backward, &params, &vbp.vp.p, nullptr, &vbp.vp, &vbp};
  }
  static Call paged(const VarlenProblem& vp, const AttentionParams& params) {
    return {Entry::paged, &params, &vp.p, nullptr, &vp};
  }
};

/// Bit of an Entry in KernelEntry::entries.
constexpr std::uint8_t entry_bit(Entry e) noexcept { return static_cast<std::uint8_t>(1u << static_cast<unsigned>(e)); }

struct KernelEntry {
  const char* name;      // "decode", "flash", "serving", "per-sequence", "reference"
  std::uint8_t entries;  // the entry points it serves (entry_bit)
  /// The request that forces it; automatic: none, only the automatic choice takes it ("serving").
  KernelKind kind;
  /// Runs under every request and passes it on to each sequence's own choice ("per-sequence").
  bool any_request;
  /// Empty if the kernel can run the call, else the reason it cannot.
  std::string (*refuse)(const Call& c);
  /// What its "chosen" line says in parentheses (the ISA level and bf16 form, or the sequences'
  /// choices); null: nothing.
  std::string (*chosen)(const Call& c);
  void (*run)(const Call& c);
  /// One line for `qkv info`: the ISA variants compiled and which are usable here (null: none).
  std::string (*describe)();

  bool serves(Entry e, KernelKind requested) const noexcept {
    return (entries & entry_bit(e)) &&
           (requested == KernelKind::automatic || any_request || kind == requested);
  }
};

/// Every kernel of every entry point, in priority order (the entries of one entry point read in
/// table order are its priority list, the last one accepting every call).
std::span<const KernelEntry> kernel_registry();

struct Choice {
  const KernelEntry* kernel = nullptr;
  std::string explanation;  // with explain: one line per kernel of the entry point
};

/// Picks the kernel for `c`. A forced kind that no entry serving it can run throws qkv::Error
/// with the first refusal's reason; a kind no entry answers to throws qkv::Error too. With
/// `explain`, every entry of the entry point is considered and reported (NAME: chosen (...) |
/// refused (reason) | not requested | usable, lower priority); without, the first usable one
/// ends the search.
Choice choose_kernel(const Call& c, bool explain);

/// choose_kernel, then the chosen kernel's run function.
void run_call(const Call& c);

/// choose_kernel's explanation, with the note on probs for the dense forward.
std::string explain_call(const Call& c);

}  // namespace qkv::detail
