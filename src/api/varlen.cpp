// qkv::attention_varlen, attention_varlen_backward, attention_paged: validate once, then run the
// serving kernel over the whole batch, or one qkv::attention / attention_backward call per
// sequence on B = 1 views of the packed tensors.
#include "qkv/varlen.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/validate_varlen.hpp"
#include "kernels/kernels.hpp"
#include "qkv/backward.hpp"
#include "qkv/error.hpp"
#include "tensor/convert.hpp"

namespace qkv {
namespace {

using i64 = std::int64_t;

// Tokens [start, start + len) of a packed [T, H, X] tensor as [1, H, len, X].
TensorView seq_view(const TensorView& t, i64 start, i64 len) {
  char* base = static_cast<char*>(t.data()) + start * t.stride(0) * static_cast<i64>(dtype_size(t.dtype()));
  return TensorView(t.size(0) ? base : t.data(), t.dtype(), {1, t.size(1), len, t.size(2)},
                    {0, t.stride(1), t.stride(0), t.stride(2)});
}
// Columns [start, start + len) of softmax_lse [H, T] as [1, H, len].
TensorView lse_view(const TensorView& t, i64 start, i64 len) {
  char* base = static_cast<char*>(t.data()) + start * t.stride(1) * static_cast<i64>(dtype_size(t.dtype()));
  return TensorView(t.size(1) ? base : t.data(), t.dtype(), {1, t.size(0), len}, {0, t.stride(0), t.stride(1)});
}

// The float64 specification over keys read through the problem's addressing (packed or paged, any
// format): each sequence's keys and values gathered (dequantized: code * scale in float32, then
// widened) into float64 copies, and one qkv::attention call with the reference kernel.
void reference_gathered(const detail::VarlenProblem& vp, const TensorView& q, const TensorView& out,
                        const AttentionParams& params, const std::optional<TensorView>& softmax_lse) {
  const detail::Problem& p = vp.p;
  std::vector<float> row(static_cast<std::size_t>(std::max(p.D, p.Dv)));
  auto gather = [&](const detail::Operand& x, const detail::KVCodec& c, i64 b, i64 h, i64 j, i64 n, double* dst) {
    const i64 off = vp.key_off(x, b, h, j);
    if (c.scales) {
      detail::decode_row(c, x.data, off, h, row.data());
      detail::convert_row(row.data(), DType::f32, dst, DType::f64, n);
    } else {
      detail::convert_row(static_cast<const char*>(x.data) + off * static_cast<i64>(dtype_size(x.dtype)), x.dtype, dst,
                          DType::f64, n);
    }
  };
  for (i64 b = 0; b < vp.batch(); ++b) {
    const i64 q0 = vp.cu_q[b], sq = vp.seq_q(b), sk = vp.seq_k[b];
    Tensor qd(DType::f64, {1, p.Hq, sq, p.D}), kd(DType::f64, {1, p.Hkv, sk, p.D}), vd(DType::f64, {1, p.Hkv, sk, p.Dv});
    const TensorView qs = seq_view(q, q0, sq);
    for (i64 h = 0; h < p.Hq; ++h)
      for (i64 i = 0; i < sq; ++i)
        detail::convert_row(static_cast<const char*>(qs.data()) + (h * qs.stride(1) + i * qs.stride(2)) * dtype_size(q.dtype()),
                            q.dtype(), qd.data_as<double>() + (h * sq + i) * p.D, DType::f64, p.D);
    for (i64 h = 0; h < p.Hkv; ++h)
      for (i64 j = 0; j < sk; ++j) {
        gather(p.k, vp.kc, b, h, j, p.D, kd.data_as<double>() + (h * sk + j) * p.D);
        gather(p.v, vp.vc, b, h, j, p.Dv, vd.data_as<double>() + (h * sk + j) * p.Dv);
      }
    std::optional<TensorView> lse;
    if (softmax_lse) lse = lse_view(*softmax_lse, q0, sq);
    AttentionParams rp = params;
    rp.kernel = KernelKind::reference;
    attention(qd, kd, vd, seq_view(out, q0, sq), rp, lse);
  }
}

}  // namespace

void attention_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                      const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k, const AttentionParams& params,
                      const std::optional<TensorView>& softmax_lse) {
  const detail::VarlenProblem vp = detail::lower_varlen(q, k, v, out, cu_seqlens_q, cu_seqlens_k, params, softmax_lse);
  if (params.kernel == KernelKind::automatic && q.dtype() != DType::f64) {
    detail::serving_kernel(vp);
    return;
  }
  // A forced kernel (or float64 inputs): one qkv::attention call per sequence.
  for (i64 b = 0; b < vp.batch(); ++b) {
    const i64 q0 = vp.cu_q[b], sq = vp.seq_q(b), k0 = vp.cu_k[b], sk = vp.seq_k[b];
    std::optional<TensorView> lse;
    if (softmax_lse) lse = lse_view(*softmax_lse, q0, sq);
    attention(seq_view(q, q0, sq), seq_view(k, k0, sk), seq_view(v, k0, sk), seq_view(out, q0, sq), params, lse);
  }
}

