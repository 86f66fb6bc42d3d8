#pragma once
// Test support for attention: a case held in float64 (BHSD, contiguous), a runner that feeds it
// to qkv::reference::attention or qkv::attention in any input/output dtype and layout, and an
// independent float64 computation written straight from docs/semantics.md (it shares no code
// with src/reference, so the two judge each other).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/reference.hpp"
#include "qkv/tensor.hpp"

namespace qkv::test {

inline constexpr double kInf = std::numeric_limits<double>::infinity();

struct Case {
  std::int64_t B = 1, Hq = 1, Hkv = 1, Sq = 1, Sk = 1, D = 1, Dv = 1;
  std::vector<double> q, k, v;  // [B,Hq,Sq,D], [B,Hkv,Sk,D], [B,Hkv,Sk,Dv], contiguous
  AttentionParams params;       // mask and kv_lens are taken from the fields below
  Shape mask_shape;             // empty: no mask
  DType mask_dtype = DType::b8;
  std::vector<double> mask;     // bool masks: nonzero = attend
  std::vector<std::int64_t> kv_lens;  // empty: none
  DType lens_dtype = DType::i64;

  std::int64_t qi(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t x) const {
    return ((b * Hq + h) * Sq + i) * D + x;
  }
  std::int64_t ki(std::int64_t b, std::int64_t h, std::int64_t j, std::int64_t x) const {
    return ((b * Hkv + h) * Sk + j) * D + x;
  }
  std::int64_t vi(std::int64_t b, std::int64_t h, std::int64_t j, std::int64_t x) const {
    return ((b * Hkv + h) * Sk + j) * Dv + x;
  }
  void resize() {
    q.assign(static_cast<std::size_t>(B * Hq * Sq * D), 0.0);
    k.assign(static_cast<std::size_t>(B * Hkv * Sk * D), 0.0);
    v.assign(static_cast<std::size_t>(B * Hkv * Sk * Dv), 0.0);
  }
};

/// Outputs in float64, O [B,Hq,Sq,Dv], lse [B,Hq,Sq], probs [B,Hq,Sq,Sk].
struct Result {
  std::vector<double> o, lse, probs;
};

enum class Impl { reference, dispatch };
inline const char* impl_name(Impl i) { return i == Impl::reference ? "reference" : "dispatch"; }

struct RunOptions {
  DType in = DType::f64;
  DType out = DType::f64;
  DType aux = DType::f64;  // softmax_lse and probs
  bool bshd = false;       // store q, k, v and out as [B,S,H,X] and pass permuted views
  bool want_lse = true;
  bool want_probs = true;
};

/// The value x takes once stored in dtype `d` (what the kernel actually sees).
inline double rounded(double x, DType d) {
  std::uint64_t buf = 0;
  store_from_double(&buf, d, 0, x);
  return load_as_double(&buf, d, 0);
}

/// Rounds every input of a case to the dtype it will be stored in.
inline Case rounded_case(Case c, DType d) {
  for (auto* vec : {&c.q, &c.k, &c.v})
    for (double& x : *vec) x = rounded(x, d);
  return c;
}

namespace detail_t {
// A buffer of `n` elements of dtype `d`, 64-bit aligned.
struct Buf {
  std::vector<std::uint64_t> words;
  DType dtype;
  Buf(DType d, std::int64_t n) : words(static_cast<std::size_t>((n * static_cast<std::int64_t>(dtype_size(d)) + 7) / 8 + 1)), dtype(d) {}
  void* data() { return words.data(); }
};
// [B,H,S,X] logical -> storage index for BHSD or BSHD.
inline std::int64_t idx(bool bshd, std::int64_t H, std::int64_t S, std::int64_t X, std::int64_t b,
                        std::int64_t h, std::int64_t s, std::int64_t x) {
  return bshd ? ((b * S + s) * H + h) * X + x : ((b * H + h) * S + s) * X + x;
}
inline TensorView view4(Buf& buf, bool bshd, std::int64_t B, std::int64_t H, std::int64_t S, std::int64_t X) {
  if (bshd) return TensorView(buf.data(), buf.dtype, {B, S, H, X}).permute({0, 2, 1, 3});
  return TensorView(buf.data(), buf.dtype, {B, H, S, X});
}
}  // namespace detail_t

/// Runs a case through one implementation and returns its outputs as float64.
inline Result run(const Case& c, Impl impl, const RunOptions& ro = {}) {
  using namespace detail_t;
  Buf q(ro.in, c.B * c.Hq * c.Sq * c.D), k(ro.in, c.B * c.Hkv * c.Sk * c.D),
      v(ro.in, c.B * c.Hkv * c.Sk * c.Dv), o(ro.out, c.B * c.Hq * c.Sq * c.Dv);
  for (std::int64_t b = 0; b < c.B; ++b) {
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Sq; ++i)
        for (std::int64_t x = 0; x < c.D; ++x)
          store_from_double(q.data(), ro.in, idx(ro.bshd, c.Hq, c.Sq, c.D, b, h, i, x), c.q[c.qi(b, h, i, x)]);
    for (std::int64_t h = 0; h < c.Hkv; ++h)
      for (std::int64_t j = 0; j < c.Sk; ++j) {
        for (std::int64_t x = 0; x < c.D; ++x)
          store_from_double(k.data(), ro.in, idx(ro.bshd, c.Hkv, c.Sk, c.D, b, h, j, x), c.k[c.ki(b, h, j, x)]);
        for (std::int64_t x = 0; x < c.Dv; ++x)
          store_from_double(v.data(), ro.in, idx(ro.bshd, c.Hkv, c.Sk, c.Dv, b, h, j, x), c.v[c.vi(b, h, j, x)]);
      }
  }
  // Outputs start as NaN so that an element left unwritten is caught.
  for (std::int64_t n = 0; n < c.B * c.Hq * c.Sq * c.Dv; ++n) store_from_double(o.data(), ro.out, n, NAN);
  Buf lse(ro.aux, c.B * c.Hq * c.Sq), probs(ro.aux, c.B * c.Hq * c.Sq * c.Sk);
  for (std::int64_t n = 0; n < c.B * c.Hq * c.Sq; ++n) store_from_double(lse.data(), ro.aux, n, NAN);
  for (std::int64_t n = 0; n < c.B * c.Hq * c.Sq * c.Sk; ++n) store_from_double(probs.data(), ro.aux, n, NAN);

