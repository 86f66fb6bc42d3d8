#include "dispatch/dispatch.hpp"

#include "dispatch/packed.hpp"
#include "kernels/isa_kernels.hpp"
#include "kernels/kernels.hpp"
#include "qkv/error.hpp"
#include "qkv/tensor.hpp"
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

std::string accept(const Call&) { return {}; }

// Dropout: only the reference applies it yet; every fast kernel's gate says so first.
std::string dropout_refusal(const Problem& p) {
  if (!p.dropout.on()) return {};
  return "dropout_p = " + std::to_string(p.dropout.p) + ": no fast kernel applies dropout yet (the reference does)";
}

// ---- qkv::attention -----------------------------------------------------------------------------

// decode takes every score option (sinks in its merge, the position terms by its score rule).
std::string decode_gate(const Call& c) {
  if (std::string why = dropout_refusal(*c.p); !why.empty()) return why;
  return decode_refuse(*c.p);
}
std::string flash_gate(const Call& c) {
  std::string why = dropout_refusal(*c.p);
  return why.empty() ? flash_refuse(*c.p) : why;
}
// The tiled kernels are handed the level's bf16 form for bf16 q (kernels/engine/engine.hpp).
std::string forward_isa(const Call& c) { return active_isa_form(c.p->q.dtype == DType::bf16); }

// A fast kernel: nothing for an empty output; asked for the weights too, it computes O and
// softmax_lse as without them (it never forms the Sq x Sk weights), and the reference fills probs
// in a second pass (its own O goes to a scratch buffer).
template <void (*Kernel)(const Problem&)>
void run_fast_forward(const Call& c) {
  const Problem& p = *c.p;
  if (p.B == 0 || p.Hq == 0 || p.Sq == 0) return;
  if (!p.probs.data) return Kernel(p);
  Problem fast = p;
  fast.probs = {};
  Kernel(fast);
  Tensor scratch(DType::f64, {p.B, p.Hq, p.Sq, p.Dv});
  Problem weights = p;
  weights.lse = {};
  weights.out = {scratch.data(), DType::f64, p.Hq * p.Sq * p.Dv, p.Sq * p.Dv, p.Dv, 1};
  reference_kernel(weights);
}

void run_reference_forward(const Call& c) {
  const Problem& p = *c.p;
  if (p.B == 0 || p.Hq == 0 || p.Sq == 0) return;
  reference_kernel(p);
}

std::string reference_describe() { return "float64 loops, always usable"; }

// ---- qkv::attention_backward --------------------------------------------------------------------

std::string flash_backward_gate(const Call& c) {
  std::string why = dropout_refusal(c.bp->fwd);
  return why.empty() ? flash_backward_refuse(*c.bp) : why;
}
// The bf16 form needs bf16 q, dO and O (kernels/engine/engine.hpp).
std::string backward_isa(const Call& c) {
  const BackwardProblem& bp = *c.bp;
  return active_isa_form(bp.fwd.q.dtype == DType::bf16 && bp.dout.dtype == DType::bf16 &&
                         bp.fwd.out.dtype == DType::bf16);
}
// Empty shapes need no special case: a call with Sq = 0 still writes dK = dV = 0.
void run_flash_backward(const Call& c) { flash_backward_kernel(*c.bp); }
void run_reference_backward(const Call& c) { reference_backward(*c.bp); }

// ---- packed and paged batches ---------------------------------------------------------------------

std::string serving_gate(const Call& c) {
  if (std::string why = dropout_refusal(*c.p); !why.empty()) return why;
  if (c.p->q.dtype == DType::f64) return "float64 inputs: serving computes in fp32";
  return {};
}
// The item's bf16 form is for bf16 queries over bf16 keys (kernels/engine/serving_item.hpp).
std::string serving_isa(const Call& c) {
  return active_isa_form(c.p->q.dtype == DType::bf16 && c.p->k.dtype == DType::bf16 && !c.vp->kc.scales);
}
void run_serving(const Call& c) { serving_kernel(*c.vp); }

constexpr std::uint8_t kForward = entry_bit(Entry::forward), kBackward = entry_bit(Entry::backward),
                       kVarlen = entry_bit(Entry::varlen), kVarlenBackward = entry_bit(Entry::varlen_backward),
                       kPaged = entry_bit(Entry::paged);

