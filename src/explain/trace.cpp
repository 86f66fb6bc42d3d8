// Step trace of attention: every intermediate of qkv::reference::attention, kept.
//
// Algorithm: Vaswani et al. 2017, sec. 3.2.1, in float64: the trace runs the reference's own rows
// (src/reference, ReferenceRows) and keeps the steps they record, so its weights and outputs are
// the reference's to the last bit. The arguments are validated by the same lowering as
// qkv::attention(), so errors read the same.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <limits>

#include "core/validate.hpp"
#include "reference/reference_kernel.hpp"
#include "qkv/error.hpp"
#include "qkv/explain.hpp"

namespace qkv::explain {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();


std::string fmt(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

void check_index(std::int64_t x, std::int64_t n, const char* what, const char* axis) {
  if (x < 0 || x >= n)
    throw Error(std::string(what) + ": expected an index in [0, " + axis + ") = [0, " + std::to_string(n) + "), got " +
                std::to_string(x));
}

}  // namespace

const char* key_status_name(KeyStatus st) noexcept {
  switch (st) {
    case KeyStatus::admitted:
      return "admitted";
    case KeyStatus::outside_window:
      return "causal/window";
    case KeyStatus::beyond_kv_len:
      return "kv_len";
    case KeyStatus::masked:
      return "mask";
  }
  return "?";
}

std::int64_t Trace::diag(std::int64_t b, std::int64_t i) const noexcept {
  const std::int64_t len = kv_lens.empty() ? Sk : kv_lens[static_cast<std::size_t>(b)];
  return align == Alignment::bottom_right ? i + len - Sq : i;
}

TensorView Trace::scores_view() const {
  return TensorView(const_cast<double*>(scores.data()), DType::f64, {B, Hq, Sq, Sk});
}
TensorView Trace::scaled_view() const {
  return TensorView(const_cast<double*>(scaled.data()), DType::f64, {B, Hq, Sq, Sk});
}
TensorView Trace::weights_view() const {
  return TensorView(const_cast<double*>(weights.data()), DType::f64, {B, Hq, Sq, Sk});
}
TensorView Trace::output_view() const {
  return TensorView(const_cast<double*>(output.data()), DType::f64, {B, Hq, Sq, Dv});
}

Trace trace_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                      const AttentionParams& params) {
  detail::check_rank4(q, "q", "[B,Hq,Sq,D]");
  detail::check_rank4(k, "k", "[B,Hkv,Sk,D]");
  detail::check_rank4(v, "v", "[B,Hkv,Sk,Dv]");
  Trace t;
  t.B = q.size(0);
  t.Hq = q.size(1);
  t.Sq = q.size(2);
  t.D = q.size(3);
  t.Hkv = k.size(1);
  t.Sk = k.size(2);
  t.Dv = v.size(3);
  // Sizes are checked before anything is allocated: the entries grow as B*Hq*Sq*Sk.
  const std::int64_t entries = checked_numel({t.B, t.Hq, t.Sq, std::max<std::int64_t>(t.Sk, 1)}, 8, "q, k");
  if (entries > kMaxTraceEntries)
    throw Error("q, k: a trace holds B*Hq*Sq*Sk = " + std::to_string(entries) + " entries per step, more than " +
                std::to_string(kMaxTraceEntries) + "; trace fewer heads or a shorter sequence");
  const std::int64_t nout = checked_numel({t.B, t.Hq, t.Sq, t.Dv}, 8, "out");
  if (nout > kMaxTraceEntries)
    throw Error("v: a trace output holds B*Hq*Sq*Dv = " + std::to_string(nout) + " entries, more than " +
                std::to_string(kMaxTraceEntries));

  const auto n = static_cast<std::size_t>(t.B * t.Hq * t.Sq * t.Sk);
  t.output.assign(static_cast<std::size_t>(nout), 0.0);
  t.lse.assign(static_cast<std::size_t>(t.B * t.Hq * t.Sq), 0.0);
  t.weights.assign(n, 0.0);
  // The lowering validates every argument with the messages of qkv::attention(); its outputs
  // point at the trace's own buffers (never read: the loop below writes them).
  AttentionParams p = params;
  p.kernel = KernelKind::reference;
  const detail::Problem pr =
      detail::lower_attention(q, k, v, TensorView(t.output.data(), DType::f64, {t.B, t.Hq, t.Sq, t.Dv}), p,
                              TensorView(t.lse.data(), DType::f64, {t.B, t.Hq, t.Sq}),
                              TensorView(t.weights.data(), DType::f64, {t.B, t.Hq, t.Sq, t.Sk}));

  t.scale = pr.scale;
  t.softcap = pr.softcap;
  t.window = effective_window(params);
  t.align = pr.align;
  t.has_mask = pr.mask.data != nullptr;
  t.additive_mask = t.has_mask && pr.mask.dtype != DType::b8;
  t.kv_lens.resize(static_cast<std::size_t>(t.B));
  for (std::int64_t b = 0; b < t.B; ++b) t.kv_lens[static_cast<std::size_t>(b)] = pr.key_len(b);
  t.keep_first = pr.keep_first;
  if (!pr.sinks.empty()) {
    t.sinks = pr.sinks;
    t.sink_weights.assign(static_cast<std::size_t>(t.B * t.Hq * t.Sq), 0.0);
  }
  if (!pr.alibi.empty())
    for (std::int64_t b = 0; b < t.B; ++b)
      for (std::int64_t h = 0; h < t.Hq; ++h) t.alibi_slopes.push_back(pr.slope(b, h));
  t.scores.assign(n, kNegInf);
  t.scaled.assign(n, kNegInf);
  t.status.assign(n, KeyStatus::admitted);
  if (t.additive_mask) t.mask_add.assign(n, 0.0);

  static_assert(static_cast<int>(KeyStatus::admitted) == static_cast<int>(detail::KeyState::admitted) &&
                static_cast<int>(KeyStatus::outside_window) == static_cast<int>(detail::KeyState::outside_window) &&
                static_cast<int>(KeyStatus::beyond_kv_len) == static_cast<int>(detail::KeyState::beyond_kv_len) &&
                static_cast<int>(KeyStatus::masked) == static_cast<int>(detail::KeyState::masked));
  detail::ReferenceRows rows(pr);
  std::vector<detail::KeyState> states(static_cast<std::size_t>(t.Sk));
  for (std::int64_t b = 0; b < t.B; ++b)
    for (std::int64_t h = 0; h < t.Hq; ++h)
      for (std::int64_t i = 0; i < t.Sq; ++i) {
        const auto row = static_cast<std::size_t>(t.at(b, h, i, 0));
        detail::RowSteps steps;
        steps.scores = &t.scores[row];
        steps.scaled = &t.scaled[row];
        steps.mask_add = t.additive_mask ? &t.mask_add[row] : nullptr;
        steps.state = states.data();
        const auto r = static_cast<std::size_t>((b * t.Hq + h) * t.Sq + i);
        if (!t.sink_weights.empty()) steps.sink = &t.sink_weights[r];
        t.lse[r] = rows.run(b, h, i, &t.weights[row], &t.output[r * static_cast<std::size_t>(t.Dv)], steps);
        std::transform(states.begin(), states.end(), t.status.begin() + static_cast<std::ptrdiff_t>(row),
                       [](detail::KeyState x) { return static_cast<KeyStatus>(x); });
      }
  return t;
}

