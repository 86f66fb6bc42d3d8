#pragma once
// Kernel selection: a priority list of kernels, each with a gate that says why it cannot run a
// given problem (empty string = it can). explain() reports the choice and every refusal.
#include <span>
#include <string>

#include "core/problem.hpp"

namespace qkv::detail {

struct KernelEntry {
  const char* name;  // "flash", "decode", "reference"
  KernelKind kind;
  /// Empty if the kernel can run `p`, else the reason it cannot.
  std::string (*refuse)(const Problem& p);
  void (*run)(const Problem& p);
  /// One line for `qkv info`: the ISA variants compiled and which are usable here.
  std::string (*describe)();
};

/// All kernels, fastest first; the reference is last and accepts everything.
std::span<const KernelEntry> kernel_registry();

struct Choice {
  const KernelEntry* kernel = nullptr;
  std::string explanation;  // one line per kernel considered
};

/// Picks the kernel for `p`. A forced kind that refuses throws qkv::Error with its reason.
Choice choose_kernel(const Problem& p, KernelKind requested);

/// The backward pass's kernels: `flash` (FlashAttention-2 backward) unless it refuses, else the
/// float64 reference. Runs the choice; a forced kind that cannot run the call throws qkv::Error
/// ("kernel: ..."); `decode` has no backward.
void run_backward(const BackwardProblem& bp, KernelKind requested);

}  // namespace qkv::detail
