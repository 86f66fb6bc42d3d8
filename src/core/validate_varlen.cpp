// The argument checks of attention_varlen, attention_varlen_backward and attention_paged, and their
// lowering to detail::VarlenProblem (VarlenBackwardProblem). The options and the overlap of outputs
// with inputs are checked by lower_attention on B = 1 views of the packed operands; a backward call
// lowers each sequence through lower_attention_backward.
#include "core/validate_varlen.hpp"

#include <algorithm>
#include <string>

#include "core/validate.hpp"
#include "qkv/error.hpp"
#include "tensor/convert.hpp"

namespace qkv::detail {
namespace {

std::string str(std::int64_t x) { return std::to_string(x); }

void check_rank3(const TensorView& t, const char* name, const char* axes) {
  if (t.rank() != 3)
    throw Error(std::string(name) + ": expected a 3-D tensor " + axes + ", got rank " + str(t.rank()) +
                " with shape " + shape_str(t.shape()));
  check_sizes(t, name);
  check_data(t, name);
  if (t.size(2) > 1 && t.stride(2) != 1)
    throw Error(std::string(name) + ": expected a contiguous last dimension (stride 1), got stride " +
                str(t.stride(2)) + " in shape " + shape_str(t.shape()));
}

void expect_size(const TensorView& t, const char* name, const char* axes, int axis, const char* letter,
                 std::int64_t want, const char* why) {
  if (t.size(axis) != want)
    throw Error(std::string(name) + ": expected " + axes + " with " + letter + " == " + why + " (" + str(want) +
                "), got " + letter + " = " + str(t.size(axis)) + " in shape " + shape_str(t.shape()));
}

// int32 vector of `n` entries (n < 0: any n >= 1), read into int64.
std::vector<std::int64_t> read_i32(const TensorView& t, const char* name, const char* axes, std::int64_t n) {
  if (t.rank() != 1)
    throw Error(std::string(name) + ": expected a 1-D int32 tensor " + axes + ", got rank " + str(t.rank()) +
                " with shape " + shape_str(t.shape()));
  if (t.dtype() != DType::i32)
    throw Error(std::string(name) + ": expected dtype int32, got " + std::string(dtype_name(t.dtype())));
  if (n >= 0 && t.size(0) != n)
    throw Error(std::string(name) + ": expected " + axes + " = " + str(n) + " entries, got " + str(t.size(0)));
  if (n < 0 && t.size(0) < 1)
    throw Error(std::string(name) + ": expected " + axes + " >= 1 entries, got 0");
  check_sizes(t, name);
  check_data(t, name);
  std::vector<std::int64_t> out(static_cast<std::size_t>(t.size(0)));
  for (std::int64_t i = 0; i < t.size(0); ++i) out[static_cast<std::size_t>(i)] = t.data_as<const std::int32_t>()[i * t.stride(0)];
  return out;
}

std::vector<std::int64_t> read_cu(const TensorView& t, const char* name, std::int64_t n, std::int64_t total,
                                  const char* total_name) {
  std::vector<std::int64_t> cu = read_i32(t, name, "[batch + 1]", n);
  if (cu[0] != 0) throw Error(std::string(name) + ": expected the first entry == 0, got " + str(cu[0]));
  for (std::size_t b = 0; b + 1 < cu.size(); ++b)
    if (cu[b + 1] < cu[b])
      throw Error(std::string(name) + ": expected non-decreasing prefix sums, got " + str(cu[b]) + " at " + str(b) +
                  " then " + str(cu[b + 1]));
  if (cu.back() != total)
    throw Error(std::string(name) + ": expected the last entry == " + total_name + " (" + str(total) + "), got " +
                str(cu.back()));
  return cu;
}

// [T, H, X] as [1, H, T, X]; [H, T] as [1, H, T].
TensorView as_bhsd(const TensorView& t) {
  return TensorView(t.data(), t.dtype(), {1, t.size(1), t.size(0), t.size(2)}, {0, t.stride(1), t.stride(0), t.stride(2)});
}
TensorView as_bhs(const TensorView& t) {
  return TensorView(t.data(), t.dtype(), {1, t.size(0), t.size(1)}, {0, t.stride(0), t.stride(1)});
}

// Tokens [start, start + len) of a packed [T, H, X] tensor as [1, H, len, X].
TensorView seq_view(const TensorView& t, std::int64_t start, std::int64_t len) {
  char* base = static_cast<char*>(t.data()) + start * t.stride(0) * static_cast<std::int64_t>(dtype_size(t.dtype()));
  return TensorView(t.size(0) ? base : t.data(), t.dtype(), {1, t.size(1), len, t.size(2)},
                    {0, t.stride(1), t.stride(0), t.stride(2)});
}
// Columns [start, start + len) of softmax_lse [H, T] as [1, H, len].
TensorView lse_view(const TensorView& t, std::int64_t start, std::int64_t len) {
  char* base = static_cast<char*>(t.data()) + start * t.stride(1) * static_cast<std::int64_t>(dtype_size(t.dtype()));
  return TensorView(t.size(1) ? base : t.data(), t.dtype(), {1, t.size(0), len}, {0, t.stride(0), t.stride(1)});
}

void check_lse(const std::optional<TensorView>& lse, std::int64_t Hq, std::int64_t T) {
  if (!lse) return;
  if (lse->rank() != 2 || lse->size(0) != Hq || lse->size(1) != T)
    throw Error("softmax_lse: expected shape [Hq,total_q] = " + shape_str({Hq, T}) + ", got " + shape_str(lse->shape()));
}

void refuse_per_batch_options(const AttentionParams& params, const char* fn) {
  if (params.mask)
    throw Error(std::string("mask: expected none (") + fn + " takes causal and window masks only), got a mask of shape " +
                shape_str(params.mask->shape()));
  if (params.kv_lens)
    throw Error(std::string("kv_lens: expected none (") + fn + ": a sequence's keys are given by " +
                (std::string(fn) == "attention_paged" ? "seq_lens" : "cu_seqlens_k") + "), got a tensor of shape " +
                shape_str(params.kv_lens->shape()));
}

// The options without the ALiBi slopes: lower_attention sees a B = 1 view of a packed call, whose
// [batch, Hq] slopes lower_alibi checks once the batch is known.
AttentionParams without_alibi(const AttentionParams& params) {
  AttentionParams p = params;
  p.alibi_slopes.reset();
  return p;
}

}  // namespace

VarlenProblem lower_varlen(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                           const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                           const AttentionParams& params, const std::optional<TensorView>& softmax_lse) {
  check_rank3(q, "q", "[total_q,Hq,D]");
  check_rank3(k, "k", "[total_k,Hkv,D]");
  check_rank3(v, "v", "[total_k,Hkv,Dv]");
  check_rank3(out, "out", "[total_q,Hq,Dv]");
  expect_size(k, "k", "[total_k,Hkv,D]", 2, "D", q.size(2), "q.D");
  expect_size(v, "v", "[total_k,Hkv,Dv]", 0, "total_k", k.size(0), "k.total_k");
  expect_size(v, "v", "[total_k,Hkv,Dv]", 1, "Hkv", k.size(1), "k.Hkv");
  expect_size(out, "out", "[total_q,Hq,Dv]", 0, "total_q", q.size(0), "q.total_q");
  expect_size(out, "out", "[total_q,Hq,Dv]", 1, "Hq", q.size(1), "q.Hq");
  expect_size(out, "out", "[total_q,Hq,Dv]", 2, "Dv", v.size(2), "v.Dv");
  check_lse(softmax_lse, q.size(1), q.size(0));
  refuse_per_batch_options(params, "attention_varlen");

  VarlenProblem vp;
  std::optional<TensorView> lse4;
  if (softmax_lse) lse4 = as_bhs(*softmax_lse);
  vp.p = lower_attention(as_bhsd(q), as_bhsd(k), as_bhsd(v), as_bhsd(out), without_alibi(params), lse4, std::nullopt);
  vp.cu_q = read_cu(cu_seqlens_q, "cu_seqlens_q", -1, q.size(0), "total_q");
  vp.cu_k = read_cu(cu_seqlens_k, "cu_seqlens_k", static_cast<std::int64_t>(vp.cu_q.size()), k.size(0), "total_k");
  vp.seq_k.resize(vp.cu_q.size() - 1);
  for (std::size_t b = 0; b < vp.seq_k.size(); ++b) vp.seq_k[b] = vp.cu_k[b + 1] - vp.cu_k[b];
  if (params.alibi_slopes) lower_alibi(vp.p, *params.alibi_slopes, vp.batch());
  for (const TensorView* cu : {&cu_seqlens_q, &cu_seqlens_k}) {
    const char* n = cu == &cu_seqlens_q ? "cu_seqlens_q" : "cu_seqlens_k";
    check_no_overlap(out, "out", *cu, n);
    if (softmax_lse) check_no_overlap(*softmax_lse, "softmax_lse", *cu, n);
  }
  return vp;
}

namespace {

// lower_paged for float pools (kc == nullptr) or pools in any format (kc, vc checked by make_codec).
VarlenProblem lower_paged_impl(const TensorView& q, const TensorView& k_pool, const TensorView& v_pool, const TensorView& out,
                               const TensorView& cu_seqlens_q, const TensorView& seq_lens, const TensorView& block_table,
                               const AttentionParams& params, const std::optional<TensorView>& softmax_lse,
                               const KVCodec* kc, const KVCodec* vc) {
  check_rank3(q, "q", "[total_q,Hq,D]");
  check_rank4(k_pool, "k_pool", "[num_blocks,Hkv,block_size,D]");
  check_rank4(v_pool, "v_pool", "[num_blocks,Hkv,block_size,Dv]");
  check_rank3(out, "out", "[total_q,Hq,Dv]");
  const char* kax = "[num_blocks,Hkv,block_size,D]";
  const char* vax = "[num_blocks,Hkv,block_size,Dv]";
  expect_size(k_pool, "k_pool", kax, 3, "D", q.size(2), "q.D");
  expect_size(v_pool, "v_pool", vax, 0, "num_blocks", k_pool.size(0), "k_pool.num_blocks");
  expect_size(v_pool, "v_pool", vax, 1, "Hkv", k_pool.size(1), "k_pool.Hkv");
  expect_size(v_pool, "v_pool", vax, 2, "block_size", k_pool.size(2), "k_pool.block_size");
  expect_size(out, "out", "[total_q,Hq,Dv]", 0, "total_q", q.size(0), "q.total_q");
  expect_size(out, "out", "[total_q,Hq,Dv]", 1, "Hq", q.size(1), "q.Hq");
  expect_size(out, "out", "[total_q,Hq,Dv]", 2, "Dv", v_pool.size(3), "v_pool.Dv");
  check_lse(softmax_lse, q.size(1), q.size(0));
  refuse_per_batch_options(params, "attention_paged");
  if (params.align != Alignment::bottom_right)
    throw Error("align: expected bottom_right for attention_paged (new tokens sit at the end of their sequence), got top_left");
  const DType pd = k_pool.dtype();
  if (!kc && pd != DType::f32 && pd != DType::bf16 && pd != DType::f16)
    throw Error("k_pool: expected dtype float32, float16 or bfloat16, got " + std::string(dtype_name(pd)));
  if (!kc && v_pool.dtype() != pd)
    throw Error("v_pool: expected dtype " + std::string(dtype_name(pd)) + " (the dtype of k_pool), got " +
                std::string(dtype_name(v_pool.dtype())));
  if (q.dtype() != DType::f32 && q.dtype() != DType::bf16 && q.dtype() != DType::f16)
    throw Error("q: expected dtype float32, float16 or bfloat16, got " + std::string(dtype_name(q.dtype())));
  if (params.kernel != KernelKind::automatic && params.kernel != KernelKind::reference)
    throw Error("kernel: expected automatic or reference for attention_paged, got another kernel");

  // The options, q, out and softmax_lse through lower_attention, with empty stand-ins for K and V
  // (their shape and dtype are checked above).
  const std::int64_t Hkv = k_pool.size(1);
  TensorView k0(k_pool.data(), q.dtype(), {1, Hkv, 0, q.size(2)});
  TensorView v0(v_pool.data(), q.dtype(), {1, Hkv, 0, v_pool.size(3)});
  std::optional<TensorView> lse4;
  if (softmax_lse) lse4 = as_bhs(*softmax_lse);
  VarlenProblem vp;
  vp.p = lower_attention(as_bhsd(q), k0, v0, as_bhsd(out), without_alibi(params), lse4, std::nullopt);
  Problem& p = vp.p;
  p.Sk = k_pool.size(0) * k_pool.size(2);
  p.k = {k_pool.data(), pd, k_pool.stride(0), k_pool.stride(1), k_pool.stride(2)};
  p.v = {v_pool.data(), v_pool.dtype(), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2)};
  if (kc) { vp.kc = *kc; vp.vc = *vc; }