// name, entry points, forcing kind, any request, gate, chosen line, run, describe
const KernelEntry kRegistry[] = {
    // qkv::attention: flash-decoding for a few query rows, FlashAttention-2, the float64 reference.
    {"decode", kForward, KernelKind::decode, false, decode_gate, forward_isa, run_fast_forward<decode_kernel>,
     decode_describe},
    {"flash", kForward, KernelKind::flash, false, flash_gate, forward_isa, run_fast_forward<flash_kernel>,
     flash_describe},
    {"reference", kForward, KernelKind::reference, false, accept, nullptr, run_reference_forward, reference_describe},
    // qkv::attention_backward: FlashAttention-2's backward, the float64 reference.
    {"flash", kBackward, KernelKind::flash, false, flash_backward_gate, backward_isa, run_flash_backward, nullptr},
    {"reference", kBackward, KernelKind::reference, false, accept, nullptr, run_reference_backward, nullptr},
    // Packed and paged batches: the batch-invariant split kernel (automatic only); one dense call
    // per sequence through the entries above (a forced kind, float64 inputs, the backward); the
    // float64 reference over each sequence's keys gathered (paged or quantized).
    {"serving", kVarlen | kPaged, KernelKind::automatic, false, serving_gate, serving_isa, run_serving, nullptr},
    {"per-sequence", kVarlen | kVarlenBackward, KernelKind::automatic, true, per_sequence_refuse, per_sequence_chosen,
     per_sequence_run, nullptr},
    {"reference", kVarlen | kPaged, KernelKind::reference, false, accept, nullptr, reference_gathered, nullptr},
};

}  // namespace

std::span<const KernelEntry> kernel_registry() { return kRegistry; }

Choice choose_kernel(const Call& c, bool explain) {
  const KernelKind requested = c.requested();
  Choice ch;
  std::string refusal;  // the first refusal of a kernel the request names
  for (const KernelEntry& k : kRegistry) {
    if (!(k.entries & entry_bit(c.entry))) continue;
    if (!k.serves(c.entry, requested)) {
      if (explain) ch.explanation += std::string(k.name) + ": not requested\n";
      continue;
    }
    if (ch.kernel && !explain) break;
    const std::string why = k.refuse(c);
    if (!why.empty()) {
      if (refusal.empty()) refusal = why;
      if (explain) ch.explanation += std::string(k.name) + ": refused (" + why + ")\n";
    } else if (ch.kernel) {
      ch.explanation += std::string(k.name) + ": usable, lower priority\n";
    } else {
      ch.kernel = &k;
      if (explain)
        ch.explanation += std::string(k.name) + ": chosen" + (k.chosen ? " (" + k.chosen(c) + ")" : std::string()) + "\n";
    }
  }
  if (ch.kernel) return ch;
  // Only a forced kind gets here: every entry point ends with a kernel that takes every call.
  const bool backward = c.entry == Entry::backward || c.entry == Entry::varlen_backward;
  if (!refusal.empty() && backward)
    throw Error(std::string("kernel: the requested kernel '") + kind_name(requested) +
                "' cannot run this backward call: " + refusal);
  if (!refusal.empty())
    throw Error(std::string("kernel: the requested kernel '") + kind_name(requested) + "' cannot run this call: " + refusal);
  if (backward)
    throw Error(std::string("kernel: expected automatic, flash or reference for the backward pass, got '") +
                kind_name(requested) + "'");
  std::string names;
  for (const KernelEntry& k : kRegistry)
    if (k.entries & entry_bit(c.entry)) names += std::string(names.empty() ? "" : ", ") + k.name;
  throw Error(std::string("kernel: expected a kernel compiled into this build (") + names + "), got '" +
              kind_name(requested) + "'");
}

void run_call(const Call& c) { choose_kernel(c, false).kernel->run(c); }

std::string explain_call(const Call& c) {
  Choice ch = choose_kernel(c, true);
  if (c.entry == Entry::forward && c.p->probs.data && ch.kernel->kind != KernelKind::reference)
    ch.explanation += "probs: the fast kernels never form the Sq x Sk weights; the reference fills them in a second pass\n";
  return ch.explanation;
}

}  // namespace qkv::detail