  AttentionParams p = c.params;
  Buf mask(c.mask_dtype, static_cast<std::int64_t>(c.mask.size()));
  if (!c.mask_shape.empty()) {
    for (std::size_t n = 0; n < c.mask.size(); ++n)
      store_from_double(mask.data(), c.mask_dtype, static_cast<std::int64_t>(n), c.mask[n]);
    p.mask = TensorView(mask.data(), c.mask_dtype, c.mask_shape);
  }
  Buf lens(c.lens_dtype, static_cast<std::int64_t>(c.kv_lens.size()));
  if (!c.kv_lens.empty()) {
    for (std::size_t n = 0; n < c.kv_lens.size(); ++n)
      store_from_double(lens.data(), c.lens_dtype, static_cast<std::int64_t>(n), static_cast<double>(c.kv_lens[n]));
    p.kv_lens = TensorView(lens.data(), c.lens_dtype, {static_cast<std::int64_t>(c.kv_lens.size())});
  }
  std::optional<TensorView> lse_v, probs_v;
  if (ro.want_lse) lse_v = TensorView(lse.data(), ro.aux, {c.B, c.Hq, c.Sq});
  if (ro.want_probs) probs_v = TensorView(probs.data(), ro.aux, {c.B, c.Hq, c.Sq, c.Sk});
  const TensorView qv = view4(q, ro.bshd, c.B, c.Hq, c.Sq, c.D), kv = view4(k, ro.bshd, c.B, c.Hkv, c.Sk, c.D),
                   vv = view4(v, ro.bshd, c.B, c.Hkv, c.Sk, c.Dv), ov = view4(o, ro.bshd, c.B, c.Hq, c.Sq, c.Dv);
  if (impl == Impl::reference)
    reference::attention(qv, kv, vv, ov, p, lse_v, probs_v);
  else
    attention(qv, kv, vv, ov, p, lse_v, probs_v);

