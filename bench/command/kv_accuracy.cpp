// `qkv bench --kv-accuracy`: what each KV format costs in accuracy (docs/accuracy.md), for K only,
// V only, and both quantized (f32 for the other), all deterministic:
//   random   NMSE of the attention output (the serving kernel on the quantized cache, float32)
//            against float64 attention on the unquantized values: one sequence of 4096 keys,
//            its last 16 tokens as causal queries, Hq 8, Hkv 2, D 128, N(0, 1) entries;
//   model    the same NMSE on stories260K's own queries, keys and values: every layer's post-RoPE
//            q, k, v over a fixed text (the README prompt's greedy continuation, 256 positions),
//            causal;
//   KL       mean and max over positions of KL(p_f32 || p_format) of stories260K's next-token
//            distributions over that text, run on a cache in the format (one prefill);
//   greedy   whether the greedy continuation of the README prompt ("Once upon a time", 256
//            positions) changes, and where it first does.
// NMSE = sum (out - ref)^2 / sum ref^2. fp8 uses per-head scale 1 (the caches' default).
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "rows.hpp"
#include "models.hpp"
#include "qkv/kv_quant.hpp"
#include "qkv/llama.hpp"
#include "qkv/reference.hpp"
#include "qkv/sampler.hpp"
#include "qkv/varlen.hpp"

