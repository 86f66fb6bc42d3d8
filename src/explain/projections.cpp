// Q = X W^Q, K = X W^K, V = X W^V (Vaswani et al. 2017, sec. 3.2.2, row-vector convention), in
// float64 with BLAS dgemm, split into heads by column blocks and laid out BHSD.
#include <cblas.h>

#include <string>

#include "qkv/error.hpp"
#include "qkv/explain.hpp"
#include "qkv/npy.hpp"

namespace qkv::explain {
namespace {


void need_float(const TensorView& t, const char* name) {
  const DType d = t.dtype();
  if (d != DType::f32 && d != DType::f64 && d != DType::f16 && d != DType::bf16)
    throw Error(std::string(name) + ": expected dtype float32, float64, float16 or bfloat16, got " +
                std::string(dtype_name(d)));
}

// [B*S, d_model] x [d_model, H*dh] -> [B, H, S, dh], float64.
Tensor project(const Tensor& x, std::int64_t B, std::int64_t S, const TensorView& w, std::int64_t H) {
  const std::int64_t dm = w.size(0), cols = w.size(1), dh = cols / H;
  const Tensor wd = to_contiguous(w, DType::f64);
  Tensor flat(DType::f64, {B * S, cols});
  if (B * S > 0 && cols > 0 && dm > 0)
    cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(B * S), static_cast<int>(cols),
                static_cast<int>(dm), 1.0, x.data_as<const double>(), static_cast<int>(dm),
                wd.data_as<const double>(), static_cast<int>(cols), 0.0, flat.data_as<double>(),
                static_cast<int>(cols));
  Tensor out(DType::f64, {B, H, S, dh});
  const double* f = flat.data_as<const double>();
  double* o = out.data_as<double>();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < S; ++t)
        for (std::int64_t c = 0; c < dh; ++c)
          o[((b * H + h) * S + t) * dh + c] = f[(b * S + t) * cols + h * dh + c];
  return out;
}

}  // namespace

Projected project_qkv(const TensorView& x, const TensorView& wq, const TensorView& wk, const TensorView& wv,
                      std::int64_t num_heads) {
  if (x.rank() != 2 && x.rank() != 3)
    throw Error("x: expected [S,d_model] or [B,S,d_model], got shape " + shape_str(x.shape()));
  need_float(x, "x");
  const std::int64_t B = x.rank() == 3 ? x.size(0) : 1, S = x.size(x.rank() - 2), dm = x.size(x.rank() - 1);
  if (num_heads < 1) throw Error("num_heads: expected >= 1, got " + std::to_string(num_heads));
  for (auto [w, name] : {std::pair{&wq, "wq"}, std::pair{&wk, "wk"}, std::pair{&wv, "wv"}}) {
    need_float(*w, name);
    if (w->rank() != 2 || w->size(0) != dm)
      throw Error(std::string(name) + ": expected [d_model, H*d] with d_model == x.d_model (" + std::to_string(dm) +
                  "), got shape " + shape_str(w->shape()));
    if (w->size(1) % num_heads != 0 || w->size(1) == 0)
      throw Error(std::string(name) + ": expected a column count divisible by the number of heads (" +
                  std::to_string(num_heads) + ") and > 0, got " + std::to_string(w->size(1)));
  }
  if (wq.size(1) != wk.size(1))
    throw Error("wk: expected as many columns as wq (" + std::to_string(wq.size(1)) + ": q.k needs equal d_k), got " +
                std::to_string(wk.size(1)));
  checked_numel({B * S, dm}, 8, "x");
  // BLAS takes int dimensions.
  constexpr std::int64_t kIntMax = 2147483647;
  if (B * S > kIntMax || dm > kIntMax || wq.size(1) > kIntMax || wv.size(1) > kIntMax)
    throw Error("x: dimensions beyond 2^31 - 1 are not supported, got shape " + shape_str(x.shape()));
  const Tensor xd = to_contiguous(x, DType::f64);
  Projected p;
  p.q = project(xd, B, S, wq, num_heads);
  p.k = project(xd, B, S, wk, num_heads);
  p.v = project(xd, B, S, wv, num_heads);
  return p;
}

}  // namespace qkv::explain
