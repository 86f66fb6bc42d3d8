#pragma once
/// @file train.hpp
/// A small transformer trained on the CPU with qkv's attention layer (forward and backward), on
/// tasks generated from a seed; and the scaling study, which trains it with the attention scale
/// 1/sqrt(d_k), 1 and 1/d_k (Vaswani et al. 2017, sec. 3.2.1 and footnote 4: unscaled dot
/// products of variance d_k push the softmax towards one-hot, where its gradient vanishes).
///
/// The model (pre-norm, as GPT-2; Radford et al. 2019), all float32, matrix products on BLAS:
///   x0[t]  = E_tok[tok_t] + E_prev[tok_{t-1}] + E_pos[t]          (tok_{-1} = the start row V)
///   per block:  h = x + MHA(rmsnorm(x) * g1)                      (qkv::MultiHeadAttention, causal)
///               x = h + W2 gelu(W1 (rmsnorm(h) * g2) + b1) + b2   (GELU, tanh form; Hendrycks 2016)
///   logits = (rmsnorm(x) * g_f) W_u^T,  loss = mean cross-entropy over the scored positions
/// RMSNorm: Zhang & Sennrich 2019, eps 1e-5. E_prev, the previous token's embedding, is a width-2
/// causal convolution of the one-hot tokens (the "shift" of H3, Fu et al. 2023): with it a single
/// attention layer can solve associative recall by matching a query against the key that came
/// before each value.
/// The MHA has head_dim = d_k independent of d_model, so d_k changes the variance of q.k (W_Q
/// and W_K start N(0, 1/d_model), the normed input has unit RMS, so q.k has variance ~d_k at
/// the start) and nothing else.
///
/// Optimizer: AdamW (Loshchilov & Hutter 2019) with bias correction, decoupled weight decay on
/// matrices only, global gradient-norm clipping (Pascanu et al. 2013), linear warm-up.
///
/// Determinism: the same TrainConfig gives bitwise the same losses and weights for every
/// TrainConfig::threads (qkv's attention is thread-count independent; every matrix product is
/// cut into blocks fixed by its shape, each one single-threaded OpenBLAS call, whatever the
/// thread count: docs/threads.md; every other reduction here is serial).
/// Threads: TrainConfig::threads goes to each attention call; OpenBLAS (OpenMP build) follows
/// OpenMP's setting, which the caller sets (omp_set_num_threads, or OMP_NUM_THREADS).

#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "qkv/mha.hpp"
#include "qkv/tensor.hpp"

