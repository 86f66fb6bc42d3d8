// `qkv generate`: text from a llama2.c checkpoint (a Llama-2 model running on qkv's attention),
// printed as it is produced, with prefill and decode speed on stderr at the end.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "io/atomic_file.hpp"
#include "models.hpp"
#include "qkv/error.hpp"
#include "qkv/kv_quant.hpp"
#include "qkv/llama.hpp"
#include "qkv/sampler.hpp"
#include "qkv/tokenizer.hpp"

namespace qkv::cli {
namespace {

struct GenerateOptions {
  std::string model, tokenizer;  // empty: the default model's files (models.hpp)
  std::string prompt, prompts, out_jsonl;
  int batch = 8;
  int steps = 256;
  double temperature = 1.0;
  double top_p = 0.9;
  std::uint64_t seed = 0;  // 0: from the clock, as llama2.c
  bool reference = false;
  int threads = 0;
  std::string kv_dtype = "f32";
};

double rate(std::int64_t n, double seconds) { return seconds > 0 ? static_cast<double>(n) / seconds : 0.0; }

// The text `qkv generate --prompt` prints for a sequence: every token's piece after the first, then
// a newline.
std::string sequence_text(const Tokenizer& tok, const std::vector<int>& seq) {
  std::string text;
  for (std::size_t i = 1; i < seq.size(); ++i) text += printable_piece(tok.decode(seq[i - 1], seq[i]));
  return text + "\n";
}

// --prompts FILE: one prompt per line, continuous batching over LlamaBatch, one JSON line per
// prompt in the file's order with its text exactly as the single-prompt run prints it.
void run_generate_batch(const GenerateOptions& o, const Llama2cModel& weights, const Tokenizer& tok,
                        const SamplerConfig& sc, const LlamaOptions& lo) {
  if (o.batch < 1) throw Error("--batch: expected a count >= 1, got " + std::to_string(o.batch));
  if (o.out_jsonl.empty()) throw Error("--out-jsonl: expected a path for the results of --prompts, got none");
  if (!o.prompt.empty()) throw Error("--prompt: expected none with --prompts (one prompt per line of the file), got one");
  std::error_code ec;
  if (std::filesystem::is_directory(o.prompts, ec))
    throw Error("--prompts: expected a file of prompts, got the directory '" + o.prompts + "'");
  std::ifstream in(o.prompts, std::ios::binary);
  if (!in) throw Error("--prompts: cannot open '" + o.prompts + "' for reading");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  std::vector<std::vector<int>> prompts;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    prompts.push_back(tok.encode(lines[i], /*bos=*/true, /*eos=*/false));
    const auto n = static_cast<int>(prompts.back().size());
    if (n > o.steps)
      throw Error("--prompts: line " + std::to_string(i + 1) + " has " + std::to_string(n) +
                  " tokens (BOS included), more than --steps (" + std::to_string(o.steps) + ")");
  }
  std::vector<Sampler> samplers(prompts.size(), Sampler(sc));
  LlamaBatch model(weights, o.batch, lo);
  GenerationStats st;
  const auto seqs = generate_batch(
      model, prompts, o.steps, o.batch,
      [&](std::size_t i, std::span<const float> logits) { return samplers[i].sample(logits); }, &st);
  std::string jsonl;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const nlohmann::json j = {{"prompt", lines[i]}, {"text", sequence_text(tok, seqs[i])}};
    jsonl += j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  }
  try {
    detail::write_file_atomically(o.out_jsonl, jsonl);
  } catch (const Error& e) {
    throw Error(std::string("--out-jsonl: ") + e.what());
  }
  std::fprintf(stderr, "%zu prompts, batch %d: %lld prompt + %lld generated tokens in %.3f ms (%.0f tok/s), %lld steps",
               prompts.size(), o.batch, static_cast<long long>(st.prompt_tokens),
               static_cast<long long>(st.generated_tokens), st.decode_seconds * 1e3,
               rate(st.prompt_tokens + st.generated_tokens, st.decode_seconds), static_cast<long long>(st.decode_steps));
  if (o.temperature > 0) std::fprintf(stderr, "; seed %llu", static_cast<unsigned long long>(sc.seed));
  std::fprintf(stderr, "\n");
}

