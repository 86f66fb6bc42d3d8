#pragma once
// Differential testing of the fast backward kernel against the float64 backward specification.
//
// One BwConfig describes a call; run_backward_case() builds random inputs (optionally with +-20
// sigma outliers) in the config's dtype and layout, plants NaN in every K/V row that no query
// row of its batch may attend (a read of an excluded key would show up as NaN), runs the fast
// forward for out and softmax_lse, then:
//   - the float64 reference backward (the judge),
//   - two naive fp32 backwards (P materialised row by row, straightforward loops; P by a softmax
//     of its own or from the forward's softmax_lse): the worse of the two is the yardstick,
//   - the fast backward on every ISA level this machine supports, with 1 and 2 threads,
// and checks for dQ, dK and dV: no NaN; max |fast - ref| <= 2 max |naive - ref| + a floor
// (1e-6 max(1, max |ref|), plus the rounding of a bf16/fp16 gradient to its dtype, plus on the
// AVX512_BF16 path 2^-8 of the largest sum of absolute terms of a gradient element); and bitwise
// identical gradients for 1 and 2 threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "attention_diff.hpp"  // test_isas, IsaCap
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/reference.hpp"
#include "qkv/tensor.hpp"

namespace qkv::test {

struct BwConfig {
  std::int64_t B = 1, Hq = 1, Hkv = 1, Sq = 1, Sk = 1, D = 8, Dv = 8;
  DType dtype = DType::f32;
  DType grad = DType::f32;  // dtype of dQ, dK, dV: f32 or the input's
  DType dout = DType::f32;  // dtype of dO and of the forward's out (any float dtype)
  DType lse = DType::f32;   // dtype of softmax_lse (f32 or f64)
  bool causal = false;
  std::int64_t wl = -1, wr = -1;
  Alignment align = Alignment::bottom_right;
  int mask = 0;  // 0 none, 1 bool [B,1,Sq,Sk], 2 additive f32 [Sq,Sk] with some -inf
  bool kv_lens = false;
  double softcap = 0.0;
  double scale = 0.0;  // 0: default 1/sqrt(D)
  bool outliers = false;
  bool bshd = false;
  bool sinks = false;           // sink logits [Hq] (and dL/dz checked)
  int alibi = 0;                // 0 none, 1 slopes [Hq], 2 slopes [B, Hq]
  std::int64_t keep_first = 0;  // window_keep_first
  std::uint64_t seed = 1;

