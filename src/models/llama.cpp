// Llama-2 forward pass (architecture and sources in include/qkv/llama.hpp) on qkv's layers:
// detail::sgemm projections over all tokens of a call, apply_rope, KVCache::append and attend
// (or attend_varlen, the batch-invariant serving kernel).
#include "qkv/llama.hpp"

#include "models/llama_common.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include "qkv/error.hpp"
#include "qkv/reference.hpp"
#include "qkv/tokenizer.hpp"

namespace qkv {
using namespace llama_detail;

struct Llama::Impl {
  Llama2cModel model;
  LlamaOptions options;
  int dim = 0, kv_dim = 0, hidden = 0, Hq = 0, Hkv = 0, D = 0, vocab = 0, L = 0, max_seq = 0;
  std::vector<Tensor> wqkv;  // per layer [dim + 2 kv_dim, dim]: rows of wq, wk, wv
  std::vector<Tensor> w13;   // per layer [2 hidden, dim]: rows of w1, w3
  std::vector<KVCache> caches;
  std::vector<Tensor> rec_q;  // per layer [max_seq, Hq, D] when recording
  Tensor logits;
  std::int64_t length = 0;
};

Llama::Llama(const Llama2cModel& model, const LlamaOptions& options) : impl_(new Impl) {
  Impl& m = *impl_;
  const Llama2cConfig& c = model.config;
  if (c.n_layers < 1 || static_cast<int>(model.layers.size()) != c.n_layers || !model.storage ||
      model.token_embedding.data() == nullptr) {
    delete impl_;
    impl_ = nullptr;
    throw Error("llama: model: expected a loaded llama2.c checkpoint (read_llama2c), got an empty model");
  }
  m.model = model;
  m.options = options;
  m.dim = c.dim;
  m.kv_dim = c.kv_dim;
  m.hidden = c.hidden_dim;
  m.Hq = c.n_heads;
  m.Hkv = c.n_kv_heads;
  m.D = c.head_dim;
  m.vocab = c.vocab_size;
  m.L = c.n_layers;
  m.max_seq = c.max_seq_len;
  for (const Llama2cLayer& layer : model.layers) {
    llama_detail::fuse_layer_weights(layer, m.dim, m.kv_dim, m.hidden, m.wqkv, m.w13);
    m.caches.emplace_back(1, m.Hkv, m.max_seq, m.D, options.kv_k_format, options.kv_v_format);
    if (options.record_queries) m.rec_q.emplace_back(DType::f32, Shape{m.max_seq, m.Hq, m.D});
  }
}

Llama::Llama(Llama&& o) noexcept : impl_(std::exchange(o.impl_, nullptr)) {}
Llama& Llama::operator=(Llama&& o) noexcept {
  if (this != &o) {
    delete impl_;
    impl_ = std::exchange(o.impl_, nullptr);
  }
  return *this;
}
Llama::~Llama() { delete impl_; }

const Llama2cConfig& Llama::config() const noexcept { return impl_->model.config; }
const LlamaOptions& Llama::options() const noexcept { return impl_->options; }
std::int64_t Llama::length() const noexcept { return impl_->length; }

void Llama::reset() noexcept {
  for (KVCache& c : impl_->caches) c.clear();
  impl_->length = 0;
}

TensorView Llama::forward(std::span<const int> tokens, bool all_logits) {
  Impl& m = *impl_;
  const auto S = static_cast<std::int64_t>(tokens.size());
  if (S == 0) throw Error("llama: tokens: expected at least one token, got none");
  check_tokens(tokens, m.vocab, "llama: tokens");
  if (S > m.max_seq - m.length)
    throw Error("llama: tokens: " + std::to_string(S) + " more tokens at position " + std::to_string(m.length) +
                " exceed max_seq_len (" + std::to_string(m.length + S) + " > " + std::to_string(m.max_seq) + ")");
  const int dim = m.dim, kv = m.kv_dim, hid = m.hidden, Si = static_cast<int>(S);
  const int N = dim + 2 * kv;
  StepBuffers st(tokens, m.model.token_embedding.data_as<const float>(), dim, kv, hid);
  Tensor &att = st.att, &h13 = st.h13, &hb = st.hb;
  float *xd = st.x.data_as<float>(), *xbd = st.xb.data_as<float>(), *qd = st.qkv.data_as<float>();
  std::vector<std::int64_t> pos(static_cast<std::size_t>(S));
  for (std::int64_t t = 0; t < S; ++t) pos[static_cast<std::size_t>(t)] = m.length + t;
  RopeConfig rope;
  rope.style = RopeStyle::interleaved;
  rope.theta = rope_theta;
  rope.angles = m.options.rope_angles;
  AttentionParams ap;
  ap.causal = true;
  ap.kernel = m.options.attention_kernel;
  ap.num_threads = m.options.num_threads;
  // Heads are strided views of the packed projection rows (BSHD storage seen as BHSD).
  const TensorView q(qd, DType::f32, {1, m.Hq, S, m.D}, {S * N, m.D, N, 1});
  const TensorView k(qd + dim, DType::f32, {1, m.Hkv, S, m.D}, {S * N, m.D, N, 1});
  const TensorView v(qd + dim + kv, DType::f32, {1, m.Hkv, S, m.D}, {S * N, m.D, N, 1});
  const TensorView o(att.data(), DType::f32, {1, m.Hq, S, m.D}, {S * dim, m.D, dim, 1});
  for (int l = 0; l < m.L; ++l) {
    const Llama2cLayer& w = m.model.layers[static_cast<std::size_t>(l)];
    rmsnorm(xd, w.rms_att.data_as<const float>(), xbd, S, dim);
    gemm_nt(Si, N, dim, xbd, dim, m.wqkv[static_cast<std::size_t>(l)].data_as<const float>(), dim, 0.0f, qd,
            N);
    apply_rope(q, pos, rope);
    apply_rope(k, pos, rope);
    if (m.options.record_queries) {
      float* rq = m.rec_q[static_cast<std::size_t>(l)].data_as<float>();
      for (std::int64_t t = 0; t < S; ++t)
        std::memcpy(rq + (m.length + t) * dim, qd + t * N, static_cast<std::size_t>(dim) * sizeof(float));
    }
    KVCache& cache = m.caches[static_cast<std::size_t>(l)];
    cache.append(k, v);
    try {
      // The serving kernel (batch invariant: the bits LlamaBatch computes for this sequence), or
      // the kernel the dispatcher picks; a quantized cache always attends through the former.
      if (m.options.batch_invariant && ap.kernel == KernelKind::automatic)
        cache.attend_varlen(q, o, ap);
      else
        cache.attend(q, o, ap);
    } catch (...) {
      for (int r = 0; r <= l; ++r) m.caches[static_cast<std::size_t>(r)].truncate(m.length);
      throw;
    }
    gemm_nt(Si, dim, dim, att.data_as<const float>(), dim, w.wo.data_as<const float>(), dim, 1.0f, xd, dim);
    rmsnorm(xd, w.rms_ffn.data_as<const float>(), xbd, S, dim);
    float* h = h13.data_as<float>();
    gemm_nt(Si, 2 * hid, dim, xbd, dim, m.w13[static_cast<std::size_t>(l)].data_as<const float>(), dim, 0.0f,
            h, 2 * hid);
    float* g = hb.data_as<float>();
    swiglu(h, g, S, hid);  // SiLU(w1 x) * (w3 x)
    gemm_nt(Si, dim, hid, g, hid, w.w2.data_as<const float>(), hid, 1.0f, xd, dim);
  }
  const std::int64_t first = all_logits ? 0 : S - 1, rows = S - first;
  rmsnorm(xd + first * dim, m.model.rms_final.data_as<const float>(), xbd, rows, dim);
  if (m.logits.shape() != Shape{rows, m.vocab}) m.logits = Tensor(DType::f32, {rows, m.vocab});
  gemm_nt(static_cast<int>(rows), m.vocab, dim, xbd, dim, m.model.wcls.data_as<const float>(), dim, 0.0f,
          m.logits.data_as<float>(), m.vocab);
  m.length += S;
  return m.logits.view();
}

const KVCache& Llama::cache(int layer) const {
  if (layer < 0 || layer >= impl_->L)
    throw Error("llama: layer: expected an index in [0, n_layers) = [0, " + std::to_string(impl_->L) + "), got " +
                std::to_string(layer));
  return impl_->caches[static_cast<std::size_t>(layer)];
}

TensorView Llama::queries(int layer) const {
  cache(layer);
  if (!impl_->options.record_queries)
    throw Error(
        "llama: queries: not recorded (construct the model with LlamaOptions::record_queries = true)");
  return TensorView(impl_->rec_q[static_cast<std::size_t>(layer)].data(), DType::f32,
                    {impl_->length, impl_->Hq, impl_->D});
}

namespace {
void require_f32_cache(const KVCache& c, const char* what) {
  if (c.k_format() != KVFormat::f32 || c.v_format() != KVFormat::f32)
    throw Error(std::string("llama: ") + what + ": expected an f32 KV cache, got formats " +
                std::string(kv_format_name(c.k_format())) + "/" + std::string(kv_format_name(c.v_format())));
}
// Sequence 0's cached positions, [1, Hkv, length, D], as [Hkv, length, D].
TensorView drop_batch(const TensorView& x) {
  return TensorView(x.data(), x.dtype(), {x.size(1), x.size(2), x.size(3)}, {x.stride(1), x.stride(2), 1});
}
}  // namespace

TensorView Llama::keys(int layer) const {
  const KVCache& c = cache(layer);
  require_f32_cache(c, "keys");
  return drop_batch(c.active_keys());
}

TensorView Llama::values(int layer) const {
  const KVCache& c = cache(layer);
  require_f32_cache(c, "values");
  return drop_batch(c.active_values());
}

Tensor Llama::attention_weights(int layer, std::int64_t pos) const {
  const TensorView qs = queries(layer);
  if (pos < 0 || pos >= impl_->length)
    throw Error("llama: pos: expected a position in [0, length()) = [0, " + std::to_string(impl_->length) + "), got " +
                std::to_string(pos));
  const std::int64_t Hq = impl_->Hq, Hkv = impl_->Hkv, D = impl_->D, Sk = pos + 1;
  // Widen q of this position and keys 0..pos to float64 (exact), then the reference's probs.
  Tensor q(DType::f64, {1, Hq, 1, D}), k(DType::f64, {1, Hkv, Sk, D}), o(DType::f64, {1, Hq, 1, D});
  const float* src_q = qs.data_as<const float>() + pos * Hq * D;
  for (std::int64_t i = 0; i < Hq * D; ++i) q.data_as<double>()[i] = src_q[i];
  const TensorView ks = keys(layer);
  for (std::int64_t h = 0; h < Hkv; ++h)
    for (std::int64_t j = 0; j < Sk; ++j)
      for (std::int64_t d = 0; d < D; ++d)
        k.data_as<double>()[(h * Sk + j) * D + d] = ks.data_as<const float>()[h * ks.stride(0) + j * D + d];
  Tensor probs(DType::f64, {Hq, Sk});
  AttentionParams p;
  p.causal = true;
  // The weights do not depend on v: the keys stand in for it (out is discarded).
  reference::attention(q, k, k, o, p, std::nullopt, TensorView(probs.data(), DType::f64, {1, Hq, 1, Sk}));
  return probs;
}

Llama::LayerAttention Llama::layer_attention(int layer) const {
  const TensorView qs = queries(layer), ks = keys(layer), vs = values(layer);
  const std::int64_t S = impl_->length, Hq = impl_->Hq, Hkv = impl_->Hkv, D = impl_->D;
  LayerAttention a;
  a.q = TensorView(qs.data(), DType::f32, {1, S, Hq, D}).permute({0, 2, 1, 3});
  a.k =
      TensorView(ks.data(), DType::f32, {1, Hkv, S, D}, {Hkv * ks.stride(0), ks.stride(0), ks.stride(1), 1});
  a.v =
      TensorView(vs.data(), DType::f32, {1, Hkv, S, D}, {Hkv * vs.stride(0), vs.stride(0), vs.stride(1), 1});
  // The params of forward(): causal, default scale (kernel choice does not change the semantics).
  a.params.causal = true;
  return a;
}

std::vector<int> generate(Llama& model, std::span<const int> prompt, int steps,
                          const std::function<int(std::span<const float>)>& sample,
                          const std::function<void(int, int)>& on_token, GenerationStats* stats) {
  const Llama2cConfig& c = model.config();
  const auto n = static_cast<std::int64_t>(prompt.size());
  if (n == 0) throw Error("generate: prompt: expected at least one token (BOS), got none");
  if (n > c.max_seq_len)
    throw Error("generate: prompt: " + std::to_string(n) + " tokens (BOS included) exceed the model's max_seq_len (" +
                std::to_string(c.max_seq_len) + ")");
  if (steps < n || steps > c.max_seq_len)
    throw Error("generate: steps: expected a count of positions in [prompt tokens, max_seq_len] = [" + std::to_string(n) +
                ", " + std::to_string(c.max_seq_len) + "], got " + std::to_string(steps));
  check_tokens(prompt, c.vocab_size, "generate: prompt");
  using clock = std::chrono::steady_clock;
  GenerationStats st;
  st.prompt_tokens = n;
  std::vector<int> seq(prompt.begin(), prompt.end());
  model.reset();
  if (on_token)
    for (std::int64_t i = 1; i < n; ++i)
      on_token(seq[static_cast<std::size_t>(i - 1)], seq[static_cast<std::size_t>(i)]);
  auto t0 = clock::now();
  TensorView logits = model.forward(prompt);
  st.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
  while (true) {
    const int next =
        sample(std::span<const float>(logits.data_as<const float>(), static_cast<std::size_t>(c.vocab_size)));
    if (next == Tokenizer::bos_id) break;
    if (next < 0 || next >= c.vocab_size)
      throw Error("generate: sample: returned token " + std::to_string(next) + ", expected [0, " + std::to_string(c.vocab_size) + ")");
    if (on_token) on_token(seq.back(), next);
    seq.push_back(next);
    ++st.generated_tokens;
    if (model.length() >= steps) break;
    t0 = clock::now();
    logits = model.forward(std::span<const int>(&seq.back(), 1));
    st.decode_seconds += std::chrono::duration<double>(clock::now() - t0).count();
    ++st.decode_steps;
  }
  if (stats) *stats = st;
  return seq;
}

}  // namespace qkv
