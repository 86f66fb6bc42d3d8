#pragma once
// Where the commands look for the bundled stories260K model when no path is given:
// $QKV_MODELS_DIR/stories260K if that variable is set, else <source>/../shared/models/stories260K
// (QKV_SHARED_DIR is a compile definition of the qkv target in CMakeLists.txt).
#include <cstdlib>
#include <filesystem>

namespace qkv::cli {

inline std::filesystem::path default_model_dir() {
  if (const char* env = std::getenv("QKV_MODELS_DIR"); env && *env)
    return std::filesystem::path(env) / "stories260K";
#ifdef QKV_SHARED_DIR
  return std::filesystem::path(QKV_SHARED_DIR) / "models" / "stories260K";
#else
  return std::filesystem::path("models") / "stories260K";
#endif
}
inline std::filesystem::path default_model_path() { return default_model_dir() / "stories260K.bin"; }
inline std::filesystem::path default_tokenizer_path() { return default_model_dir() / "tok512.bin"; }

}  // namespace qkv::cli
