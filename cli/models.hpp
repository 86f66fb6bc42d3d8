#pragma once
// Where the commands find the bundled stories260K model (models/stories260K in the source tree,
// <prefix>/share/qkv/models/stories260K once installed) when --model/--tokenizer are not given:
//   1. $QKV_MODELS_DIR/stories260K, when QKV_MODELS_DIR is set (then nothing else is tried);
//   2. beside the installed executable: <dir of the qkv binary>/../share/qkv/models/stories260K
//      (QKV_MODELS_FROM_BINDIR, a path relative to the binary's folder set in CMakeLists.txt);
//   3. the source tree: models/stories260K in the binary's folder or any folder above it (finds
//      <clone>/models from <clone>/build/qkv).
// The first folder holding both stories260K.bin and tok512.bin is used. No absolute path of the
// build machine is compiled in.
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <system_error>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/llama2c.hpp"
#include "qkv/tokenizer.hpp"

#ifndef QKV_MODELS_FROM_BINDIR
#define QKV_MODELS_FROM_BINDIR "../share/qkv/models"
#endif

namespace qkv::cli {

inline constexpr const char* kModelName = "stories260K";
inline constexpr const char* kModelFile = "stories260K.bin";
inline constexpr const char* kTokenizerFile = "tok512.bin";

/// The folders tried for the default model, in order, and the first that holds it.
struct ModelSearch {
  std::vector<std::filesystem::path> tried;
  std::optional<std::filesystem::path> found;
};

inline bool holds_model(const std::filesystem::path& dir) {
  std::error_code ec;
  return std::filesystem::is_regular_file(dir / kModelFile, ec) &&
         std::filesystem::is_regular_file(dir / kTokenizerFile, ec);
}

inline ModelSearch find_default_model() {
  namespace fs = std::filesystem;
  ModelSearch s;
  auto consider = [&s](const fs::path& dir) {
    s.tried.push_back(dir);
    if (holds_model(dir)) s.found = dir;
    return s.found.has_value();
  };
  if (const char* env = std::getenv("QKV_MODELS_DIR"); env && *env) {
    consider(fs::path(env) / kModelName);
    return s;
  }
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec || exe.empty()) return s;
  const fs::path bindir = exe.parent_path();
  if (consider((bindir / QKV_MODELS_FROM_BINDIR / kModelName).lexically_normal())) return s;
  for (fs::path dir = bindir;; dir = dir.parent_path()) {
    if (consider(dir / "models" / kModelName)) return s;
    if (dir == dir.parent_path()) break;
  }
  return s;
}

/// "A, B or C": the folders tried, for messages.
inline std::string tried_list(const ModelSearch& s) {
  std::string out;
  for (std::size_t i = 0; i < s.tried.size(); ++i) {
    if (i) out += i + 1 == s.tried.size() ? " or " : ", ";
    out += s.tried[i].string();
  }
  return out.empty() ? "nowhere (the qkv binary's location is unknown)" : out;
}

/// The default model folder; throws qkv::Error naming `option` and every folder tried when none
/// holds the model.
inline std::filesystem::path default_model_dir(const std::string& option) {
  const ModelSearch s = find_default_model();
  if (!s.found)
    throw Error(option + ": no stories260K model (stories260K.bin and tok512.bin) in " + tried_list(s) +
                "; give --model and --tokenizer, or set QKV_MODELS_DIR to a folder holding stories260K/");
  return *s.found;
}
inline std::filesystem::path default_model_path() { return default_model_dir("--model") / kModelFile; }
inline std::filesystem::path default_tokenizer_path() { return default_model_dir("--tokenizer") / kTokenizerFile; }

/// For --help: where the default model is now, or that it was not found.
inline std::string default_model_help(const char* file) {
  const ModelSearch s = find_default_model();
  return s.found ? (*s.found / file).string() : std::string(file) + " of the bundled " + kModelName + " (not found)";
}

/// A llama2.c model and its tokenizer, read from the paths given to --model and --tokenizer
/// (empty: the default model's files); a reader's error is rethrown with the option's name in front.
struct LoadedModel {
  Llama2cModel weights;
  Tokenizer tok;
};
inline LoadedModel load_model(const std::string& model, const std::string& tokenizer) {
  const std::filesystem::path model_path = model.empty() ? default_model_path() : std::filesystem::path(model);
  const std::filesystem::path tokenizer_path =
      tokenizer.empty() ? default_tokenizer_path() : std::filesystem::path(tokenizer);
  LoadedModel m;
  try {
    m.weights = read_llama2c(model_path);
  } catch (const Error& e) {
    throw Error(std::string("--model: ") + e.what());
  }
  try {
    m.tok = read_tokenizer(tokenizer_path, m.weights.config.vocab_size);
  } catch (const Error& e) {
    throw Error(std::string("--tokenizer: ") + e.what());
  }
  return m;
}

}  // namespace qkv::cli
