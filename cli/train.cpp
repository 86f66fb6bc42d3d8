// `qkv train`: trains the small transformer of qkv/train.hpp on a generated task and prints the
// loss and accuracy as it goes, then the throughput and where a step's time went; and
// `--study scaling --out DIR`, the scale 1/sqrt(d_k) vs 1 vs 1/d_k study (CSV, summary, figures).
#include <omp.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "commands.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/error.hpp"
#include "qkv/train.hpp"

namespace qkv::cli {
namespace {

struct TrainOptions {
  std::string task = "recall", scale = "1/sqrt(d_k)", study, out;
  std::int64_t d_k = 16, heads = 2, d_model = 64, d_ff = 128, layers = 1, steps = 300, batch = 32, warmup = 30;
  std::int64_t seeds = 3, log_every = 0, jobs = 2;
  double lr = 3e-3, clip = 1.0, weight_decay = 0.01, target = 0.9;
  std::uint64_t seed = 1;
  int threads = 1;
  bool quick = false, no_stats = false;
};

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// "1/sqrt(d_k)", "1/d_k" or a number.
double parse_scale(const std::string& s, std::int64_t d_k) {
  if (s == "1/sqrt(d_k)" || s == "sqrt") return train::scale_of(train::ScaleRule::inv_sqrt_dk, d_k);
  if (s == "1/d_k" || s == "dk") return train::scale_of(train::ScaleRule::inv_dk, d_k);
  try {
    std::size_t n = 0;
    const double v = std::stod(s, &n);
    if (n == s.size() && std::isfinite(v)) return v;
  } catch (const std::exception&) {
  }
  throw Error("--scale: expected '1/sqrt(d_k)', '1/d_k' or a finite number, got '" + s + "'");
}

train::TrainConfig config_of(const TrainOptions& o) {
  train::TrainConfig c;
  c.task.task = train::parse_task(o.task);
  c.model.d_k = o.d_k;
  c.model.num_heads = o.heads;
  c.model.d_model = o.d_model;
  c.model.d_ff = o.d_ff;
  c.model.n_layers = o.layers;
  c.model.scale = parse_scale(o.scale, o.d_k);
  c.steps = o.steps;
  c.batch = o.batch;
  c.warmup = o.warmup;
  c.lr = o.lr;
  c.clip = o.clip;
  c.weight_decay = o.weight_decay;
  c.seed = o.seed;
  c.threads = o.threads;
  c.attention_stats = !o.no_stats;
  return c;
}

// The attention core alone (qkv::attention + attention_backward) on one block's shapes, timed
// over `reps` calls: the part of the layer's time that is not its projections.
double attention_core_seconds(const train::TrainConfig& c, std::int64_t T, int reps) {
  const std::int64_t B = c.batch, H = c.model.num_heads, D = c.model.d_k;
  const Tensor q(DType::f32, {B, H, T, D}), k(DType::f32, {B, H, T, D}), v(DType::f32, {B, H, T, D});
  const Tensor o(DType::f32, {B, H, T, D}), lse(DType::f32, {B, H, T}), go(DType::f32, {B, H, T, D});
  const Tensor gq(DType::f32, {B, H, T, D}), gk(DType::f32, {B, H, T, D}), gv(DType::f32, {B, H, T, D});
  for (const Tensor* t : {&q, &k, &v, &go})
    for (std::int64_t i = 0; i < t->numel(); ++i) t->data_as<float>()[i] = static_cast<float>(std::sin(0.37 * i));
  AttentionParams p;
  p.causal = true;
  p.scale = c.model.scale;
  p.num_threads = c.threads;
  const auto t0 = Clock::now();
  for (int r = 0; r < reps; ++r) {
    attention(q, k, v, o, p, lse.view());  // the forward, and the backward's recomputation
    attention(q, k, v, o, p, lse.view());
    attention_backward(q, k, v, o, lse, go, gq, gk, gv, p);
  }
  return since(t0) / reps;
}

void run_single(const TrainOptions& o) {
  const train::TrainConfig c = config_of(o);
  train::Trainer tr(c);
  const train::ModelConfig& m = tr.model().config();
  std::printf("task %s (V = %lld, T = %lld), d_model %lld, %lld block(s) of %lld heads, d_k %lld, scale %.6g, "
              "batch %lld, seed %llu\n",
              o.task.c_str(), static_cast<long long>(m.vocab), static_cast<long long>(m.seq_len),
              static_cast<long long>(m.d_model), static_cast<long long>(m.n_layers), static_cast<long long>(m.num_heads),
              static_cast<long long>(m.d_k), m.scale, static_cast<long long>(c.batch),
              static_cast<unsigned long long>(c.seed));
  std::printf("%6s %9s %8s %10s %8s %9s %10s %10s\n", "step", "loss", "acc", "max_w", "entropy", "sat_frac", "|dWq|",
              "|dWk|");
  const std::int64_t every = o.log_every > 0 ? o.log_every : std::max<std::int64_t>(1, c.steps / 20);
  const auto t0 = Clock::now();
  for (std::int64_t s = 1; s <= c.steps; ++s) {
    const train::StepStats st = tr.step();
    if (s % every == 0 || s == 1 || s == c.steps)
      std::printf("%6lld %9.4f %8.3f %10.4f %8.4f %9.4f %10.3g %10.3g\n", static_cast<long long>(s), st.loss,
                  st.accuracy, st.max_weight, st.entropy, st.saturated, st.grad_wq, st.grad_wk);
  }
  const double total = since(t0);
  if (c.steps == 0) return;
  const double tokens = static_cast<double>(c.steps * c.batch * m.seq_len);
  std::printf("\n%lld steps in %.2f s: %.0f tokens/s (%.2f ms/step)\n", static_cast<long long>(c.steps), total,
              tokens / total, 1e3 * total / static_cast<double>(c.steps));
  const train::Model::Profile& p = tr.model().profile();
  const double core = attention_core_seconds(c, m.seq_len, 20) * static_cast<double>(m.n_layers * c.steps);
  const double mha = p.mha_forward + p.mha_backward;
  std::printf("where the time went (%% of the wall time):\n");
  auto row = [&](const char* what, double sec) {
    std::printf("  %-58s %7.3f s %5.1f%%\n", what, sec, 100 * sec / total);
  };
  row("attention layer forward (projections, attention, weights)", p.mha_forward);
  row("attention layer backward (recompute + attention bwd + grads)", p.mha_backward);
  row("  of which the attention core (fwd x2 + bwd, timed alone)", core);
  row("  of which projections and the rest (the difference)", mha - core);
  row("feed-forward forward + backward", p.ffn);
  row("unembedding + cross-entropy", p.head_loss);
  row("embeddings, RMSNorms, residuals", p.embed_norm);
  row("attention statistics (per row; the weights: in the forward)", p.stats);
  row("AdamW + clipping + gradient norms", tr.optimizer_seconds());
  row("other (batch generation)", total - p.mha_forward - p.mha_backward - p.ffn - p.head_loss - p.embed_norm -
                                     p.stats - tr.optimizer_seconds());
}

void run_study(const TrainOptions& o) {
  if (o.study != "scaling") throw Error("--study: expected 'scaling', got '" + o.study + "'");
  if (o.out.empty()) throw Error("--out: expected the output directory of --study (e.g. --out study)");
  train::StudyOptions so;
  so.base = config_of(o);
  so.target_accuracy = o.target;
  if (o.seeds < 1) throw Error("--seeds: expected >= 1, got " + std::to_string(o.seeds));
  so.seeds.clear();
  for (std::int64_t s = 0; s < o.seeds; ++s) so.seeds.push_back(o.seed + static_cast<std::uint64_t>(s));
  so.parallel_runs = static_cast<int>(o.jobs);
  if (o.quick) {  // the same study, reduced to run in well under a minute
    so.base.steps = std::min<std::int64_t>(so.base.steps, 60);
    so.base.batch = std::min<std::int64_t>(so.base.batch, 16);
    so.base.warmup = std::min<std::int64_t>(so.base.warmup, 10);
    so.seeds.resize(1);
  }
  std::printf("scaling study: %zu d_k x %zu scales x %zu seeds, %lld steps each, task %s, %d runs at once\n",
              so.d_k.size(), so.rules.size(), so.seeds.size(), static_cast<long long>(so.base.steps), o.task.c_str(),
              so.parallel_runs);
  const auto t0 = Clock::now();
  const auto rows = train::run_study(so, [&](std::size_t i, std::size_t n, double sec) {
    std::printf("  run %zu/%zu done in %.1f s\n", i + 1, n, sec);
    std::fflush(stdout);
  });
  const auto files = train::write_study(o.out, rows, so);
  std::printf("\n%s\nstudy wall time %.1f s; wrote %zu files to %s\n", train::study_summary(rows, so).c_str(),
              since(t0), files.size(), o.out.c_str());
}

}  // namespace

void add_train(CLI::App& app) {
  auto o = std::make_shared<TrainOptions>();
  auto* cmd = app.add_subcommand(
      "train", "train a small transformer with qkv's attention layer on a generated task (recall, copy), or run "
               "the scale study: --study scaling --out DIR");
  cmd->add_option("--task", o->task, "recall (multi-query associative recall) or copy")
      ->check(CLI::IsMember({"recall", "copy"}));
  cmd->add_option("--d-k", o->d_k, "head dimension d_k (default 16)")->check(CLI::Range(1, 4096));
  cmd->add_option("--heads", o->heads, "attention heads (default 2)")->check(CLI::Range(1, 256));
  cmd->add_option("--d-model", o->d_model, "model width (default 64)")->check(CLI::Range(1, 4096));
  cmd->add_option("--d-ff", o->d_ff, "feed-forward width (default 128)")->check(CLI::Range(1, 16384));
  cmd->add_option("--layers", o->layers, "transformer blocks (default 1)")->check(CLI::Range(1, 16));
  cmd->add_option("--scale", o->scale, "multiplies q.k: '1/sqrt(d_k)' (default), '1/d_k' or a number");
  cmd->add_option("--steps", o->steps, "training steps (default 300)")->check(CLI::Range(0, 10000000));
  cmd->add_option("--batch", o->batch, "sequences per step (default 32)")->check(CLI::Range(1, 65536));
  cmd->add_option("--warmup", o->warmup, "linear learning-rate warm-up steps (default 30)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--lr", o->lr, "AdamW learning rate (default 3e-3)")->check(CLI::PositiveNumber);
  cmd->add_option("--clip", o->clip, "global gradient-norm clip, 0 = none (default 1)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--weight-decay", o->weight_decay, "AdamW weight decay of the matrices (default 0.01)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--seed", o->seed, "seed of the weights and the data (study: the first seed; default 1)");
  cmd->add_option("--threads", o->threads, "threads of attention and BLAS (default 1: at these sizes two are slower; 0 = OpenMP's default)")
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--log-every", o->log_every, "print every N steps (default steps/20)")->check(CLI::NonNegativeNumber);
  cmd->add_flag("--no-stats", o->no_stats, "skip the attention statistics (faster)");
  cmd->add_option("--study", o->study, "run a study instead of one model: 'scaling'")
      ->check(CLI::IsMember({"scaling"}));
  cmd->add_option("--out", o->out, "output directory of --study (CSV, summary.md, PNG and SVG figures)");
  cmd->add_option("--seeds", o->seeds, "--study: seeds per configuration (default 3)")->check(CLI::Range(1, 1000));
  cmd->add_option("--jobs", o->jobs, "--study: runs trained at once, each on one thread (default 2)")
      ->check(CLI::Range(1, 256));
  cmd->add_option("--target", o->target, "--study: the accuracy whose first step the summary reports (default 0.9)")
      ->check(CLI::Range(0.0, 1.0));
  cmd->add_flag("--quick", o->quick, "--study: a reduced study (60 steps, batch 16, one seed)");
  cmd->callback([o] {
    if (o->threads > 0) omp_set_num_threads(o->threads);  // OpenBLAS (OpenMP build) follows it
    if (!o->study.empty())
      run_study(*o);
    else {
      if (!o->out.empty() || o->quick) throw Error("--out and --quick need --study scaling");
      run_single(*o);
    }
  });
}

}  // namespace qkv::cli
