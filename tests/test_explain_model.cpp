// The step trace fed from a real model (stories260K): Llama::layer_attention's views traced by
// explain::trace_attention give, at every layer and position, the model's own attention weights
// (Llama::attention_weights) and the output qkv::attention computes on the same q, k, v.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/error.hpp"
#include "qkv/explain.hpp"
#include "qkv/llama.hpp"
#include "qkv/llama2c.hpp"
#include "qkv/tokenizer.hpp"

namespace fs = std::filesystem;
using namespace qkv;

namespace {

const fs::path kDir = fs::path(QKV_SOURCE_DIR) / "models/stories260K";
const char* const kPrompt = "Once upon a time, there was a little girl named Lily. She";

const Llama2cModel& weights() {
  static const Llama2cModel m = read_llama2c(kDir / "stories260K.bin");
  return m;
}
const Tokenizer& tok() {
  static const Tokenizer t = read_tokenizer(kDir / "tok512.bin", 512);
  return t;
}

}  // namespace

TEST(ExplainModel, LayerAttentionViewsAreTheRecordedQAndTheCache) {
  LlamaOptions lo;
  lo.record_queries = true;
  Llama model(weights(), lo);
  const std::vector<int> tokens = tok().encode(kPrompt);
  model.forward(tokens);
  const auto S = static_cast<std::int64_t>(tokens.size());
  const Llama2cConfig& c = weights().config;
  const std::int64_t Hq = c.n_heads, Hkv = c.n_kv_heads, D = c.dim / c.n_heads;
  const Llama::LayerAttention la = model.layer_attention(1);
  ASSERT_EQ(la.q.shape(), (Shape{1, Hq, S, D}));
  ASSERT_EQ(la.k.shape(), (Shape{1, Hkv, S, D}));
  ASSERT_EQ(la.v.shape(), (Shape{1, Hkv, S, D}));
  EXPECT_TRUE(la.params.causal);
  EXPECT_FALSE(la.params.scale.has_value());
  const TensorView qs = model.queries(1), ks = model.keys(1), vs = model.values(1);
  auto at = [](const TensorView& t, std::initializer_list<std::int64_t> idx) {
    std::int64_t off = 0, a = 0;
    for (const std::int64_t i : idx) off += i * t.stride(a++);
    return t.data_as<const float>()[off];
  };
  for (std::int64_t h = 0; h < Hq; ++h)
    for (std::int64_t i = 0; i < S; ++i)
      for (std::int64_t d = 0; d < D; ++d) ASSERT_EQ(at(la.q, {0, h, i, d}), at(qs, {i, h, d}));
  for (std::int64_t h = 0; h < Hkv; ++h)
    for (std::int64_t j = 0; j < S; ++j)
      for (std::int64_t d = 0; d < D; ++d) {
        ASSERT_EQ(at(la.k, {0, h, j, d}), at(ks, {h, j, d}));
        ASSERT_EQ(at(la.v, {0, h, j, d}), at(vs, {h, j, d}));
      }
}

TEST(ExplainModel, TraceEqualsTheModelsAttentionAtEveryLayerAndPosition) {
  LlamaOptions lo;
  lo.record_queries = true;
  Llama model(weights(), lo);
  const std::vector<int> tokens = tok().encode(kPrompt);
  model.forward(tokens);
  const auto S = static_cast<std::int64_t>(tokens.size());
  for (int layer = 0; layer < weights().config.n_layers; ++layer) {
    SCOPED_TRACE("layer " + std::to_string(layer));
    const Llama::LayerAttention la = model.layer_attention(layer);
    const explain::Trace t = explain::trace_attention(la.q, la.k, la.v, la.params);
    ASSERT_EQ(t.Sq, S);
    ASSERT_EQ(t.Sk, S);
    EXPECT_DOUBLE_EQ(t.scale, 1.0 / std::sqrt(static_cast<double>(t.D)));
    // Weights: the model's float64 softmax of the scores of its run, position by position.
    double err_w = 0.0;
    for (std::int64_t i = 0; i < S; ++i) {
      const Tensor w = model.attention_weights(layer, i);
      for (std::int64_t h = 0; h < t.Hq; ++h) {
        for (std::int64_t j = 0; j <= i; ++j)
          err_w = std::max(
              err_w, std::fabs(w.data_as<const double>()[h * (i + 1) + j] - t.weights[t.at(0, h, i, j)]));
        for (std::int64_t j = i + 1; j < S; ++j) {
          ASSERT_EQ(t.weights[t.at(0, h, i, j)], 0.0);
          ASSERT_EQ(t.status[t.at(0, h, i, j)], explain::KeyStatus::outside_window);
        }
      }
    }
    EXPECT_LE(err_w, 1e-12);
    // Output: z_i = sum_j alpha_ij v_j from the cache's values directly, and qkv::attention's
    // float32 output on the same views (the kernel the model runs for a prefill).
    const TensorView vs = model.values(layer);
    Tensor out(DType::f32, {1, t.Hq, S, t.Dv});
    attention(la.q, la.k, la.v, out, la.params);
    double err_z = 0.0, err_o = 0.0;
    for (std::int64_t h = 0; h < t.Hq; ++h)
      for (std::int64_t i = 0; i < S; ++i)
        for (std::int64_t d = 0; d < t.Dv; ++d) {
          double z = 0.0;
          for (std::int64_t j = 0; j <= i; ++j)
            z += t.weights[t.at(0, h, i, j)] *
                 vs.data_as<const float>()[t.kv_head(h) * vs.stride(0) + j * vs.stride(1) + d];
          const double got = t.output[static_cast<std::size_t>(((h * S) + i) * t.Dv + d)];
          err_z = std::max(err_z, std::fabs(got - z));
          err_o = std::max(err_o, std::fabs(got - out.data_as<const float>()[((h * S) + i) * t.Dv + d]));
        }
    EXPECT_LE(err_z, 1e-12);
    EXPECT_LE(err_o, 2e-5);
  }
}

TEST(ExplainModel, LayerAttentionRefusesBadInput) {
  LlamaOptions lo;
  lo.record_queries = true;
  Llama model(weights(), lo);
  model.forward(tok().encode("Once"));
  EXPECT_THROW(model.layer_attention(-1), Error);
  EXPECT_THROW(model.layer_attention(weights().config.n_layers), Error);
  Llama plain(weights());
  plain.forward(tok().encode("Once"));
  EXPECT_THROW(plain.layer_attention(0), Error);
}
