// The serving kernel's item body (kernels/serving_item.hpp) compiled for scalar: the same bits as every
// other level, vectorized by the compiler with this level's instructions.
#define QKV_SERVING_NS serving_scalar
#include "kernels/serving_item.hpp"

namespace qkv::detail {

void serving_item_scalar(const VarlenProblem& vp, const ServingItem& it, const ServingLayout& L, char* ws) {
  serving_scalar::run_item(vp, it, L, ws);
}

}  // namespace qkv::detail