namespace qkv::train {

/// The tasks, generated on the fly from a seed.
enum class Task {
  /// Multi-query associative recall (Arora et al. 2023, "Zoology", MQAR): n_pairs key-value pairs
  /// k1 v1 ... kn vn with distinct keys, then n_queries of those keys, each followed by its value:
  /// the value is scored at each query position. Keys and values have separate vocabularies.
  recall,
  /// Copying: n_copy distinct tokens, a separator, the same tokens again; each token of the copy
  /// is scored (predicted from the tokens before it).
  copy,
};

/// "recall" or "copy". @throws qkv::Error for another name.
Task parse_task(const std::string& name);
const char* task_name(Task task) noexcept;

/// The sizes of a task (vocabulary and sequence length follow from them).
struct TaskConfig {
  Task task = Task::recall;
  std::int64_t n_keys = 16, n_values = 16, n_pairs = 8, n_queries = 4;  ///< recall
  std::int64_t n_symbols = 16, n_copy = 8;                             ///< copy
};

/// Vocabulary size V of a task: recall n_keys + n_values; copy n_symbols + 1 (the separator).
std::int64_t vocab_size(const TaskConfig& t);
/// Sequence length T: recall 2 * (n_pairs + n_queries); copy 2 * n_copy + 1.
std::int64_t seq_len(const TaskConfig& t);
/// @throws qkv::Error naming the field for sizes that cannot make a sequence (recall: n_pairs >
/// n_keys, n_queries > n_pairs, a size < 1; copy: n_copy > n_symbols, a size < 1).
void check_task(const TaskConfig& t);

/// A batch: tokens and targets [batch, T] row-major; target -1 = the position is not scored,
/// else the token that must be predicted at that position (the next token).
struct Batch {
  std::int64_t batch = 0, T = 0;
  std::vector<std::int32_t> tokens, targets;
};

/// `batch` sequences of task t from the random stream `seed`, `index` (the same (seed, index)
/// always gives the same batch). @throws qkv::Error as check_task(), or batch < 1.
Batch make_batch(const TaskConfig& t, std::int64_t batch, std::uint64_t seed, std::uint64_t index);

/// The model's shape and the attention options it is trained with.
struct ModelConfig {
  std::int64_t vocab = 0, seq_len = 0;      ///< from the task
  std::int64_t d_model = 64, num_heads = 2, d_k = 16, d_ff = 128, n_layers = 1;
  double scale = 0.25;                      ///< multiplied into q.k (1/sqrt(d_k) for d_k = 16)
};

/// One named parameter: its weights and its gradient (float32 views of equal shape), and
/// whether AdamW decays it (matrices yes; gains, biases and embeddings no).
struct Param {
  std::string name;
  TensorView value, grad;
  bool decay = false;
};

/// Measurements of one training step (before its update).
struct StepStats {
  double loss = 0;           ///< mean cross-entropy over the scored positions (nats)
  double accuracy = 0;       ///< fraction of scored positions whose argmax is the target
  double grad_norm = 0;      ///< global gradient norm before clipping
  double grad_wq = 0;        ///< Frobenius norm of dL/dW_Q over every block (before clipping)
  double grad_wk = 0;        ///< the same for W_K
  /// Attention statistics over every head and block and the scored rows (the rows the task is
  /// decided on); NaN unless computed (TrainConfig::attention_stats).
  double max_weight = 0;     ///< mean largest attention weight of a row
  double entropy = 0;        ///< mean entropy of a row's weights (nats)
  double saturated = 0;      ///< fraction of rows with ||diag(a) - a a^T||_F < 0.01
};

/// The model: parameters, gradients, forward and backward.
class Model {
 public:
  /// Weights drawn from `seed`: embeddings N(0, 1), W_Q, W_K, W_V, W1, W_u N(0, 1/d_model),
  /// W_O and W2 N(0, 1/(fan_in * 2 n_layers)) (GPT-2's residual scaling), biases 0, gains 1.
  /// @throws qkv::Error naming the field for a size < 1 or a non-finite scale.
  Model(const ModelConfig& config, std::uint64_t seed);

  const ModelConfig& config() const noexcept { return cfg_; }
  /// Every parameter, in a fixed order (embeddings, then each block's g1, in_proj_weight,
  /// in_proj_bias, out_proj weight and bias, g2, W1, b1, W2, b2, then g_f and W_u).
  std::vector<Param> parameters() const;
  /// The attention layer of block l.
  const MultiHeadAttention& attention(std::int64_t l) const;

  /// Forward and backward on one batch: sets every gradient (not accumulated), returns the loss
  /// and accuracy; with `attention_stats` also fills the attention statistics. The attention
  /// calls run on `threads` threads (0 = OpenMP's default).
  /// @throws qkv::Error when the batch does not match the config (T, token range).
  StepStats forward_backward(const Batch& batch, bool attention_stats, int threads);
  /// The loss only (no gradients touched).
  double loss(const Batch& batch, int threads) const;

  /// Wall seconds spent per phase by forward_backward() since construction: embedding, norms
  /// and residuals; attention layer forward; attention layer backward; feed-forward forward and
  /// backward; unembedding and loss; attention statistics.
  struct Profile {
    double embed_norm = 0, mha_forward = 0, mha_backward = 0, ffn = 0, head_loss = 0, stats = 0;
  };
  const Profile& profile() const noexcept { return prof_; }

 private:
  ModelConfig cfg_;
  std::vector<MultiHeadAttention> mha_;
  std::vector<MhaGrads> mha_grads_;
  std::vector<Tensor> own_;    // the parameters that are not the attention layers'
  std::vector<Tensor> own_g_;  // their gradients
  Profile prof_;

