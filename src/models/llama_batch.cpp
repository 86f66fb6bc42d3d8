// LlamaBatch: the Llama-2 forward pass of llama.cpp for many sequences per step, over one
// PagedKVCache per layer, and generate_batch (continuous batching). Each sequence's rows go
// through the same calls as Llama::forward (batch_invariant) makes for it alone: GEMMs over that
// sequence's rows only, row-wise norms and activations, and batch-invariant attention.
#include <chrono>
#include <cstring>
#include <deque>
#include <string>

#include "models/llama_common.hpp"
#include "qkv/llama.hpp"
#include "qkv/paged_kv_cache.hpp"
#include "qkv/tokenizer.hpp"

namespace qkv {
using namespace llama_detail;

struct LlamaBatch::Impl {
  Llama2cModel model;
  LlamaOptions options;
  int dim = 0, kv_dim = 0, hidden = 0, Hq = 0, Hkv = 0, D = 0, vocab = 0, L = 0, max_seq = 0;
  std::vector<Tensor> wqkv, w13;
  std::vector<PagedKVCache> caches;
  Tensor logits;
};

LlamaBatch::LlamaBatch(const Llama2cModel& model, std::int64_t max_sequences, const LlamaOptions& options,
                       std::int64_t block_size, std::int64_t num_blocks)
    : impl_(new Impl) {
  Impl& m = *impl_;
  const Llama2cConfig& c = model.config;
  try {
    if (c.n_layers < 1 || static_cast<int>(model.layers.size()) != c.n_layers || !model.storage ||
        model.token_embedding.data() == nullptr)
      throw Error("llama: model: expected a loaded llama2.c checkpoint (read_llama2c), got an empty model");
    if (max_sequences < 1) throw Error("llama: max_sequences: expected >= 1, got " + std::to_string(max_sequences));
    if (num_blocks < 0) throw Error("llama: num_blocks: expected >= 0 (0 = enough for max_sequences), got " + std::to_string(num_blocks));
    m.model = model;
    m.options = options;
    m.dim = c.dim; m.kv_dim = c.kv_dim; m.hidden = c.hidden_dim; m.Hq = c.n_heads; m.Hkv = c.n_kv_heads;
    m.D = c.head_dim; m.vocab = c.vocab_size; m.L = c.n_layers; m.max_seq = c.max_seq_len;
    const std::int64_t bs = block_size;
    const std::int64_t nb = num_blocks > 0 ? num_blocks : max_sequences * ((m.max_seq + std::max<std::int64_t>(bs, 1) - 1) / std::max<std::int64_t>(bs, 1));
    for (const Llama2cLayer& layer : model.layers) {
      llama_detail::fuse_layer_weights(layer, m.dim, m.kv_dim, m.hidden, m.wqkv, m.w13);
      m.caches.emplace_back(nb, bs, m.Hkv, m.D, m.options.kv_k_format, m.options.kv_v_format);
    }
  } catch (...) {
    delete impl_;
    impl_ = nullptr;
    throw;
  }
}

LlamaBatch::~LlamaBatch() { delete impl_; }
const Llama2cConfig& LlamaBatch::config() const noexcept { return impl_->model.config; }

std::int64_t LlamaBatch::add_sequence() {
  std::int64_t id = -1;
  for (PagedKVCache& c : impl_->caches) id = c.add_sequence();  // the layers allocate ids in lockstep
  return id;
}
void LlamaBatch::free_sequence(std::int64_t seq) {
  for (PagedKVCache& c : impl_->caches) c.free_sequence(seq);
}
std::int64_t LlamaBatch::length(std::int64_t seq) const { return impl_->caches[0].length(seq); }

TensorView LlamaBatch::step(std::span<const std::int64_t> seqs, std::span<const std::int64_t> counts,
                            std::span<const int> tokens) {
  Impl& m = *impl_;
  if (counts.size() != seqs.size())
    throw Error("llama: counts: expected one count per sequence (" + std::to_string(seqs.size()) + "), got " +
                std::to_string(counts.size()));
  std::int64_t T = 0;
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    if (counts[b] < 0) throw Error("llama: counts: expected >= 0, got " + std::to_string(counts[b]));
    if (length(seqs[b]) + counts[b] > m.max_seq)
      throw Error("llama: tokens: " + std::to_string(counts[b]) + " more tokens of sequence " + std::to_string(seqs[b]) +
                  " exceed max_seq_len (" + std::to_string(length(seqs[b]) + counts[b]) + " > " + std::to_string(m.max_seq) + ")");
    T += counts[b];
  }
  if (T != static_cast<std::int64_t>(tokens.size()))
    throw Error("llama: tokens: expected sum(counts) = " + std::to_string(T) + " tokens, got " + std::to_string(tokens.size()));
  check_tokens(tokens, m.vocab, "llama: tokens");
  const int dim = m.dim, kv = m.kv_dim, hid = m.hidden, N = dim + 2 * kv;
  const std::int64_t n = static_cast<std::int64_t>(seqs.size());
  if (m.logits.shape() != Shape{n, m.vocab}) m.logits = Tensor(DType::f32, {n, m.vocab});
  std::memset(m.logits.data(), 0, m.logits.nbytes());
  if (T == 0) return m.logits.view();
  StepBuffers st(tokens, m.model.token_embedding.data_as<const float>(), dim, kv, hid);
  Tensor &att = st.att, &h13 = st.h13, &hb = st.hb;
  float *xd = st.x.data_as<float>(), *xbd = st.xb.data_as<float>(), *qd = st.qkv.data_as<float>();
  std::vector<std::int64_t> first(seqs.size());  // first row of each sequence
  for (std::size_t b = 0, r = 0; b < seqs.size(); r += counts[b], ++b) first[b] = static_cast<std::int64_t>(r);
  // c[rows of b] = a[rows of b] w^T for each sequence b: its own GEMM, as it would run alone.
  const auto per_seq = [&](int Ncols, int K, const float* a, int lda, const float* w, float beta, float* c, int ldc) {
    for (std::size_t b = 0; b < seqs.size(); ++b)
      if (counts[b] > 0)
        gemm_nt(static_cast<int>(counts[b]), Ncols, K, a + first[b] * lda, lda, w, K, beta, c + first[b] * ldc, ldc);
  };
  RopeConfig rope;
  rope.style = RopeStyle::interleaved;
  rope.theta = Llama::rope_theta;
  rope.angles = m.options.rope_angles;
  AttentionParams ap;
  ap.causal = true;
  ap.kernel = m.options.attention_kernel;
  ap.num_threads = m.options.num_threads;
  const TensorView q(qd, DType::f32, {T, m.Hq, m.D}, {N, m.D, 1});
  const TensorView k(qd + dim, DType::f32, {T, m.Hkv, m.D}, {N, m.D, 1});
  const TensorView v(qd + dim + kv, DType::f32, {T, m.Hkv, m.D}, {N, m.D, 1});
  const TensorView o(att.data(), DType::f32, {T, m.Hq, m.D}, {dim, m.D, 1});
  std::vector<std::int64_t> lengths(seqs.size());
  for (std::size_t b = 0; b < seqs.size(); ++b) lengths[b] = length(seqs[b]);
  for (int l = 0; l < m.L; ++l) {
    const Llama2cLayer& w = m.model.layers[static_cast<std::size_t>(l)];
    rmsnorm(xd, w.rms_att.data_as<const float>(), xbd, T, dim);
    per_seq(N, dim, xbd, dim, m.wqkv[static_cast<std::size_t>(l)].data_as<const float>(), 0.0f, qd, N);
    try {
      m.caches[static_cast<std::size_t>(l)].forward(seqs, counts, q, k, v, o, ap, rope);
    } catch (...) {
      // Layers before l have stored this step's keys: roll them back by rebuilding is not
      // possible per position, so a failing step leaves the earlier layers longer; forbid reuse.
      for (int r = 0; r < l; ++r)
        for (std::size_t b = 0; b < seqs.size(); ++b)
          if (m.caches[static_cast<std::size_t>(r)].length(seqs[b]) != lengths[b]) {
            free_sequence(seqs[b]);
            break;
          }
      throw;
    }
    per_seq(dim, dim, att.data_as<const float>(), dim, w.wo.data_as<const float>(), 1.0f, xd, dim);
    rmsnorm(xd, w.rms_ffn.data_as<const float>(), xbd, T, dim);
    float* h = h13.data_as<float>();
    per_seq(2 * hid, dim, xbd, dim, m.w13[static_cast<std::size_t>(l)].data_as<const float>(), 0.0f, h, 2 * hid);
    swiglu(h, hb.data_as<float>(), T, hid);
    per_seq(dim, hid, hb.data_as<const float>(), hid, w.w2.data_as<const float>(), 1.0f, xd, dim);
  }
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    if (counts[b] == 0) continue;
    const std::int64_t last = first[b] + counts[b] - 1;
    rmsnorm(xd + last * dim, m.model.rms_final.data_as<const float>(), xbd, 1, dim);
    gemm_nt(1, m.vocab, dim, xbd, dim, m.model.wcls.data_as<const float>(), dim, 0.0f,
            m.logits.data_as<float>() + static_cast<std::int64_t>(b) * m.vocab, m.vocab);
  }
  return m.logits.view();
}

