// Every check of an attention call happens here, once; kernels trust the lowered Problem.
#include "core/validate.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "qkv/error.hpp"
#include "tensor/convert.hpp"

namespace qkv {

EffectiveWindow effective_window(const AttentionParams& params) noexcept {
  EffectiveWindow w{params.window_left, params.window_right};
  if (params.causal) w.right = w.right < 0 ? 0 : std::min<std::int64_t>(w.right, 0);
  return w;
}

}  // namespace qkv

namespace qkv::detail {

// The element count must fit int64 (and its bytes size_t), and the bytes between the lowest and
// the highest element must fit int64, so that no offset a kernel forms can overflow.
void check_sizes(const TensorView& t, const char* name) {
  checked_numel(t.shape(), dtype_size(t.dtype()), name);
  if (t.numel() == 0) return;
  std::int64_t ext = 0;
  for (int a = 0; a < t.rank(); ++a) {
    const std::int64_t st = t.stride(a);
    std::int64_t e = 0;
    if (st == std::numeric_limits<std::int64_t>::min() || __builtin_mul_overflow(t.size(a) - 1, st < 0 ? -st : st, &e) ||
        __builtin_add_overflow(ext, e, &ext))
      ext = -1;
    if (ext < 0) break;
  }
  std::int64_t bytes = 0;
  if (ext < 0 || __builtin_mul_overflow(ext + 1, static_cast<std::int64_t>(dtype_size(t.dtype())), &bytes))
    throw Error(std::string(name) + ": expected strides whose byte extent fits in int64, got strides " +
                shape_str(t.strides()) + " with shape " + shape_str(t.shape()));
}

// A null data pointer is only acceptable for a view of no elements. checked_numel() first:
// TensorView::numel() of an overflowing shape would itself overflow.
void check_data(const TensorView& t, const char* name) {
  const std::int64_t n = checked_numel(t.shape(), dtype_size(t.dtype()), name);
  if (t.data() == nullptr && n > 0)
    throw Error(std::string(name) + ": expected a data pointer for shape " + shape_str(t.shape()) +
                ", got null");
}

// Two elements of an output must not share memory: a zero stride on an axis of size > 1 (a
// broadcast view) would make every kernel write one element many times, racing across threads.
void check_distinct(const TensorView& t, const char* name) {
  for (int a = 0; a < t.rank(); ++a)
    if (t.size(a) > 1 && t.stride(a) == 0)
      throw Error(std::string(name) + ": expected an output with distinct elements (no zero stride on an axis of size > 1), got shape " +
                  shape_str(t.shape()) + " with strides " + shape_str(t.strides()));
}


namespace {
void expect_dim(const TensorView& t, const char* name, const char* axes, int axis,
                const char* letter, std::int64_t want, const std::string& why) {
  if (t.size(axis) != want)
    throw Error(std::string(name) + ": expected " + axes + " with " + letter + " == " + why + " (" +
                std::to_string(want) + "), got " + letter + " = " + std::to_string(t.size(axis)) + " in shape " + shape_str(t.shape()));
}

}  // namespace

// Byte range [lo, hi) spanned by a view (empty views span nothing). Addresses as integers:
// the range may reach outside what a pointer may point to when strides are negative.
namespace {
struct Span { std::uintptr_t lo = 0, hi = 0; bool empty = true; };
Span span_of(const TensorView& t, const char* name) {
  if (!t.data()) return {};
  for (auto d : t.shape())
    if (d == 0) return {};
  const auto es = static_cast<std::int64_t>(dtype_size(t.dtype()));
  std::int64_t lo = 0, hi = 0;
  bool overflow = false;
  for (int a = 0; a < t.rank(); ++a) {
    std::int64_t ext = 0;
    overflow |= __builtin_mul_overflow(t.size(a) - 1, t.stride(a), &ext);
    std::int64_t& side = ext < 0 ? lo : hi;
    overflow |= __builtin_add_overflow(side, ext, &side);
  }
  overflow |= __builtin_mul_overflow(lo, es, &lo) || __builtin_add_overflow(hi, 1, &hi) ||
              __builtin_mul_overflow(hi, es, &hi);
  if (overflow)
    throw Error(std::string(name) + ": expected strides whose byte extent fits in int64, got shape " +
                shape_str(t.shape()) + " with strides " + shape_str(t.strides()));
  const auto base = reinterpret_cast<std::uintptr_t>(t.data());
  return {base + static_cast<std::uintptr_t>(lo), base + static_cast<std::uintptr_t>(hi), false};
}
}  // namespace
void check_no_overlap(const TensorView& out, const char* oname, const TensorView& in, const char* iname) {
  const Span a = span_of(out, oname), b = span_of(in, iname);
  if (!a.empty && !b.empty && a.lo < b.hi && b.lo < a.hi)
    throw Error(std::string(oname) + ": expected memory disjoint from " + iname + ", got " +
                std::to_string(std::min(a.hi, b.hi) - std::max(a.lo, b.lo)) + " overlapping bytes");
}

namespace {

OutOperand lower_out(const TensorView& t) {
  OutOperand o;
  o.data = t.data();
  o.dtype = t.dtype();
  o.sb = t.stride(0);
  o.sh = t.stride(1);
  o.ss = t.stride(2);
  o.sx = t.rank() == 4 ? t.stride(3) : 1;
  return o;
}

}  // namespace

namespace {

// A float32, contiguous, finite vector (or [B, Hq] table) of per-head values, read into float64.
std::vector<double> read_head_values(const TensorView& t, const char* name, const char* want) {
  if (t.dtype() != DType::f32)
    throw Error(std::string(name) + ": expected dtype float32, got " + std::string(dtype_name(t.dtype())));
  check_sizes(t, name);
  check_data(t, name);
  if (!t.is_contiguous())
    throw Error(std::string(name) + ": expected a contiguous tensor " + want + ", got strides " + shape_str(t.strides()) +
                " with shape " + shape_str(t.shape()));
  const float* x = t.data_as<const float>();
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  for (std::size_t e = 0; e < out.size(); ++e) {
    if (!std::isfinite(x[e]))
      throw Error(std::string(name) + ": expected finite values, got " + std::to_string(x[e]) + " at index " + std::to_string(e));
    out[e] = x[e];
  }
  return out;
}

}  // namespace

namespace {
// A double as the shortest text that reads back to it (1 - 1e-17 is not "1.000000").
std::string format_double(double x) {
  char buf[32];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, x);
    if (std::strtod(buf, nullptr) == x || std::isnan(x)) break;
  }
  return buf;
}
}  // namespace

