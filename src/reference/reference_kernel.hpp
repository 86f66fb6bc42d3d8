#pragma once
// The float64 specification of attention (reference.cpp), row by row. qkv::reference::attention,
// the dispatcher's `reference` kernel, `qkv explain`'s step trace and the backward specification
// all run these same steps, so there is one float64 specification and no copy to keep in step.
#include <cstdint>
#include <vector>

#include "core/problem.hpp"

namespace qkv::detail {

/// Why a key is, or is not, in a row's softmax (the checks in the order reference_row makes them).
enum class KeyState : std::uint8_t { admitted, outside_window, beyond_kv_len, masked };

/// Where reference_row leaves each intermediate step of one row; every pointer may be null,
/// each non-null one points at Sk entries. Excluded keys get -inf scores and scaled scores.
struct RowSteps {
  double* scores = nullptr;    // step 1: q_i . k_j
  double* scaled = nullptr;    // step 2: scale, softcap, additive mask: the softmax's logits
  double* mask_add = nullptr;  // the additive mask's term, where the mask was read
  KeyState* state = nullptr;
  double* sink = nullptr;      // one value: the sink's weight exp(z_h - lse) (0 without sinks)
};

/// The five steps for one query row at a time, with scratch sized for one Problem.
class ReferenceRows {
 public:
  explicit ReferenceRows(const Problem& p);
  /// Row (b, h, i): writes the weights alpha[Sk] (0 for excluded keys; all 0 for an empty row)
  /// and z[Dv] = sum_j alpha_j v_j (alpha_j times Z_ij / (1 - p) with dropout; alpha stays the
  /// weights before dropout), records the steps asked for, and returns softmax_lse
  /// (natural log, the sink included; -inf for a row with no admissible key and no sink, z_h
  /// with a sink; NaN if a score is NaN).
  double run(std::int64_t b, std::int64_t h, std::int64_t i, double* alpha, double* z,
             const RowSteps& steps = {});

 private:
  const Problem& p_;
  std::vector<double> q_, k_, v_, s_;
  std::vector<KeyState> state_;
};

/// The float64 reference kernel: every row of `p` into out, softmax_lse and probs. Never throws
/// (beyond std::bad_alloc).
void reference_kernel(const Problem& p);

/// The float64 backward (backward.cpp): dQ, dK, dV (and dL/dz when bp.dsinks is set) written. Never throws (beyond
/// std::bad_alloc).
void reference_backward(const BackwardProblem& bp);

}  // namespace qkv::detail
