#pragma once
// with_int: a run-time count (query vectors of a block, rows of a remainder, vectors of a row)
// turned into a template argument, so that each microkernel is compiled for a fixed size with its
// accumulators in registers. It stands for the `switch (n) { case Lo: f<Lo>(); ... case Hi: ... }`
// those call sites would otherwise spell out, and an upper bound taken from the ISA's traits
// instantiates nothing the ISA cannot hold.
//
// The callers' lambdas are marked __attribute__((always_inline)) (after a lambda's parameters the
// standard [[gnu::always_inline]] names the call operator's type, not the operator, and is
// ignored), so a case costs no call of its own, as with a switch.
#include <cstdint>
#include <utility>

#ifndef QKV_ENGINE_NS
#error "define QKV_ENGINE_NS before including kernels/engine/size_switch.hpp"
#endif

namespace qkv::detail::QKV_ENGINE_NS {

template <int Lo, class F, int... I>
[[gnu::always_inline]] inline bool with_int_in(std::int64_t n, F& f, std::integer_sequence<int, I...>) {
  return ((n == Lo + I ? (f.template operator()<Lo + I>(), true) : false) || ...);
}

/// Calls f.template operator()<N>() for N == n and returns true when Lo <= n <= Hi; otherwise
/// calls nothing and returns false. f is typically `[&]<int N>() { kernel<N>(...); }`.
template <int Lo, int Hi, class F>
[[gnu::always_inline]] inline bool with_int(std::int64_t n, F&& f) {
  static_assert(Lo <= Hi, "an empty range");
  return with_int_in<Lo>(n, f, std::make_integer_sequence<int, Hi - Lo + 1>{});
}

}  // namespace qkv::detail::QKV_ENGINE_NS