void check_dropout_p(double p) {
  // !(p >= 0 && p < 1) also refuses NaN.
  if (!(p >= 0.0 && p < 1.0)) throw Error("dropout_p: expected a probability in [0, 1), got " + format_double(p));
}

void lower_alibi(Problem& p, const TensorView& slopes, std::int64_t batch) {
  const bool per_head = slopes.rank() == 1 && slopes.size(0) == p.Hq;
  const bool per_batch = slopes.rank() == 2 && slopes.size(0) == batch && slopes.size(1) == p.Hq;
  if (!per_head && !per_batch)
    throw Error("alibi_slopes: expected shape [Hq] = " + shape_str({p.Hq}) + " or [B,Hq] = " + shape_str({batch, p.Hq}) +
                ", got " + shape_str(slopes.shape()));
  p.alibi = read_head_values(slopes, "alibi_slopes", per_head ? "[Hq]" : "[B,Hq]");
  p.alibi_sb = per_head ? 0 : p.Hq;
}

void lower_score_options(Problem& p, const AttentionParams& params, std::int64_t batch) {
  if (params.sinks) {
    const TensorView& z = *params.sinks;
    if (z.rank() != 1 || z.size(0) != p.Hq)
      throw Error("sinks: expected shape [Hq] = " + shape_str({p.Hq}) + ", got " + shape_str(z.shape()));
    p.sinks = read_head_values(z, "sinks", "[Hq]");
  }
  if (params.alibi_slopes) lower_alibi(p, *params.alibi_slopes, batch);
  if (params.window_keep_first < 0)
    throw Error("window_keep_first: expected >= 0 (0 = off), got " + std::to_string(params.window_keep_first));
  // Not clamped to Sk: packed and paged calls lower their options before their keys are known;
  // the kernels only compare it with key positions (Problem::key_ranges).
  p.keep_first = params.window_keep_first;
  check_dropout_p(params.dropout_p);
  if (params.dropout_p > 0.0)
    p.dropout = Dropout::make(params.dropout_p, params.dropout_seed, params.dropout_offset, p.Hq);
}

