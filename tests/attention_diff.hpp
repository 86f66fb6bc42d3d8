#pragma once
// Differential testing of the fast attention kernels against the float64 reference.
//
// One Config describes a call (shapes, dtype, options, layout); run_case() builds random inputs
// (optionally with +-20 sigma outliers), plants NaN in every K/V row that no query row of its KV
// head may attend (so any read of an excluded key shows up), optionally plants NaN in one key that
// only some rows may attend (rows that admit it must be NaN, the others exact), runs the
// reference, a naive fp32 attention (written here, the accuracy yardstick), and the requested
// fast kernel on every ISA level this machine supports with 1 and 2 threads, and checks:
//   - NaN pattern and empty rows (O = 0, lse = -inf) identical to the reference;
//   - fp32/fp16: max |fast - ref| <= 2 max |naive - ref| + 1e-6 (out; lse: + one fp32 ulp + two
//     typical score errors 2^-24 sqrt(D) scale max sum|q_d k_d|), the naive error
//     being the worst of three naive variants (forward, backward, forward with FMA);
//     bf16 with the AVX512_BF16 path (P rounded to bf16): + a floor of max|v| / 256;
//   - bitwise identical output for 1 and 2 threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/problem.hpp"
#include "core/validate.hpp"
#include "platform/cpu_features.hpp"
#include "qkv/attention.hpp"
#include "qkv/reference.hpp"
#include "qkv/tensor.hpp"

namespace qkv::test {

struct Config {
  std::int64_t B = 1, Hq = 1, Hkv = 1, Sq = 1, Sk = 1, D = 8, Dv = 8;
  DType dtype = DType::f32;
  bool causal = false;
  std::int64_t wl = -1, wr = -1;
  Alignment align = Alignment::bottom_right;
  int mask = 0;              // 0 none, 1 bool, 2 additive float
  bool mask_bcast = false;   // mask [Sq, Sk] broadcast over B and H
  bool kv_lens = false;
  double softcap = 0.0;
  bool outliers = false;
  int layout = 0;            // 0 BHSD contiguous, 1 BSHD with padded rows, 2 packed QKV [B,S,3,H,D]
  bool partial_nan = false;  // plant NaN in one key that only some rows admit
  bool sinks = false;        // sink logits [Hq]
  int alibi = 0;             // 0 none, 1 slopes [Hq], 2 slopes [B, Hq]
  std::int64_t keep_first = 0;  // window_keep_first
  std::uint64_t seed = 1;