  vp.cu_q = read_cu(cu_seqlens_q, "cu_seqlens_q", -1, q.size(0), "total_q");
  const std::int64_t batch = static_cast<std::int64_t>(vp.cu_q.size()) - 1;
  vp.seq_k = read_i32(seq_lens, "seq_lens", "[batch]", batch);
  if (params.alibi_slopes) lower_alibi(p, *params.alibi_slopes, batch);
  if (block_table.rank() != 2 || block_table.size(0) != batch)
    throw Error("block_table: expected a 2-D int32 tensor [batch,max_blocks] with batch = " + str(batch) + ", got shape " +
                shape_str(block_table.shape()));
  if (block_table.dtype() != DType::i32)
    throw Error("block_table: expected dtype int32, got " + std::string(dtype_name(block_table.dtype())));
  check_sizes(block_table, "block_table");
  check_data(block_table, "block_table");
  vp.paged = true;
  vp.block_size = k_pool.size(2);
  vp.block_table = block_table.data_as<const std::int32_t>();
  vp.bt_stride = block_table.stride(0);
  vp.bt_col_stride = block_table.stride(1);
  const std::int64_t max_blocks = block_table.size(1), nb = k_pool.size(0);
  // A window wider than any sequence admits the same keys as an unbounded one; clamped so the
  // kernels' key arithmetic cannot overflow. A sequence may be longer than the pool (a block
  // table may name one block twice), so the bound is the table's reach, not the pool's size.
  const EffectiveWindow w = effective_window(params);
  const std::int64_t wide = p.Sq + std::max(p.Sk, max_blocks * vp.block_size) + 1;
  p.window_left = w.left < 0 ? -1 : std::min(w.left, wide);
  p.window_right = w.right < 0 ? -1 : std::min(w.right, wide);
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t len = vp.seq_k[static_cast<std::size_t>(b)];
    if (len < vp.seq_q(b) || len > max_blocks * vp.block_size)
      throw Error("seq_lens: expected each length in [Sq, max_blocks * block_size] = [" + str(vp.seq_q(b)) + ", " +
                  str(max_blocks * vp.block_size) + "], got " + str(len) + " at batch " + str(b));
    const std::int64_t used = vp.block_size > 0 ? (len + vp.block_size - 1) / vp.block_size : 0;
    for (std::int64_t c = 0; c < used; ++c) {
      const std::int64_t e = vp.block_table[b * vp.bt_stride + c * vp.bt_col_stride];
      if (e < 0 || e >= nb)
        throw Error("block_table: expected entries in [0, num_blocks) = [0, " + str(nb) + ") for the blocks of each sequence, got " +
                    str(e) + " at [" + str(b) + ", " + str(c) + "]");
    }
  }
  const std::pair<const TensorView*, const char*> inputs[] = {{&k_pool, "k_pool"}, {&v_pool, "v_pool"},
                                                              {&cu_seqlens_q, "cu_seqlens_q"}, {&seq_lens, "seq_lens"},
                                                              {&block_table, "block_table"}};
  for (const auto& [t, n] : inputs) {
    check_no_overlap(out, "out", *t, n);
    if (softmax_lse) check_no_overlap(*softmax_lse, "softmax_lse", *t, n);
  }
  return vp;
}

