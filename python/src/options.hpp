#pragma once
// The options of one attention call as they cross from Python: one immutable object, built and
// checked once in Python (qkv/_options.py, which keeps the objects of recent option values so
// that a call passes one pointer) and converted to qkv::AttentionParams here, in one place.

#include <cstdint>
#include <optional>

#include <nanobind/nanobind.h>

#include "arrays.hpp"
#include "qkv/attention.hpp"

namespace qkv::python {

/// The scalar options of attention, attention_backward, explain_dispatch, explain and the layers.
/// Bound as qkv._qkv.Options (keyword-only constructor, read-only fields of the same names).
struct Options {
  std::optional<double> scale;  ///< nullopt: 1/sqrt(D), resolved by the library
  double softcap = 0.0;
  bool causal = false;
  Alignment align = Alignment::bottom_right;
  std::int64_t window_left = -1;
  std::int64_t window_right = -1;
  bool bshd = false;  ///< layout "bshd": q, k, v, out and their gradients are [B, S, H, D]
  KernelKind kernel = KernelKind::automatic;
  int num_threads = 0;
  std::int64_t keep_first = 0;  ///< AttentionParams::window_keep_first (StreamingLLM's sink keys)
};

/// The array options of a call, in the order of the `arrays` tuple every entry point takes
/// (exported as qkv._qkv.ARRAY_OPTIONS; qkv/_options.py checks it against its own table).
struct ArrayOption {
  const char* name;
  std::optional<TensorView> AttentionParams::*field;
};
inline constexpr ArrayOption kArrayOptions[] = {
    {"mask", &AttentionParams::mask},
    {"kv_lens", &AttentionParams::kv_lens},
    {"sinks", &AttentionParams::sinks},
    {"alibi_slopes", &AttentionParams::alibi_slopes},
};

/// The library's parameters for `o` and the arrays of `arrays` (a tuple in kArrayOptions' order,
/// None for an absent one), viewed through `a` (which keeps them alive for the call).
AttentionParams params_of(const Options& o, CallArrays& a, nb::handle arrays);

/// A BSHD array [B, S, H, D] as the BHSD view [B, H, S, D] the library reads (no copy); other
/// layouts and ranks as they are (the library names a wrong rank).
TensorView as_bhsd(const TensorView& t, const Options& o);

}  // namespace qkv::python