  std::string str() const {
    std::ostringstream o;
    o << "B" << B << " Hq" << Hq << " Hkv" << Hkv << " Sq" << Sq << " Sk" << Sk << " D" << D << " Dv" << Dv
      << " " << dtype_name(dtype) << (causal ? " causal" : "") << " win(" << wl << "," << wr << ")"
      << (align == Alignment::top_left ? " top_left" : " bottom_right") << " mask" << mask
      << (mask_bcast ? "b" : "") << (kv_lens ? " kv_lens" : "") << " cap" << softcap
      << (outliers ? " outliers" : "") << " layout" << layout << (partial_nan ? " pnan" : "")
      << (sinks ? " sinks" : "") << (alibi ? (alibi == 1 ? " alibi[Hq]" : " alibi[B,Hq]") : "")
      << (keep_first ? " keep_first" + std::to_string(keep_first) : "") << " seed" << seed;
    return o.str();
  }
};

struct Stats {
  double err = 0, naive_err = 0, lse_err = 0, naive_lse_err = 0, vmax = 0;
};

inline float round_to(DType dt, float x) {
  if (dt == DType::bf16) return bf16_to_float(float_to_bf16(x));
  if (dt == DType::f16) return half_to_float(float_to_half(x));
  return x;
}

inline void put(const TensorView& t, std::int64_t off, float x) {
  switch (t.dtype()) {
    case DType::f32: t.data_as<float>()[off] = x; break;
    case DType::bf16: t.data_as<std::uint16_t>()[off] = float_to_bf16(x); break;
    case DType::f16: t.data_as<std::uint16_t>()[off] = float_to_half(x); break;
    default: break;
  }
}
inline double get(const TensorView& t, std::int64_t off) { return load_as_double(t.data(), t.dtype(), off); }
inline std::int64_t off4(const TensorView& t, std::int64_t a, std::int64_t b, std::int64_t c, std::int64_t d) {
  return a * t.stride(0) + b * t.stride(1) + c * t.stride(2) + d * t.stride(3);
}

/// The ISA levels this machine can run, up to a QKV_ISA cap (all of them are tested in turn).
inline std::vector<detail::Isa> test_isas(DType dt) {
  std::vector<detail::Isa> v;
  for (int l = 0; l <= static_cast<int>(detail::Isa::avx512amx); ++l) {
    const auto isa = static_cast<detail::Isa>(l);
    if (!detail::isa_compiled(isa) || !detail::isa_supported(isa)) continue;
    if (isa >= detail::Isa::avx512bf16 && dt != DType::bf16) continue;  // same code as avx512
    detail::set_isa_cap(isa);
    const bool reachable = detail::active_isa() == isa;  // not above a QKV_ISA cap
    detail::reset_isa_cap();
    if (reachable) v.push_back(isa);
  }
  return v;
}

struct IsaCap {
  explicit IsaCap(detail::Isa isa) { detail::set_isa_cap(isa); }
  ~IsaCap() { detail::reset_isa_cap(); }
};

/// Naive fp32 attention: one row at a time, sequential fp32 dot products, std::exp, as a
/// straightforward implementation would be written. Reads only admissible keys.
inline void naive_fp32(const detail::Problem& p, const TensorView& q, const TensorView& k, const TensorView& v,
                       const std::vector<std::uint8_t>& admit, const std::vector<float>& add,
                       std::vector<double>& out, std::vector<double>& lse, bool reverse = false,
                       double* max_abs_dot = nullptr, bool fused = false, const float* sinks = nullptr) {
  out.assign(p.B * p.Hq * p.Sq * p.Dv, 0.0);
  lse.assign(p.B * p.Hq * p.Sq, 0.0);
  std::vector<float> s(p.Sk), acc(p.Dv);
  for (std::int64_t b = 0; b < p.B; ++b)
    for (std::int64_t h = 0; h < p.Hq; ++h)
      for (std::int64_t i = 0; i < p.Sq; ++i) {
        const std::int64_t hk = p.kv_head(h);
        const std::int64_t row = (b * p.Hq + h) * p.Sq + i;
        float mx = -std::numeric_limits<float>::infinity();
        bool any = false;
        for (std::int64_t j = 0; j < p.Sk; ++j) {
          if (!admit[row * p.Sk + j]) continue;
          any = true;
          float dot = 0.0f;
          double absdot = 0.0;
          for (std::int64_t dd = 0; dd < p.D; ++dd) {
            const std::int64_t d = reverse ? p.D - 1 - dd : dd;
            const float qd = static_cast<float>(get(q, off4(q, b, h, i, d)));
            const float kd = static_cast<float>(get(k, off4(k, b, hk, j, d)));
            dot = fused ? std::fma(qd, kd, dot) : dot + qd * kd;
            absdot += std::abs(double(qd) * double(kd));
          }
          if (max_abs_dot && std::isfinite(absdot)) *max_abs_dot = std::max(*max_abs_dot, absdot);
          float x = static_cast<float>(p.scale) * dot;
          if (p.softcap > 0) x = static_cast<float>(p.softcap) * std::tanh(x / static_cast<float>(p.softcap));
          x += add[row * p.Sk + j];
          s[j] = x;
          mx = std::max(mx, x);
        }
        if (sinks && !any) {  // an empty row with a sink: O = 0, lse = z
          lse[row] = sinks[h];
          continue;
        }
        if (mx == -std::numeric_limits<float>::infinity()) {
          lse[row] = -std::numeric_limits<double>::infinity();
          continue;
        }
        if (sinks) mx = std::max(mx, sinks[h]);
        float sum = sinks ? std::exp(sinks[h] - mx) : 0.0f;  // the sink: denominator only
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (std::int64_t jj = 0; jj < p.Sk; ++jj) {
          const std::int64_t j = reverse ? p.Sk - 1 - jj : jj;
          if (!admit[row * p.Sk + j]) continue;
          const float e = std::exp(s[j] - mx);
          sum += e;
          for (std::int64_t d = 0; d < p.Dv; ++d) {
            const float vd = static_cast<float>(get(v, off4(v, b, hk, j, d)));
            acc[d] = fused ? std::fma(e, vd, acc[d]) : acc[d] + e * vd;
          }
        }
        for (std::int64_t d = 0; d < p.Dv; ++d) out[row * p.Dv + d] = acc[d] / sum;
        lse[row] = mx + std::log(sum);
      }
}

/// Runs one configuration; `kind` is the fast kernel forced. Returns the worst stats over ISAs.
inline Stats run_case(const Config& c, KernelKind kind, bool check_threads = true, double naive_factor = 2.0) {
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  const DType dt = c.dtype;

  // Inputs in the requested layout.
  Tensor qbuf, kbuf, vbuf;
  TensorView q, k, v;
  if (c.layout == 2) {  // packed QKV: [B, S, 3, H, D] (needs Sq == Sk, Hq == Hkv, D == Dv)
    qbuf = Tensor(dt, {c.B, c.Sq, 3, c.Hq, c.D});
    const std::int64_t sB = c.Sq * 3 * c.Hq * c.D, sS = 3 * c.Hq * c.D;
    char* base = static_cast<char*>(qbuf.data());
    const std::size_t es = dtype_size(dt);
    q = TensorView(base, dt, {c.B, c.Hq, c.Sq, c.D}, {sB, c.D, sS, 1});
    k = TensorView(base + es * c.Hq * c.D, dt, {c.B, c.Hq, c.Sq, c.D}, {sB, c.D, sS, 1});
    v = TensorView(base + es * 2 * c.Hq * c.D, dt, {c.B, c.Hq, c.Sq, c.D}, {sB, c.D, sS, 1});
  } else if (c.layout == 1) {  // BSHD, each row padded by 3 elements
    auto mk = [&](Tensor& t, std::int64_t S, std::int64_t H, std::int64_t X) {
      t = Tensor(dt, {c.B, S, H, X + 3});
      return TensorView(t.data(), dt, {c.B, H, S, X}, {S * H * (X + 3), X + 3, H * (X + 3), 1});
    };
    q = mk(qbuf, c.Sq, c.Hq, c.D);
    k = mk(kbuf, c.Sk, c.Hkv, c.D);
    v = mk(vbuf, c.Sk, c.Hkv, c.Dv);
  } else {
    qbuf = Tensor(dt, {c.B, c.Hq, c.Sq, c.D});
    kbuf = Tensor(dt, {c.B, c.Hkv, c.Sk, c.D});
    vbuf = Tensor(dt, {c.B, c.Hkv, c.Sk, c.Dv});
    q = qbuf.view(); k = kbuf.view(); v = vbuf.view();
  }
  auto fill = [&](const TensorView& t) {
    for (std::int64_t a = 0; a < t.size(0); ++a)
      for (std::int64_t b = 0; b < t.size(1); ++b)
        for (std::int64_t s = 0; s < t.size(2); ++s)
          for (std::int64_t d = 0; d < t.size(3); ++d) {
            float x = nd(rng);
            if (c.outliers && ud(rng) < 0.01f) x = ud(rng) < 0.5f ? 20.0f : -20.0f;
            put(t, off4(t, a, b, s, d), x);
          }
  };
  fill(q); fill(k); fill(v);

  AttentionParams prm;
  prm.causal = c.causal;
  prm.window_left = c.wl;
  prm.window_right = c.wr;
  prm.align = c.align;
  prm.softcap = c.softcap;
  Tensor mask_t, lens_t;
  if (c.mask) {
    const DType mdt = c.mask == 1 ? DType::b8 : DType::f32;
    mask_t = c.mask_bcast ? Tensor(mdt, {c.Sq, c.Sk}) : Tensor(mdt, {c.B, c.Hq, c.Sq, c.Sk});
    for (std::int64_t x = 0; x < mask_t.numel(); ++x) {
      if (c.mask == 1) mask_t.data_as<std::uint8_t>()[x] = ud(rng) < 0.7f;
      else mask_t.data_as<float>()[x] = ud(rng) < 0.3f ? -std::numeric_limits<float>::infinity() : nd(rng);
    }
    prm.mask = mask_t.view();
  }
  if (c.kv_lens) {
    lens_t = Tensor(DType::i64, {c.B});
    std::uniform_int_distribution<std::int64_t> ld(0, c.Sk);
    for (std::int64_t b = 0; b < c.B; ++b) lens_t.data_as<std::int64_t>()[b] = b == 0 ? c.Sk : ld(rng);
    prm.kv_lens = lens_t.view();
  }
  Tensor sinks_t, slopes_t;
  if (c.sinks) {
    sinks_t = Tensor(DType::f32, {c.Hq});
    for (std::int64_t h = 0; h < c.Hq; ++h) sinks_t.data_as<float>()[h] = 2.0f * nd(rng);
    prm.sinks = sinks_t.view();
  }
  if (c.alibi) {
    slopes_t = c.alibi == 1 ? Tensor(DType::f32, {c.Hq}) : Tensor(DType::f32, {c.B, c.Hq});
    for (std::int64_t x = 0; x < slopes_t.numel(); ++x) slopes_t.data_as<float>()[x] = 0.5f * ud(rng);
    prm.alibi_slopes = slopes_t.view();
  }
  prm.window_keep_first = c.keep_first;

  Tensor out_ref(DType::f64, {c.B, c.Hq, c.Sq, c.Dv}), lse_ref(DType::f64, {c.B, c.Hq, c.Sq});
  Tensor out1(DType::f32, {c.B, c.Hq, c.Sq, c.Dv}), lse1(DType::f32, {c.B, c.Hq, c.Sq});
  Tensor out2(DType::f32, {c.B, c.Hq, c.Sq, c.Dv}), lse2(DType::f32, {c.B, c.Hq, c.Sq});
  const detail::Problem p = detail::lower_attention(q, k, v, out_ref, prm, lse_ref.view(), std::nullopt);

  // Admissibility of every (row, key) and the additive term, from the semantics.
  std::vector<std::uint8_t> admit(c.B * c.Hq * c.Sq * c.Sk, 0);
  std::vector<float> add(admit.size(), 0.0f);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h)
      for (std::int64_t i = 0; i < c.Sq; ++i) {
        std::int64_t lo, hi, first_hi;
        p.key_ranges(b, i, lo, hi, first_hi);
        const std::int64_t row = (b * c.Hq + h) * c.Sq + i;
        for (std::int64_t j = 0; j < hi; ++j) {
          if (j < lo && j >= first_hi) continue;
          bool ok = true;
          // ALiBi's bias (after softcap, before the mask's term): - slope |diag - j|.
          float a = p.alibi.empty() ? 0.0f : static_cast<float>(-p.slope(b, h) * std::abs(double(p.diag(b, i) - j)));
          if (c.mask) {
            const std::int64_t mo = b * p.mask.sb + h * p.mask.sh + i * p.mask.sq + j * p.mask.sk;
            if (c.mask == 1) ok = mask_t.data_as<std::uint8_t>()[mo] != 0;
            else {
              const float m = mask_t.data_as<float>()[mo];
              ok = m != -std::numeric_limits<float>::infinity();
              a += m;
            }
          }
          admit[row * c.Sk + j] = ok;
          add[row * c.Sk + j] = ok ? a : 0.0f;
        }
      }
  // NaN in every K/V row that no row of its KV head admits (never to be read) ...
  const float nan = std::numeric_limits<float>::quiet_NaN();
  auto plant = [&](std::int64_t b, std::int64_t hk, std::int64_t j) {
    for (std::int64_t d = 0; d < c.D; ++d) put(k, off4(k, b, hk, j, d), nan);
    for (std::int64_t d = 0; d < c.Dv; ++d) put(v, off4(v, b, hk, j, d), nan);
  };
  const std::int64_t G = c.Hq / c.Hkv;
  std::vector<std::pair<std::int64_t, std::int64_t>> partial;  // (b*Hkv+hk, j) admitted by some rows only
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t hk = 0; hk < c.Hkv; ++hk)
      for (std::int64_t j = 0; j < c.Sk; ++j) {
        int n_adm = 0, n_rows = 0;
        for (std::int64_t h = hk * G; h < (hk + 1) * G; ++h)
          for (std::int64_t i = 0; i < c.Sq; ++i, ++n_rows) n_adm += admit[((b * c.Hq + h) * c.Sq + i) * c.Sk + j];
        if (n_adm == 0) plant(b, hk, j);
        else if (n_adm < n_rows) partial.push_back({b * c.Hkv + hk, j});
      }
  // ... and optionally in one key that only some rows admit.
  if (c.partial_nan && !partial.empty()) {
    const auto [bh, j] = partial[rng() % partial.size()];
    plant(bh / c.Hkv, bh % c.Hkv, j);
  }

  qkv::reference::attention(q, k, v, out_ref, prm, lse_ref.view());
  // The naive error: the worst of three naive variants (forward and backward summation over d and
  // j, and forward with fused multiply-adds, as a compiler contracting a*b+c would produce), so
  // that one lucky rounding pattern of a small case does not set the bar.
  std::vector<double> nout, nlse, nout2, nlse2, nout3, nlse3;
  double max_abs_dot = 0.0;
  const float* zs = c.sinks ? sinks_t.data_as<float>() : nullptr;
  naive_fp32(p, q, k, v, admit, add, nout, nlse, false, &max_abs_dot, false, zs);
  naive_fp32(p, q, k, v, admit, add, nout2, nlse2, true, nullptr, false, zs);
  naive_fp32(p, q, k, v, admit, add, nout3, nlse3, false, nullptr, true, zs);

  Stats st;
  const double* ro = out_ref.data_as<double>();
  const double* rl = lse_ref.data_as<double>();
  for (std::int64_t x = 0; x < out_ref.numel(); ++x)
    if (std::isfinite(ro[x])) {
      st.naive_err = std::max({st.naive_err, std::abs(nout[x] - ro[x]), std::abs(nout2[x] - ro[x]),
                               std::abs(nout3[x] - ro[x])});
      st.vmax = std::max(st.vmax, std::abs(ro[x]));
    }
  for (std::int64_t x = 0; x < lse_ref.numel(); ++x)
    if (std::isfinite(rl[x]))
      st.naive_lse_err = std::max({st.naive_lse_err, std::abs(nlse[x] - rl[x]), std::abs(nlse2[x] - rl[x]),
                                   std::abs(nlse3[x] - rl[x])});
  double vabs = 0;
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hkv; ++h)
      for (std::int64_t j = 0; j < c.Sk; ++j)
        for (std::int64_t d = 0; d < c.Dv; ++d) {
          const double x = get(v, off4(v, b, h, j, d));
          if (std::isfinite(x)) vabs = std::max(vabs, std::abs(x));
        }

  for (detail::Isa isa : test_isas(dt)) {
    IsaCap cap(isa);
    SCOPED_TRACE(std::string("isa ") + detail::isa_name(isa) + ": " + c.str());
    AttentionParams fp = prm;
    fp.kernel = kind;
    fp.num_threads = 1;
    qkv::attention(q, k, v, out1, fp, lse1.view());
    if (check_threads) {
      fp.num_threads = 2;
      qkv::attention(q, k, v, out2, fp, lse2.view());
      EXPECT_EQ(0, std::memcmp(out1.data(), out2.data(), out1.nbytes())) << "1 vs 2 threads differ";
      EXPECT_EQ(0, std::memcmp(lse1.data(), lse2.data(), lse1.nbytes())) << "1 vs 2 threads differ (lse)";
    }
    const float* fo = out1.data_as<float>();
    const float* fl = lse1.data_as<float>();
    double err = 0, lerr = 0;
    std::int64_t nan_mismatch = 0, empty_mismatch = 0;
    for (std::int64_t x = 0; x < out_ref.numel(); ++x) {
      if (std::isnan(ro[x]) != std::isnan(fo[x])) { ++nan_mismatch; continue; }
      if (std::isfinite(ro[x])) err = std::max(err, std::abs(fo[x] - ro[x]));
    }
    for (std::int64_t x = 0; x < lse_ref.numel(); ++x) {
      if (std::isnan(rl[x]) != std::isnan(fl[x])) { ++nan_mismatch; continue; }
      if (std::isinf(rl[x]) != std::isinf(fl[x])) { ++empty_mismatch; continue; }
      if (std::isinf(rl[x])) {
        const std::int64_t row = x;
        for (std::int64_t d = 0; d < c.Dv; ++d) empty_mismatch += fo[row * c.Dv + d] != 0.0f;
        continue;
      }
      // Less one fp32 ulp of |lse|: the stored lse is an fp32 number (ulp 7.6e-6 at 100).
      if (std::isfinite(rl[x]))
        lerr = std::max(lerr, std::abs(fl[x] - rl[x]) - std::ldexp(1.0, std::ilogb(rl[x]) - 23) * (rl[x] != 0));
    }
    EXPECT_EQ(nan_mismatch, 0) << "NaN pattern differs from the reference";
    EXPECT_EQ(empty_mismatch, 0) << "empty rows must give O = 0, lse = -inf";
    double floor = 1e-6;
    // lse moves by at most the largest score error; an fp32 dot product of D terms typically
    // errs by ~sqrt(D) 2^-24 sum |q_d k_d| (x scale): two such units are allowed on top.
    double lse_floor = 1e-6 + 2 * std::sqrt(double(c.D)) * std::ldexp(1.0, -24) * std::abs(p.scale) * max_abs_dot;
    // P rounded to bf16 (relative 2^-9 per weight) moves O by at most max|v| / 512.
    if (dt == DType::bf16 && isa >= detail::Isa::avx512bf16) floor += vabs / 256.0;
    EXPECT_LE(err, naive_factor * st.naive_err + floor) << "naive fp32 error " << st.naive_err;
    EXPECT_LE(lerr, naive_factor * st.naive_lse_err + lse_floor) << "naive fp32 lse error " << st.naive_lse_err;
    if (std::getenv("QKV_TEST_VERBOSE"))
      std::printf("    %s %s: err %.3g (naive %.3g), lse err %.3g (naive %.3g)\n", detail::isa_name(isa), c.str().c_str(),
                  err, st.naive_err, lerr, st.naive_lse_err);
    st.err = std::max(st.err, err);
    st.lse_err = std::max(st.lse_err, lerr);
  }
  return st;
}

