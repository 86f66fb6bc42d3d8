#pragma once
/// @file llama.hpp
/// A Llama-2 decoder forward pass built from qkv's layers, for llama2.c checkpoints (llama2c.hpp).
///
/// Architecture (Touvron et al. 2023, "Llama 2", sec. 2.2, with the details of Meta's reference
/// code and of llama2.c's run.c, https://github.com/karpathy/llama2.c, MIT licence). Per token,
/// x = token_embedding[token]; then for each of the n_layers blocks:
///   h = RMSNorm(x) * rms_att                       (Zhang & Sennrich 2019, eps = 1e-5)
///   q = h Wq^T, k = h Wk^T, v = h Wv^T             heads: q [Hq, D], k and v [Hkv, D]
///   q, k rotated by RoPE, interleaved pairs (2j, 2j+1), theta 10000, at the token's position
///   k, v appended to the layer's KVCache; o = causal attention of q over the cache (GQA: query
///   head h reads KV head h / (Hq/Hkv)), scale 1/sqrt(D)
///   x += o Wo^T
///   h = RMSNorm(x) * rms_ffn
///   x += (SiLU(h W1^T) * (h W3^T)) W2^T            (SwiGLU, Shazeer 2020)
/// then logits = (RMSNorm(x) * rms_final) Wcls^T (Wcls = token_embedding when shared).
///
/// Execution: all projections are matrix products (OpenBLAS sgemm in blocks fixed by the shape,
/// bitwise independent of the thread count: docs/threads.md) over the rows of every token of the call
/// (a prefill of S tokens is one [S, dim] x [dim, N] GEMM per projection; q, k and v share one
/// GEMM, as do W1 and W3: the loader packs those weights); attention runs through
/// KVCache::attend, i.e. qkv::attention() with Sq = S (the fused kernel for a prefill, the decode
/// kernel for S = 1 where the dispatcher picks them), or the float64 reference when
/// LlamaOptions::attention_kernel says so. Activations are float32.
///
/// Inspection: with LlamaOptions::record_queries, the post-RoPE queries of every position are kept,
/// so that queries(l), keys(l), values(l) give the q, k, v of layer l for the whole run and
/// attention_weights(l, pos) recomputes the attention weights of one position (used by
/// `qkv demo`). The float64 reference::llama_forward() is the executable specification of the
/// whole forward pass.

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/kv_cache.hpp"
#include "qkv/kv_quant.hpp"
#include "qkv/llama2c.hpp"
#include "qkv/rope.hpp"
#include "qkv/tensor.hpp"

namespace qkv {

/// Options of a Llama runner.
struct LlamaOptions {
  /// Kernel of every attention call: automatic (the dispatcher's choice: fused/decode kernels),
  /// or KernelKind::reference to force the float64 reference kernel.
  KernelKind attention_kernel = KernelKind::automatic;
  /// Threads inside each attention call (0 = OpenMP's default). GEMMs use OpenBLAS's own setting.
  int num_threads = 0;
  /// Keep the post-RoPE queries of every position of every layer (n_layers * max_seq_len * dim
  /// floats) for queries() and attention_weights().
  bool record_queries = false;
  /// RoPE angle precision (rope.hpp): f64 (exact) or llama2c_f32 (bit-for-bit llama2.c's floats).
  RopeAngles rope_angles = RopeAngles::f64;
  /// Attention through the batch-invariant serving kernel (KVCache::attend_varlen; with
  /// attention_kernel automatic): every position's bits are then those LlamaBatch computes for
  /// the same sequence in any batch (qkv generate uses it, so --prompts reproduces --prompt).
  bool batch_invariant = false;
  /// Formats of the cached keys and values (qkv/kv_quant.hpp): f32 (default), bf16, f16, int8,
  /// q8_0, fp8 (per-head scale 1). Quantized caches attend through the serving kernel on the
  /// codes (attention_kernel automatic, or reference on the dequantized values); keys(),
  /// values() and layer_attention() need f32.
  KVFormat kv_k_format = KVFormat::f32;
  KVFormat kv_v_format = KVFormat::f32;
};

/// A Llama-2 model with its per-layer KV caches (batch 1): feed tokens, read logits.
/// Not thread-safe (one sequence, mutated by forward()); copies are not allowed.
class Llama {
 public:
  static constexpr double rms_eps = 1e-5;
  static constexpr double rope_theta = 10000.0;

