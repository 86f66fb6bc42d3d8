#pragma once
// Helpers of the MPI test programs: random tensors, bitwise and tolerance comparisons, and a
// failure count every rank contributes to.
#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>

#include "qkv/tensor.hpp"

namespace qkv::dist::test {

inline int g_failures = 0;
inline int g_checks = 0;

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

inline void check(bool ok, const std::string& what) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    std::fprintf(stderr, "rank %d: FAILED %s\n", world_rank(), what.c_str());
  }
}

inline Tensor random_tensor(DType dt, const Shape& shape, std::uint64_t seed, double scale = 1.0) {
  Tensor t(dt, shape);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-scale, scale);
  for (std::int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data(), dt, i, u(rng));
  return t;
}

/// Bitwise equality of two views of one shape and dtype (any strides).
inline bool same_bits(const TensorView& a, const TensorView& b) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype()) return false;
  const std::size_t es = dtype_size(a.dtype());
  const Shape& s = a.shape();
  std::vector<std::int64_t> idx(s.size(), 0);
  const std::int64_t n = a.numel();
  for (std::int64_t e = 0; e < n; ++e) {
    std::int64_t oa = 0, ob = 0, rem = e;
    for (int ax = static_cast<int>(s.size()) - 1; ax >= 0; --ax) {
      const std::int64_t i = rem % s[static_cast<std::size_t>(ax)];
      rem /= s[static_cast<std::size_t>(ax)];
      oa += i * a.stride(ax);
      ob += i * b.stride(ax);
    }
    if (std::memcmp(static_cast<const char*>(a.data()) + oa * static_cast<std::int64_t>(es),
                    static_cast<const char*>(b.data()) + ob * static_cast<std::int64_t>(es), es) != 0)
      return false;
  }
  return true;
}

/// max |a - b| over contiguous tensors of equal numel (as doubles); infinities must match
/// exactly (counted as 0 when equal, +inf when not).
inline double max_diff(const TensorView& a, const TensorView& b) {
  double m = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double x = load_as_double(a.data(), a.dtype(), i), y = load_as_double(b.data(), b.dtype(), i);
    if (std::isinf(x) || std::isinf(y)) {
      if (x != y) return INFINITY;
      continue;
    }
    m = std::max(m, std::abs(x - y));
  }
  return m;
}

inline double max_abs(const TensorView& a) {
  double m = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double x = load_as_double(a.data(), a.dtype(), i);
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  }
  return m;
}

}  // namespace qkv::dist::test