/// A random configuration from the design grid; `budget` bounds B*Hq*Sq*Sk*(D+Dv) so that the
/// float64 reference stays fast.
inline Config random_config(std::mt19937_64& rng, bool decode, double budget) {
  auto pick = [&](std::initializer_list<std::int64_t> l) { return *(l.begin() + rng() % l.size()); };
  Config c;
  c.seed = rng();
  c.D = pick({1, 8, 59, 64, 111, 128, 256});
  c.Dv = rng() % 4 == 0 ? pick({1, 8, 59, 64, 111, 128, 256}) : c.D;
  c.Sk = pick({1, 2, 17, 97, 128, 1025});
  c.Sq = decode ? 1 + static_cast<std::int64_t>(rng() % 16) : (rng() % 3 == 0 ? c.Sk : pick({1, 2, 17, 97, 128, 1025}));
  if (decode && rng() % 2) c.Sk = pick({300, 2049, 4100});
  const std::int64_t ratio = pick({1, 2, 8});
  c.Hkv = 1 + static_cast<std::int64_t>(rng() % 2);
  c.Hq = c.Hkv * ratio;
  c.B = 1 + static_cast<std::int64_t>(rng() % 2);
  const int dsel = static_cast<int>(rng() % 6);
  c.dtype = dsel < 4 ? DType::f32 : dsel == 4 ? DType::bf16 : DType::f16;
  c.align = rng() % 2 ? Alignment::bottom_right : Alignment::top_left;
  const int msel = static_cast<int>(rng() % 8);
  if (msel == 0 || msel == 1) c.causal = true;
  if (msel == 2) { c.wl = static_cast<std::int64_t>(rng() % 40); c.wr = static_cast<std::int64_t>(rng() % 40) - 1; }
  if (msel == 3) { c.causal = true; c.wl = static_cast<std::int64_t>(rng() % 100); }
  const int x = static_cast<int>(rng() % 6);
  if (x == 0) c.mask = 1;
  if (x == 1) c.mask = 2;
  c.mask_bcast = rng() % 2;
  c.kv_lens = rng() % 4 == 0;
  if (rng() % 6 == 0) c.softcap = pick({5, 30});
  c.outliers = rng() % 3 == 0;
  c.partial_nan = rng() % 3 == 0;
  c.layout = static_cast<int>(rng() % 2);
  if (!decode && rng() % 6 == 0) {  // packed QKV
    c.layout = 2; c.Sq = c.Sk; c.Hkv = c.Hq = c.Hkv; c.Dv = c.D;
  }
  // Keep within the budget: shrink heads, batch, then lengths.
  auto cost = [&] { return double(c.B) * c.Hq * c.Sq * c.Sk * (c.D + c.Dv); };
  while (cost() > budget && c.B > 1) c.B = 1;
  while (cost() > budget && c.Hq > c.Hkv) { c.Hq /= 2; if (c.Hq % c.Hkv) c.Hq = c.Hkv; }
  while (cost() > budget && c.Hkv > 1) { c.Hkv = 1; c.Hq = std::max<std::int64_t>(1, c.Hq / 2); }
  while (cost() > budget && c.D > 8) { c.D = c.D / 2 + 1; if (c.layout == 2) c.Dv = c.D; }
  while (cost() > budget && c.Dv > 8 && c.layout != 2) c.Dv = c.Dv / 2 + 1;
  while (cost() > budget && c.Sk > 97 && !decode) { c.Sk = 97; if (c.layout == 2) c.Sq = c.Sk; }
  if (c.Hq % c.Hkv) c.Hq = c.Hkv;
  return c;
}