  /// Packs the weights (a copy of wq|wk|wv and w1|w3 per layer; the rest is shared with `model`)
  /// and allocates a KV cache of max_seq_len positions per layer.
  /// @throws qkv::Error if the model has no layers or weights (a default-constructed model).
  explicit Llama(const Llama2cModel& model, const LlamaOptions& options = {});
  Llama(const Llama&) = delete;
  Llama& operator=(const Llama&) = delete;
  Llama(Llama&&) noexcept;
  Llama& operator=(Llama&&) noexcept;
  ~Llama();

  const Llama2cConfig& config() const noexcept;
  const LlamaOptions& options() const noexcept;
  /// Number of positions processed so far (held in the KV caches): the next token's position.
  std::int64_t length() const noexcept;
  /// Forgets the sequence (KV caches emptied); weights are kept.
  void reset() noexcept;

  /// Runs `tokens` at positions length() .. length()+n-1 in one pass: a prefill when n > 1, a
  /// decode step when n == 1. Returns float32 logits, [n, vocab_size] when all_logits, else
  /// [1, vocab_size] for the last token only. The view stays valid until the next forward() or
  /// reset().
  /// @throws qkv::Error for n == 0, a token outside [0, vocab_size), or length()+n > max_seq_len
  ///         (nothing is changed then).
  TensorView forward(std::span<const int> tokens, bool all_logits = false);

  /// The KV cache of layer l: K [1, Hkv, max_seq_len, D] (post-RoPE) and V, length() positions.
  /// @throws qkv::Error if l is outside [0, n_layers).
  const KVCache& cache(int layer) const;
  /// Post-RoPE queries of layer l: float32 [length(), Hq, D] (requires record_queries).
  /// @throws qkv::Error for a bad layer, or when queries are not recorded.
  TensorView queries(int layer) const;
  /// Post-RoPE keys and the values of layer l: float32 [Hkv, length(), D], views into the cache.
  TensorView keys(int layer) const;
  TensorView values(int layer) const;

  /// The attention weights of position `pos` in layer `layer`, per query head, over positions
  /// 0..pos: float64 [Hq, pos+1], each row summing to 1. Recomputed by qkv::reference::attention
  /// (probs output) from the recorded query and the cached keys, so they are the weights of the
  /// exact float64 softmax of the scores the run used. Requires record_queries.
  /// @throws qkv::Error for a bad layer, pos outside [0, length()), or queries not recorded.
  Tensor attention_weights(int layer, std::int64_t pos) const;

  /// The inputs of layer l's attention over the whole run, as the BHSD views qkv::attention and
  /// qkv::explain::trace_attention take (batch 1, S = length()):
  ///   q [1, Hq, S, D] post-RoPE queries (strides {S*Hq*D, D, Hq*D, 1}: the recorded [S, Hq, D]),
  ///   k, v [1, Hkv, S, D] views into the KV cache,
  /// all float32, and the AttentionParams the layer ran with (causal, the default scale
  /// 1/sqrt(D); Sq = Sk, so the diagonal alignment does not matter). Attention on them gives,
  /// for every position, the weights of attention_weights() and the output the layer computed.
  /// The views stay valid until the next forward() or reset(). Requires record_queries.
  /// @throws qkv::Error for a bad layer or when queries are not recorded.
  struct LayerAttention {
    TensorView q, k, v;
    AttentionParams params;
  };
  LayerAttention layer_attention(int layer) const;

