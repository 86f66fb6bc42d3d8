// The model's forward and backward in float32 (train.hpp gives the math). Activations are
// [B*T, features] row-major matrices; every matrix product is one detail::sgemm (blas/gemm.hpp), the attention
// layer is qkv::MultiHeadAttention (its backward recomputes q, k, v itself), and every other step
// is a plain loop whose reductions run in double, serially, so results never depend on threads.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "blas/gemm.hpp"
#include "qkv/error.hpp"
#include "qkv/explain.hpp"
#include "qkv/train.hpp"
#include "tensor/random.hpp"

namespace qkv::train {
using detail::Rng;
using detail::mix;
namespace {

constexpr double kNormEps = 1e-5;

int bi(std::int64_t v) { return static_cast<int>(v); }

// C[M,N] = A[M,K] B[N,K]^T (+ C when accumulate): a Linear layer's forward, and dX = dY W.
void gemm_nt(std::int64_t M, std::int64_t N, std::int64_t K, const float* A, const float* Bm, float* C,
             bool accumulate) {
  qkv::detail::sgemm(CblasNoTrans, CblasTrans, bi(M), bi(N), bi(K), 1.0f, A, bi(K), Bm, bi(K),
              accumulate ? 1.0f : 0.0f, C, bi(N));
}
// C[M,N] = A[M,K] B[K,N].
void gemm_nn(std::int64_t M, std::int64_t N, std::int64_t K, const float* A, const float* Bm, float* C) {
  qkv::detail::sgemm(CblasNoTrans, CblasNoTrans, bi(M), bi(N), bi(K), 1.0f, A, bi(K), Bm, bi(N), 0.0f, C,
              bi(N));
}
// C[M,N] = A[R,M]^T B[R,N]: a weight's gradient dY^T X.
void gemm_tn(std::int64_t M, std::int64_t N, std::int64_t R, const float* A, const float* Bm, float* C) {
  qkv::detail::sgemm(CblasTrans, CblasNoTrans, bi(M), bi(N), bi(R), 1.0f, A, bi(M), Bm, bi(N), 0.0f, C,
              bi(N));
}

// g[n] = sum over rows of a[r, n], in double.
void colsum(const float* a, std::int64_t rows, std::int64_t n, float* g) {
  std::vector<double> acc(static_cast<std::size_t>(n), 0.0);
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t j = 0; j < n; ++j) acc[static_cast<std::size_t>(j)] += a[r * n + j];
  for (std::int64_t j = 0; j < n; ++j) g[j] = static_cast<float>(acc[static_cast<std::size_t>(j)]);
}

// y = x * r * g per row, r = 1 / sqrt(mean(x^2) + eps) (saved for the backward).
void rmsnorm(const float* x, const float* g, std::int64_t rows, std::int64_t d, float* y, float* r) {
  for (std::int64_t i = 0; i < rows; ++i) {
    double ss = 0;
    for (std::int64_t j = 0; j < d; ++j) ss += static_cast<double>(x[i * d + j]) * x[i * d + j];
    const double ri = 1.0 / std::sqrt(ss / static_cast<double>(d) + kNormEps);
    r[i] = static_cast<float>(ri);
    for (std::int64_t j = 0; j < d; ++j) y[i * d + j] = static_cast<float>(x[i * d + j] * ri * g[j]);
  }
}

// dx (+)= the gradient of rmsnorm through dy; dg = sum over rows of dy * x * r.
//   z = g * dy;  dx = r z - x r^3 sum(z x) / d.
void rmsnorm_backward(const float* x, const float* g, const float* r, const float* dy, std::int64_t rows,
                      std::int64_t d, float* dx, bool accumulate, float* dg) {
  std::vector<double> acc(static_cast<std::size_t>(d), 0.0);
  for (std::int64_t i = 0; i < rows; ++i) {
    const double ri = r[i];
    double zx = 0;
    for (std::int64_t j = 0; j < d; ++j) {
      zx += static_cast<double>(g[j]) * dy[i * d + j] * x[i * d + j];
      acc[static_cast<std::size_t>(j)] += static_cast<double>(dy[i * d + j]) * x[i * d + j] * ri;
    }
    const double c = ri * ri * ri * zx / static_cast<double>(d);
    for (std::int64_t j = 0; j < d; ++j) {
      const auto v = static_cast<float>(ri * g[j] * dy[i * d + j] - x[i * d + j] * c);
      dx[i * d + j] = accumulate ? dx[i * d + j] + v : v;
    }
  }
  for (std::int64_t j = 0; j < d; ++j) dg[j] = static_cast<float>(acc[static_cast<std::size_t>(j)]);
}

constexpr double kGeluC = 0.7978845608028654;  // sqrt(2 / pi)
constexpr double kGeluA = 0.044715;
double gelu(double u) { return 0.5 * u * (1 + std::tanh(kGeluC * (u + kGeluA * u * u * u))); }
double gelu_grad(double u) {
  const double t = std::tanh(kGeluC * (u + kGeluA * u * u * u));
  return 0.5 * (1 + t) + 0.5 * u * (1 - t * t) * kGeluC * (1 + 3 * kGeluA * u * u);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void check_model(const ModelConfig& c) {
  auto need = [](bool ok, const char* field, std::int64_t v) {
    if (!ok) throw Error(std::string("model: ") + field + ": expected 1 .. 65536, got " + std::to_string(v));
  };
  need(c.vocab >= 1 && c.vocab <= 65536, "vocab", c.vocab);
  need(c.seq_len >= 1 && c.seq_len <= 65536, "seq_len", c.seq_len);
  need(c.d_model >= 1 && c.d_model <= 65536, "d_model", c.d_model);
  need(c.num_heads >= 1 && c.num_heads <= 65536, "num_heads", c.num_heads);
  need(c.d_k >= 1 && c.d_k <= 65536, "d_k", c.d_k);
  need(c.d_ff >= 1 && c.d_ff <= 65536, "d_ff", c.d_ff);
  need(c.n_layers >= 1 && c.n_layers <= 64, "n_layers", c.n_layers);
  if (!std::isfinite(c.scale)) throw Error("model: scale: expected a finite number, got " + std::to_string(c.scale));
}

// Indices into Model::own_: 3 embeddings, 6 per block, then g_f and W_u.
enum : std::size_t { kTok = 0, kPrev = 1, kPos = 2, kBlock0 = 3 };
enum : std::size_t { kG1 = 0, kG2 = 1, kW1 = 2, kB1 = 3, kW2 = 4, kB2 = 5, kPerBlock = 6 };

}  // namespace

Model::Model(const ModelConfig& config, std::uint64_t seed) : cfg_(config) {
  check_model(cfg_);
  const std::int64_t V = cfg_.vocab, T = cfg_.seq_len, d = cfg_.d_model, F = cfg_.d_ff, L = cfg_.n_layers;
  const Shape shapes[] = {{V, d}, {V + 1, d}, {T, d}};
  for (const Shape& s : shapes) own_.emplace_back(DType::f32, s);
  for (std::int64_t l = 0; l < L; ++l) {
    for (const Shape& s : {Shape{d}, Shape{d}, Shape{F, d}, Shape{F}, Shape{d, F}, Shape{d}})
      own_.emplace_back(DType::f32, s);
    MhaConfig mc;
    mc.d_model = d;
    mc.num_heads = cfg_.num_heads;
    mc.head_dim = cfg_.d_k;
    mha_.emplace_back(mc);
    mha_grads_.emplace_back(mha_.back());
  }
  own_.emplace_back(DType::f32, Shape{d});
  own_.emplace_back(DType::f32, Shape{V, d});
  for (const Tensor& t : own_) own_g_.emplace_back(DType::f32, t.shape());

  Rng rng(mix(seed, 0));
  auto fill = [&](const TensorView& t, double stdev) {
    float* p = t.data_as<float>();
    for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(stdev * rng.normal());
  };
  auto ones = [](const Tensor& t) { std::fill_n(t.data_as<float>(), t.numel(), 1.0f); };
  const double in_std = 1.0 / std::sqrt(static_cast<double>(d));
  fill(own_[kTok], 1.0);
  fill(own_[kPrev], 1.0);
  fill(own_[kPos], 1.0);
  for (std::int64_t l = 0; l < L; ++l) {
    const std::size_t b = kBlock0 + kPerBlock * static_cast<std::size_t>(l);
    const MultiHeadAttention& m = mha_[static_cast<std::size_t>(l)];
    ones(own_[b + kG1]);
    ones(own_[b + kG2]);
    fill(m.in_proj_weight(), in_std);
    const double hd = static_cast<double>(cfg_.num_heads * cfg_.d_k);
    fill(m.w_o(), 1.0 / std::sqrt(hd * 2.0 * static_cast<double>(L)));
    fill(own_[b + kW1], in_std);
    fill(own_[b + kW2], 1.0 / std::sqrt(static_cast<double>(F) * 2.0 * static_cast<double>(L)));
  }
  ones(own_[own_.size() - 2]);
  fill(own_.back(), in_std);
}

std::vector<Param> Model::parameters() const {
  std::vector<Param> ps;
  auto own = [&](const char* name, std::size_t i, bool decay) {
    ps.push_back({name, own_[i].view(), own_g_[i].view(), decay});
  };
  own("tok_embedding", kTok, false);
  own("prev_embedding", kPrev, false);
  own("pos_embedding", kPos, false);
  for (std::size_t l = 0; l < mha_.size(); ++l) {
    const std::size_t b = kBlock0 + kPerBlock * l;
    const std::string pre = "blocks." + std::to_string(l) + ".";
    const MultiHeadAttention& m = mha_[l];
    const MhaGrads& g = mha_grads_[l];
    ps.push_back({pre + "norm1.gain", own_[b + kG1].view(), own_g_[b + kG1].view(), false});
    ps.push_back({pre + "attn.in_proj_weight", m.in_proj_weight(), g.in_proj_weight(), true});
    ps.push_back({pre + "attn.in_proj_bias", m.in_proj_bias(), g.in_proj_bias(), false});
    ps.push_back({pre + "attn.out_proj.weight", m.w_o(), g.w_o(), true});
    ps.push_back({pre + "attn.out_proj.bias", m.b_o(), g.b_o(), false});
    ps.push_back({pre + "norm2.gain", own_[b + kG2].view(), own_g_[b + kG2].view(), false});
    ps.push_back({pre + "ffn.w1", own_[b + kW1].view(), own_g_[b + kW1].view(), true});
    ps.push_back({pre + "ffn.b1", own_[b + kB1].view(), own_g_[b + kB1].view(), false});
    ps.push_back({pre + "ffn.w2", own_[b + kW2].view(), own_g_[b + kW2].view(), true});
    ps.push_back({pre + "ffn.b2", own_[b + kB2].view(), own_g_[b + kB2].view(), false});
  }
  own("final_norm.gain", own_.size() - 2, false);
  own("unembedding", own_.size() - 1, true);
  return ps;
}

const MultiHeadAttention& Model::attention(std::int64_t l) const {
  if (l < 0 || l >= static_cast<std::int64_t>(mha_.size()))
    throw Error("attention: l: expected 0 .. " + std::to_string(mha_.size() - 1) + ", got " + std::to_string(l));
  return mha_[static_cast<std::size_t>(l)];
}

StepStats Model::forward_backward(const Batch& batch, bool attention_stats, int threads) {
  return run(batch, &mha_grads_, attention_stats, threads, &prof_);
}

double Model::loss(const Batch& batch, int threads) const { return run(batch, nullptr, false, threads, nullptr).loss; }

StepStats Model::run(const Batch& batch, std::vector<MhaGrads>* mgrads, bool attention_stats, int threads,
                     Profile* prof) const {
  const std::int64_t V = cfg_.vocab, T = cfg_.seq_len, d = cfg_.d_model, F = cfg_.d_ff, L = cfg_.n_layers;
  const std::int64_t H = cfg_.num_heads, B = batch.batch, N = B * T;
  if (batch.T != T || B < 1 || batch.tokens.size() != static_cast<std::size_t>(N) ||
      batch.targets.size() != static_cast<std::size_t>(N))
    throw Error("batch: expected [batch, T = " + std::to_string(T) + "] tokens and targets, got T = " +
                std::to_string(batch.T) + ", batch = " + std::to_string(B) + ", " +
                std::to_string(batch.tokens.size()) + " tokens");
  for (std::size_t i = 0; i < batch.tokens.size(); ++i)
    if (batch.tokens[i] < 0 || batch.tokens[i] >= V || batch.targets[i] < -1 || batch.targets[i] >= V)
      throw Error("batch: token or target " + std::to_string(i) + ": expected 0 .. V-1 = " + std::to_string(V - 1) +
                  " (target -1: not scored), got " + std::to_string(batch.tokens[i]) + " / " +
                  std::to_string(batch.targets[i]));
  Profile dummy;
  Profile& pf = prof ? *prof : dummy;
  const bool backward = mgrads != nullptr;
  auto t0 = std::chrono::steady_clock::now();
  auto lap = [&](double& slot) {
    slot += seconds_since(t0);
    t0 = std::chrono::steady_clock::now();
  };
  auto P = [&](std::size_t i) { return own_[i].data_as<float>(); };
  auto G = [&](std::size_t i) { return own_g_[i].data_as<float>(); };
  using Buf = std::vector<float>;
  auto sz = [](std::int64_t n) { return static_cast<std::size_t>(n); };

  // Embedding.
  Buf x0(sz(N * d));
  for (std::int64_t i = 0; i < N; ++i) {
    const std::int64_t t = i % T, tok = batch.tokens[sz(i)], prev = t == 0 ? V : batch.tokens[sz(i - 1)];
    for (std::int64_t j = 0; j < d; ++j)
      x0[sz(i * d + j)] = P(kTok)[tok * d + j] + P(kPrev)[prev * d + j] + P(kPos)[t * d + j];
  }
  struct Saved {
    Buf x, n1, r1, h, n2, r2, u, a;
  };
  std::vector<Saved> sv(sz(L));
  MhaOptions mo;
  mo.attention.causal = true;
  mo.attention.scale = cfg_.scale;
  mo.attention.num_threads = threads;
  const Tensor probs = attention_stats ? Tensor(DType::f32, {B, H, T, T}) : Tensor();
  double st_max = 0, st_ent = 0, st_sat = 0, st_rows = 0;
  Buf x = std::move(x0);
  lap(pf.embed_norm);
  for (std::int64_t l = 0; l < L; ++l) {
    Saved& s = sv[sz(l)];
    const std::size_t b = kBlock0 + kPerBlock * sz(l);
    s.x = std::move(x);
    s.n1.resize(sz(N * d));
    s.r1.resize(sz(N));
    rmsnorm(s.x.data(), P(b + kG1), N, d, s.n1.data(), s.r1.data());
    Buf att(sz(N * d));
    lap(pf.embed_norm);
    if (attention_stats) mo.probs = probs.view();
    mha_[sz(l)].forward(TensorView(s.n1.data(), DType::f32, {B, T, d}), TensorView(att.data(), DType::f32, {B, T, d}),
                        mo);
    mo.probs.reset();
    lap(pf.mha_forward);
    if (attention_stats) {
      const float* pr = probs.data_as<float>();
      std::vector<double> a(sz(T));
      for (std::int64_t bb = 0; bb < B; ++bb)
        for (std::int64_t t = 0; t < T; ++t) {
          if (batch.targets[sz(bb * T + t)] < 0) continue;
          for (std::int64_t hh = 0; hh < H; ++hh) {
            const float* row = pr + ((bb * H + hh) * T + t) * T;
            double mx = 0, ent = 0;
            for (std::int64_t j = 0; j <= t; ++j) {
              a[sz(j)] = row[j];
              mx = std::max(mx, a[sz(j)]);
              if (a[sz(j)] > 0) ent -= a[sz(j)] * std::log(a[sz(j)]);
            }
            st_max += mx;
            st_ent += ent;
            st_sat += explain::softmax_jacobian_frobenius(a.data(), t + 1) < 0.01 ? 1 : 0;
            st_rows += 1;
          }
        }
      lap(pf.stats);
    }
    s.h.resize(sz(N * d));
    for (std::int64_t i = 0; i < N * d; ++i) s.h[sz(i)] = s.x[sz(i)] + att[sz(i)];
    s.n2.resize(sz(N * d));
    s.r2.resize(sz(N));
    rmsnorm(s.h.data(), P(b + kG2), N, d, s.n2.data(), s.r2.data());
    lap(pf.embed_norm);
    s.u.resize(sz(N * F));
    s.a.resize(sz(N * F));
    for (std::int64_t i = 0; i < N; ++i) std::memcpy(s.u.data() + i * F, P(b + kB1), sz(F) * sizeof(float));
    gemm_nt(N, F, d, s.n2.data(), P(b + kW1), s.u.data(), true);
    for (std::int64_t i = 0; i < N * F; ++i) s.a[sz(i)] = static_cast<float>(gelu(s.u[sz(i)]));
    x.resize(sz(N * d));
    for (std::int64_t i = 0; i < N; ++i) std::memcpy(x.data() + i * d, P(b + kB2), sz(d) * sizeof(float));
    gemm_nt(N, d, F, s.a.data(), P(b + kW2), x.data(), true);
    for (std::int64_t i = 0; i < N * d; ++i) x[sz(i)] += s.h[sz(i)];
    lap(pf.ffn);
  }
  const std::size_t kGf = own_.size() - 2, kWu = own_.size() - 1;
  Buf nf(sz(N * d)), rf(sz(N));
  rmsnorm(x.data(), P(kGf), N, d, nf.data(), rf.data());
  lap(pf.embed_norm);
  Buf logits(sz(N * V));
  gemm_nt(N, V, d, nf.data(), P(kWu), logits.data(), false);

  // Cross-entropy over the scored positions; dlogits = (softmax - onehot) / count.
  std::int64_t count = 0;
  for (const std::int32_t t : batch.targets) count += t >= 0;
  StepStats out;
  if (count == 0) throw Error("batch: expected at least one scored position (target >= 0), got none");
  double loss = 0, correct = 0;
  Buf dlogits(backward ? sz(N * V) : 0, 0.0f);
  for (std::int64_t i = 0; i < N; ++i) {
    const std::int32_t tgt = batch.targets[sz(i)];
    if (tgt < 0) continue;
    const float* z = logits.data() + i * V;
    std::int64_t arg = 0;
    for (std::int64_t j = 1; j < V; ++j)
      if (z[j] > z[arg]) arg = j;
    double sum = 0;
    for (std::int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<double>(z[j]) - z[arg]);
    const double lse = z[arg] + std::log(sum);
    loss += lse - z[tgt];
    correct += arg == tgt;
    if (backward) {
      float* dz = dlogits.data() + i * V;
      for (std::int64_t j = 0; j < V; ++j)
        dz[j] = static_cast<float>((std::exp(z[j] - lse) - (j == tgt)) / static_cast<double>(count));
    }
  }
  out.loss = loss / static_cast<double>(count);
  out.accuracy = correct / static_cast<double>(count);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  out.max_weight = attention_stats ? st_max / st_rows : nan;
  out.entropy = attention_stats ? st_ent / st_rows : nan;
  out.saturated = attention_stats ? st_sat / st_rows : nan;
  lap(pf.head_loss);
  if (!backward) return out;

  // Backward, last step first.
  gemm_tn(V, d, N, dlogits.data(), nf.data(), G(kWu));
  Buf dnf(sz(N * d)), dx(sz(N * d));
  gemm_nn(N, d, V, dlogits.data(), P(kWu), dnf.data());
  lap(pf.head_loss);
  rmsnorm_backward(x.data(), P(kGf), rf.data(), dnf.data(), N, d, dx.data(), false, G(kGf));
  lap(pf.embed_norm);
  Buf du(sz(N * F)), dn(sz(N * d));
  for (std::int64_t l = L - 1; l >= 0; --l) {
    Saved& s = sv[sz(l)];
    const std::size_t b = kBlock0 + kPerBlock * sz(l);
    // x_out = h + W2 a + b2: dh = dx, plus the FFN's path.
    gemm_tn(d, F, N, dx.data(), s.a.data(), G(b + kW2));
    colsum(dx.data(), N, d, G(b + kB2));
    gemm_nn(N, F, d, dx.data(), P(b + kW2), du.data());
    for (std::int64_t i = 0; i < N * F; ++i) du[sz(i)] = static_cast<float>(du[sz(i)] * gelu_grad(s.u[sz(i)]));
    gemm_tn(F, d, N, du.data(), s.n2.data(), G(b + kW1));
    colsum(du.data(), N, F, G(b + kB1));
    gemm_nn(N, d, F, du.data(), P(b + kW1), dn.data());
    lap(pf.ffn);
    rmsnorm_backward(s.h.data(), P(b + kG2), s.r2.data(), dn.data(), N, d, dx.data(), true, G(b + kG2));
    lap(pf.embed_norm);
    // h = x + MHA(n1): dx = dh + rmsnorm's backward of the layer's dx.
    MhaGrads& mg = (*mgrads)[sz(l)];
    mg.zero();
    mha_[sz(l)].backward(TensorView(s.n1.data(), DType::f32, {B, T, d}), TensorView(dx.data(), DType::f32, {B, T, d}),
                         TensorView(dn.data(), DType::f32, {B, T, d}), mg, mo);
    lap(pf.mha_backward);
    rmsnorm_backward(s.x.data(), P(b + kG1), s.r1.data(), dn.data(), N, d, dx.data(), true, G(b + kG1));
    lap(pf.embed_norm);
  }
  // Embedding: scatter-add, serially (rows repeat).
  for (const std::size_t e : {kTok, kPrev, kPos}) std::memset(G(e), 0, own_g_[e].nbytes());
  for (std::int64_t i = 0; i < N; ++i) {
    const std::int64_t t = i % T, tok = batch.tokens[sz(i)], prev = t == 0 ? V : batch.tokens[sz(i - 1)];
    for (std::int64_t j = 0; j < d; ++j) {
      const float g = dx[sz(i * d + j)];
      G(kTok)[tok * d + j] += g;
      G(kPrev)[prev * d + j] += g;
      G(kPos)[t * d + j] += g;
    }
  }
  lap(pf.embed_norm);
  return out;
}

}  // namespace qkv::train