void run_generate(const GenerateOptions& o) {
  // Checked before the files are read, so a bad flag is named even when the files are fine.
  if (!std::isfinite(o.temperature) || o.temperature < 0)
    throw Error("--temperature: expected a number >= 0 (0 = greedy), got " + std::to_string(o.temperature));
  if (!(o.top_p > 0 && o.top_p <= 1))
    throw Error("--top-p: expected a number in (0, 1], got " + std::to_string(o.top_p));
  if (o.steps < 1) throw Error("--steps: expected a count >= 1, got " + std::to_string(o.steps));
  auto [weights, tok] = load_model(o.model, o.tokenizer);
  const int max_seq = weights.config.max_seq_len;
  if (o.steps > max_seq)
    throw Error("--steps: expected at most the model's max_seq_len (" + std::to_string(max_seq) + "), got " +
                std::to_string(o.steps));
  if (!o.prompts.empty()) {
    SamplerConfig sc;
    sc.temperature = o.temperature;
    sc.top_p = o.top_p;
    sc.seed = o.seed;
    if (sc.seed == 0)
      sc.seed = static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) | 1u;
    LlamaOptions lo;
    lo.attention_kernel = o.reference ? KernelKind::reference : KernelKind::automatic;
    lo.num_threads = o.threads;
    lo.batch_invariant = true;
    lo.kv_k_format = lo.kv_v_format = parse_kv_format(o.kv_dtype, "--kv-dtype");
    return run_generate_batch(o, weights, tok, sc, lo);
  }
  if (!o.out_jsonl.empty()) throw Error("--out-jsonl: expected --prompts FILE with it, got none");
  const std::vector<int> prompt = tok.encode(o.prompt, /*bos=*/true, /*eos=*/false);
  const auto n = static_cast<int>(prompt.size());
  if (n > max_seq)
    throw Error("--prompt: " + std::to_string(n) + " tokens (BOS included) exceed the model's max_seq_len (" +
                std::to_string(max_seq) + ")");
  if (n > o.steps)
    throw Error("--steps: expected at least the prompt's " + std::to_string(n) +
                " tokens (BOS included), got " + std::to_string(o.steps));
  SamplerConfig sc;
  sc.temperature = o.temperature;
  sc.top_p = o.top_p;
  sc.seed = o.seed;
  if (sc.seed == 0)
    sc.seed = static_cast<std::uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) | 1u;
  Sampler sampler(sc);
  LlamaOptions lo;
  lo.attention_kernel = o.reference ? KernelKind::reference : KernelKind::automatic;
  lo.num_threads = o.threads;
  // The batch-invariant attention, so that --prompts gives every prompt these very bits.
  lo.batch_invariant = true;
  lo.kv_k_format = lo.kv_v_format = parse_kv_format(o.kv_dtype, "--kv-dtype");
  Llama model(weights, lo);
  GenerationStats st;
  generate(
      model, prompt, o.steps, [&](std::span<const float> logits) { return sampler.sample(logits); },
      [&](int prev, int token) {
        const std::string_view piece = printable_piece(tok.decode(prev, token));
        std::fwrite(piece.data(), 1, piece.size(), stdout);
        std::fflush(stdout);
      },
      &st);
  std::printf("\n");
  std::fflush(stdout);
  std::fprintf(stderr,
               "prefill: %lld tokens in %.3f ms (%.0f tok/s); decode: %lld tokens in %.3f ms (%.0f tok/s)",
               static_cast<long long>(st.prompt_tokens), st.prefill_seconds * 1e3,
               rate(st.prompt_tokens, st.prefill_seconds), static_cast<long long>(st.decode_steps),
               st.decode_seconds * 1e3, rate(st.decode_steps, st.decode_seconds));
  if (o.temperature > 0) std::fprintf(stderr, "; seed %llu", static_cast<unsigned long long>(sc.seed));
  std::fprintf(stderr, "\n");
}

}  // namespace

void add_generate(CLI::App& app) {
  auto opts = std::make_shared<GenerateOptions>();
  auto* cmd =
      app.add_subcommand("generate", "Generate text with a llama2.c checkpoint (Llama-2 on qkv attention)");
  cmd->add_option("--model", opts->model,
                  "llama2.c checkpoint (version 0 float32 or version 2 Q8_0; default: " +
                      default_model_help(kModelFile) + ")");
  cmd->add_option("--tokenizer", opts->tokenizer,
                  "llama2.c tokenizer.bin (default: " + default_model_help(kTokenizerFile) + ")");
  cmd->add_option("--prompt", opts->prompt, "text to continue (BOS and a leading space are added)");
  cmd->add_option("--prompts", opts->prompts,
                  "file of prompts, one per line: generated in batches (continuous batching), results to --out-jsonl");
  cmd->add_option("--batch", opts->batch, "with --prompts: sequences run at once")->capture_default_str();
  cmd->add_option("--out-jsonl", opts->out_jsonl,
                  "with --prompts: one JSON line per prompt, in order, {\"prompt\", \"text\"}; text as --prompt prints it (bytes not valid UTF-8 as U+FFFD)");
  cmd->add_option("--steps", opts->steps, "positions to run, the prompt's tokens included (<= max_seq_len)")
      ->capture_default_str();
  cmd->add_option("--temperature", opts->temperature, "sampling temperature, 0 = greedy")
      ->capture_default_str();
  cmd->add_option("--top-p", opts->top_p, "nucleus sampling mass in (0, 1], 1 = off")->capture_default_str();
  cmd->add_option("--seed", opts->seed, "random seed (default: from the clock, printed on stderr)")
      ->check(CLI::Validator(
          [](std::string& v) {
            return !v.empty() && v.find_first_not_of("0123456789") == std::string::npos
                       ? std::string()
                       : "expected a non-negative integer, got '" + v + "'";
          },
          "UINT"));
  cmd->add_flag("--reference", opts->reference, "run every attention call on the float64 reference kernel");
  cmd->add_option("--threads", opts->threads, "threads per attention call (0 = OpenMP default)");
  cmd->add_option("--kv-dtype", opts->kv_dtype,
                  "format of the cached keys and values: f32, bf16, f16, int8, q8_0 or fp8 (docs/accuracy.md)")
      ->capture_default_str();
  cmd->callback([opts] { run_generate(*opts); });
}

}  // namespace qkv::cli
