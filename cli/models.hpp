#pragma once
// Where the commands look for the bundled stories260K model when no path is given:
// $QKV_MODELS_DIR/stories260K if that variable is set, else <source>/../shared/models/stories260K
// (QKV_SHARED_DIR is a compile definition of the qkv target in CMakeLists.txt).
#include <cstdlib>
#include <filesystem>
#include <string>

#include "qkv/error.hpp"
#include "qkv/llama2c.hpp"
#include "qkv/tokenizer.hpp"

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

/// A llama2.c model and its tokenizer, read from the paths given to --model and --tokenizer;
/// a reader's error is rethrown with the option's name in front.
struct LoadedModel {
  Llama2cModel weights;
  Tokenizer tok;
};
inline LoadedModel load_model(const std::string& model, const std::string& tokenizer) {
  LoadedModel m;
  try {
    m.weights = read_llama2c(model);
  } catch (const Error& e) {
    throw Error(std::string("--model: ") + e.what());
  }
  try {
    m.tok = read_tokenizer(tokenizer, m.weights.config.vocab_size);
  } catch (const Error& e) {
    throw Error(std::string("--tokenizer: ") + e.what());
  }
  return m;
}

}  // namespace qkv::cli