std::string kv_formats(const QuantizedKV& k, const QuantizedKV& v) {
  return std::string(kv_format_name(k.format)) + "/" + std::string(kv_format_name(v.format));
}

// The scales must not overlap the outputs either.
void check_scales_overlap(const QuantizedKV& x, const char* name, const TensorView& out,
                          const std::optional<TensorView>& softmax_lse) {
  if (!kv_format_quantized(x.format) || x.scales.numel() == 0) return;
  check_no_overlap(out, "out", x.scales, name);
  if (softmax_lse) check_no_overlap(*softmax_lse, "softmax_lse", x.scales, name);
}

}  // namespace

VarlenProblem lower_paged(const TensorView& q, const TensorView& k_pool, const TensorView& v_pool, const TensorView& out,
                          const TensorView& cu_seqlens_q, const TensorView& seq_lens, const TensorView& block_table,
                          const AttentionParams& params, const std::optional<TensorView>& softmax_lse) {
  return lower_paged_impl(q, k_pool, v_pool, out, cu_seqlens_q, seq_lens, block_table, params, softmax_lse, nullptr,
                          nullptr);
}

VarlenProblem lower_paged(const TensorView& q, const QuantizedKV& k_pool, const QuantizedKV& v_pool,
                          const TensorView& out, const TensorView& cu_seqlens_q, const TensorView& seq_lens,
                          const TensorView& block_table, const AttentionParams& params,
                          const std::optional<TensorView>& softmax_lse) {
  if (!kv_format_quantized(k_pool.format) && !kv_format_quantized(v_pool.format) && k_pool.format == v_pool.format)
    return lower_paged(q, k_pool.data, v_pool.data, out, cu_seqlens_q, seq_lens, block_table, params, softmax_lse);
  check_rank4(k_pool.data, "k_pool", "[num_blocks,Hkv,block_size,D]");
  check_rank4(v_pool.data, "v_pool", "[num_blocks,Hkv,block_size,Dv]");
  const KVCodec kc = make_codec(k_pool, "k_pool"), vc = make_codec(v_pool, "v_pool");
  check_scales_overlap(k_pool, "k_pool scales", out, softmax_lse);
  check_scales_overlap(v_pool, "v_pool scales", out, softmax_lse);
  return lower_paged_impl(q, k_pool.data, v_pool.data, out, cu_seqlens_q, seq_lens, block_table, params, softmax_lse,
                          &kc, &vc);
}

