// `qkv demo`: self-attention on a short sentence, each of the five steps printed, and the
// fast path checked against the float64 reference; then a real trained model (stories260K, when
// its files are found) generates a story on qkv's attention, and one token's attention weights
// are shown per head.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <stdexcept>
#include <cstdio>
#include <string>
#include <vector>

#include "commands.hpp"
#include "models.hpp"
#include "print.hpp"
#include "qkv/attention.hpp"
#include "qkv/llama.hpp"
#include "qkv/reference.hpp"
#include "qkv/sampler.hpp"
#include "qkv/tokenizer.hpp"

namespace qkv::cli {
namespace {

// The embedded example: six tokens, d_model = 6, d_k = d_v = 4. The token vectors use six
// readable features so that the projections mean something: a query looks for what a token
// lacks (a noun looks for its determiner and its verb), a key advertises what a token is.
constexpr int kTokens = 6, kModel = 6, kHead = 4;
const char* const kSentence[kTokens] = {"the", "cat", "sat", "on", "the", "mat"};
//                     det  noun verb prep animal place
const double kX[kTokens][kModel] = {
    {1.0, 0.0, 0.0, 0.0, 0.0, 0.0},  // the
    {0.0, 1.0, 0.0, 0.0, 1.0, 0.0},  // cat
    {0.0, 0.0, 1.0, 0.0, 0.3, 0.0},  // sat
    {0.0, 0.0, 0.0, 1.0, 0.0, 0.5},  // on
    {1.0, 0.0, 0.0, 0.0, 0.0, 0.0},  // the
    {0.0, 1.0, 0.0, 0.0, 0.0, 1.0},  // mat
};
// W^Q: what each feature looks for (columns: wants-det, wants-noun, wants-verb, wants-place).
const double kWq[kModel][kHead] = {
    {0.0, 1.5, 0.0, 0.0}, {1.5, 0.0, 1.0, 0.0}, {0.0, 2.0, 0.0, 0.0},
    {0.0, 1.0, 0.0, 1.5}, {0.0, 0.0, 0.5, 0.0}, {0.0, 0.0, 0.0, 0.5}};
// W^K: what each feature offers, on the same four axes.
const double kWk[kModel][kHead] = {
    {2.0, 0.0, 0.0, 0.0}, {0.0, 2.0, 0.0, 0.0}, {0.0, 0.0, 2.0, 0.0},
    {0.0, 0.0, 0.0, 0.5}, {0.0, 0.5, 0.0, 0.0}, {0.0, 0.0, 0.0, 2.0}};
// W^V: what each feature hands over.
const double kWv[kModel][kHead] = {
    {1.0, 0.0, 0.0, 0.0}, {0.0, 1.0, 0.0, 0.0}, {0.0, 0.0, 1.0, 0.0},
    {0.0, 0.0, 0.0, 1.0}, {0.0, 0.5, 0.0, 0.0}, {0.0, 0.0, 0.0, 0.5}};

void project(const double w[kModel][kHead], std::vector<double>& out) {
  out.assign(kTokens * kHead, 0.0);
  for (int t = 0; t < kTokens; ++t)
    for (int c = 0; c < kHead; ++c)
      for (int m = 0; m < kModel; ++m) out[t * kHead + c] += kX[t][m] * w[m][c];
}

void run_demo() {
  std::vector<std::string> labels(kSentence, kSentence + kTokens);
  for (int t = 0; t < kTokens; ++t) labels[t] += "#" + std::to_string(t);
  std::printf("qkv demo: self-attention over \"the cat sat on the mat\" (d_model %d, d_k = d_v = %d)\n\n",
              kModel, kHead);
  print_matrix("token vectors X [tokens x d_model] (features: det noun verb prep animal place)", &kX[0][0],
               kTokens, kModel, labels, {"det", "noun", "verb", "prep", "animal", "place"}, 2);

  std::vector<double> q, k, v;
  project(kWq, q);
  project(kWk, k);
  project(kWv, v);
  print_matrix("Q = X W^Q  (what each token is looking for)", q.data(), kTokens, kHead, labels);
  print_matrix("K = X W^K  (what each token offers to be matched on)", k.data(), kTokens, kHead, labels);
  print_matrix("V = X W^V  (what each token hands over)", v.data(), kTokens, kHead, labels);

  // Steps 1-4 by hand, in float64, so that every intermediate can be shown.
  const double scale = 1.0 / std::sqrt(static_cast<double>(kHead));
  std::vector<double> scores(kTokens * kTokens), scaled(kTokens * kTokens), weights(kTokens * kTokens);
  std::vector<double> z(kTokens * kHead, 0.0);
  for (int i = 0; i < kTokens; ++i) {
    double mx = -INFINITY, sum = 0.0;
    for (int j = 0; j < kTokens; ++j) {
      double s = 0.0;
      for (int c = 0; c < kHead; ++c) s += q[i * kHead + c] * k[j * kHead + c];
      scores[i * kTokens + j] = s;
      scaled[i * kTokens + j] = s * scale;
      mx = std::max(mx, s * scale);
    }
    for (int j = 0; j < kTokens; ++j) sum += weights[i * kTokens + j] = std::exp(scaled[i * kTokens + j] - mx);
    for (int j = 0; j < kTokens; ++j) weights[i * kTokens + j] /= sum;
    for (int j = 0; j < kTokens; ++j)
      for (int c = 0; c < kHead; ++c) z[i * kHead + c] += weights[i * kTokens + j] * v[j * kHead + c];
  }
  print_matrix("step 1, scores q_i . k_j  (rows: queries, columns: keys)", scores.data(), kTokens, kTokens, labels, labels);
  char title[128];
  std::snprintf(title, sizeof title, "step 2, scaled by 1/sqrt(d_k) = %.4f", scale);
  print_matrix(title, scaled.data(), kTokens, kTokens, labels, labels);
  print_matrix("step 3, softmax weights alpha_ij (each row sums to 1)", weights.data(), kTokens, kTokens, labels, labels);
  std::printf("row sums:");
  for (int i = 0; i < kTokens; ++i) {
    double s = 0.0;
    for (int j = 0; j < kTokens; ++j) s += weights[i * kTokens + j];
    std::printf(" %.6f", s);
  }
  std::printf("\n\n");
  for (int i = 0; i < kTokens; ++i) {
    int best = 0;
    for (int j = 1; j < kTokens; ++j)
      if (weights[i * kTokens + j] > weights[i * kTokens + best]) best = j;
    std::printf("  %-6s attends most to %-6s (%.2f)\n", labels[i].c_str(), labels[best].c_str(),
                weights[i * kTokens + best]);
  }
  std::printf("\n");
  print_matrix("step 4, output z_i = sum_j alpha_ij v_j", z.data(), kTokens, kHead, labels);

  // The same computation through the library: the fast path (float32) and the reference.
  std::vector<float> qf(q.begin(), q.end()), kf(k.begin(), k.end()), vf(v.begin(), v.end());
  std::vector<float> of(kTokens * kHead);
  std::vector<double> od(kTokens * kHead);
  const Shape shape{1, 1, kTokens, kHead};
  TensorView qv(qf.data(), DType::f32, shape), kv(kf.data(), DType::f32, shape), vv(vf.data(), DType::f32, shape);
  const std::string why = explain_dispatch(qv, kv, vv, TensorView(of.data(), DType::f32, shape));
  attention(qv, kv, vv, TensorView(of.data(), DType::f32, shape));
  reference::attention(TensorView(q.data(), DType::f64, shape), TensorView(k.data(), DType::f64, shape),
                       TensorView(v.data(), DType::f64, shape), TensorView(od.data(), DType::f64, shape));
  double err_fast = 0.0, err_ref = 0.0;
  for (int x = 0; x < kTokens * kHead; ++x) {
    err_fast = std::max(err_fast, std::fabs(static_cast<double>(of[x]) - od[x]));
    err_ref = std::max(err_ref, std::fabs(z[x] - od[x]));
  }
  std::string chosen = "?";
  for (std::size_t a = 0, b = 0; a < why.size(); a = b + 1) {
    b = std::min(why.find('\n', a), why.size());
    const std::size_t c = why.find(": chosen", a);
    if (c < b) { chosen = why.substr(a, c - a); break; }
  }
  std::printf("check: qkv::attention (float32, kernel '%s') vs qkv::reference (float64): max |diff| = %.2e %s\n",
              chosen.c_str(), err_fast, err_fast <= 2e-6 ? "OK" : "MISMATCH");
  std::printf("check: the steps above vs qkv::reference: max |diff| = %.2e %s\n", err_ref,
              err_ref <= 1e-12 ? "OK" : "MISMATCH");
  if (err_fast > 2e-6 || err_ref > 1e-12) throw std::runtime_error("demo: the check against the reference failed");
}

// A token as a short label: its piece in quotes (spaces visible), control bytes escaped.
std::string token_label(const Tokenizer& tok, int id) {
  if (id == Tokenizer::bos_id) return "<s>";
  std::string out = "\"";
  for (char c : tok.piece(id)) {
    if (c == '\n') out += "\\n";
    else if (static_cast<unsigned char>(c) < 0x20) out += '?';
    else out += c;
  }
  return out + "\"";
}

// The position to inspect: the last pronoun fed to the model (its heads tend to look back at
// the character it stands for), else the last position.
std::int64_t pick_position(const Tokenizer& tok, const std::vector<int>& seq, std::int64_t fed) {
  for (std::int64_t t = fed - 1; t >= 8; --t) {
    const std::string_view p = tok.piece(seq[static_cast<std::size_t>(t)]);
    for (const char* w : {" She", " she", " He", " he", " her", " him", "She", "He"})
      if (p == w) return t;
  }
  return fed - 1;
}

void run_model_demo() {
  namespace fs = std::filesystem;
  std::printf("\nA real model: stories260K, a Llama-2 trained on children's stories (5 layers, 8 query heads\n"
              "sharing 4 KV heads, head_dim 8), every attention call on qkv.\n");
  const ModelSearch found = find_default_model();
  if (!found.found) {
    std::printf("skipped: model files not found (%s and %s, looked in %s;\n"
                "set QKV_MODELS_DIR to a folder that holds stories260K/)\n",
                kModelFile, kTokenizerFile, tried_list(found).c_str());
    return;
  }
  const fs::path mp = *found.found / kModelFile, tp = *found.found / kTokenizerFile;
  const Llama2cModel weights = read_llama2c(mp);
  const Tokenizer tok = read_tokenizer(tp, weights.config.vocab_size);
  LlamaOptions opts;
  opts.record_queries = true;
  Llama model(weights, opts);
  const char* const prompt_text = "Once upon a time";
  const std::vector<int> prompt = tok.encode(prompt_text);
  const int steps = std::min(60, weights.config.max_seq_len);
  std::printf("greedy continuation of \"%s\" (%d tokens):\n\n  ", prompt_text, steps);
  std::fflush(stdout);
  const std::vector<int> seq = generate(
      model, prompt, steps, [](std::span<const float> l) { return argmax(l); },
      [&](int prev, int token) {
        std::string piece(printable_piece(tok.decode(prev, token)));
        for (std::size_t i = 0; (i = piece.find('\n', i)) != std::string::npos; i += 3) piece.replace(i, 1, "\n  ");
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      });
  std::printf("\n\n");

  const std::int64_t fed = model.length();
  const std::int64_t pos = pick_position(tok, seq, fed);
  // The middle layer: in stories260K one of its heads looks from a pronoun back to the name.
  const int layer = weights.config.n_layers / 2;
  const int Hq = weights.config.n_heads, group = Hq / weights.config.n_kv_heads;
  std::string context;
  for (std::int64_t t = std::max<std::int64_t>(1, pos - 6); t <= pos; ++t)
    context += tok.decode(seq[static_cast<std::size_t>(t - 1)], seq[static_cast<std::size_t>(t)]);
  std::printf("where token #%lld %s (\"...%s\") looks in layer %d: each head's three largest\n"
              "attention weights over tokens #0..#%lld (<s> = BOS):\n",
              static_cast<long long>(pos), token_label(tok, seq[static_cast<std::size_t>(pos)]).c_str(), context.c_str(),
              layer, static_cast<long long>(pos));
  const Tensor w = model.attention_weights(layer, pos);
  const double* wd = w.data_as<const double>();
  for (int h = 0; h < Hq; ++h) {
    std::vector<std::int64_t> idx(static_cast<std::size_t>(pos + 1));
    for (std::int64_t j = 0; j <= pos; ++j) idx[static_cast<std::size_t>(j)] = j;
    const std::size_t top = std::min<std::size_t>(3, idx.size());
    std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(top), idx.end(),
                      [&](std::int64_t a, std::int64_t b) { return wd[h * (pos + 1) + a] > wd[h * (pos + 1) + b]; });
    std::printf("  head %d (KV head %d):", h, h / group);
    for (std::size_t r = 0; r < top; ++r) {
      const std::int64_t j = idx[r];
      const std::string label = token_label(tok, seq[static_cast<std::size_t>(j)]) + "#" + std::to_string(j);
      std::printf("  %-14s %.2f", label.c_str(), wd[h * (pos + 1) + j]);
    }
    std::printf("\n");
  }

  // The run's logits (one prefill of the same tokens) against the float64 forward pass.
  const std::vector<int> tokens(seq.begin(), seq.begin() + fed);
  Llama check(weights);
  const TensorView fast = check.forward(tokens, /*all_logits=*/true);
  const std::vector<double> ref = reference::llama_forward(weights, tokens);
  double err = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i)
    err = std::max(err, std::fabs(static_cast<double>(fast.data_as<const float>()[i]) - ref[i]));
  std::printf("\ncheck: logits at all %lld positions, float32 on qkv vs the float64 reference forward pass: "
              "max |diff| = %.2e %s\n",
              static_cast<long long>(fed), err, err <= 1e-3 ? "OK" : "MISMATCH");
  std::printf("more: build/qkv generate --prompt \"Once upon a time\" --temperature 0.8\n");
  if (err > 1e-3) throw std::runtime_error("demo: the model check against the float64 reference failed");
}

}  // namespace

void add_demo(CLI::App& app) {
  auto* cmd = app.add_subcommand("demo", "Self-attention on a short sentence, step by step; then a real model");
  cmd->callback([] {
    run_demo();
    run_model_demo();
  });
}

}  // namespace qkv::cli
