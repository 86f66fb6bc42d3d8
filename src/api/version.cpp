#include "qkv/version.hpp"
namespace qkv {
const char* version() noexcept { return QKV_VERSION; }
}  // namespace qkv