void check_rank4(const TensorView& t, const char* name, const char* axes) {
  if (t.rank() != 4)
    throw Error(std::string(name) + ": expected a 4-D tensor " + axes + ", got rank " +
                std::to_string(t.rank()) + " with shape " + shape_str(t.shape()));
  check_sizes(t, name);
  check_data(t, name);
  if (t.size(3) > 1 && t.stride(3) != 1)
    throw Error(std::string(name) + ": expected a contiguous last dimension (stride 1), got stride " +
                std::to_string(t.stride(3)) + " in shape " + shape_str(t.shape()));
}

Problem lower_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const AttentionParams& params,
                        const std::optional<TensorView>& softmax_lse,
                        const std::optional<TensorView>& probs) {
  check_rank4(q, "q", "[B,Hq,Sq,D]");
  check_rank4(k, "k", "[B,Hkv,Sk,D]");
  check_rank4(v, "v", "[B,Hkv,Sk,Dv]");
  check_rank4(out, "out", "[B,Hq,Sq,Dv]");
  check_distinct(out, "out");

  if (!is_float_dtype(q.dtype()))
    throw Error("q: expected dtype float32, float64, float16 or bfloat16, got " + std::string(dtype_name(q.dtype())));
  if (k.dtype() != q.dtype())
    throw Error("k: expected dtype " + std::string(dtype_name(q.dtype())) + " (the dtype of q), got " + std::string(dtype_name(k.dtype())));
  if (v.dtype() != q.dtype())
    throw Error("v: expected dtype " + std::string(dtype_name(q.dtype())) + " (the dtype of q), got " + std::string(dtype_name(v.dtype())));
  if (!is_float_dtype(out.dtype()))
    throw Error("out: expected dtype float32, float64, float16 or bfloat16, got " + std::string(dtype_name(out.dtype())));

  Problem p;
  p.B = q.size(0); p.Hq = q.size(1); p.Sq = q.size(2); p.D = q.size(3);
  p.Hkv = k.size(1); p.Sk = k.size(2); p.Dv = v.size(3);
  expect_dim(k, "k", "[B,Hkv,Sk,D]", 0, "B", p.B, "q.B");
  expect_dim(k, "k", "[B,Hkv,Sk,D]", 3, "D", p.D, "q.D");
  expect_dim(v, "v", "[B,Hkv,Sk,Dv]", 0, "B", p.B, "q.B");
  expect_dim(v, "v", "[B,Hkv,Sk,Dv]", 1, "Hkv", p.Hkv, "k.Hkv");
  expect_dim(v, "v", "[B,Hkv,Sk,Dv]", 2, "Sk", p.Sk, "k.Sk");
  expect_dim(out, "out", "[B,Hq,Sq,Dv]", 0, "B", p.B, "q.B");
  expect_dim(out, "out", "[B,Hq,Sq,Dv]", 1, "Hq", p.Hq, "q.Hq");
  expect_dim(out, "out", "[B,Hq,Sq,Dv]", 2, "Sq", p.Sq, "q.Sq");
  expect_dim(out, "out", "[B,Hq,Sq,Dv]", 3, "Dv", p.Dv, "v.Dv");
  if (p.Hkv == 0 ? p.Hq != 0 : p.Hq % p.Hkv != 0)
    throw Error("k: expected Hq % Hkv == 0 (grouped-query attention), got Hq = " + std::to_string(p.Hq) +
                ", Hkv = " + std::to_string(p.Hkv));
  if (p.D < 1 && !params.scale)
    throw Error("q: expected D >= 1 for the default scale 1/sqrt(D), got D = " + std::to_string(p.D));

  p.q = {q.data(), q.dtype(), q.stride(0), q.stride(1), q.stride(2)};
  p.k = {k.data(), k.dtype(), k.stride(0), k.stride(1), k.stride(2)};
  p.v = {v.data(), v.dtype(), v.stride(0), v.stride(1), v.stride(2)};
  p.out = lower_out(out);

  if (softmax_lse) {
    const TensorView& l = *softmax_lse;
    if (l.rank() != 3 || l.size(0) != p.B || l.size(1) != p.Hq || l.size(2) != p.Sq)
      throw Error("softmax_lse: expected shape [B,Hq,Sq] = " + shape_str({p.B, p.Hq, p.Sq}) +
                  ", got " + shape_str(l.shape()));
    if (l.dtype() != DType::f32 && l.dtype() != DType::f64)
      throw Error("softmax_lse: expected dtype float32 or float64, got " + std::string(dtype_name(l.dtype())));
    check_sizes(l, "softmax_lse");
    check_data(l, "softmax_lse");
    check_distinct(l, "softmax_lse");
    check_no_overlap(*softmax_lse, "softmax_lse", out, "out");
    p.lse = lower_out(l);
  }
  if (probs) {
    const TensorView& pr = *probs;
    if (pr.rank() != 4 || pr.size(0) != p.B || pr.size(1) != p.Hq || pr.size(2) != p.Sq || pr.size(3) != p.Sk)
      throw Error("probs: expected shape [B,Hq,Sq,Sk] = " + shape_str({p.B, p.Hq, p.Sq, p.Sk}) +
                  ", got " + shape_str(pr.shape()));
    if (pr.dtype() != DType::f32 && pr.dtype() != DType::f64)
      throw Error("probs: expected dtype float32 or float64, got " + std::string(dtype_name(pr.dtype())));
    check_sizes(pr, "probs");
    check_data(pr, "probs");
    check_distinct(pr, "probs");
    check_no_overlap(*probs, "probs", out, "out");
    if (softmax_lse) check_no_overlap(*probs, "probs", *softmax_lse, "softmax_lse");
    p.probs = lower_out(pr);
  }

  // After the shape and extent checks above, so that every extent computed here fits int64.
  for (const auto* in : {&q, &k, &v}) {
    const char* n = in == &q ? "q" : in == &k ? "k" : "v";
    check_no_overlap(out, "out", *in, n);
    if (softmax_lse) check_no_overlap(*softmax_lse, "softmax_lse", *in, n);
    if (probs) check_no_overlap(*probs, "probs", *in, n);
  }

  // Scalars.
  if (params.scale && !std::isfinite(*params.scale))
    throw Error("scale: expected a finite number, got " + std::to_string(*params.scale));
  p.scale = params.scale ? *params.scale : 1.0 / std::sqrt(static_cast<double>(p.D));
  if (!std::isfinite(params.softcap) || params.softcap < 0.0)
    throw Error("softcap: expected a finite number >= 0 (0 = off), got " + std::to_string(params.softcap));
  p.softcap = params.softcap;
  if (params.window_left < -1 || params.window_right < -1)
    throw Error("window: expected LEFT,RIGHT >= -1 (-1 = unbounded), got " + std::to_string(params.window_left) +
                "," + std::to_string(params.window_right));
  const EffectiveWindow w = effective_window(params);
  // A window wider than Sq + Sk admits everything on that side: clamping keeps the index
  // arithmetic of the kernels far from overflow without changing the result.
  const std::int64_t wide = p.Sq + p.Sk + 1;
  p.window_left = w.left < 0 ? -1 : std::min(w.left, wide);
  p.window_right = w.right < 0 ? -1 : std::min(w.right, wide);
  p.align = params.align;
  if (params.num_threads < 0)
    throw Error("num_threads: expected >= 0 (0 = OpenMP default), got " + std::to_string(params.num_threads));
  p.num_threads = params.num_threads;

  // Explicit mask, broadcast to [B,Hq,Sq,Sk] with NumPy rules (right-aligned, size-1 axes).
  if (params.mask) {
    const TensorView& m = *params.mask;
    const Shape target{p.B, p.Hq, p.Sq, p.Sk};
    if (m.rank() < 1 || m.rank() > 4)
      throw Error("mask: expected rank 1..4 broadcastable to [B,Hq,Sq,Sk] = " + shape_str(target) +
                  ", got shape " + shape_str(m.shape()));
    if (m.dtype() != DType::b8 && m.dtype() != DType::f32 && m.dtype() != DType::f64)
      throw Error("mask: expected dtype bool (true = attend) or float32/float64 (additive), got " +
                  std::string(dtype_name(m.dtype())));
    check_sizes(m, "mask");
    check_data(m, "mask");
    std::int64_t st[4] = {0, 0, 0, 0};
    const int off = 4 - m.rank();
    for (int a = 0; a < m.rank(); ++a) {
      const std::int64_t want = target[static_cast<std::size_t>(a + off)];
      if (m.size(a) != want && m.size(a) != 1)
        throw Error("mask: shape " + shape_str(m.shape()) + " is not broadcastable to [B,Hq,Sq,Sk] = " +
                    shape_str(target));
      st[a + off] = m.size(a) == 1 ? 0 : m.stride(a);
    }
    check_no_overlap(out, "out", m, "mask");
    if (softmax_lse) check_no_overlap(*softmax_lse, "softmax_lse", m, "mask");
    if (probs) check_no_overlap(*probs, "probs", m, "mask");
    p.mask = {m.data(), m.dtype(), st[0], st[1], st[2], st[3]};
  }

  if (params.kv_lens) {
    const TensorView& l = *params.kv_lens;
    if (l.rank() != 1 || l.size(0) != p.B)
      throw Error("kv_lens: expected shape [B] = " + shape_str({p.B}) + ", got " + shape_str(l.shape()));
    if (l.dtype() != DType::i32 && l.dtype() != DType::i64)
      throw Error("kv_lens: expected dtype int32 or int64, got " + std::string(dtype_name(l.dtype())));
    check_data(l, "kv_lens");
    p.kv_lens.resize(static_cast<std::size_t>(p.B));
    for (std::int64_t b = 0; b < p.B; ++b) {
      const std::int64_t off = b * l.stride(0);
      const std::int64_t len = l.dtype() == DType::i32 ? l.data_as<const std::int32_t>()[off]
                                                       : l.data_as<const std::int64_t>()[off];
      if (len < 0 || len > p.Sk)
        throw Error("kv_lens: expected each length in [0, Sk] = [0, " + std::to_string(p.Sk) + "], got " + std::to_string(len) +
                    " at batch " + std::to_string(b));
      p.kv_lens[static_cast<std::size_t>(b)] = len;
    }
  }
  lower_score_options(p, params, p.B);
  return p;
}