  std::string str() const {
    std::ostringstream o;
    o << "B" << B << " Hq" << Hq << " Hkv" << Hkv << " Sq" << Sq << " Sk" << Sk << " D" << D << " Dv" << Dv << " "
      << dtype_name(dtype) << "->" << dtype_name(grad) << (causal ? " causal" : "") << " win(" << wl << "," << wr
      << ")" << (align == Alignment::top_left ? " top_left" : " bottom_right") << " mask" << mask
      << (kv_lens ? " kv_lens" : "") << " cap" << softcap << " scale" << scale << (outliers ? " outliers" : "")
      << (bshd ? " bshd" : "") << " dO/O " << dtype_name(dout) << " lse " << dtype_name(lse)
      << (sinks ? " sinks" : "") << (alibi ? (alibi == 1 ? " alibi[Hq]" : " alibi[B,Hq]") : "")
      << (keep_first ? " keep_first" + std::to_string(keep_first) : "") << " seed" << seed;
    return o.str();
  }
};

/// The inputs of one backward call, with the forward's out and softmax_lse.
struct BwInputs {
  BwConfig c;
  Tensor q, k, v, dout, out, lse, mask, lens, sinks, slopes;
  AttentionParams p;
  TensorView view(const Tensor& t) const { return c.bshd ? t.view().permute({0, 2, 1, 3}) : t.view(); }
  Tensor like(std::int64_t H, std::int64_t S, std::int64_t X, DType dt) const {
    return Tensor(dt, c.bshd ? Shape{c.B, S, H, X} : Shape{c.B, H, S, X});
  }
};

inline BwInputs make_inputs(const BwConfig& c) {
  BwInputs in;
  in.c = c;
  std::mt19937_64 rng(c.seed);
  std::normal_distribution<double> nd(0.0, 1.0);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  auto fill = [&](Tensor& t) {
    for (std::int64_t i = 0; i < t.numel(); ++i) {
      double x = nd(rng);
      if (c.outliers && u(rng) < 0.01) x *= 20.0;
      store_from_double(t.data(), t.dtype(), i, x);
    }
  };
  in.q = in.like(c.Hq, c.Sq, c.D, c.dtype);
  in.k = in.like(c.Hkv, c.Sk, c.D, c.dtype);
  in.v = in.like(c.Hkv, c.Sk, c.Dv, c.dtype);
  in.dout = in.like(c.Hq, c.Sq, c.Dv, c.dout);
  fill(in.q);
  fill(in.k);
  fill(in.v);
  fill(in.dout);
  in.p.causal = c.causal;
  in.p.align = c.align;
  in.p.window_left = c.wl;
  in.p.window_right = c.wr;
  in.p.softcap = c.softcap;
  if (c.scale != 0.0) in.p.scale = c.scale;
  if (c.mask == 1) {
    in.mask = Tensor(DType::b8, {c.B, 1, c.Sq, c.Sk});
    for (std::int64_t i = 0; i < in.mask.numel(); ++i) static_cast<std::uint8_t*>(in.mask.data())[i] = u(rng) < 0.8;
    in.p.mask = in.mask.view();
  } else if (c.mask == 2) {
    in.mask = Tensor(DType::f32, {c.Sq, c.Sk});
    for (std::int64_t i = 0; i < in.mask.numel(); ++i)
      static_cast<float*>(in.mask.data())[i] =
          u(rng) < 0.15 ? -std::numeric_limits<float>::infinity() : static_cast<float>(nd(rng));
    in.p.mask = in.mask.view();
  }
  if (c.kv_lens) {
    in.lens = Tensor(DType::i64, {c.B});
    for (std::int64_t b = 0; b < c.B; ++b)
      static_cast<std::int64_t*>(in.lens.data())[b] = static_cast<std::int64_t>(u(rng) * (c.Sk + 1)) % (c.Sk + 1);
    in.p.kv_lens = in.lens.view();
  }
  if (c.sinks) {
    in.sinks = Tensor(DType::f32, {c.Hq});
    for (std::int64_t h = 0; h < c.Hq; ++h) static_cast<float*>(in.sinks.data())[h] = static_cast<float>(2.0 * nd(rng));
    in.p.sinks = in.sinks.view();
  }
  if (c.alibi) {
    in.slopes = c.alibi == 1 ? Tensor(DType::f32, {c.Hq}) : Tensor(DType::f32, {c.B, c.Hq});
    for (std::int64_t x = 0; x < in.slopes.numel(); ++x) static_cast<float*>(in.slopes.data())[x] = static_cast<float>(0.5 * u(rng));
    in.p.alibi_slopes = in.slopes.view();
  }
  in.p.window_keep_first = c.keep_first;
  // NaN in every K/V row no query row of its batch may attend (causal, window, key lengths, and
  // the mask: a key it excludes for every row).
  const detail::Problem pr = detail::lower_attention(in.view(in.q), in.view(in.k), in.view(in.v),
                                                     in.view(in.like(c.Hq, c.Sq, c.Dv, DType::f32)), in.p,
                                                     std::nullopt, std::nullopt);
  const TensorView kv = in.view(in.k), vv = in.view(in.v);
  for (std::int64_t b = 0; b < c.B; ++b) {
    std::vector<bool> read(c.Sk, false);
    for (std::int64_t i = 0; i < c.Sq; ++i) {
      std::int64_t lo, hi, first_hi;
      pr.key_ranges(b, i, lo, hi, first_hi);
      for (std::int64_t j = 0; j < hi; ++j) {
        if (j < lo && j >= first_hi) continue;
        if (c.mask == 1) read[j] = read[j] || static_cast<const std::uint8_t*>(in.mask.data())[(b * c.Sq + i) * c.Sk + j] != 0;
        else if (c.mask == 2) read[j] = read[j] || static_cast<const float*>(in.mask.data())[i * c.Sk + j] != -std::numeric_limits<float>::infinity();
        else read[j] = true;
      }
    }
    for (std::int64_t h = 0; h < c.Hkv; ++h)
      for (std::int64_t j = 0; j < c.Sk; ++j)
        if (!read[j]) {
          for (std::int64_t x = 0; x < c.D; ++x) put(kv, off4(kv, b, h, j, x), std::numeric_limits<float>::quiet_NaN());
          for (std::int64_t x = 0; x < c.Dv; ++x) put(vv, off4(vv, b, h, j, x), std::numeric_limits<float>::quiet_NaN());
        }
  }
  in.out = in.like(c.Hq, c.Sq, c.Dv, c.dout);
  in.lse = Tensor(c.lse, {c.B, c.Hq, c.Sq});
  attention(in.view(in.q), in.view(in.k), in.view(in.v), in.view(in.out), in.p, in.lse.view());
  return in;
}

struct BwGrads {
  Tensor dq, dk, dv;
};

inline BwGrads run_backward(const BwInputs& in, DType gdt, KernelKind kind, int threads, Tensor* dz = nullptr) {
  const BwConfig& c = in.c;
  BwGrads g{in.like(c.Hq, c.Sq, c.D, gdt), in.like(c.Hkv, c.Sk, c.D, gdt), in.like(c.Hkv, c.Sk, c.Dv, gdt)};
  AttentionParams p = in.p;
  p.kernel = kind;
  p.num_threads = threads;
  if (dz)
    attention_backward(in.view(in.q), in.view(in.k), in.view(in.v), in.view(in.out), in.lse.view(), in.view(in.dout),
                       in.view(g.dq), in.view(g.dk), in.view(g.dv), dz->view(), p);
  else
    attention_backward(in.view(in.q), in.view(in.k), in.view(in.v), in.view(in.out), in.lse.view(), in.view(in.dout),
                       in.view(g.dq), in.view(g.dk), in.view(g.dv), p);
  return g;
}

/// Naive fp32 backward: per row, fp32 scores, P materialised (from_lse: exp(s - lse) with the
/// forward's softmax_lse, as an implementation that saved lse computes it; otherwise a softmax
/// with its own max and sum), D = dO.O in fp32 from the forward's O (what any backward is given),
/// then dV, dP, dS, dQ, dK accumulated in fp32 in key order. Gradients as float64 arrays in BHSD
/// order.
/// Sums of absolute terms of each gradient element (|dS K|, |dS^T Q|, |P^T dO|, dS with its
/// scale), for the floor of the bf16 dot-product path: rounding P and dS to bf16 moves each
/// term by at most 2^-9 of itself.
struct BwAbsTerms {
  std::vector<double> dq, dk, dv;
};

inline void naive_backward_fp32(const BwInputs& in, bool from_lse, std::vector<double>& dq, std::vector<double>& dk,
                                std::vector<double>& dv, BwAbsTerms* terms = nullptr, std::vector<double>* dz = nullptr) {
  const BwConfig& c = in.c;
  const detail::Problem pr = detail::lower_attention(in.view(in.q), in.view(in.k), in.view(in.v), in.view(in.out),
                                                     in.p, std::nullopt, std::nullopt);
  const TensorView q = in.view(in.q), k = in.view(in.k), v = in.view(in.v), dout = in.view(in.dout);
  std::vector<float> dqf(c.B * c.Hq * c.Sq * c.D, 0.0f), dkf(c.B * c.Hkv * c.Sk * c.D, 0.0f),
      dvf(c.B * c.Hkv * c.Sk * c.Dv, 0.0f);
  std::vector<float> s(c.Sk), pj(c.Sk), th(c.Sk);
  std::vector<bool> adm(c.Sk);
  if (terms) {
    terms->dq.assign(dqf.size(), 0.0);
    terms->dk.assign(dkf.size(), 0.0);
    terms->dv.assign(dvf.size(), 0.0);
  }
  const float scale = static_cast<float>(pr.scale), cap = static_cast<float>(pr.softcap);
  for (std::int64_t b = 0; b < c.B; ++b)
    for (std::int64_t h = 0; h < c.Hq; ++h) {
      const std::int64_t hk = pr.kv_head(h);
      for (std::int64_t i = 0; i < c.Sq; ++i) {
        std::int64_t lo, hi, first_hi;
        pr.key_ranges(b, i, lo, hi, first_hi);
        float mx = -std::numeric_limits<float>::infinity();
        for (std::int64_t j = 0; j < c.Sk; ++j) {
          adm[j] = j < hi && (j >= lo || j < first_hi);
          // ALiBi's bias, after softcap: - slope |diag - j|.
          const float bias = pr.alibi.empty() ? 0.0f : static_cast<float>(-pr.slope(b, h) * std::abs(double(pr.diag(b, i) - j)));
          float add = 0.0f;
          if (adm[j] && pr.mask.data) {
            const std::int64_t mo = b * pr.mask.sb + h * pr.mask.sh + i * pr.mask.sq + j * pr.mask.sk;
            if (pr.mask.dtype == DType::b8) adm[j] = static_cast<const std::uint8_t*>(pr.mask.data)[mo] != 0;
            else {
              add = static_cast<const float*>(pr.mask.data)[mo];
              adm[j] = add != -std::numeric_limits<float>::infinity();
            }
          }
          if (!adm[j]) continue;
          float dot = 0.0f;
          for (std::int64_t x = 0; x < c.D; ++x)
            dot += static_cast<float>(get(q, off4(q, b, h, i, x))) * static_cast<float>(get(k, off4(k, b, hk, j, x)));
          float y = scale * dot;
          if (cap > 0) {
            th[j] = std::tanh(y / cap);
            y = cap * th[j];
          }
          s[j] = y + bias + add;
          mx = std::max(mx, s[j]);
        }
        if (mx == -std::numeric_limits<float>::infinity()) continue;  // empty row: nothing flows
        const float z = pr.sinks.empty() ? -std::numeric_limits<float>::infinity() : static_cast<float>(pr.sinks[h]);
        float psink = 0.0f;  // the sink's weight
        if (from_lse) {  // P = exp(s - lse) with the forward's softmax_lse
          const float l = static_cast<float>(load_as_double(in.lse.data(), in.lse.dtype(), (b * c.Hq + h) * c.Sq + i));
          for (std::int64_t j = 0; j < c.Sk; ++j) pj[j] = adm[j] ? std::exp(s[j] - l) : 0.0f;
          psink = std::exp(z - l);
        } else {  // P = softmax(s) with its own max and sum (the sink in the sum)
          mx = std::max(mx, z);
          float sum = std::exp(z - mx);
          psink = sum;
          for (std::int64_t j = 0; j < c.Sk; ++j) {
            pj[j] = adm[j] ? std::exp(s[j] - mx) : 0.0f;
            sum += pj[j];
          }
          for (std::int64_t j = 0; j < c.Sk; ++j) pj[j] /= sum;
          psink /= sum;
        }
        // D from the forward's O, as a backward pass gets it.
        const TensorView fo = in.view(in.out);
        float Di = 0.0f;
        for (std::int64_t x = 0; x < c.Dv; ++x)
          Di += static_cast<float>(get(dout, off4(dout, b, h, i, x))) * static_cast<float>(get(fo, off4(fo, b, h, i, x)));
        if (dz) (*dz)[static_cast<std::size_t>(h)] -= static_cast<float>(psink * Di);
        for (std::int64_t j = 0; j < c.Sk; ++j) {
          if (!adm[j]) continue;
          float dp = 0.0f;
          for (std::int64_t x = 0; x < c.Dv; ++x) {
            const float g = static_cast<float>(get(dout, off4(dout, b, h, i, x)));
            dvf[((b * c.Hkv + hk) * c.Sk + j) * c.Dv + x] += pj[j] * g;
            if (terms) terms->dv[((b * c.Hkv + hk) * c.Sk + j) * c.Dv + x] += std::abs(double(pj[j]) * g);
            dp += g * static_cast<float>(get(v, off4(v, b, hk, j, x)));
          }
          float ds = pj[j] * (dp - Di);
          if (cap > 0) ds *= 1.0f - th[j] * th[j];
          for (std::int64_t x = 0; x < c.D; ++x) {
            dqf[((b * c.Hq + h) * c.Sq + i) * c.D + x] += scale * ds * static_cast<float>(get(k, off4(k, b, hk, j, x)));
            dkf[((b * c.Hkv + hk) * c.Sk + j) * c.D + x] += scale * ds * static_cast<float>(get(q, off4(q, b, h, i, x)));
            if (terms) {
              const double a = std::abs(double(scale) * ds);
              terms->dq[((b * c.Hq + h) * c.Sq + i) * c.D + x] += a * std::abs(get(k, off4(k, b, hk, j, x)));
              terms->dk[((b * c.Hkv + hk) * c.Sk + j) * c.D + x] += a * std::abs(get(q, off4(q, b, h, i, x)));
            }
          }
        }
      }
    }
  dq.assign(dqf.begin(), dqf.end());
  dk.assign(dkf.begin(), dkf.end());
  dv.assign(dvf.begin(), dvf.end());
}

/// A gradient view as float64 in BHSD order.
inline std::vector<double> bhsd(const TensorView& t) {
  std::vector<double> out;
  out.reserve(t.numel());
  for (std::int64_t a = 0; a < t.size(0); ++a)
    for (std::int64_t b = 0; b < t.size(1); ++b)
      for (std::int64_t c = 0; c < t.size(2); ++c)
        for (std::int64_t d = 0; d < t.size(3); ++d) out.push_back(get(t, off4(t, a, b, c, d)));
  return out;
}

inline double max_abs_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double m = 0.0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

inline double max_abs(const std::vector<double>& a) {
  double m = 0.0;
  for (double x : a) m = std::max(m, std::abs(x));
  return m;
}

/// Worst ratio err / (2 naive + floor) over the three gradients, for reports; the check itself is
/// err <= factor naive + floor (factor 2 in CI; the soak bounds at 4 and counts ratios above 1).
inline double run_backward_case(const BwConfig& c, double factor = 2.0) {
  SCOPED_TRACE(c.str());
  const BwInputs in = make_inputs(c);
  const BwGrads ref = run_backward(in, DType::f64, KernelKind::reference, 1);
  // The yardstick: the worse of the two naive variants, gradient by gradient.
  std::vector<double> nq, nk, nv, lq, lk, lv, nz(c.Hq, 0.0), lz(c.Hq, 0.0);
  BwAbsTerms terms;
  naive_backward_fp32(in, false, nq, nk, nv, nullptr, &nz);
  naive_backward_fp32(in, true, lq, lk, lv, &terms, &lz);
  // dL/dz: the float64 reference's against the fast backward's (f32), 2 x the naive's error.
  std::vector<double> rz;
  if (c.sinks) {
    Tensor z(DType::f32, {c.Hq});
    run_backward(in, DType::f64, KernelKind::reference, 1, &z);
    rz.assign(static_cast<const float*>(z.data()), static_cast<const float*>(z.data()) + c.Hq);
  }
  const std::vector<double>* abs_terms[3] = {&terms.dq, &terms.dk, &terms.dv};
  // The bf16 dot-product path (bf16 q, k, v, dO and O on AVX512_BF16) rounds P and dS to bf16.
  const bool dot_path = c.dtype == DType::bf16 && c.dout == DType::bf16;
  const std::vector<double> rq = bhsd(in.view(ref.dq)), rk = bhsd(in.view(ref.dk)), rv = bhsd(in.view(ref.dv));
  const std::vector<double>* refs[3] = {&rq, &rk, &rv};
  const std::vector<double>* naive[3] = {&nq, &nk, &nv};
  const std::vector<double>* naive_lse[3] = {&lq, &lk, &lv};
  const char* names[3] = {"dq", "dk", "dv"};
  double worst = 0.0;
  for (detail::Isa isa : test_isas(c.dtype)) {
    IsaCap cap(isa);
    SCOPED_TRACE(detail::isa_name(isa));
    Tensor z1(DType::f32, {c.Hq}), z2(DType::f32, {c.Hq});
    const BwGrads g1 = run_backward(in, c.grad, KernelKind::flash, 1, c.sinks ? &z1 : nullptr);
    const BwGrads g2 = run_backward(in, c.grad, KernelKind::flash, 2, c.sinks ? &z2 : nullptr);
    if (c.sinks) {
      EXPECT_EQ(std::memcmp(z1.data(), z2.data(), z1.nbytes()), 0) << "dz: 1 and 2 threads differ";
      std::vector<double> got(static_cast<const float*>(z1.data()), static_cast<const float*>(z1.data()) + c.Hq);
      const double floor = 1e-6 * std::max(1.0, max_abs(rz)) + std::ldexp(max_abs(rz), -23);
      const double nerr = std::max(max_abs_diff(nz, rz), max_abs_diff(lz, rz));
      EXPECT_LE(max_abs_diff(got, rz), factor * nerr + floor) << "dz: naive fp32 error " << nerr;
    }
    const Tensor* t1[3] = {&g1.dq, &g1.dk, &g1.dv};
    const Tensor* t2[3] = {&g2.dq, &g2.dk, &g2.dv};
    for (int x = 0; x < 3; ++x) {
      EXPECT_EQ(std::memcmp(t1[x]->data(), t2[x]->data(), t1[x]->nbytes()), 0) << names[x] << ": 1 and 2 threads differ";
      const std::vector<double> got = bhsd(in.view(*t1[x]));
      bool nan = false;
      for (double e : got) nan = nan || std::isnan(e);
      EXPECT_FALSE(nan) << names[x] << " has NaN (an excluded key was read)";
      const double gmax = max_abs(*refs[x]);
      double floor = 1e-6 * std::max(1.0, gmax);
      if (c.grad == DType::bf16) floor += gmax * std::ldexp(1.0, -8);
      if (c.grad == DType::f16) floor += gmax * std::ldexp(1.0, -11);
      if (dot_path && isa >= detail::Isa::avx512bf16) floor += std::ldexp(max_abs(*abs_terms[x]), -8);
      const double err = max_abs_diff(got, *refs[x]);
      const double nerr = std::max(max_abs_diff(*naive[x], *refs[x]), max_abs_diff(*naive_lse[x], *refs[x]));
      EXPECT_LE(err, factor * nerr + floor) << names[x] << ": naive fp32 error " << nerr << ", max |ref| " << gmax;
      worst = std::max(worst, err / (2 * nerr + floor));
    }
  }
  return worst;
}

}  // namespace qkv::test