TensorView head_weights(const Trace& t, std::int64_t b) {
  check_index(b, t.B, "batch", "B");
  return TensorView(const_cast<double*>(t.weights.data()) + b * t.Hq * t.Sq * t.Sk, DType::f64,
                    {t.Hq, t.Sq, t.Sk});
}

Tensor head_weights_with_sink(const Trace& t, std::int64_t b) {
  check_index(b, t.B, "batch", "B");
  Tensor w(DType::f64, {t.Hq, t.Sq, t.Sk + 1});
  double* dst = w.data_as<double>();
  for (std::int64_t h = 0; h < t.Hq; ++h)
    for (std::int64_t i = 0; i < t.Sq; ++i, dst += t.Sk + 1) {
      const auto r = static_cast<std::size_t>((b * t.Hq + h) * t.Sq + i);
      std::copy_n(t.weights.begin() + static_cast<std::ptrdiff_t>(r * static_cast<std::size_t>(t.Sk)), t.Sk, dst);
      dst[t.Sk] = t.sink_weights.empty() ? 0.0 : t.sink_weights[r];
    }
  return w;
}

std::vector<KeyWeight> top_keys(const Trace& t, std::int64_t b, std::int64_t h, std::int64_t i,
                                std::int64_t count) {
  check_index(b, t.B, "batch", "B");
  check_index(h, t.Hq, "head", "Hq");
  check_index(i, t.Sq, "query", "Sq");
  std::vector<KeyWeight> keys;
  for (std::int64_t j = 0; j < t.Sk; ++j)
    if (t.status[static_cast<std::size_t>(t.at(b, h, i, j))] == KeyStatus::admitted)
      keys.push_back({j, t.weights[static_cast<std::size_t>(t.at(b, h, i, j))]});
  // NaN weights sort last so the order is total.
  std::stable_sort(keys.begin(), keys.end(), [](const KeyWeight& a, const KeyWeight& c) {
    if (std::isnan(a.weight)) return false;
    if (std::isnan(c.weight)) return true;
    return a.weight > c.weight;
  });
  if (count >= 0 && static_cast<std::size_t>(count) < keys.size())
    keys.resize(static_cast<std::size_t>(count));
  return keys;
}

