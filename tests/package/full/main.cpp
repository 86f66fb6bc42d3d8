// Builds against the whole installed qkv package (qkv::qkv) and checks one attention call and a
// greedy continuation of the installed stories260K model (io, layers and models together).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <qkv/qkv.hpp>

int main() {
  // Two keys with equal scores: the output is the mean of the two values.
  std::vector<float> q{0, 0}, k{1, 0, 1, 0}, v{1, 2, 3, 4}, o(2);
  qkv::attention(qkv::TensorView(q.data(), qkv::DType::f32, {1, 1, 1, 2}),
                 qkv::TensorView(k.data(), qkv::DType::f32, {1, 1, 2, 2}),
                 qkv::TensorView(v.data(), qkv::DType::f32, {1, 1, 2, 2}),
                 qkv::TensorView(o.data(), qkv::DType::f32, {1, 1, 1, 2}));
  const bool attention_ok = std::fabs(o[0] - 2.0f) < 1e-6f && std::fabs(o[1] - 3.0f) < 1e-6f;
  std::printf("qkv %s consumer: O = [%g, %g] %s\n", qkv::version(), o[0], o[1], attention_ok ? "ok" : "WRONG");

  const std::filesystem::path dir = std::filesystem::path(QKV_MODELS_DIR) / "stories260K";
  const qkv::Llama2cModel weights = qkv::read_llama2c(dir / "stories260K.bin");
  const qkv::Tokenizer tok = qkv::read_tokenizer(dir / "tok512.bin", weights.config.vocab_size);
  qkv::Llama model(weights);
  const std::vector<int> seq =
      qkv::generate(model, tok.encode("Once upon a time"), 12, [](std::span<const float> l) { return qkv::argmax(l); });
  const std::string text = tok.decode(seq);
  const bool model_ok = text.find("Once upon a time, there was a little") != std::string::npos;
  std::printf("installed model: \"%s\" %s\n", text.c_str(), model_ok ? "ok" : "WRONG");
  return attention_ok && model_ok ? 0 : 1;
}
