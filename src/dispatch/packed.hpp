#pragma once
// The registry's paths for packed and paged batches other than the serving kernel (packed.cpp):
// one dense call per sequence through the registry's dense entries, and the float64 reference
// over each sequence's keys gathered from their storage.
#include <string>

#include "dispatch/dispatch.hpp"

namespace qkv::detail {

/// "per-sequence" (attention_varlen, attention_varlen_backward): each sequence as the B = 1 call
/// qkv::attention (attention_backward) would make on its views, its kernel chosen by the dense
/// registry under the call's own request; every choice is made, so every forced kind checked,
/// before any kernel runs. Refuses keys and values that are not of q's dtype (quantized formats,
/// float mixes): the dense kernels read neither.
std::string per_sequence_refuse(const Call& c);
/// The sequences' choices: "one qkv::attention call per sequence: flash (avx512) for 3, decode
/// (avx512) for 1".
std::string per_sequence_chosen(const Call& c);
void per_sequence_run(const Call& c);

/// "reference" (attention_varlen, attention_paged): per sequence, q and its keys and values
/// gathered through the call's addressing (packed or paged, any format; dequantized as code *
/// scale in float32, then widened) into float64 copies, then the float64 reference kernel.
void reference_gathered(const Call& c);

}  // namespace qkv::detail
