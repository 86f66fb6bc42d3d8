#pragma once
// Packed batches of sequences for the tests of attention_varlen, attention_paged and
// PagedKVCache: random inputs, the float64 reference run sequence by sequence on B = 1 views, and
// comparisons.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "qkv/reference.hpp"
#include "qkv/tensor.hpp"
#include "qkv/varlen.hpp"

namespace qkv::test {

using i64 = std::int64_t;
using Seqs = std::vector<std::pair<i64, i64>>;  // (query tokens, keys) per sequence

/// Tokens [start, start + len) of a packed [T, H, X] tensor as a [1, H, len, X] view.
inline TensorView seq_view(const TensorView& t, i64 start, i64 len) {
  char* base = static_cast<char*>(t.data()) + start * t.stride(0) * static_cast<i64>(dtype_size(t.dtype()));
  return TensorView(base, t.dtype(), {1, t.size(1), len, t.size(2)}, {0, t.stride(1), t.stride(0), t.stride(2)});
}
/// Columns [start, start + len) of softmax_lse [H, T] as [1, H, len].
inline TensorView lse_view(const TensorView& t, i64 start, i64 len) {
  char* base = static_cast<char*>(t.data()) + start * t.stride(1) * static_cast<i64>(dtype_size(t.dtype()));
  return TensorView(base, t.dtype(), {1, t.size(0), len}, {0, t.stride(0), t.stride(1)});
}

inline void fill_normal(const Tensor& t, std::mt19937_64& rng, double sd = 1.0) {
  std::normal_distribution<double> n(0.0, sd);
  for (i64 i = 0; i < t.numel(); ++i) {
    const double x = n(rng);
    switch (t.dtype()) {
      case DType::f32: t.data_as<float>()[i] = static_cast<float>(x); break;
      case DType::f64: t.data_as<double>()[i] = x; break;
      case DType::bf16: t.data_as<std::uint16_t>()[i] = float_to_bf16(static_cast<float>(x)); break;
      case DType::f16: t.data_as<std::uint16_t>()[i] = float_to_half(static_cast<float>(x)); break;
      default: break;
    }
  }
}

inline Tensor cu_seqlens(const std::vector<i64>& lens) {
  Tensor t(DType::i32, {static_cast<i64>(lens.size()) + 1});
  t.data_as<std::int32_t>()[0] = 0;
  for (std::size_t b = 0; b < lens.size(); ++b)
    t.data_as<std::int32_t>()[b + 1] = t.data_as<std::int32_t>()[b] + static_cast<std::int32_t>(lens[b]);
  return t;
}

struct Packed {
  Seqs seqs;
  i64 Hq = 1, Hkv = 1, D = 8, Dv = 8, Tq = 0, Tk = 0;
  DType dtype = DType::f32;
  Tensor q, k, v, cu_q, cu_k;
  i64 q0(std::size_t b) const { return cu_q.data_as<std::int32_t>()[b]; }
  i64 k0(std::size_t b) const { return cu_k.data_as<std::int32_t>()[b]; }
};

inline Packed make_packed(const Seqs& seqs, i64 Hq, i64 Hkv, i64 D, i64 Dv, DType dt, std::uint64_t seed) {
  Packed p;
  p.seqs = seqs; p.Hq = Hq; p.Hkv = Hkv; p.D = D; p.Dv = Dv; p.dtype = dt;
  std::vector<i64> lq, lk;
  for (const auto& [sq, sk] : seqs) { lq.push_back(sq); lk.push_back(sk); p.Tq += sq; p.Tk += sk; }
  p.cu_q = cu_seqlens(lq);
  p.cu_k = cu_seqlens(lk);
  p.q = Tensor(dt, {p.Tq, Hq, D});
  p.k = Tensor(dt, {p.Tk, Hkv, D});
  p.v = Tensor(dt, {p.Tk, Hkv, Dv});
  std::mt19937_64 rng(seed);
  fill_normal(p.q, rng);
  fill_normal(p.k, rng);
  fill_normal(p.v, rng);
  return p;
}

/// The float64 reference, sequence by sequence: out [Tq, Hq, Dv] and lse [Hq, Tq] in float64.
inline void reference_packed(const Packed& p, const AttentionParams& params, Tensor& out, Tensor& lse) {
  out = Tensor(DType::f64, {p.Tq, p.Hq, p.Dv});
  lse = Tensor(DType::f64, {p.Hq, p.Tq});
  AttentionParams rp = params;
  rp.kernel = KernelKind::reference;
  for (std::size_t b = 0; b < p.seqs.size(); ++b) {
    const auto [sq, sk] = p.seqs[b];
    reference::attention(seq_view(p.q, p.q0(b), sq), seq_view(p.k, p.k0(b), sk), seq_view(p.v, p.k0(b), sk),
                         seq_view(out, p.q0(b), sq), rp, lse_view(lse, p.q0(b), sq));
  }
}

inline double get_d(const Tensor& t, i64 i) {
  switch (t.dtype()) {
    case DType::f32: return t.data_as<float>()[i];
    case DType::f64: return t.data_as<double>()[i];
    case DType::bf16: return bf16_to_float(t.data_as<std::uint16_t>()[i]);
    case DType::f16: return half_to_float(t.data_as<std::uint16_t>()[i]);
    default: return 0;
  }
}

/// max |got - ref| over elements, requiring the same non-finite values (an empty row's lse is
/// -inf in both, a NaN row NaN in both); `relative`: max |got - ref| / (1 + |ref|).
inline double max_err(const Tensor& got, const Tensor& ref, const std::string& what, bool relative = false) {
  double e = 0;
  for (i64 i = 0; i < ref.numel(); ++i) {
    const double g = get_d(got, i), r = get_d(ref, i);
    if (!std::isfinite(r) || !std::isfinite(g)) {
      EXPECT_TRUE((std::isnan(r) && std::isnan(g)) || g == r) << what << " element " << i << ": got " << g << ", want " << r;
      continue;
    }
    e = std::max(e, std::abs(g - r) / (relative ? 1.0 + std::abs(r) : 1.0));
  }
  return e;
}

inline bool same_bits(const TensorView& a, const TensorView& b) {
  const std::size_t n = static_cast<std::size_t>(a.numel()) * dtype_size(a.dtype());
  return a.numel() == b.numel() && std::memcmp(a.data(), b.data(), n) == 0;
}

}  // namespace qkv::test
