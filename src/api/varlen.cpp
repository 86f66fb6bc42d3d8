// qkv::attention_varlen, attention_varlen_backward, attention_paged and their explanations:
// lowered once (src/core: detail::VarlenProblem, VarlenBackwardProblem), the path chosen and run,
// or explained, by the registry (src/dispatch): the serving kernel, one dense call per sequence,
// or the float64 reference over gathered keys.
#include "qkv/varlen.hpp"

#include "core/validate_varlen.hpp"
#include "dispatch/dispatch.hpp"

namespace qkv {
namespace {

std::string run_or_explain(const detail::Call& c, bool explain) {
  if (explain) return detail::explain_call(c);
  detail::run_call(c);
  return {};
}

// K and V as TensorView or QuantizedKV: K and V in one float format of q's dtype lower as the
// float form (validate_varlen.cpp), which the per-sequence path takes under any kernel.
template <class KV>
std::string varlen(bool explain, const TensorView& q, const KV& k, const KV& v, const TensorView& out,
                   const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k, const AttentionParams& params,
                   const std::optional<TensorView>& softmax_lse) {
  const detail::VarlenProblem vp = detail::lower_varlen(q, k, v, out, cu_seqlens_q, cu_seqlens_k, params, softmax_lse);
  return run_or_explain(detail::Call::varlen(vp, params), explain);
}

template <class Pool>
std::string paged(bool explain, const TensorView& q, const Pool& k_pool, const Pool& v_pool, const TensorView& out,
                  const TensorView& cu_seqlens_q, const TensorView& seq_lens, const TensorView& block_table,
                  const AttentionParams& params, const std::optional<TensorView>& softmax_lse) {
  const detail::VarlenProblem vp =
      detail::lower_paged(q, k_pool, v_pool, out, cu_seqlens_q, seq_lens, block_table, params, softmax_lse);
  return run_or_explain(detail::Call::paged(vp, params), explain);
}

std::string varlen_backward(bool explain, const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const TensorView& softmax_lse, const TensorView& grad_out,
                            const TensorView& grad_q, const TensorView& grad_k, const TensorView& grad_v,
                            const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                            const AttentionParams& params, const TensorView* grad_sinks = nullptr) {
  const detail::VarlenBackwardProblem vbp = detail::lower_varlen_backward(
      q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, cu_seqlens_q, cu_seqlens_k, params, grad_sinks);
  return run_or_explain(detail::Call::varlen_backward(vbp, params), explain);
}

}  // namespace

void attention_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                      const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k, const AttentionParams& params,
                      const std::optional<TensorView>& softmax_lse) {
  varlen(false, q, k, v, out, cu_seqlens_q, cu_seqlens_k, params, softmax_lse);
}

void attention_varlen(const TensorView& q, const QuantizedKV& k, const QuantizedKV& v, const TensorView& out,
                      const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k, const AttentionParams& params,
                      const std::optional<TensorView>& softmax_lse) {
  varlen(false, q, k, v, out, cu_seqlens_q, cu_seqlens_k, params, softmax_lse);
}

void attention_varlen_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                               const TensorView& grad_k, const TensorView& grad_v, const TensorView& cu_seqlens_q,
                               const TensorView& cu_seqlens_k, const AttentionParams& params) {
  varlen_backward(false, q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, cu_seqlens_q, cu_seqlens_k,
                  params);
}

void attention_varlen_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                               const TensorView& grad_k, const TensorView& grad_v, const TensorView& cu_seqlens_q,
                               const TensorView& cu_seqlens_k, const TensorView& grad_sinks,
                               const AttentionParams& params) {
  varlen_backward(false, q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, cu_seqlens_q, cu_seqlens_k,
                  params, &grad_sinks);
}

void attention_paged(const TensorView& q, const TensorView& k_pool, const TensorView& v_pool, const TensorView& out,
                     const TensorView& cu_seqlens_q, const TensorView& seq_lens, const TensorView& block_table,
                     const AttentionParams& params, const std::optional<TensorView>& softmax_lse) {
  paged(false, q, k_pool, v_pool, out, cu_seqlens_q, seq_lens, block_table, params, softmax_lse);
}

void attention_paged(const TensorView& q, const QuantizedKV& k_pool, const QuantizedKV& v_pool, const TensorView& out,
                     const TensorView& cu_seqlens_q, const TensorView& seq_lens, const TensorView& block_table,
                     const AttentionParams& params, const std::optional<TensorView>& softmax_lse) {
  paged(false, q, k_pool, v_pool, out, cu_seqlens_q, seq_lens, block_table, params, softmax_lse);
}

std::string explain_dispatch(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                             const AttentionParams& params, const std::optional<TensorView>& softmax_lse) {
  return varlen(true, q, k, v, out, cu_seqlens_q, cu_seqlens_k, params, softmax_lse);
}

std::string explain_dispatch(const TensorView& q, const QuantizedKV& k, const QuantizedKV& v, const TensorView& out,
                             const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                             const AttentionParams& params, const std::optional<TensorView>& softmax_lse) {
  return varlen(true, q, k, v, out, cu_seqlens_q, cu_seqlens_k, params, softmax_lse);
}

std::string explain_dispatch(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                             const TensorView& grad_k, const TensorView& grad_v, const TensorView& cu_seqlens_q,
                             const TensorView& cu_seqlens_k, const AttentionParams& params) {
  return varlen_backward(true, q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, cu_seqlens_q,
                         cu_seqlens_k, params);
}

std::string explain_dispatch(const TensorView& q, const TensorView& k_pool, const TensorView& v_pool,
                             const TensorView& out, const TensorView& cu_seqlens_q, const TensorView& seq_lens,
                             const TensorView& block_table, const AttentionParams& params,
                             const std::optional<TensorView>& softmax_lse) {
  return paged(true, q, k_pool, v_pool, out, cu_seqlens_q, seq_lens, block_table, params, softmax_lse);
}

std::string explain_dispatch(const TensorView& q, const QuantizedKV& k_pool, const QuantizedKV& v_pool,
                             const TensorView& out, const TensorView& cu_seqlens_q, const TensorView& seq_lens,
                             const TensorView& block_table, const AttentionParams& params,
                             const std::optional<TensorView>& softmax_lse) {
  return paged(true, q, k_pool, v_pool, out, cu_seqlens_q, seq_lens, block_table, params, softmax_lse);
}

}  // namespace qkv