 private:
  struct Impl;
  Impl* impl_ = nullptr;
};

/// Timings and counts of one generate() call.
struct GenerationStats {
  std::int64_t prompt_tokens = 0;     ///< tokens prefilled (BOS included)
  std::int64_t generated_tokens = 0;  ///< tokens sampled (the BOS that stops generation excluded)
  std::int64_t decode_steps = 0;      ///< single-token forward() calls
  double prefill_seconds = 0.0;       ///< wall time of the prefill forward()
  double decode_seconds = 0.0;        ///< wall time of the decode forward() calls
};

/// Autoregressive generation as llama2.c's generate(): `steps` counts forward positions including
/// the prompt's (prompt[0] is normally BOS). The whole prompt is prefilled in one forward(); each
/// sampled token is then fed back one at a time. Generation stops after `steps` positions have
/// been run (the last sampled token is kept, not fed) or when the sampler returns BOS (token 1,
/// not kept). `sample` maps the logits [vocab_size] of the newest position to the next token.
/// `on_token(prev, token)` is called for every token after the first (prompt tokens included, in
/// order) as soon as it is known, so the caller can print text as it is produced.
/// The model is reset() first. Returns the sequence: prompt then the sampled tokens.
/// @throws qkv::Error for an empty prompt, a prompt longer than max_seq_len, steps outside
///         [prompt size, max_seq_len], or a token outside the vocabulary.
std::vector<int> generate(Llama& model, std::span<const int> prompt, int steps,
                          const std::function<int(std::span<const float>)>& sample,
                          const std::function<void(int, int)>& on_token = {},
                          GenerationStats* stats = nullptr);

/// Many sequences at once over paged KV caches (one PagedKVCache per layer): continuous batching,
/// where any set of live sequences, each with its own number of new tokens (a whole prompt, or one
/// decode token), runs in one step(). Per sequence, every computation is the one Llama::forward
/// does with LlamaOptions::batch_invariant for that sequence alone: the projections are
/// matrix products over that sequence's rows of the step, and the attention of all sequences is
/// one attention_paged call per layer (batch invariant, qkv/varlen.hpp), so a sequence's logits
/// are bitwise those of Llama (batch_invariant) fed the same tokens in the same calls.
/// Not thread-safe.
class LlamaBatch {
 public:
  /// Packs the weights as Llama does and allocates, per layer, a pool of num_blocks blocks of
  /// block_size positions (0: room for max_sequences sequences of max_seq_len positions).
  /// @throws qkv::Error as Llama, or for max_sequences < 1, block_size < 16, num_blocks < 0.
  LlamaBatch(const Llama2cModel& model, std::int64_t max_sequences, const LlamaOptions& options = {},
             std::int64_t block_size = 16, std::int64_t num_blocks = 0);
  LlamaBatch(const LlamaBatch&) = delete;
  LlamaBatch& operator=(const LlamaBatch&) = delete;
  ~LlamaBatch();
  const Llama2cConfig& config() const noexcept;
  /// A new sequence (position 0); returns its id (freed ids are reused).
  std::int64_t add_sequence();
  /// Frees the sequence's pages in every layer. @throws qkv::Error for an id not live.
  void free_sequence(std::int64_t seq);
  /// Positions processed for `seq`. @throws qkv::Error for an id not live.
  std::int64_t length(std::int64_t seq) const;
  /// One step: counts[b] tokens of seqs[b] (distinct, live), packed in order in `tokens`, at
  /// positions length(seqs[b]) onwards. Returns float32 logits [seqs.size(), vocab_size] of each
  /// sequence's last token (a row of zeros for a count of 0), valid until the next step().
  /// @throws qkv::Error for a sequence not live or repeated, counts of another size than seqs,
  ///         a sum of counts other than tokens.size(), a token outside the vocabulary, a sequence
  ///         passing max_seq_len, or a pool too short (the step's sequences may then be freed).
  TensorView step(std::span<const std::int64_t> seqs, std::span<const std::int64_t> counts,
                  std::span<const int> tokens);

 private:
  struct Impl;
  Impl* impl_ = nullptr;
};

/// Generation of many prompts with continuous batching: at most `max_batch` sequences run at
/// once; each step prefills the prompts admitted in it (in one pass each) and decodes one token of
/// every other running sequence; a finished sequence (as generate(): `steps` positions, or BOS
/// sampled) frees its pages and the next waiting prompt takes its place. `sample(i, logits)`
/// picks the next token of prompt i (give each prompt its own Sampler). Returns each prompt's
/// sequence (prompt then sampled tokens), in the prompts' order; with Llama (batch_invariant) and
/// the same samplers, generate() gives the same sequences one prompt at a time.
/// `stats`: prompt_tokens and generated_tokens summed, decode_steps = steps run, prefill_seconds
/// = 0, decode_seconds = the wall time of all steps.
/// @throws qkv::Error as generate() for each prompt, or for max_batch < 1.
std::vector<std::vector<int>> generate_batch(LlamaBatch& model, const std::vector<std::vector<int>>& prompts, int steps,
                                             int max_batch,
                                             const std::function<int(std::size_t, std::span<const float>)>& sample,
                                             GenerationStats* stats = nullptr);

namespace reference {

/// The float64 specification of Llama::forward(): the same model evaluated from scratch on
/// `tokens` (positions 0..n-1) with every product, norm, RoPE angle and softmax in double and the
/// attention by qkv::reference::attention on float64 tensors. Returns the logits [n, vocab_size],
/// row-major. Cost O(n * parameters + n^2 * dim); meant for tests.
/// @throws qkv::Error for an empty or too long sequence or a token outside the vocabulary.
std::vector<double> llama_forward(const Llama2cModel& model, std::span<const int> tokens);

}  // namespace reference
}  // namespace qkv