namespace qkv::cli::benchcmd {
namespace {

using i64 = std::int64_t;

struct Combo {
  KVFormat k, v;
  std::string label() const {
    return std::string(kv_format_name(k)) + "/" + std::string(kv_format_name(v));
  }
};

// x [S, H, D] float32 stored in format f: the codes and scales (kept alive by the caller).
struct Stored {
  Tensor codes, scales;
  QuantizedKV view;
};
Stored store(const TensorView& x, KVFormat f) {
  Stored s;
  s.codes = Tensor(kv_format_dtype(f), x.shape());
  if (kv_format_quantized(f)) {
    s.scales = Tensor(kv_scales_dtype(f), kv_scales_shape(f, x.shape()));
    if (f == KVFormat::fp8)
      for (i64 h = 0; h < s.scales.numel(); ++h) s.scales.data_as<float>()[h] = 1.0f;
  }
  s.view = {f, s.codes.view(), kv_format_quantized(f) ? s.scales.view() : TensorView()};
  quantize_kv(x, s.view, "x");
  return s;
}

// Accumulates sum (out - ref)^2 and sum ref^2 of one causal prefill of q [S, Hq, D] over k, v
// [S, Hkv, D] (float32) stored in the combo's formats, against float64 attention on k, v.
void nmse_terms(const Tensor& q, const Tensor& k, const Tensor& v, i64 Sq, const Combo& c, double& err, double& ref) {
  const i64 S = k.shape()[0], Hq = q.shape()[1], D = q.shape()[2], Hkv = k.shape()[1];
  const Stored ks = store(k, c.k), vs = store(v, c.v);
  Tensor cq(DType::i32, {2}), ck(DType::i32, {2});
  cq.data_as<std::int32_t>()[0] = ck.data_as<std::int32_t>()[0] = 0;
  cq.data_as<std::int32_t>()[1] = static_cast<std::int32_t>(Sq);
  ck.data_as<std::int32_t>()[1] = static_cast<std::int32_t>(S);
  const TensorView qs(static_cast<float*>(q.data()) + (q.shape()[0] - Sq) * Hq * D, DType::f32, {Sq, Hq, D});
  Tensor out(DType::f32, {Sq, Hq, D}), r(DType::f64, {Sq, Hq, D});
  AttentionParams p;
  p.causal = true;
  attention_varlen(qs, ks.view, vs.view, out, cq, ck, p);
  p.kernel = KernelKind::reference;
  attention_varlen(qs, k, v, r, cq, ck, p);
  (void)Hkv;
  for (i64 i = 0; i < r.numel(); ++i) {
    const double d = out.data_as<float>()[i] - r.data_as<double>()[i];
    err += d * d;
    ref += r.data_as<double>()[i] * r.data_as<double>()[i];
  }
}

std::vector<float> softmax(std::span<const float> l) {
  double m = -INFINITY;
  for (float x : l) m = std::max(m, static_cast<double>(x));
  std::vector<float> p(l.size());
  double s = 0;
  for (std::size_t i = 0; i < l.size(); ++i) s += (p[i] = static_cast<float>(std::exp(l[i] - m)));
  for (float& x : p) x = static_cast<float>(x / s);
  return p;
}

}  // namespace

void run_bench_kv_accuracy(const BenchOptions& o) {
  std::vector<Combo> combos = {{KVFormat::f32, KVFormat::f32}};
  for (KVFormat f : {KVFormat::bf16, KVFormat::f16, KVFormat::int8, KVFormat::q8_0, KVFormat::fp8}) {
    combos.push_back({f, KVFormat::f32});
    combos.push_back({KVFormat::f32, f});
    combos.push_back({f, f});
  }
  // Random data.
  const i64 S = o.quick ? 1024 : 4096, Hq = 8, Hkv = 2, D = 128, Sq = 16;
  Tensor q(DType::f32, {S, Hq, D}), k(DType::f32, {S, Hkv, D}), v(DType::f32, {S, Hkv, D});
  std::mt19937_64 rng(42);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (const Tensor* t : {&q, &k, &v})
    for (i64 i = 0; i < t->numel(); ++i) t->data_as<float>()[i] = n(rng);

  // stories260K: the README prompt's greedy continuation is the fixed text.
  auto [weights, tok] = load_model("", "");
  const int steps = 256;
  const std::vector<int> prompt = tok.encode("Once upon a time", true, false);
  SamplerConfig greedy;
  greedy.temperature = 0;
  auto continuation = [&](const Combo& c) {
    LlamaOptions lo;
    lo.batch_invariant = true;
    lo.kv_k_format = c.k;
    lo.kv_v_format = c.v;
    Llama m(weights, lo);
    Sampler s(greedy);
    return generate(m, prompt, steps, [&](std::span<const float> l) { return s.sample(l); });
  };
  const std::vector<int> text = continuation(combos[0]);
  const i64 T = static_cast<i64>(text.size());
  // The model's own q, k, v per layer (f32 cache, recorded).
  LlamaOptions rec;
  rec.record_queries = true;
  rec.batch_invariant = true;
  Llama recm(weights, rec);
  recm.forward(text, true);
  const int L = weights.config.n_layers;
  const i64 mHq = weights.config.n_heads, mHkv = weights.config.n_kv_heads, mD = weights.config.head_dim;
  std::vector<Tensor> mq, mk, mv;
  for (int l = 0; l < L; ++l) {
    Tensor tq(DType::f32, {T, mHq, mD}), tk(DType::f32, {T, mHkv, mD}), tv(DType::f32, {T, mHkv, mD});
    const TensorView rq = recm.queries(l), rk = recm.keys(l), rv = recm.values(l);  // [T,Hq,D], [Hkv,T,D]
    for (i64 i = 0; i < T * mHq * mD; ++i) tq.data_as<float>()[i] = rq.data_as<const float>()[i];
    for (i64 h = 0; h < mHkv; ++h)
      for (i64 t = 0; t < T; ++t)
        for (i64 d = 0; d < mD; ++d) {
          tk.data_as<float>()[(t * mHkv + h) * mD + d] = rk.data_as<const float>()[h * rk.stride(0) + t * rk.stride(1) + d];
          tv.data_as<float>()[(t * mHkv + h) * mD + d] = rv.data_as<const float>()[h * rv.stride(0) + t * rv.stride(1) + d];
        }
    mq.push_back(std::move(tq));
    mk.push_back(std::move(tk));
    mv.push_back(std::move(tv));
  }
  // The f32 cache's next-token distributions over the text.
  auto distributions = [&](const Combo& c) {
    LlamaOptions lo;
    lo.batch_invariant = true;
    lo.kv_k_format = c.k;
    lo.kv_v_format = c.v;
    Llama m(weights, lo);
    const TensorView lg = m.forward(text, true);
    const i64 V = lg.shape()[1];
    std::vector<std::vector<float>> ps;
    for (i64 t = 0; t < T; ++t) ps.push_back(softmax(std::span<const float>(lg.data_as<const float>() + t * V, V)));
    return ps;
  };
  const auto base = distributions(combos[0]);

  std::printf("qkv bench --kv-accuracy: random (Sk %lld, last %lld queries, Hq %lld, Hkv %lld, D %lld, N(0,1)); "
              "stories260K over %lld positions (the greedy continuation of \"Once upon a time\")\n\n",
              static_cast<long long>(S), static_cast<long long>(Sq), static_cast<long long>(Hq),
              static_cast<long long>(Hkv), static_cast<long long>(D), static_cast<long long>(T));
  std::printf("| K/V | quantized | NMSE random | NMSE stories260K | KL mean | KL max | top-1 same | greedy text |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (const Combo& c : combos) {
    double e = 0, r = 0;
    nmse_terms(q, k, v, Sq, c, e, r);
    const double nr = e / r;
    double me = 0, mr = 0;
    for (int l = 0; l < L; ++l) nmse_terms(mq[l], mk[l], mv[l], T, c, me, mr);
    const auto ps = distributions(c);
    double kl_sum = 0, kl_max = 0;
    i64 same_top = 0;
    for (i64 t = 0; t < T; ++t) {
      double kl = 0;
      const auto& a = base[static_cast<std::size_t>(t)];
      const auto& b = ps[static_cast<std::size_t>(t)];
      std::size_t am = 0, bm = 0;
      for (std::size_t i = 0; i < a.size(); ++i) {
        if (a[i] > 0) kl += a[i] * (std::log(static_cast<double>(a[i])) - std::log(std::max(static_cast<double>(b[i]), 1e-45)));
        if (a[i] > a[am]) am = i;
        if (b[i] > b[bm]) bm = i;
      }
      kl_sum += kl;
      kl_max = std::max(kl_max, kl);
      same_top += am == bm;
    }
    const std::vector<int> g = continuation(c);
    std::string greedy_txt = "same";
    if (g != text) {
      std::size_t i = 0;
      while (i < g.size() && i < text.size() && g[i] == text[i]) ++i;
      greedy_txt = "differs from position " + std::to_string(i);
    }
    const bool qk = c.k != KVFormat::f32, qv = c.v != KVFormat::f32;
    std::printf("| %s | %s | %.2e | %.2e | %.2e | %.2e | %lld/%lld | %s |\n", c.label().c_str(),
                qk && qv ? "both" : qk ? "K only" : qv ? "V only" : "neither", nr, me / mr, kl_sum / T, kl_max,
                static_cast<long long>(same_top), static_cast<long long>(T), greedy_txt.c_str());
    std::fflush(stdout);
  }
}

}  // namespace qkv::cli::benchcmd