void attention_varlen_backward(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& softmax_lse, const TensorView& grad_out, const TensorView& grad_q,
                               const TensorView& grad_k, const TensorView& grad_v, const TensorView& cu_seqlens_q,
                               const TensorView& cu_seqlens_k, const AttentionParams& params) {
  const detail::VarlenProblem vp = detail::lower_varlen(q, k, v, out, cu_seqlens_q, cu_seqlens_k, params, softmax_lse);
  const struct { const TensorView* t; const char* name; const char* axes; const TensorView* like; } grads[] = {
      {&grad_out, "grad_out", "[total_q,Hq,Dv]", &out},
      {&grad_q, "grad_q", "[total_q,Hq,D]", &q},
      {&grad_k, "grad_k", "[total_k,Hkv,D]", &k},
      {&grad_v, "grad_v", "[total_k,Hkv,Dv]", &v}};
  for (const auto& g : grads)
    if (g.t->rank() != 3 || g.t->shape() != g.like->shape())
      throw Error(std::string(g.name) + ": expected shape " + g.axes + " = " + shape_str(g.like->shape()) + ", got " +
                  shape_str(g.t->shape()));
  for (i64 b = 0; b < vp.batch(); ++b) {
    const i64 q0 = vp.cu_q[b], sq = vp.seq_q(b), k0 = vp.cu_k[b], sk = vp.seq_k[b];
    attention_backward(seq_view(q, q0, sq), seq_view(k, k0, sk), seq_view(v, k0, sk), seq_view(out, q0, sq),
                       lse_view(softmax_lse, q0, sq), seq_view(grad_out, q0, sq), seq_view(grad_q, q0, sq),
                       seq_view(grad_k, k0, sk), seq_view(grad_v, k0, sk), params);
  }
}

namespace {
// Both pool kinds (float, quantized): lowered once, the serving kernel or the float64 reference.
template <class Pool>
void paged(const TensorView& q, const Pool& k_pool, const Pool& v_pool, const TensorView& out,
           const TensorView& cu_seqlens_q, const TensorView& seq_lens, const TensorView& block_table,
           const AttentionParams& params, const std::optional<TensorView>& softmax_lse) {
  const detail::VarlenProblem vp =
      detail::lower_paged(q, k_pool, v_pool, out, cu_seqlens_q, seq_lens, block_table, params, softmax_lse);
  if (params.kernel != KernelKind::reference) {
    detail::serving_kernel(vp);
    return;
  }
  reference_gathered(vp, q, out, params, softmax_lse);
}
}  // namespace

void attention_paged(const TensorView& q, const TensorView& k_pool, const TensorView& v_pool, const TensorView& out,
                     const TensorView& cu_seqlens_q, const TensorView& seq_lens, const TensorView& block_table,
                     const AttentionParams& params, const std::optional<TensorView>& softmax_lse) {
  paged(q, k_pool, v_pool, out, cu_seqlens_q, seq_lens, block_table, params, softmax_lse);
}

void attention_paged(const TensorView& q, const QuantizedKV& k_pool, const QuantizedKV& v_pool, const TensorView& out,
                     const TensorView& cu_seqlens_q, const TensorView& seq_lens, const TensorView& block_table,
                     const AttentionParams& params, const std::optional<TensorView>& softmax_lse) {
  paged(q, k_pool, v_pool, out, cu_seqlens_q, seq_lens, block_table, params, softmax_lse);
}

void attention_varlen(const TensorView& q, const QuantizedKV& k, const QuantizedKV& v, const TensorView& out,
                      const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k, const AttentionParams& params,
                      const std::optional<TensorView>& softmax_lse) {
  // Float keys and values of q's dtype: the float form (float64 and forced kernels included).
  if (!kv_format_quantized(k.format) && k.format == v.format && k.data.dtype() == q.dtype()) {
    attention_varlen(q, k.data, v.data, out, cu_seqlens_q, cu_seqlens_k, params, softmax_lse);
    return;
  }
  const detail::VarlenProblem vp = detail::lower_varlen(q, k, v, out, cu_seqlens_q, cu_seqlens_k, params, softmax_lse);
  if (params.kernel != KernelKind::reference) {
    detail::serving_kernel(vp);
    return;
  }
  reference_gathered(vp, q, out, params, softmax_lse);
}

}  // namespace qkv