  StepStats run(const Batch& batch, std::vector<MhaGrads>* grads, bool attention_stats, int threads,
                Profile* prof) const;
};

/// The loss of `model` on `batch` computed in float64 by plain loops (an independent
/// specification of Model's forward, for gradient checks), with the parameters `params`
/// (model.parameters()'s order and shapes, as float64) in place of the model's own.
/// @throws qkv::Error if params do not match the model's parameters.
double reference_loss(const Model& model, const Batch& batch, std::span<const std::vector<double>> params);
/// The model's parameters widened to float64, in parameters() order.
std::vector<std::vector<double>> parameters_f64(const Model& model);

/// One training run's settings.
struct TrainConfig {
  TaskConfig task;
  ModelConfig model;           ///< vocab and seq_len are filled from the task
  std::int64_t steps = 300, batch = 32, warmup = 30;
  double lr = 3e-3, beta1 = 0.9, beta2 = 0.98, eps = 1e-8, weight_decay = 0.01, clip = 1.0;
  std::uint64_t seed = 1;      ///< the weights' and the data's streams both derive from it
  int threads = 0;             ///< attention threads (0 = OpenMP's default)
  bool attention_stats = true; ///< measure the attention statistics every step
};

/// A training run: the model, AdamW's state, the data stream.
class Trainer {
 public:
  /// @throws qkv::Error for invalid task or model sizes, steps < 0, batch < 1, lr <= 0, or
  ///         beta1/beta2 outside [0, 1).
  explicit Trainer(const TrainConfig& config);
  /// Runs step number step() + 1: a fresh batch, forward, backward, clipping, AdamW.
  StepStats step();
  std::int64_t steps_done() const noexcept { return t_; }
  const Model& model() const noexcept { return model_; }
  Model& model() noexcept { return model_; }
  /// Wall seconds spent in AdamW and clipping.
  double optimizer_seconds() const noexcept { return opt_s_; }

 private:
  TrainConfig cfg_;
  Model model_;
  std::vector<Param> params_;
  std::vector<std::vector<float>> m_, v_;
  std::int64_t t_ = 0;
  double opt_s_ = 0;
};

// ---- the scaling study ---------------------------------------------------------------------

/// Which scale a run uses, as a rule of d_k.
enum class ScaleRule { inv_sqrt_dk, one, inv_dk };
double scale_of(ScaleRule rule, std::int64_t d_k) noexcept;
const char* scale_rule_name(ScaleRule rule) noexcept;  ///< "1/sqrt(d_k)", "1", "1/d_k"

struct StudyOptions {
  TrainConfig base;                                      ///< everything but d_k, scale and seed
  std::vector<std::int64_t> d_k = {16, 64, 256};
  std::vector<ScaleRule> rules = {ScaleRule::inv_sqrt_dk, ScaleRule::one, ScaleRule::inv_dk};
  std::vector<std::uint64_t> seeds = {1, 2, 3};
  double target_accuracy = 0.9;                          ///< for "steps to reach"
  /// Runs trained at once (OpenMP threads, >= 1). Inside them BLAS runs on one thread (OpenMP's
  /// nested regions are off) and so should the attention (base.threads = 1). The rows do not
  /// depend on it: each run is independent and they are gathered in a fixed order.
  int parallel_runs = 1;
};

/// One row of the study: a run's step.
struct StudyRow {
  ScaleRule rule = ScaleRule::inv_sqrt_dk;
  double scale = 0;
  std::int64_t d_k = 0;
  std::uint64_t seed = 0;
  std::int64_t step = 0;
  StepStats stats;
};

/// Runs every (rule, d_k, seed): rows in the order d_k, rule, seed, step. Calls `progress` after
/// each run (from the thread that ran it, one call at a time) with the run's index, the number of
/// runs and its wall seconds. @throws qkv::Error as Trainer, or parallel_runs < 1.
std::vector<StudyRow> run_study(const StudyOptions& options,
                                const std::function<void(std::size_t, std::size_t, double)>& progress = {});

/// CSV with a header: scale_rule, scale, d_k, seed, step, loss, accuracy, max_weight, entropy,
/// saturated_frac, grad_wq, grad_wk, grad_norm.
std::string study_csv(const std::vector<StudyRow>& rows);
/// The summary table (markdown): per rule and d_k, over seeds: steps to reach the target
/// accuracy (median and range; "-" for a run that never does), final loss (mean and min..max, over
/// the last 10% of steps), final accuracy, and the start and end mean largest weight.
std::string study_summary(const std::vector<StudyRow>& rows, const StudyOptions& options);
/// Writes study.csv, summary.md and a PNG and an SVG per quantity (loss, accuracy, max_weight,
/// entropy, saturated_frac, grad_wq, grad_wk) into `dir` (created if missing), each atomically.
/// Returns the files written. @throws qkv::Error if `dir` cannot be created or written.
std::vector<std::filesystem::path> write_study(const std::filesystem::path& dir,
                                               const std::vector<StudyRow>& rows, const StudyOptions& options);

}  // namespace qkv::train
