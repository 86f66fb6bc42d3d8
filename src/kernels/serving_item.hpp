#pragma once
// The body of the serving kernel (serving.cpp): one work item, compiled once per ISA level
// (src/kernels/simd/<isa>/serving_<isa>.cpp defines QKV_SERVING_NS first). Plain C++ whose every
// operation is an IEEE operation written out (-ffp-contract=off, no reassociation): the
// compiler vectorizes the loops over D and over the 16 partial sums, which changes no bit, so
// every ISA level computes the same bits, only faster.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "kernels/serving.hpp"
#include "tensor/kv_codec.hpp"

namespace qkv::detail::QKV_SERVING_NS {

using i64 = std::int64_t;
constexpr i64 P = kServingSplit;
// Pitch of a row's scores: off a multiple of 4 KiB, so the rows do not share L1 sets.
constexpr i64 SP = kServingSplit + 16;

// float16 bits to float, exactly (subnormals, inf, NaN).
inline float half_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t{h & 0x8000u} << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  std::uint32_t bits;
  if (e == 0) {
    const float f = static_cast<float>(m) * 0x1p-24f;  // exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  } else if (e == 31) {
    bits = sign | 0x7f800000u | (m << 13);
  } else {
    bits = sign | ((e + 112) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}



inline void to_f32(const void* data, DType dt, i64 off, float* dst, i64 n) {
  switch (dt) {
    case DType::f32: std::memcpy(dst, static_cast<const float*>(data) + off, static_cast<std::size_t>(n) * 4); break;
    case DType::bf16: {
      const auto* s = static_cast<const std::uint16_t*>(data) + off;
      for (i64 i = 0; i < n; ++i) {
        const std::uint32_t bits = std::uint32_t{s[i]} << 16;
        std::memcpy(dst + i, &bits, 4);
      }
      break;
    }
    case DType::f16: {
      const auto* s = static_cast<const std::uint16_t*>(data) + off;
      for (i64 i = 0; i < n; ++i) dst[i] = half_bits_to_float(s[i]);
      break;
    }
    default: {
      const auto* s = static_cast<const double*>(data) + off;
      for (i64 i = 0; i < n; ++i) dst[i] = static_cast<float>(s[i]);
    }
  }
}

// q.k with 16 partial sums (lane l takes d = l mod 16) and one fixed reduction tree, halving.
inline float dot(const float* a, const float* b, i64 n) {
  float acc[16] = {};
  i64 d = 0;
  for (; d + 16 <= n; d += 16)
    for (int l = 0; l < 16; ++l) acc[l] += a[d + l] * b[d + l];
  for (int l = 0; d + l < n; ++l) acc[l] += a[d + l] * b[d + l];
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// exp(x) for x <= 0 (or NaN) on an array, y = exp(x - shift), written so that the loop
// vectorizes: Cephes' expf (range reduction by ln 2 in two parts, a degree-6 polynomial, 2^n by
// the exponent bits), about 1 ulp; x - shift < -87.3 gives 0 (also -inf); NaN stays NaN.
inline void exp_shifted(float* x, i64 n, float shift) {
  for (i64 i = 0; i < n; ++i) {
    const float t = x[i] - shift;
    const float tc = t < -87.0f ? -87.0f : t;  // NaN compares false: stays NaN
    const float fn = std::floor(tc * 1.44269504088896341f + 0.5f);
    const float r = (tc - fn * 0.693359375f) - fn * -2.12194440e-4f;
    const float z = r * r;
    float y = 1.9875691500e-4f;
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = (y * z + r) + 1.0f;
    const std::int32_t ni = static_cast<std::int32_t>(tc == tc ? fn : 0.0f);
    const std::uint32_t bits = static_cast<std::uint32_t>(ni + 127) << 23;
    float two_n;
    std::memcpy(&two_n, &bits, 4);
    const float out = y * two_n;
    x[i] = t < -87.0f ? 0.0f : out;
  }
}

// dot() of one query with four keys at once (each key's sums exactly as dot() forms them).
inline void dot4(const float* a, const float* const* b, i64 n, float* out) {
  float acc[4][16] = {};
  i64 d = 0;
  for (; d + 16 <= n; d += 16)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < 16; ++l) acc[k][l] += a[d + l] * b[k][d + l];
  for (int k = 0; k < 4; ++k)
    for (int l = 0; d + l < n; ++l) acc[k][l] += a[d + l] * b[k][d + l];
  for (int k = 0; k < 4; ++k) {
    for (int w = 8; w >= 1; w /= 2)
      for (int l = 0; l < w; ++l) acc[k][l] += acc[k][l + w];
    out[k] = acc[k][0];
  }
}

inline void store(void* data, DType dt, i64 off, float x) {
  switch (dt) {
    case DType::f32: static_cast<float*>(data)[off] = x; break;
    case DType::f64: static_cast<double*>(data)[off] = x; break;
    case DType::bf16: static_cast<std::uint16_t*>(data)[off] = float_to_bf16(x); break;
    case DType::f16: static_cast<std::uint16_t*>(data)[off] = float_to_half(x); break;
    default: break;
  }
}


// The rows (tokens t0 .. t0 + nt - 1 of sequence b, query heads of KV head hk) of one item.
inline void run_item(const VarlenProblem& vp, const ServingItem& it, const ServingLayout& L, char* ws) {
  const Problem& p = vp.p;
  const i64 G = p.group(), D = p.D, Dv = p.Dv, R = it.nt * G;
  const i64 b = it.b, hk = it.hk;
  auto carve = [&ws](i64 bytes) { char* r = ws; ws += (bytes + 63) / 64 * 64; return r; };
  ServingRow* rows = reinterpret_cast<ServingRow*>(carve(R * static_cast<i64>(sizeof(ServingRow))));
  float* qf = reinterpret_cast<float*>(carve(R * D * 4));
  float* s = reinterpret_cast<float*>(carve(R * SP * 4));
  float* parts = reinterpret_cast<float*>(carve(R * L.nsplit * (Dv + 2) * 4));
  float* kf = reinterpret_cast<float*>(carve(4 * D * 4));
  float* vf = reinterpret_cast<float*>(carve(4 * Dv * 4));
  double* accd = reinterpret_cast<double*>(carve((Dv + 2) * 8));
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float scale = static_cast<float>(p.scale), cap = static_cast<float>(p.softcap);

  i64 klo = std::numeric_limits<i64>::max(), khi = 0;
  for (i64 r = 0; r < R; ++r) {
    const i64 t = it.t0 + r / G, h = hk * G + r % G, tok = vp.cu_q[b] + t;
    ServingRow& ri = rows[r];
    ri.q_off = h * p.q.sh + tok * p.q.ss;
    ri.out_off = h * p.out.sh + tok * p.out.ss;
    ri.lse_off = h * p.lse.sh + tok * p.lse.ss;
    vp.key_range(b, t, ri.lo, ri.hi);
    if (ri.lo < ri.hi) { klo = std::min(klo, ri.lo); khi = std::max(khi, ri.hi); }
    to_f32(p.q.data, p.q.dtype, ri.q_off, qf + r * D, D);
  }
  const i64 c0 = klo < khi ? klo / P : 0, c1 = klo < khi ? (khi + P - 1) / P : 0, NS = c1 - c0;
  const i64 pf = Dv + 2;
  for (i64 x = 0; x < R * NS; ++x) { parts[x * pf + Dv] = neg_inf; parts[x * pf + Dv + 1] = 0.0f; }

  for (i64 c = c0; c < c1; ++c) {
    const i64 a = std::max(klo, c * P), e = std::min(khi, (c + 1) * P);
    // Scores: each key read once for all rows that admit it, four keys at a time.
    for (i64 j = a; j < e; j += 4) {
      const i64 nk = std::min<i64>(4, e - j);
      const float* kp[4];
      for (i64 x = 0; x < 4; ++x) {
        const i64 off = vp.key_off(p.k, b, hk, j + std::min(x, nk - 1));
        if (p.k.dtype == DType::f32) kp[x] = static_cast<const float*>(p.k.data) + off;
        else if (x < nk) {
          if (vp.kc.scales) decode_row(vp.kc, p.k.data, off, hk, kf + x * D);
          else to_f32(p.k.data, p.k.dtype, off, kf + x * D, D);
          kp[x] = kf + x * D;
        }
        else kp[x] = kp[nk - 1];
      }
      for (i64 r = 0; r < R; ++r) {
        const i64 ra = std::max(rows[r].lo, j), rb = std::min(rows[r].hi, j + nk);
        if (ra >= rb) continue;
        float* sr = s + r * SP + (j - c * P);
        if (ra == j && rb == j + 4) {
          dot4(qf + r * D, kp, D, sr);
        } else {
          for (i64 x = ra; x < rb; ++x) sr[x - j] = dot(qf + r * D, kp[x - j], D);
        }
      }
    }
    // Per row: scale, softcap, max, exp, sum.
    for (i64 r = 0; r < R; ++r) {
      const i64 ra = std::max(rows[r].lo, c * P), rb = std::min(rows[r].hi, (c + 1) * P);
      float* part = parts + (r * NS + (c - c0)) * pf;
      for (i64 d = 0; d < Dv; ++d) part[d] = 0.0f;
      if (ra >= rb) continue;
      float* sr = s + r * SP - c * P;
      float m = neg_inf;
      for (i64 j = ra; j < rb; ++j) {
        float x = sr[j] * scale;
        if (cap > 0.0f) x = cap * std::tanh(x / cap);
        sr[j] = x;
        if (x > m) m = x;
      }
      const float ms = m == neg_inf ? 0.0f : m;  // nothing but -inf: every weight 0, the split empty
      exp_shifted(sr + ra, rb - ra, ms);
      float l = 0.0f;
      for (i64 j = ra; j < rb; ++j) l += sr[j];
      part[Dv] = ms;
      part[Dv + 1] = l;
    }
    // O_c = sum_j p_j v_j, keys ascending, four keys per pass over a row's accumulator (the
    // same roundings in the same order as one key at a time).
    for (i64 j = a; j < e; j += 4) {
      const i64 nk = std::min<i64>(4, e - j);
      const float* vv[4];
      for (i64 x = 0; x < 4; ++x) {
        const i64 off = vp.key_off(p.v, b, hk, j + std::min(x, nk - 1));
        if (p.v.dtype == DType::f32) vv[x] = static_cast<const float*>(p.v.data) + off;
        else if (x < nk) {
          if (vp.vc.scales) decode_row(vp.vc, p.v.data, off, hk, vf + x * Dv);
          else to_f32(p.v.data, p.v.dtype, off, vf + x * Dv, Dv);
          vv[x] = vf + x * Dv;
        }
        else vv[x] = vv[nk - 1];
      }
      for (i64 r = 0; r < R; ++r) {
        const i64 ra = std::max(rows[r].lo, j), rb = std::min(rows[r].hi, j + nk);
        if (ra >= rb) continue;
        const float* w = s + r * SP + (j - c * P);
        float* acc = parts + (r * NS + (c - c0)) * pf;
        if (ra == j && rb == j + 4) {
          const float w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
          const float *v0 = vv[0], *v1 = vv[1], *v2 = vv[2], *v3 = vv[3];
          for (i64 d = 0; d < Dv; ++d) acc[d] = (((acc[d] + w0 * v0[d]) + w1 * v1[d]) + w2 * v2[d]) + w3 * v3[d];
        } else {
          for (i64 x = ra; x < rb; ++x) {
            const float wx = w[x - j];
            const float* v = vv[x - j];
            for (i64 d = 0; d < Dv; ++d) acc[d] += wx * v[d];
          }
        }
      }
    }
  }

  // Merge each row's split partials in split order.
  for (i64 r = 0; r < R; ++r) {
    double mx = -std::numeric_limits<double>::infinity();
    bool any = false, nan = false;
    for (i64 c = 0; c < NS; ++c) {
      const float* part = parts + (r * NS + c) * pf;
      if (part[Dv + 1] == 0.0f) continue;  // a split with no admissible key
      any = true;
      nan = nan || std::isnan(part[Dv + 1]);
      mx = std::max(mx, static_cast<double>(part[Dv]));
    }
    for (i64 d = 0; d < Dv; ++d) accd[d] = 0.0;
    double lsum = 0.0;
    if (any && !nan)
      for (i64 c = 0; c < NS; ++c) {
        const float* part = parts + (r * NS + c) * pf;
        if (part[Dv + 1] == 0.0f) continue;
        const double w = std::exp(static_cast<double>(part[Dv]) - mx);
        lsum += w * part[Dv + 1];
        for (i64 d = 0; d < Dv; ++d) accd[d] += w * part[d];
      }
    const float qnan = std::numeric_limits<float>::quiet_NaN();
    for (i64 d = 0; d < Dv; ++d)
      store(p.out.data, p.out.dtype, rows[r].out_off + d * p.out.sx,
            nan ? qnan : any ? static_cast<float>(accd[d] / lsum) : 0.0f);
    if (p.lse.data)
      store(p.lse.data, p.lse.dtype, rows[r].lse_off,
            !any ? neg_inf : nan ? qnan : static_cast<float>(mx + std::log(lsum)));
  }
}


}  // namespace qkv::detail::QKV_SERVING_NS