std::vector<std::string> query_labels(const Trace& t, const std::vector<std::string>& key_labels,
                                      std::int64_t b) {
  std::vector<std::string> out;
  for (std::int64_t i = 0; i < t.Sq; ++i) {
    const std::int64_t d = key_labels.empty() ? i : t.diag(b, i);
    out.push_back(d >= 0 && d < static_cast<std::int64_t>(key_labels.size())
                      ? key_labels[static_cast<std::size_t>(d)]
                      : std::to_string(i));
  }
  return out;
}

std::string format_row(const Trace& t, std::int64_t b, std::int64_t h, std::int64_t i,
                       const std::vector<std::string>& key_labels, std::int64_t top) {
  check_index(b, t.B, "batch", "B");
  check_index(h, t.Hq, "head", "Hq");
  check_index(i, t.Sq, "query", "Sq");
  if (!key_labels.empty() && static_cast<std::int64_t>(key_labels.size()) != t.Sk)
    throw Error("labels: expected Sk = " + std::to_string(t.Sk) + " key labels, got " +
                std::to_string(static_cast<std::int64_t>(key_labels.size())));
  auto label = [&](std::int64_t j) {
    return key_labels.empty() ? std::string() : key_labels[static_cast<std::size_t>(j)];
  };
  const std::vector<std::string> ql = query_labels(t, key_labels, b);
  std::string o;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "batch %" PRId64 ", head %" PRId64 " (kv head %" PRId64 "), query %" PRId64 " \"%s\"\n", b, h,
                t.kv_head(h), i, ql[static_cast<std::size_t>(i)].c_str());
  o += buf;
  // Header: only the columns of the options in use.
  std::snprintf(buf, sizeof buf, "  %5s %-12s %13s %13s", "key", "label", "q.k", "x scale");
  o += buf;
  if (t.softcap > 0.0) {
    std::snprintf(buf, sizeof buf, " %13s", "softcap");
    o += buf;
  }
  const bool alibi = !t.alibi_slopes.empty();
  const double slope = alibi ? t.alibi_slopes[static_cast<std::size_t>(b * t.Hq + h)] : 0.0;
  if (alibi) {
    std::snprintf(buf, sizeof buf, " %13s", "+ alibi");
    o += buf;
  }
  if (t.additive_mask) {
    std::snprintf(buf, sizeof buf, " %13s", "+ mask");
    o += buf;
  }
  std::snprintf(buf, sizeof buf, " %13s %13s\n", "logit", "weight");
  o += buf;
  std::int64_t admitted = 0;
  double sum = 0.0;
  for (std::int64_t j = 0; j < t.Sk; ++j) {
    const auto e = static_cast<std::size_t>(t.at(b, h, i, j));
    std::snprintf(buf, sizeof buf, "  %5" PRId64 " ", j);
    o += buf;
    // Padded to 12 characters, not bytes, so UTF-8 labels (U+2581 word marks) keep the columns.
    const std::string lab = label(j);
    const auto chars = std::count_if(lab.begin(), lab.end(), [](char c) { return (c & 0xC0) != 0x80; });
    o += lab;
    if (chars < 12) o.append(static_cast<std::size_t>(12 - chars), ' ');
    if (t.status[e] != KeyStatus::admitted) {
      std::snprintf(buf, sizeof buf, " %13s  (excluded by %s: -inf, weight 0)\n", "-inf",
                    key_status_name(t.status[e]));
      o += buf;
      continue;
    }
    ++admitted;
    sum += t.weights[e];
    const double scaled = t.scale * t.scores[e];
    std::snprintf(buf, sizeof buf, " %13s %13s", fmt(t.scores[e]).c_str(), fmt(scaled).c_str());
    o += buf;
    if (t.softcap > 0.0) {
      std::snprintf(buf, sizeof buf, " %13s", fmt(t.softcap * std::tanh(scaled / t.softcap)).c_str());
      o += buf;
    }
    if (alibi) {
      std::snprintf(buf, sizeof buf, " %13s", fmt(-slope * static_cast<double>(std::abs(t.diag(b, i) - j))).c_str());
      o += buf;
    }
    if (t.additive_mask) {
      std::snprintf(buf, sizeof buf, " %13s", fmt(t.mask_add[e]).c_str());
      o += buf;
    }
    std::snprintf(buf, sizeof buf, " %13s %13s\n", fmt(t.scaled[e]).c_str(), fmt(t.weights[e]).c_str());
    o += buf;
  }
  const auto r = static_cast<std::size_t>((b * t.Hq + h) * t.Sq + i);
  if (!t.sink_weights.empty()) {
    // The sink: a logit in the denominator with no value (its weight completes the row's 1).
    std::snprintf(buf, sizeof buf, "  %5s %-12s %13s %13s", "sink", "", "", "");
    o += buf;
    if (t.softcap > 0.0) o.append(14, ' ');
    if (alibi) o.append(14, ' ');
    if (t.additive_mask) o.append(14, ' ');
    std::snprintf(buf, sizeof buf, " %13s %13s  (no value)\n", fmt(t.sinks[static_cast<std::size_t>(h)]).c_str(),
                  fmt(t.sink_weights[r]).c_str());
    o += buf;
    sum += t.sink_weights[r];
  }
  std::snprintf(buf, sizeof buf,
                "  admitted keys: %" PRId64 " of %" PRId64 "; sum of weights%s = %s; softmax_lse = %s\n",
                admitted, t.Sk, t.sink_weights.empty() ? "" : " (sink included)", fmt(sum).c_str(), fmt(t.lse[r]).c_str());
  o += buf;
  o += "  z = sum_j weight_j v_j = [";
  for (std::int64_t x = 0; x < t.Dv; ++x) {
    if (x) o += ", ";
    o += fmt(t.output[r * static_cast<std::size_t>(t.Dv) + static_cast<std::size_t>(x)]);
  }
  o += "]\n  most weight:";
  const auto best = top_keys(t, b, h, i, top);
  if (best.empty()) o += " none (no admissible key: z = 0)";
  for (const auto& kw : best) {
    std::snprintf(buf, sizeof buf, " %" PRId64 " %s%s%s (%s)", kw.key, key_labels.empty() ? "" : "\"",
                  label(kw.key).c_str(), key_labels.empty() ? "" : "\"", fmt(kw.weight).c_str());
    o += buf;
    if (&kw != &best.back()) o += ",";
  }
  o += "\n";
  return o;
}

}  // namespace qkv::explain