BackwardProblem lower_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                         const TensorView& out, const TensorView& softmax_lse,
                                         const TensorView& grad_out, const TensorView& grad_q,
                                         const TensorView& grad_k, const TensorView& grad_v,
                                         const AttentionParams& params) {
  BackwardProblem bp;
  bp.fwd = lower_attention(q, k, v, out, params, softmax_lse, std::nullopt);
  const Problem& p = bp.fwd;

  check_rank4(grad_out, "grad_out", "[B,Hq,Sq,Dv]");
  if (grad_out.shape() != out.shape())
    throw Error("grad_out: expected the shape of out [B,Hq,Sq,Dv] = " + shape_str(out.shape()) + ", got " +
                shape_str(grad_out.shape()));
  if (!is_float_dtype(grad_out.dtype()))
    throw Error("grad_out: expected dtype float32, float64, float16 or bfloat16, got " +
                std::string(dtype_name(grad_out.dtype())));
  bp.dout = {grad_out.data(), grad_out.dtype(), grad_out.stride(0), grad_out.stride(1), grad_out.stride(2)};

  struct Grad { const TensorView* t; const char* name; const char* axes; Shape want; OutOperand* dst; };
  const Grad grads[] = {{&grad_q, "grad_q", "[B,Hq,Sq,D]", {p.B, p.Hq, p.Sq, p.D}, &bp.dq},
                        {&grad_k, "grad_k", "[B,Hkv,Sk,D]", {p.B, p.Hkv, p.Sk, p.D}, &bp.dk},
                        {&grad_v, "grad_v", "[B,Hkv,Sk,Dv]", {p.B, p.Hkv, p.Sk, p.Dv}, &bp.dv}};
  for (const Grad& g : grads) {
    check_rank4(*g.t, g.name, g.axes);
    if (g.t->shape() != g.want)
      throw Error(std::string(g.name) + ": expected shape " + g.axes + " = " + shape_str(g.want) + ", got " +
                  shape_str(g.t->shape()));
    if (g.t->dtype() != q.dtype() && g.t->dtype() != DType::f32 && g.t->dtype() != DType::f64)
      throw Error(std::string(g.name) + ": expected dtype float32 or float64" +
                  (q.dtype() == DType::f32 || q.dtype() == DType::f64
                       ? std::string()
                       : " or " + std::string(dtype_name(q.dtype())) + " (the dtype of q)") +
                  ", got " + std::string(dtype_name(g.t->dtype())));
    check_distinct(*g.t, g.name);
    *g.dst = lower_out(*g.t);
  }
  // Every gradient is written while every other operand is read: all must be disjoint.
  const std::pair<const TensorView*, const char*> inputs[] = {
      {&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&softmax_lse, "softmax_lse"}, {&grad_out, "grad_out"}};
  for (std::size_t a = 0; a < 3; ++a) {
    for (const auto& [t, n] : inputs) check_no_overlap(*grads[a].t, grads[a].name, *t, n);
    if (params.mask) check_no_overlap(*grads[a].t, grads[a].name, *params.mask, "mask");
    if (params.kv_lens) check_no_overlap(*grads[a].t, grads[a].name, *params.kv_lens, "kv_lens");
    for (std::size_t b = a + 1; b < 3; ++b) check_no_overlap(*grads[b].t, grads[b].name, *grads[a].t, grads[a].name);
  }
  return bp;
}

