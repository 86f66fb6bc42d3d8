// Rotary position embedding (Su et al. 2021, RoFormer sec. 3.4), in place on [B,H,S,D] views.
// Per token, the R/2 angles are computed once and reused by every head. The inverse uses the
// same cos and sin values with the sine negated: the transpose of the forward's rotation.
#include "qkv/rope.hpp"

#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "qkv/error.hpp"

namespace qkv {
namespace {


template <class T, class A>
void rotate_row(T* x, const A* c, const A* sn, std::int64_t half, RopeStyle style) {
  for (std::int64_t j = 0; j < half; ++j) {
    const std::int64_t a = style == RopeStyle::interleaved ? 2 * j : j;
    const std::int64_t b = style == RopeStyle::interleaved ? 2 * j + 1 : j + half;
    const A xa = static_cast<A>(x[a]), xb = static_cast<A>(x[b]);
    x[a] = static_cast<T>(xa * c[j] - xb * sn[j]);
    x[b] = static_cast<T>(xa * sn[j] + xb * c[j]);
  }
}

template <class T, class A>
void rope_impl(const TensorView& x, std::span<const std::int64_t> positions, const RopeConfig& cfg,
               std::int64_t R, bool inverse) {
  const std::int64_t B = x.size(0), H = x.size(1), S = x.size(2), half = R / 2;
  const std::int64_t sb = x.stride(0), sh = x.stride(1), ss = x.stride(2);
  const bool per_batch = static_cast<std::int64_t>(positions.size()) == B * S && S > 0 && B > 1;
  // Inverse frequencies w_j, computed the way the chosen convention does.
  std::vector<A> inv_freq(static_cast<std::size_t>(half));
  for (std::int64_t j = 0; j < half; ++j) {
    if constexpr (std::is_same_v<A, float>)
      inv_freq[j] =
          1.0f / std::pow(static_cast<float>(cfg.theta), static_cast<float>(2 * j) / static_cast<float>(R));
    else
      inv_freq[j] = std::pow(cfg.theta, -static_cast<double>(2 * j) / static_cast<double>(R));
  }
  T* base = x.data_as<T>();
  const std::int64_t rows = B * S;
#pragma omp parallel for schedule(static) if (rows * H * R > (1 << 15))
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t b = r / S, t = r % S;
    const std::int64_t pos = positions[static_cast<std::size_t>(per_batch ? r : t)];
    std::vector<A> c(static_cast<std::size_t>(half)), sn(static_cast<std::size_t>(half));
    for (std::int64_t j = 0; j < half; ++j) {
      const A val = static_cast<A>(pos) * inv_freq[j];
      c[j] = std::cos(val);
      sn[j] = inverse ? -std::sin(val) : std::sin(val);
    }
    for (std::int64_t h = 0; h < H; ++h)
      rotate_row(base + b * sb + h * sh + t * ss, c.data(), sn.data(), half, cfg.style);
  }
}

void rope(const TensorView& x, std::span<const std::int64_t> positions, const RopeConfig& config,
          bool inverse) {
  if (x.rank() != 4)
    throw Error("rope: x: expected a 4-D tensor [B,H,S,D], got shape " + shape_str(x.shape()));
  if (x.size(3) > 1 && x.stride(3) != 1)
    throw Error("rope: x: expected a contiguous last dimension (stride 1), got stride " + std::to_string(x.stride(3)));
  if (x.dtype() != DType::f32 && x.dtype() != DType::f64)
    throw Error("rope: x: expected dtype float32 or float64, got " + std::string(dtype_name(x.dtype())));
  const std::int64_t B = x.size(0), S = x.size(2), D = x.size(3);
  const std::int64_t R = config.rotary_dim == 0 ? D : config.rotary_dim;
  if (R < 0 || R % 2 != 0 || R > D)
    throw Error("rope: rotary_dim: expected an even number in [0, D] = [0, " + std::to_string(D) + "] (0 = D), got " +
                std::to_string(config.rotary_dim) + (config.rotary_dim == 0 ? " (D is odd)" : ""));
  if (!std::isfinite(config.theta) || config.theta <= 0.0)
    throw Error("rope: theta: expected a finite number > 0, got " + std::to_string(config.theta));
  const auto n = static_cast<std::int64_t>(positions.size());
  if (n != S && n != B * S)
    throw Error("rope: positions: expected S = " + std::to_string(S) + " or B*S = " + std::to_string(B * S) + " entries, got " + std::to_string(n));
  for (std::int64_t i = 0; i < n; ++i)
    if (positions[static_cast<std::size_t>(i)] < 0)
      throw Error("rope: positions: expected every position >= 0, got " +
                  std::to_string(positions[static_cast<std::size_t>(i)]) + " at index " + std::to_string(i));
  if (x.numel() == 0 || R == 0) return;
  if (!x.data()) throw Error("rope: x: data pointer is null");
  const bool f32_angles = config.angles == RopeAngles::llama2c_f32;
  if (x.dtype() == DType::f32) {
    if (f32_angles)
      rope_impl<float, float>(x, positions, config, R, inverse);
    else
      rope_impl<float, double>(x, positions, config, R, inverse);
  } else {
    if (f32_angles)
      rope_impl<double, float>(x, positions, config, R, inverse);
    else
      rope_impl<double, double>(x, positions, config, R, inverse);
  }
}

std::vector<std::int64_t> positions_from(const TensorView& x, std::int64_t start) {
  if (x.rank() != 4)
    throw Error("rope: x: expected a 4-D tensor [B,H,S,D], got shape " + shape_str(x.shape()));
  if (start < 0) throw Error("rope: start: expected a position >= 0, got " + std::to_string(start));
  std::vector<std::int64_t> pos(static_cast<std::size_t>(x.size(2)));
  for (std::size_t i = 0; i < pos.size(); ++i) pos[i] = start + static_cast<std::int64_t>(i);
  return pos;
}

}  // namespace

void apply_rope(const TensorView& x, std::span<const std::int64_t> positions, const RopeConfig& config) {
  rope(x, positions, config, false);
}

void apply_rope(const TensorView& x, std::int64_t start, const RopeConfig& config) {
  rope(x, positions_from(x, start), config, false);
}

void apply_rope_inverse(const TensorView& x, std::span<const std::int64_t> positions,
                        const RopeConfig& config) {
  rope(x, positions, config, true);
}

void apply_rope_inverse(const TensorView& x, std::int64_t start, const RopeConfig& config) {
  rope(x, positions_from(x, start), config, true);
}

}  // namespace qkv