VarlenProblem lower_varlen(const TensorView& q, const QuantizedKV& k, const QuantizedKV& v, const TensorView& out,
                           const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                           const AttentionParams& params, const std::optional<TensorView>& softmax_lse) {
  if (!kv_format_quantized(k.format) && k.format == v.format && k.data.dtype() == q.dtype())
    return lower_varlen(q, k.data, v.data, out, cu_seqlens_q, cu_seqlens_k, params, softmax_lse);
  check_rank3(q, "q", "[total_q,Hq,D]");
  check_rank3(k.data, "k", "[total_k,Hkv,D]");
  check_rank3(v.data, "v", "[total_k,Hkv,Dv]");
  const KVCodec kc = make_codec(k, "k"), vc = make_codec(v, "v");
  check_rank3(out, "out", "[total_q,Hq,Dv]");
  expect_size(k.data, "k", "[total_k,Hkv,D]", 2, "D", q.size(2), "q.D");
  expect_size(v.data, "v", "[total_k,Hkv,Dv]", 0, "total_k", k.data.size(0), "k.total_k");
  expect_size(v.data, "v", "[total_k,Hkv,Dv]", 1, "Hkv", k.data.size(1), "k.Hkv");
  expect_size(out, "out", "[total_q,Hq,Dv]", 0, "total_q", q.size(0), "q.total_q");
  expect_size(out, "out", "[total_q,Hq,Dv]", 1, "Hq", q.size(1), "q.Hq");
  expect_size(out, "out", "[total_q,Hq,Dv]", 2, "Dv", v.data.size(2), "v.Dv");
  check_lse(softmax_lse, q.size(1), q.size(0));
  refuse_per_batch_options(params, "attention_varlen");
  if (q.dtype() != DType::f32 && q.dtype() != DType::bf16 && q.dtype() != DType::f16)
    throw Error("q: expected dtype float32, float16 or bfloat16 over K/V in formats " + kv_formats(k, v) + ", got " +
                std::string(dtype_name(q.dtype())));
  if (params.kernel != KernelKind::automatic && params.kernel != KernelKind::reference)
    throw Error("kernel: expected automatic or reference over K/V in formats " + kv_formats(k, v) + ", got another kernel");
  // Options, q, out and softmax_lse through lower_attention with empty stand-ins for K and V.
  const std::int64_t Hkv = k.data.size(1), T = k.data.size(0);
  TensorView k0(k.data.data(), q.dtype(), {1, Hkv, 0, q.size(2)});
  TensorView v0(v.data.data(), q.dtype(), {1, Hkv, 0, v.data.size(2)});
  std::optional<TensorView> lse4;
  if (softmax_lse) lse4 = as_bhs(*softmax_lse);
  VarlenProblem vp;
  vp.p = lower_attention(as_bhsd(q), k0, v0, as_bhsd(out), without_alibi(params), lse4, std::nullopt);
  Problem& p = vp.p;
  p.Sk = T;
  const EffectiveWindow w = effective_window(params);
  const std::int64_t wide = p.Sq + p.Sk + 1;
  p.window_left = w.left < 0 ? -1 : std::min(w.left, wide);
  p.window_right = w.right < 0 ? -1 : std::min(w.right, wide);
  p.k = {k.data.data(), k.data.dtype(), 0, k.data.stride(1), k.data.stride(0)};
  p.v = {v.data.data(), v.data.dtype(), 0, v.data.stride(1), v.data.stride(0)};
  vp.kc = kc;
  vp.vc = vc;
  vp.cu_q = read_cu(cu_seqlens_q, "cu_seqlens_q", -1, q.size(0), "total_q");
  vp.cu_k = read_cu(cu_seqlens_k, "cu_seqlens_k", static_cast<std::int64_t>(vp.cu_q.size()), T, "total_k");
  vp.seq_k.resize(vp.cu_q.size() - 1);
  for (std::size_t b = 0; b < vp.seq_k.size(); ++b) vp.seq_k[b] = vp.cu_k[b + 1] - vp.cu_k[b];
  if (params.alibi_slopes) lower_alibi(p, *params.alibi_slopes, vp.batch());
  const std::pair<const TensorView*, const char*> inputs[] = {
      {&k.data, "k"}, {&v.data, "v"}, {&cu_seqlens_q, "cu_seqlens_q"}, {&cu_seqlens_k, "cu_seqlens_k"}};
  for (const auto& [t, n] : inputs) {
    check_no_overlap(out, "out", *t, n);
    if (softmax_lse) check_no_overlap(*softmax_lse, "softmax_lse", *t, n);
  }
  check_scales_overlap(k, "k scales", out, softmax_lse);
  check_scales_overlap(v, "v scales", out, softmax_lse);
  return vp;
}