  Result r;
  r.o.resize(static_cast<std::size_t>(c.B * c.Hq * c.Sq * c.Dv));
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Sq; ++i)
        for (std::int64_t x = 0; x < c.Dv; ++x)
          r.o[static_cast<std::size_t>(((b * c.Hq + h) * c.Sq + i) * c.Dv + x)] =
              load_as_double(o.data(), ro.out, idx(ro.bshd, c.Hq, c.Sq, c.Dv, b, h, i, x));
  if (ro.want_lse)
    for (std::int64_t n = 0; n < c.B * c.Hq * c.Sq; ++n) r.lse.push_back(load_as_double(lse.data(), ro.aux, n));
  if (ro.want_probs)
    for (std::int64_t n = 0; n < c.B * c.Hq * c.Sq * c.Sk; ++n) r.probs.push_back(load_as_double(probs.data(), ro.aux, n));
  return r;
}

/// The explicit mask of a case at (b,h,i,j), broadcast with NumPy rules: {attend, additive}.
inline std::pair<bool, double> mask_value(const Case& c, std::int64_t b, std::int64_t h, std::int64_t i,
                                          std::int64_t j) {
  if (c.mask_shape.empty()) return {true, 0.0};
  const std::int64_t full[4] = {b, h, i, j};
  const int r = static_cast<int>(c.mask_shape.size());
  std::int64_t flat = 0;
  for (int a = 0; a < r; ++a) {
    const std::int64_t n = c.mask_shape[static_cast<std::size_t>(a)];
    flat = flat * n + (n == 1 ? 0 : full[4 - r + a]);
  }
  const double m = c.mask[static_cast<std::size_t>(flat)];
  if (c.mask_dtype == DType::b8) return {m != 0.0, 0.0};
  return {m != -kInf, m};
}

/// True when causal/window/kv_lens admit key j for query i of batch b (docs/semantics.md).
inline bool admissible(const Case& c, std::int64_t b, std::int64_t i, std::int64_t j) {
  const std::int64_t len = c.kv_lens.empty() ? c.Sk : c.kv_lens[static_cast<std::size_t>(b)];
  if (j >= len) return false;
  std::int64_t left = c.params.window_left, right = c.params.window_right;
  if (c.params.causal) right = right < 0 ? 0 : std::min<std::int64_t>(right, 0);
  const std::int64_t diag = c.params.align == Alignment::bottom_right ? i + len - c.Sq : i;
  if (left >= 0 && j < diag - left) return false;
  if (right >= 0 && j > diag + right) return false;
  return true;
}

/// Straightforward float64 attention over the full score matrix.
inline Result naive(const Case& c) {
  Result r;
  r.o.assign(static_cast<std::size_t>(c.B * c.Hq * c.Sq * c.Dv), 0.0);
  r.lse.assign(static_cast<std::size_t>(c.B * c.Hq * c.Sq), -kInf);
  r.probs.assign(static_cast<std::size_t>(c.B * c.Hq * c.Sq * c.Sk), 0.0);
  const double scale = c.params.scale ? *c.params.scale : 1.0 / std::sqrt(static_cast<double>(c.D));
  const std::int64_t group = c.Hq / c.Hkv;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Sq; ++i) {
        const std::int64_t hk = h / group;
        std::vector<double> s(static_cast<std::size_t>(c.Sk), -kInf);
        std::vector<bool> in(static_cast<std::size_t>(c.Sk), false);
        double mx = -kInf;
        for (std::int64_t j = 0; j < c.Sk; ++j) {
          if (!admissible(c, b, i, j)) continue;
          const auto [attend, add] = mask_value(c, b, h, i, j);
          if (!attend) continue;
          double dot = 0;
          for (std::int64_t x = 0; x < c.D; ++x) dot += c.q[c.qi(b, h, i, x)] * c.k[c.ki(b, hk, j, x)];
          double sj = dot * scale;
          if (c.params.softcap > 0) sj = c.params.softcap * std::tanh(sj / c.params.softcap);
          sj += add;
          s[static_cast<std::size_t>(j)] = sj;
          in[static_cast<std::size_t>(j)] = true;
          mx = std::max(mx, sj);
        }
        if (mx == -kInf) continue;  // empty row: O = 0, lse = -inf, probs = 0
        double sum = 0;
        for (std::int64_t j = 0; j < c.Sk; ++j)
          if (in[static_cast<std::size_t>(j)]) sum += std::exp(s[static_cast<std::size_t>(j)] - mx);
        const std::int64_t row = (b * c.Hq + h) * c.Sq + i;
        r.lse[static_cast<std::size_t>(row)] = mx + std::log(sum);
        for (std::int64_t j = 0; j < c.Sk; ++j) {
          if (!in[static_cast<std::size_t>(j)]) continue;
          const double p = std::exp(s[static_cast<std::size_t>(j)] - mx) / sum;
          r.probs[static_cast<std::size_t>(row * c.Sk + j)] = p;
          for (std::int64_t x = 0; x < c.Dv; ++x) r.o[static_cast<std::size_t>(row * c.Dv + x)] += p * c.v[c.vi(b, hk, j, x)];
        }
      }
  return r;
}

