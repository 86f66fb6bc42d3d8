// The gradient of the attention sinks' logits, for every fast backward (kernels.hpp).
//
// A sink z_h is a logit in the softmax's denominator with no value (gpt-oss; Xiao et al. 2023):
// its weight in row i is P_i,sink = e^{z_h - lse_i}, lse_i the forward's softmax_lse (which
// includes the sink), and since its value is 0 its dP is 0, so dS_i,sink = P_i,sink (0 - D_i)
// with D_i = rowsum(dO_i * O_i), the same D as the tiles' (FlashAttention-2, Algorithm 2):
//   dz_h = - sum_{b, i} e^{z_h - lse_i} D_i.
// dQ, dK and dV need nothing more: their P comes from lse, which already holds the sink's term.
// From O, dO and lse alone, in float64 in the fixed order h, b, i (one rounding at the end), so
// dz never depends on threads, tiles or splits.
#include <cmath>
#include <cstdint>

#include "kernels/kernels.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail {

void sink_gradient(const BackwardProblem& bp) {
  const Problem& p = bp.fwd;
  if (!bp.dsinks.data || p.sinks.empty()) return;
  for (std::int64_t h = 0; h < p.Hq; ++h) {
    const double z = p.sinks[static_cast<std::size_t>(h)];
    double dz = 0.0;
    for (std::int64_t b = 0; b < p.B; ++b)
      for (std::int64_t i = 0; i < p.Sq; ++i) {
        const double lse = load_as_double(p.lse.data, p.lse.dtype, b * p.lse.sb + h * p.lse.sh + i * p.lse.ss);
        double d = 0.0;
        const std::int64_t oo = b * p.out.sb + h * p.out.sh + i * p.out.ss;
        const std::int64_t go = b * bp.dout.sb + h * bp.dout.sh + i * bp.dout.ss;
        for (std::int64_t x = 0; x < p.Dv; ++x)
          d += load_as_double(bp.dout.data, bp.dout.dtype, go + x) * load_as_double(p.out.data, p.out.dtype, oo + x * p.out.sx);
        if (d != 0.0) dz -= std::exp(z - lse) * d;  // an empty row (O = 0) adds nothing, whatever its lse
      }
    store_from_double(bp.dsinks.data, bp.dsinks.dtype, h * bp.dsinks.sx, dz);
  }
}

}  // namespace qkv::detail