VarlenBackwardProblem lower_varlen_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                            const TensorView& out, const TensorView& softmax_lse,
                                            const TensorView& grad_out, const TensorView& grad_q,
                                            const TensorView& grad_k, const TensorView& grad_v,
                                            const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                                            const AttentionParams& params, const TensorView* grad_sinks) {
  VarlenBackwardProblem vbp;
  vbp.vp = lower_varlen(q, k, v, out, cu_seqlens_q, cu_seqlens_k, params, softmax_lse);
  const struct { const TensorView* t; const char* name; const char* axes; const TensorView* like; } grads[] = {
      {&grad_out, "grad_out", "[total_q,Hq,Dv]", &out},
      {&grad_q, "grad_q", "[total_q,Hq,D]", &q},
      {&grad_k, "grad_k", "[total_k,Hkv,D]", &k},
      {&grad_v, "grad_v", "[total_k,Hkv,Dv]", &v}};
  for (const auto& g : grads)
    if (g.t->rank() != 3 || g.t->shape() != g.like->shape())
      throw Error(std::string(g.name) + ": expected shape " + g.axes + " = " + shape_str(g.like->shape()) + ", got " +
                  shape_str(g.t->shape()));
  const VarlenProblem& vp = vbp.vp;
  vbp.seqs.reserve(static_cast<std::size_t>(vp.batch()));
  // [batch, Hq] slopes: each sequence's call takes its own row, as [Hq].
  const bool slope_rows = params.alibi_slopes && params.alibi_slopes->rank() == 2;
  AttentionParams seq_params = params;
  for (std::int64_t b = 0; b < vp.batch(); ++b) {
    const std::int64_t q0 = vp.cu_q[b], sq = vp.seq_q(b), k0 = vp.cu_k[b], sk = vp.seq_k[b];
    if (slope_rows) {
      const TensorView& a = *params.alibi_slopes;
      seq_params.alibi_slopes = TensorView(a.data_as<float>() + b * a.stride(0), DType::f32, {a.size(1)}, {a.stride(1)});
    }
    vbp.seqs.push_back(lower_attention_backward(seq_view(q, q0, sq), seq_view(k, k0, sk), seq_view(v, k0, sk),
                                                seq_view(out, q0, sq), lse_view(softmax_lse, q0, sq),
                                                seq_view(grad_out, q0, sq), seq_view(grad_q, q0, sq),
                                                seq_view(grad_k, k0, sk), seq_view(grad_v, k0, sk), seq_params));
    vbp.seqs.back().fwd.dropout.b0 = b;
  }
  if (grad_sinks) {
    BackwardProblem whole;
    whole.fwd = vp.p;
    lower_grad_sinks(whole, *grad_sinks, params,
                     {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&softmax_lse, "softmax_lse"},
                      {&grad_out, "grad_out"}, {&grad_q, "grad_q"}, {&grad_k, "grad_k"}, {&grad_v, "grad_v"},
                      {&cu_seqlens_q, "cu_seqlens_q"}, {&cu_seqlens_k, "cu_seqlens_k"}});
    vbp.dsinks = whole.dsinks;
  }
  return vbp;
}