std::vector<std::vector<int>> generate_batch(LlamaBatch& model, const std::vector<std::vector<int>>& prompts, int steps,
                                             int max_batch,
                                             const std::function<int(std::size_t, std::span<const float>)>& sample,
                                             GenerationStats* stats) {
  const Llama2cConfig& c = model.config();
  if (max_batch < 1) throw Error("generate: max_batch: expected >= 1, got " + std::to_string(max_batch));
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const auto n = static_cast<std::int64_t>(prompts[i].size());
    const std::string which = "generate: prompt " + std::to_string(i);
    if (n == 0) throw Error(which + ": expected at least one token (BOS), got none");
    if (n > c.max_seq_len)
      throw Error(which + ": " + std::to_string(n) + " tokens (BOS included) exceed the model's max_seq_len (" +
                  std::to_string(c.max_seq_len) + ")");
    if (steps < n || steps > c.max_seq_len)
      throw Error("generate: steps: expected a count of positions in [prompt tokens, max_seq_len] = [" + std::to_string(n) +
                  ", " + std::to_string(c.max_seq_len) + "], got " + std::to_string(steps));
    check_tokens(prompts[i], c.vocab_size, which.c_str());
  }
  using clock = std::chrono::steady_clock;
  GenerationStats st;
  std::vector<std::vector<int>> out(prompts.size());
  struct Running { std::size_t prompt; std::int64_t seq; bool prefilled; };
  std::vector<Running> running;
  std::size_t next = 0;
  const auto t0 = clock::now();
  while (next < prompts.size() || !running.empty()) {
    while (static_cast<int>(running.size()) < max_batch && next < prompts.size()) {
      out[next] = prompts[next];
      st.prompt_tokens += static_cast<std::int64_t>(prompts[next].size());
      running.push_back({next++, model.add_sequence(), false});
    }
    std::vector<std::int64_t> seqs, counts;
    std::vector<int> tokens;
    for (const Running& r : running) {
      const std::vector<int>& s = out[r.prompt];
      seqs.push_back(r.seq);
      if (!r.prefilled) {
        counts.push_back(static_cast<std::int64_t>(s.size()));
        tokens.insert(tokens.end(), s.begin(), s.end());
      } else {
        counts.push_back(1);
        tokens.push_back(s.back());
      }
    }
    const TensorView logits = model.step(seqs, counts, tokens);
    ++st.decode_steps;
    std::vector<Running> still;
    for (std::size_t b = 0; b < running.size(); ++b) {
      Running r = running[b];
      r.prefilled = true;
      std::vector<int>& s = out[r.prompt];
      const int tok = sample(r.prompt, std::span<const float>(logits.data_as<const float>() + b * c.vocab_size,
                                                               static_cast<std::size_t>(c.vocab_size)));
      bool done = tok == Tokenizer::bos_id;
      if (!done) {
        if (tok < 0 || tok >= c.vocab_size)
          throw Error("generate: sample: returned token " + std::to_string(tok) + ", expected [0, " + std::to_string(c.vocab_size) + ")");
        s.push_back(tok);
        ++st.generated_tokens;
        done = model.length(r.seq) >= steps;
      }
      if (done) model.free_sequence(r.seq);
      else still.push_back(r);
    }
    running.swap(still);
  }
  st.decode_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  if (stats) *stats = st;
  return out;
}

}  // namespace qkv
