// The serving kernel's item body (kernels/serving_item.hpp) compiled for avx512: the same bits as every
// other level, vectorized by the compiler with this level's instructions.
#define QKV_SERVING_NS serving_avx512
#include "kernels/serving_item.hpp"

namespace qkv::detail {

void serving_item_avx512(const VarlenProblem& vp, const ServingItem& it, const ServingLayout& L, char* ws) {
  serving_avx512::run_item(vp, it, L, ws);
}

}  // namespace qkv::detail
