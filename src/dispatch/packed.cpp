#include "dispatch/packed.hpp"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/validate_varlen.hpp"
#include "qkv/tensor.hpp"
#include "reference/reference_kernel.hpp"
#include "tensor/convert.hpp"

namespace qkv::detail {
namespace {

using i64 = std::int64_t;

// Each sequence's call and the kernel its own choice takes.
struct Sequences {
  std::vector<Problem> problems;  // attention_varlen: each sequence's B = 1 problem
  std::vector<BackwardProblem> backward;  // attention_varlen_backward with grad_sinks: dz into dz rows
  std::vector<double> dz;                 // [batch, Hq]: each sequence's dL/dz, summed in order after
  std::vector<Call> calls;
  std::vector<const KernelEntry*> kernels;
};

Sequences sequences(const Call& c) {
  Sequences s;
  const i64 B = c.vp->batch();
  s.calls.reserve(static_cast<std::size_t>(B));
  if (c.entry == Entry::varlen) {
    s.problems.reserve(static_cast<std::size_t>(B));
    for (i64 b = 0; b < B; ++b) s.problems.push_back(sequence_problem(*c.vp, b, *c.params));
    for (const Problem& p : s.problems) s.calls.push_back(Call::forward(p, *c.params));
  } else if (c.vbp->dsinks.data) {
    const i64 Hq = c.p->Hq;
    s.dz.assign(static_cast<std::size_t>(B * Hq), 0.0);
    s.backward = c.vbp->seqs;
    for (i64 b = 0; b < B; ++b) s.backward[static_cast<std::size_t>(b)].dsinks = {s.dz.data() + b * Hq, DType::f64, 0, 0, 0, 1};
    for (const BackwardProblem& bp : s.backward) s.calls.push_back(Call::backward(bp, *c.params));
  } else {
    for (const BackwardProblem& bp : c.vbp->seqs) s.calls.push_back(Call::backward(bp, *c.params));
  }
  for (const Call& sc : s.calls) s.kernels.push_back(choose_kernel(sc, false).kernel);
  return s;
}

}  // namespace

std::string per_sequence_refuse(const Call& c) {
  const Problem& p = *c.p;
  if (c.entry == Entry::varlen && (p.k.dtype != p.q.dtype || p.v.dtype != p.q.dtype))
    return "K and V in formats " + std::string(kv_format_name(c.vp->kc.format)) + "/" +
           std::string(kv_format_name(c.vp->vc.format)) + ": the dense kernels read keys and values of q's dtype (" +
           std::string(dtype_name(p.q.dtype)) + ")";
  return {};
}

std::string per_sequence_chosen(const Call& c) {
  const Sequences s = sequences(c);
  std::vector<std::pair<std::string, i64>> counts;  // in order of first appearance
  for (std::size_t i = 0; i < s.calls.size(); ++i) {
    const KernelEntry& k = *s.kernels[i];
    const std::string what = std::string(k.name) + (k.chosen ? " (" + k.chosen(s.calls[i]) + ")" : std::string());
    auto it = std::find_if(counts.begin(), counts.end(), [&](const auto& x) { return x.first == what; });
    if (it == counts.end()) counts.emplace_back(what, 1);
    else ++it->second;
  }
  std::string out = c.entry == Entry::varlen ? "one qkv::attention call per sequence"
                                             : "one qkv::attention_backward call per sequence";
  if (counts.empty()) return out + ", no sequence";
  for (std::size_t i = 0; i < counts.size(); ++i)
    out += (i ? ", " : ": ") + counts[i].first + " for " + std::to_string(counts[i].second);
  return out;
}

void per_sequence_run(const Call& c) {
  Sequences s = sequences(c);
  for (std::size_t i = 0; i < s.calls.size(); ++i) s.kernels[i]->run(s.calls[i]);
  if (c.entry != Entry::varlen_backward || !c.vbp->dsinks.data) return;
  // dL/dz of the packed call: the sequences' sums added in sequence order (float64), written once.
  const i64 Hq = c.p->Hq;
  for (i64 h = 0; h < Hq; ++h) {
    double total = 0.0;
    for (i64 b = 0; b < c.vp->batch(); ++b) total += s.dz[static_cast<std::size_t>(b * Hq + h)];
    store_from_double(c.vbp->dsinks.data, c.vbp->dsinks.dtype, h * c.vbp->dsinks.sx, total);
  }
}

void reference_gathered(const Call& c) {
  const VarlenProblem& vp = *c.vp;
  const Problem& p = vp.p;
  std::vector<float> row(static_cast<std::size_t>(std::max(p.D, p.Dv)));
  auto gather = [&](const Operand& x, const KVCodec& codec, i64 b, i64 h, i64 j, i64 n, double* dst) {
    const i64 off = vp.key_off(x, b, h, j);
    if (codec.scales) {
      decode_row(codec, x.data, off, h, row.data());
      convert_row(row.data(), DType::f32, dst, DType::f64, n);
    } else {
      convert_row(static_cast<const char*>(x.data) + off * static_cast<i64>(dtype_size(x.dtype)), x.dtype, dst,
                  DType::f64, n);
    }
  };
  for (i64 b = 0; b < vp.batch(); ++b) {
    // The sequence's problem, with q, k and v replaced by contiguous float64 copies: what
    // lower_attention gives for those copies and the sequence's views of out and softmax_lse.
    Problem s = sequence_problem(vp, b, *c.params);
    const i64 sq = s.Sq, sk = s.Sk;
    Tensor qd(DType::f64, {1, p.Hq, sq, p.D}), kd(DType::f64, {1, p.Hkv, sk, p.D}), vd(DType::f64, {1, p.Hkv, sk, p.Dv});
    for (i64 h = 0; h < p.Hq; ++h)
      for (i64 i = 0; i < sq; ++i)
        convert_row(static_cast<const char*>(s.q.data) + (h * s.q.sh + i * s.q.ss) * static_cast<i64>(dtype_size(p.q.dtype)),
                    p.q.dtype, qd.data_as<double>() + (h * sq + i) * p.D, DType::f64, p.D);
    for (i64 h = 0; h < p.Hkv; ++h)
      for (i64 j = 0; j < sk; ++j) {
        gather(p.k, vp.kc, b, h, j, p.D, kd.data_as<double>() + (h * sk + j) * p.D);
        gather(p.v, vp.vc, b, h, j, p.Dv, vd.data_as<double>() + (h * sk + j) * p.Dv);
      }
    s.q = {qd.data(), DType::f64, p.Hq * sq * p.D, sq * p.D, p.D};
    s.k = {kd.data(), DType::f64, p.Hkv * sk * p.D, sk * p.D, p.D};
    s.v = {vd.data(), DType::f64, p.Hkv * sk * p.Dv, sk * p.Dv, p.Dv};
    if (s.Hq == 0 || s.Sq == 0) continue;  // an empty output: nothing to compute
    reference_kernel(s);
  }
}

}  // namespace qkv::detail