namespace {
// Element `off` of an operand's data, as the sequence's view addresses it (null stays null).
const void* shift(const void* data, DType dt, std::int64_t off) {
  return data ? static_cast<const char*>(data) + off * static_cast<std::int64_t>(dtype_size(dt)) : data;
}
void* shift(void* data, DType dt, std::int64_t off) {
  return data ? static_cast<char*>(data) + off * static_cast<std::int64_t>(dtype_size(dt)) : data;
}
}  // namespace

Problem sequence_problem(const VarlenProblem& vp, std::int64_t b, const AttentionParams& params) {
  Problem s = vp.p;
  const std::int64_t q0 = vp.cu_q[static_cast<std::size_t>(b)];
  s.B = 1;
  s.Sq = vp.seq_q(b);
  s.Sk = vp.seq_k[static_cast<std::size_t>(b)];
  s.q.data = shift(s.q.data, s.q.dtype, q0 * s.q.ss);
  s.out.data = shift(s.out.data, s.out.dtype, q0 * s.out.ss);
  s.lse.data = shift(s.lse.data, s.lse.dtype, q0 * s.lse.ss);
  if (!vp.paged) {
    const std::int64_t k0 = vp.cu_k[static_cast<std::size_t>(b)];
    s.k.data = shift(s.k.data, s.k.dtype, k0 * s.k.ss);
    s.v.data = shift(s.v.data, s.v.dtype, k0 * s.v.ss);
  }
  const EffectiveWindow w = effective_window(params);
  const std::int64_t wide = s.Sq + s.Sk + 1;
  s.window_left = w.left < 0 ? -1 : std::min(w.left, wide);
  s.window_right = w.right < 0 ? -1 : std::min(w.right, wide);
  if (s.alibi_sb != 0) {  // [batch, Hq] slopes: the sequence's row
    const auto row = vp.p.alibi.begin() + b * s.alibi_sb;
    s.alibi.assign(row, row + s.Hq);
    s.alibi_sb = 0;
  }
  s.dropout.b0 = b;  // the sequence's own dropout decisions: b is its index in the batch
  return s;
}

}  // namespace qkv::detail