/// Runs n random configurations (random_config) of the flash or decode kernel against the
/// reference and prints the worst errors per dtype; stops at the first failing configuration.
inline void run_random_grid(int n, std::uint64_t seed, double budget, bool decode, double naive_factor = 2.0) {
  std::mt19937_64 rng(seed);
  Stats worst;
  double worst_dt[3][2] = {};  // per dtype (f32, bf16, f16): worst fast error, worst naive error
  double worst_ratio = 0;      // fp32: worst (fast error - 1e-6) / naive error
  int over2 = 0;               // fp32 configurations above the CI bound 2 x naive + 1e-6
  for (int t = 0; t < n; ++t) {
    const Config c = random_config(rng, decode, budget);
    const Stats s = run_case(c, decode ? KernelKind::decode : KernelKind::flash, true, naive_factor);
    const int di = c.dtype == DType::f32 ? 0 : c.dtype == DType::bf16 ? 1 : 2;
    worst_dt[di][0] = std::max(worst_dt[di][0], s.err);
    worst_dt[di][1] = std::max(worst_dt[di][1], s.naive_err);
    if (di == 0 && s.naive_err > 0) worst_ratio = std::max(worst_ratio, (s.err - 1e-6) / s.naive_err);
    if (di == 0 && s.err > 2 * s.naive_err + 1e-6) {
      ++over2;
      std::printf("above 2 x naive + 1e-6: error %.3g, naive %.3g: %s\n", s.err, s.naive_err, c.str().c_str());
    }
    worst.err = std::max(worst.err, s.err);
    worst.naive_err = std::max(worst.naive_err, s.naive_err);
    if (::testing::Test::HasFailure()) {
      ADD_FAILURE() << "stopping at configuration " << t << ": " << c.str();
      return;
    }
  }
  std::printf("%d configurations: worst fast error %.3g, worst naive fp32 error %.3g\n", n, worst.err,
              worst.naive_err);
  const char* names[3] = {"float32", "bfloat16", "float16"};
  for (int d = 0; d < 3; ++d)
    std::printf("  %s: worst fast error %.3g, worst naive fp32 error %.3g\n", names[d], worst_dt[d][0], worst_dt[d][1]);
  std::printf("  float32: worst (fast error - 1e-6) / naive error = %.3g (bound %g); above 2: %d\n", worst_ratio,
              naive_factor, over2);
}

}  // namespace qkv::test