void lower_grad_sinks(BackwardProblem& bp, const TensorView& grad_sinks, const AttentionParams& params,
                      std::initializer_list<std::pair<const TensorView*, const char*>> others) {
  const std::int64_t Hq = bp.fwd.Hq;
  if (!params.sinks)
    throw Error("grad_sinks: expected params.sinks to be given (grad_sinks is the gradient of the sink logits), got none");
  if (grad_sinks.rank() != 1 || grad_sinks.size(0) != Hq)
    throw Error("grad_sinks: expected shape [Hq] = " + shape_str({Hq}) + ", got " + shape_str(grad_sinks.shape()));
  if (grad_sinks.dtype() != DType::f32)
    throw Error("grad_sinks: expected dtype float32, got " + std::string(dtype_name(grad_sinks.dtype())));
  check_sizes(grad_sinks, "grad_sinks");
  check_data(grad_sinks, "grad_sinks");
  if (!grad_sinks.is_contiguous())
    throw Error("grad_sinks: expected a contiguous tensor [Hq], got stride " + shape_str(grad_sinks.strides()));
  for (const auto& [t, n] : others) check_no_overlap(grad_sinks, "grad_sinks", *t, n);
  check_no_overlap(grad_sinks, "grad_sinks", *params.sinks, "sinks");
  if (params.alibi_slopes) check_no_overlap(grad_sinks, "grad_sinks", *params.alibi_slopes, "alibi_slopes");
  if (params.mask) check_no_overlap(grad_sinks, "grad_sinks", *params.mask, "mask");
  if (params.kv_lens) check_no_overlap(grad_sinks, "grad_sinks", *params.kv_lens, "kv_lens");
  bp.dsinks = {grad_sinks.data(), DType::f32, 0, 0, 0, 1};
}

BackwardProblem lower_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                         const TensorView& out, const TensorView& softmax_lse,
                                         const TensorView& grad_out, const TensorView& grad_q,
                                         const TensorView& grad_k, const TensorView& grad_v,
                                         const TensorView& grad_sinks, const AttentionParams& params) {
  BackwardProblem bp = lower_attention_backward(q, k, v, out, softmax_lse, grad_out, grad_q, grad_k, grad_v, params);
  lower_grad_sinks(bp, grad_sinks, params,
                   {{&q, "q"}, {&k, "k"}, {&v, "v"}, {&out, "out"}, {&softmax_lse, "softmax_lse"},
                    {&grad_out, "grad_out"}, {&grad_q, "grad_q"}, {&grad_k, "grad_k"}, {&grad_v, "grad_v"}});
  return bp;
}

}  // namespace qkv::detail