// Q = K = 0 (all scores equal) with V column [1..Sk]: each output is the mean of the values of
// the admitted keys, so the alignment of the diagonal can be read off directly.
inline Case equal_scores_case(std::int64_t Sq, std::int64_t Sk) {
  Case c;
  c.Sq = Sq;
  c.Sk = Sk;
  c.D = 2;
  c.Dv = 1;
  c.resize();
  for (std::int64_t j = 0; j < Sk; ++j) c.v[static_cast<std::size_t>(j)] = static_cast<double>(j + 1);
  return c;
}

/// Fills q, k, v with N(0, sigma) values from a fixed seed.
inline void randomize(Case& c, std::uint32_t seed, double sigma = 1.0) {
  c.resize();
  std::mt19937 rng(seed);
  std::normal_distribution<double> nd(0.0, sigma);
  for (auto* vec : {&c.q, &c.k, &c.v})
    for (double& x : *vec) x = nd(rng);
}

/// Element-wise comparison: |got - want| <= atol + rtol*|want|; -inf must match -inf exactly.
inline ::testing::AssertionResult near(const std::vector<double>& got, const std::vector<double>& want,
                                       double atol, double rtol, const std::string& what) {
  if (got.size() != want.size())
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " != " << want.size();
  for (std::size_t n = 0; n < got.size(); ++n) {
    const double g = got[n], w = want[n];
    if (std::isinf(w) || std::isinf(g)) {
      if (g != w) return ::testing::AssertionFailure() << what << "[" << n << "] = " << g << ", want " << w;
      continue;
    }
    if (!(std::fabs(g - w) <= atol + rtol * std::fabs(w)))
      return ::testing::AssertionFailure() << what << "[" << n << "] = " << g << ", want " << w
                                           << " (diff " << std::fabs(g - w) << ")";
  }
  return ::testing::AssertionSuccess();
}

/// Tolerances for an implementation run in float64 (reference: float64 rounding only) or
/// float32 (the dispatched kernel, which may accumulate in float32).
struct Tol {
  double o, lse_abs, lse_rel, probs;
};
inline Tol tol_for(Impl impl) {
  return impl == Impl::reference ? Tol{1e-12, 1e-12, 1e-12, 1e-12} : Tol{2e-5, 1e-6, 1e-5, 1e-5};
}
inline RunOptions options_for(Impl impl) {
  RunOptions ro;
  if (impl == Impl::dispatch) ro.in = ro.out = ro.aux = DType::f32;
  return ro;
}

/// Runs `c` through `impl` in its usual precision and compares every output with naive().
inline ::testing::AssertionResult matches_naive(const Case& c, Impl impl, RunOptions ro, const std::string& what) {
  const Case cr = rounded_case(c, ro.in);
  const Result want = naive(cr);
  const Result got = run(c, impl, ro);
  const Tol t = tol_for(impl);
  auto r = near(got.o, want.o, t.o, t.o, what + " " + impl_name(impl) + " O");
  if (!r) return r;
  if (ro.want_lse) {
    r = near(got.lse, want.lse, t.lse_abs, t.lse_rel, what + " " + impl_name(impl) + " lse");
    if (!r) return r;
  }
  if (ro.want_probs) {
    r = near(got.probs, want.probs, t.probs, 0.0, what + " " + impl_name(impl) + " probs");
    if (!r) return r;
  }
  return ::testing::AssertionSuccess();
}

inline constexpr Impl kImpls[] = {Impl::reference, Impl::dispatch};

}  // namespace qkv::test
