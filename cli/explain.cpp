// `qkv explain`: the steps of attention on given Q/K/V (or X and W^Q, W^K, W^V, or one layer of
// a llama2.c model run on a prompt), printed per query row with token labels, written as .npy
// arrays and heatmaps; and `--scaling`, the measured argument for the 1/sqrt(d_k) scale.
#include "qkv/explain.hpp"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "commands.hpp"
#include "io/atomic_file.hpp"
#include "options.hpp"
#include "models.hpp"
#include "qkv/error.hpp"
#include "qkv/llama.hpp"
#include "qkv/npy.hpp"
#include "qkv/tokenizer.hpp"

namespace qkv::cli {
namespace {

struct ExplainOptions {
  std::string q, k, v, x, wq, wk, wv, mask, kv_lens, layout = "bhsd", align = "bottom-right", window;
  std::string labels, labels_file, out_dir;
  std::string sinks, alibi_slopes;  // score options (.npy) and --keep-first
  std::int64_t keep_first = 0;
  std::string model, tokenizer, prompt;  // empty model/tokenizer: the default model (models.hpp)
  bool model_given = false, prompt_given = false;
  std::optional<int> layer;
  std::vector<std::string> heatmaps, plots;
  std::optional<double> scale;
  double softcap = 0.0;
  bool causal = false, scaling = false;
  std::optional<std::int64_t> query, head, batch;
  std::int64_t heads = 1, top = 3, samples = 1000, n_keys = 64;
  std::uint64_t seed = 1;
  std::vector<std::int64_t> d_k = {4, 16, 64, 256, 1024};
};

NpyArray read(const std::string& flag, const std::string& path) {
  try {
    return read_npy(path);
  } catch (const Error& e) {
    throw Error(flag + ": " + e.what());
  }
}

std::vector<std::string> read_labels(const ExplainOptions& o) {
  std::vector<std::string> out;
  if (!o.labels.empty() && !o.labels_file.empty())
    throw Error("--labels: give either --labels or --labels-file, not both");
  if (!o.labels.empty()) {
    std::size_t start = 0;
    while (true) {
      const auto comma = o.labels.find(',', start);
      out.push_back(o.labels.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
  } else if (!o.labels_file.empty()) {
    std::ifstream f(o.labels_file);
    if (!f) throw Error("--labels-file: cannot open '" + o.labels_file + "'");
    std::string line;
    while (std::getline(f, line)) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      out.push_back(line);
    }
  }
  return out;
}

void check_index(const std::optional<std::int64_t>& x, std::int64_t n, const char* flag, const char* axis) {
  if (x && (*x < 0 || *x >= n))
    throw Error(std::string(flag) + ": expected an index in [0, " + axis + ") = [0, " + std::to_string(n) +
                "), got " + std::to_string(*x));
}

// The command's output files as one set: all are written, then all renamed into place, so a
// failure leaves every path as it was (qkv::detail::AtomicFileSet); then "wrote" for each.
class Outputs {
 public:
  template <class F>
  void write(const char* flag, const std::filesystem::path& path, F&& f) {
    files_.add(flag, path, std::forward<F>(f));
  }
  void npy_files(const std::string& out_dir, const std::vector<std::pair<std::string, TensorView>>& files) {
    const std::filesystem::path dir(out_dir);
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) throw Error("--out-dir: cannot create '" + out_dir + "': " + ec.message());
    for (const auto& [name, view] : files)
      write("--out-dir", dir / name, [&](const std::filesystem::path& to) { write_npy(to, view); });
  }
  void commit() { files_.commit(); }
  void print() const {
    for (const auto& w : files_.paths()) std::printf("wrote %s\n", w.string().c_str());
  }

 private:
  qkv::detail::AtomicFileSet files_;
};

void run_scaling(const ExplainOptions& o) {
  explain::ScalingOptions so;
  so.d_k = o.d_k;
  so.n_keys = o.n_keys;
  so.samples = o.samples;
  so.seed = o.seed;
  const auto rows = explain::scaling_study(so);
  Outputs outputs;
  for (const auto& p : o.plots)
    outputs.write("--plot", p, [&](const std::filesystem::path& to) { explain::write_scaling_plot(to, rows, so); });
  outputs.commit();
  std::fputs(explain::format_scaling(rows, so).c_str(), stdout);
  outputs.print();
}

void print_rows(const explain::Trace& t, const ExplainOptions& o, const std::vector<std::string>& labels) {
  for (std::int64_t b = 0; b < t.B; ++b) {
    if (o.batch && b != *o.batch) continue;
    for (std::int64_t h = 0; h < t.Hq; ++h) {
      if (o.head && h != *o.head) continue;
      for (std::int64_t i = 0; i < t.Sq; ++i) {
        if (o.query && i != *o.query) continue;
        std::fputs(explain::format_row(t, b, h, i, labels, o.top).c_str(), stdout);
        std::fputs("\n", stdout);
      }
    }
  }
}

// A prompt token as a label: BOS as <s>; the piece's spaces as U+2581, SentencePiece's own word
// mark (the PNG font draws it as '_'), so that " Lily" and "Lily" stay apart; newlines and
// other control bytes escaped.
std::string token_label(const Tokenizer& tok, int id) {
  if (id == Tokenizer::bos_id) return "<s>";
  if (id == Tokenizer::eos_id) return "</s>";
  std::string out;
  for (const char c : tok.piece(id)) {
    const auto u = static_cast<unsigned char>(c);
    if (c == ' ') {
      out += "\xe2\x96\x81";
    } else if (c == '\n') {
      out += "\\n";
    } else if (u < 0x20 || u == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "<0x%02X>", u);
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

// `--model`/`--prompt`: run the prompt through the model (one prefill) and trace one layer's
// attention on the q (after RoPE), k and v the model used.
void run_model(const ExplainOptions& o) {
  // The model fixes q, k, v and the attention options: the flags that set them do not apply.
  const std::pair<bool, const char*> conflicts[] = {{!o.q.empty(), "--q"},
                                                    {!o.k.empty(), "--k"},
                                                    {!o.v.empty(), "--v"},
                                                    {!o.x.empty(), "--x"},
                                                    {!o.wq.empty(), "--wq"},
                                                    {!o.wk.empty(), "--wk"},
                                                    {!o.wv.empty(), "--wv"},
                                                    {!o.mask.empty(), "--mask"},
                                                    {!o.kv_lens.empty(), "--kv-lens"},
                                                    {!o.window.empty(), "--window"},
                                                    {o.scale.has_value(), "--scale"},
                                                    {o.softcap != 0.0, "--softcap"},
                                                    {o.layout != "bhsd", "--layout"},
                                                    {o.align != "bottom-right", "--align"},
                                                    {o.heads != 1, "--heads"},
                                                    {o.batch.has_value(), "--batch"},
                                                    {!o.labels.empty(), "--labels"},
                                                    {!o.labels_file.empty(), "--labels-file"},
                                                    {o.scaling, "--scaling"},
                                                    {!o.plots.empty(), "--plot"}};
  for (const auto& [set, flag] : conflicts)
    if (set)
      throw Error(std::string(flag) +
                  ": not with --model/--prompt (the model gives q, k, v, causal masking, its scale and the "
                  "token labels)");
  if (!o.prompt_given || o.prompt.empty())
    throw Error("--prompt: expected text to run through the model, got " +
                std::string(o.prompt_given ? "an empty string" : "none"));
  if (!o.layer) throw Error("--layer: required with --model/--prompt (which layer's attention to explain)");

  const std::string model_path = o.model.empty() ? default_model_path().string() : o.model;
  auto [weights, tok] = load_model(model_path, o.tokenizer);
  const Llama2cConfig& c = weights.config;
  if (*o.layer < 0 || *o.layer >= c.n_layers)
    throw Error("--layer: expected an index in [0, n_layers) = [0, " + std::to_string(c.n_layers) +
                "), got " + std::to_string(*o.layer));
  check_index(o.head, c.n_heads, "--head", "num_heads");
  const std::vector<int> tokens = tok.encode(o.prompt, /*bos=*/true, /*eos=*/false);
  const auto S = static_cast<std::int64_t>(tokens.size());
  if (S > c.max_seq_len)
    throw Error("--prompt: " + std::to_string(S) + " tokens (BOS included) exceed the model's max_seq_len (" +
                std::to_string(c.max_seq_len) + ")");
  check_index(o.query, S, "--query", "prompt tokens incl. BOS");

  LlamaOptions lo;
  lo.record_queries = true;
  Llama model(weights, lo);
  model.forward(tokens);
  const Llama::LayerAttention la = model.layer_attention(*o.layer);
  const explain::Trace t = explain::trace_attention(la.q, la.k, la.v, la.params);
  std::vector<std::string> labels;
  for (const int id : tokens) labels.push_back(token_label(tok, id));

  // The trace against the model's own attention: the weights against Llama::attention_weights
  // (float64 softmax of the scores the run used) at every position, the output against
  // qkv::attention on the same float32 q, k, v (the kernel the model runs).
  double err_w = 0.0, err_o = 0.0;
  for (std::int64_t i = 0; i < S; ++i) {
    const Tensor w = model.attention_weights(*o.layer, i);
    for (std::int64_t h = 0; h < t.Hq; ++h)
      for (std::int64_t j = 0; j <= i; ++j)
        err_w = std::max(err_w,
                         std::fabs(w.data_as<const double>()[h * (i + 1) + j] - t.weights[t.at(0, h, i, j)]));
  }
  Tensor out(DType::f32, {1, t.Hq, S, t.Dv});
  attention(la.q, la.k, la.v, out, la.params);
  for (std::int64_t x = 0; x < out.numel(); ++x)
    err_o = std::max(err_o, std::fabs(static_cast<double>(out.data_as<const float>()[x]) - t.output[x]));
  // float64 trace of float32 inputs vs the model's float64 recomputation: rounding only; the
  // float32 kernel's output: float32 rounding of sums of at most S products.
  constexpr double kTolWeights = 1e-12, kTolOutput = 1e-4;

  Outputs outputs;
  if (!o.out_dir.empty())
    outputs.npy_files(o.out_dir, {{"scores.npy", t.scores_view()},
                                  {"scaled.npy", t.scaled_view()},
                                  {"weights.npy", t.weights_view()},
                                  {"output.npy", t.output_view()},
                                  {"q.npy", la.q},
                                  {"k.npy", la.k},
                                  {"v.npy", la.v}});
  for (const auto& path : o.heatmaps) {
    explain::HeatmapOptions ho;
    ho.title = "layer " + std::to_string(*o.layer) + " attention weights: \"" + o.prompt + "\"";
    for (std::int64_t h = 0; h < t.Hq; ++h)
      ho.panel_titles.push_back("head " + std::to_string(h) + " (kv " + std::to_string(t.kv_head(h)) + ")");
    outputs.write("--heatmap", path, [&](const std::filesystem::path& to) {
      explain::write_heatmap(to, explain::head_weights(t, 0), labels, labels, ho);
    });
  }
  outputs.commit();

  std::printf("qkv explain: %s, layer %d of %d: Hq %" PRId64 ", Hkv %" PRId64 ", S %" PRId64
              " tokens (BOS included), D %" PRId64 "\n",
              std::filesystem::path(model_path).filename().string().c_str(), *o.layer, c.n_layers, t.Hq,
              t.Hkv, S, t.D);
  std::printf("tokens:");
  for (std::int64_t j = 0; j < S; ++j)
    std::printf(" %" PRId64 " %s%s", j, labels[static_cast<std::size_t>(j)].c_str(), j + 1 < S ? "," : "\n");
  std::printf("q after RoPE, k and v from the KV cache; causal; scale %.6g (1/sqrt(D))\n", t.scale);
  std::printf(
      "check: weights vs the model's attention weights (Llama::attention_weights), all positions: "
      "max |diff| = %.2e %s\n",
      err_w, err_w <= kTolWeights ? "OK" : "MISMATCH");
  std::printf("check: z vs qkv::attention on the layer's float32 q, k, v: max |diff| = %.2e %s\n", err_o,
              err_o <= kTolOutput ? "OK" : "MISMATCH");
  std::printf(
      "steps: 1. q.k = q_i . k_j   2. x scale = scale * q.k   3. masks: causal, later keys get -inf\n"
      "       4. weight = softmax over the row of the logits   5. z_i = sum_j weight_j v_j\n\n");
  print_rows(t, o, labels);
  outputs.print();
  if (err_w > kTolWeights || err_o > kTolOutput)
    throw std::runtime_error("explain: the trace disagrees with the model's attention");
}

void run_explain(const ExplainOptions& o) {
  if (o.model_given || o.prompt_given) return run_model(o);
  if (o.scaling) return run_scaling(o);
  if (!o.plots.empty())
    throw Error("--plot: only with --scaling (attention weights are drawn with --heatmap)");
  const bool from_x = !o.x.empty() || !o.wq.empty() || !o.wk.empty() || !o.wv.empty();
  const bool from_qkv = !o.q.empty() || !o.k.empty() || !o.v.empty();
  if (from_x && from_qkv) throw Error("--x: give either --q/--k/--v or --x/--wq/--wk/--wv, not both");
  if (!from_x && !from_qkv)
    throw Error("--q: expected inputs: --q/--k/--v, or --x/--wq/--wk/--wv, or --scaling");
  if (from_qkv && (o.q.empty() || o.k.empty() || o.v.empty()))
    throw Error(std::string(o.q.empty()   ? "--q"
                            : o.k.empty() ? "--k"
                                          : "--v") +
                ": required with the other two of --q/--k/--v");
  if (from_x && o.layout == "bshd")
    throw Error("--layout: applies to --q/--k/--v; --x is [S,d_model] or [B,S,d_model], got --layout bshd");
  if (from_x && (o.x.empty() || o.wq.empty() || o.wk.empty() || o.wv.empty()))
    throw Error(std::string(o.x.empty()    ? "--x"
                            : o.wq.empty() ? "--wq"
                            : o.wk.empty() ? "--wk"
                                           : "--wv") +
                ": required with the others of --x/--wq/--wk/--wv");

  // Inputs as BHSD views.
  NpyArray qa, ka, va;
  explain::Projected proj;
  TensorView q, k, v;
  const bool bshd = from_qkv && o.layout == "bshd";
  if (from_qkv) {
    qa = read("--q", o.q);
    ka = read("--k", o.k);
    va = read("--v", o.v);
    for (const auto& [a, f] : {std::pair{&qa, "--q"}, std::pair{&ka, "--k"}, std::pair{&va, "--v"}})
      if (a->shape().size() != 4)
        throw Error(std::string(f) + ": expected a 4-D array, got shape " + shape_str(a->shape()));
    q = bshd ? qa.view().permute({0, 2, 1, 3}) : qa.view();
    k = bshd ? ka.view().permute({0, 2, 1, 3}) : ka.view();
    v = bshd ? va.view().permute({0, 2, 1, 3}) : va.view();
  } else {
    const NpyArray xa = read("--x", o.x), wqa = read("--wq", o.wq), wka = read("--wk", o.wk),
                   wva = read("--wv", o.wv);
    proj = explain::project_qkv(xa.view(), wqa.view(), wka.view(), wva.view(), o.heads);
    q = proj.q.view();
    k = proj.k.view();
    v = proj.v.view();
  }

  AttentionParams p = attention_params(o);
  NpyArray mask, lens;
  if (!o.mask.empty()) {
    mask = read("--mask", o.mask);
    p.mask = mask.view();
  }
  if (!o.kv_lens.empty()) {
    lens = read("--kv-lens", o.kv_lens);
    p.kv_lens = lens.view();
  }
  NpyArray sinks, slopes;
  if (!o.sinks.empty()) {
    sinks = read("--sinks", o.sinks);
    p.sinks = sinks.view();
  }
  if (!o.alibi_slopes.empty()) {
    slopes = read("--alibi-slopes", o.alibi_slopes);
    p.alibi_slopes = slopes.view();
  }
  if (o.keep_first < 0)
    throw Error("--keep-first: expected an integer >= 0 (0 = off), got " + std::to_string(o.keep_first));
  p.window_keep_first = o.keep_first;

  const explain::Trace t = explain::trace_attention(q, k, v, p);
  const std::vector<std::string> labels = read_labels(o);
  if (!labels.empty() && static_cast<std::int64_t>(labels.size()) != t.Sk)
    throw Error(std::string(o.labels.empty() ? "--labels-file" : "--labels") +
                ": expected one label per key, Sk = " + std::to_string(t.Sk) + ", got " +
                std::to_string(labels.size()));
  check_index(o.query, t.Sq, "--query", "Sq");
  check_index(o.head, t.Hq, "--head", "Hq");
  check_index(o.batch, t.B, "--batch", "B");

  // Files first (as one set: on a failure every path keeps what it held), then the text.
  Outputs outputs;
  if (!o.out_dir.empty()) {
    const TensorView out = bshd ? t.output_view().permute({0, 2, 1, 3}) : t.output_view();
    std::vector<std::pair<std::string, TensorView>> files = {{"scores.npy", t.scores_view()},
                                                             {"scaled.npy", t.scaled_view()},
                                                             {"weights.npy", t.weights_view()},
                                                             {"output.npy", out}};
    if (from_x) {
      files.emplace_back("q.npy", q);
      files.emplace_back("k.npy", k);
      files.emplace_back("v.npy", v);
    }
    outputs.npy_files(o.out_dir, files);
  }
  const std::int64_t hb = o.batch.value_or(0);
  // With sinks, one more column after the keys: the sink's share of each row ("sink").
  const bool sink_column = !t.sink_weights.empty();
  Tensor with_sink;
  std::vector<std::string> col_labels = labels;
  if (sink_column) {
    with_sink = explain::head_weights_with_sink(t, hb);
    if (col_labels.empty())
      for (std::int64_t j = 0; j < t.Sk; ++j) col_labels.push_back(std::to_string(j));
    col_labels.push_back("sink");
  }
  const std::int64_t cols = sink_column ? t.Sk + 1 : t.Sk;
  for (const auto& path : o.heatmaps) {
    TensorView w = sink_column ? with_sink.view() : explain::head_weights(t, hb);
    explain::HeatmapOptions ho;
    ho.title = "attention weights, batch " + std::to_string(hb) + (sink_column ? " (last column: the sink's share)" : "");
    if (o.head) {
      w = TensorView(static_cast<double*>(w.data()) + *o.head * t.Sq * cols, DType::f64, {1, t.Sq, cols});
      ho.panel_titles = {"head " + std::to_string(*o.head)};
    }
    outputs.write("--heatmap", path, [&](const std::filesystem::path& to) {
      explain::write_heatmap(to, w, explain::query_labels(t, labels, hb), col_labels, ho);
    });
  }
  outputs.commit();

  std::printf("qkv explain: B %" PRId64 ", Hq %" PRId64 ", Hkv %" PRId64 ", Sq %" PRId64 ", Sk %" PRId64
              ", D %" PRId64 ", Dv %" PRId64 "%s\n",
              t.B, t.Hq, t.Hkv, t.Sq, t.Sk, t.D, t.Dv, from_x ? " (q, k, v = x W^Q, x W^K, x W^V)" : "");
  std::printf("scale %.6g%s", t.scale, o.scale ? "" : " (1/sqrt(D))");
  if (t.softcap > 0) std::printf(", softcap %.6g", t.softcap);
  if (t.window.left >= 0 || t.window.right >= 0)
    std::printf(", window (%" PRId64 ", %" PRId64 ") %s-aligned", t.window.left, t.window.right,
                t.align == Alignment::bottom_right ? "bottom-right" : "top-left");
  if (t.has_mask) std::printf(", %s mask", t.additive_mask ? "additive" : "bool");
  if (p.kv_lens) std::printf(", kv_lens");
  if (!t.sinks.empty()) std::printf(", sinks");
  if (!t.alibi_slopes.empty()) std::printf(", alibi");
  if (t.keep_first > 0) std::printf(", keep first %" PRId64, t.keep_first);
  std::printf(
      "\nsteps: 1. q.k = q_i . k_j   2. x scale = scale * q.k%s%s%s   3. masks: excluded keys get -inf\n"
      "       4. weight = softmax over the row of the logits%s   5. z_i = sum_j weight_j v_j\n\n",
      t.softcap > 0 ? ", softcap = c*tanh(s/c)" : "", t.alibi_slopes.empty() ? "" : ", + alibi = -slope*|diag-j|",
      t.additive_mask ? ", + mask" : "", t.sinks.empty() ? "" : " (and the sink z_h, which has no value)");
  print_rows(t, o, labels);
  outputs.print();
}

}  // namespace

void add_explain(CLI::App& app) {
  auto o = std::make_shared<ExplainOptions>();
  auto* cmd = app.add_subcommand(
      "explain",
      "The steps of attention made visible: scores, scaling, masks, weights, output; heatmaps; --scaling");
  cmd->add_option("--q", o->q, "queries, [B,Hq,Sq,D] (bhsd) or [B,Sq,Hq,D] (bshd)");
  cmd->add_option("--k", o->k, "keys, [B,Hkv,Sk,D] or [B,Sk,Hkv,D]");
  cmd->add_option("--v", o->v, "values, [B,Hkv,Sk,Dv] or [B,Sk,Hkv,Dv]");
  cmd->add_option("--x", o->x,
                  "token vectors, [S,d_model] or [B,S,d_model]: q = x W^Q, k = x W^K, v = x W^V");
  cmd->add_option("--wq", o->wq, "W^Q, [d_model, H*d_k] (row-vector convention: q = x W^Q)");
  cmd->add_option("--wk", o->wk, "W^K, [d_model, H*d_k]");
  cmd->add_option("--wv", o->wv, "W^V, [d_model, H*d_v]");
  cmd->add_option("--heads", o->heads, "with --x: number of heads H (column blocks of W)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--layout", o->layout, "axis order of --q, --k, --v and output.npy")
      ->check(CLI::IsMember({"bhsd", "bshd"}));
  cmd->add_option("--scale", o->scale, "score scale (default 1/sqrt(D))");
  cmd->add_flag("--causal", o->causal, "causal mask: window (-1, 0)");
  cmd->add_option("--align", o->align, "diagonal alignment when Sq != Sk")
      ->check(CLI::IsMember({"bottom-right", "top-left"}));
  cmd->add_option("--window", o->window, "sliding window LEFT,RIGHT (-1 = unbounded)");
  cmd->add_option("--mask", o->mask,
                  "bool (true = attend) or additive float mask, broadcastable to [B,Hq,Sq,Sk]");
  cmd->add_option("--kv-lens", o->kv_lens, "int32/int64 [B] key lengths");
  cmd->add_option("--softcap", o->softcap, "softcap c > 0: score = c*tanh(score/c)");
  cmd->add_option("--sinks", o->sinks, "float32 [Hq] attention-sink logits; the heatmap gains a 'sink' column");
  cmd->add_option("--alibi-slopes", o->alibi_slopes, "float32 [Hq] or [B,Hq] ALiBi slopes");
  cmd->add_option("--keep-first", o->keep_first, "N >= 0: keys 0..N-1 join every row's window (StreamingLLM)");
  cmd->add_option("--query", o->query, "print only query row i (default: all rows)");
  cmd->add_option("--head", o->head, "print (and draw) only query head h (default: all heads)");
  cmd->add_option("--batch", o->batch, "print only batch b; the heatmap shows batch b (default 0)");
  cmd->add_option("--labels", o->labels, "token labels, comma-separated, one per key (Sk)");
  cmd->add_option("--labels-file", o->labels_file, "token labels, one per line, one per key (Sk)");
  cmd->add_option("--top", o->top, "how many keys to list by weight per row")->check(CLI::NonNegativeNumber);
  cmd->add_option("--out-dir", o->out_dir,
                  "write scores.npy, scaled.npy, weights.npy [B,Hq,Sq,Sk] (float64, excluded: -inf / 0) and "
                  "output.npy (float64, in the input layout); with --x also q.npy, k.npy, v.npy (bhsd)");
  cmd->add_option(
      "--heatmap", o->heatmaps,
      "attention-weight heatmap(s) of all heads (with --model: all heads of the layer): FILE.png, .svg "
      "or .html");
  auto* model_opt =
      cmd->add_option("--model", o->model,
                      "a llama2.c checkpoint: explain one layer of it run on --prompt (default, also when "
                      "--model is given without a value: " +
                          default_model_help(kModelFile) + ")")
          ->expected(0, 1);
  auto* prompt_opt = cmd->add_option("--prompt", o->prompt,
                                     "with --model: the text to run (BOS and a leading space are added)");
  cmd->add_option("--tokenizer", o->tokenizer,
                  "with --model: llama2.c tokenizer.bin (default: " + default_model_help(kTokenizerFile) + ")");
  cmd->add_option("--layer", o->layer, "with --model: the layer whose attention is traced (0 = first)");
  cmd->add_flag("--scaling", o->scaling, "measure the scaling argument on random N(0,1) vectors");
  cmd->add_option("--d-k", o->d_k, "with --scaling: head dimensions to measure")->delimiter(',');
  cmd->add_option("--samples", o->samples, "with --scaling: samples per d_k")->check(CLI::PositiveNumber);
  cmd->add_option("--keys", o->n_keys, "with --scaling: keys per softmax (n)")->check(CLI::PositiveNumber);
  cmd->add_option("--seed", o->seed, "with --scaling: random seed");
  cmd->add_option("--plot", o->plots, "with --scaling: write the curves as FILE.png, .svg or .html");
  cmd->callback([o, model_opt, prompt_opt] {
    o->model_given = model_opt->count() > 0;
    o->prompt_given = prompt_opt->count() > 0;
    run_explain(*o);
  });
}

}  // namespace qkv::cli
