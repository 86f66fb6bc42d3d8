// bench_mha: time of one MultiHeadAttention forward split into its parts, median of repeats.
//
//   qkv_proj   the packed q/k/v projection: one cblas_sgemm [B*S, d_model] x [d_model, 3*d_model]
//   attention  qkv::attention() on the strided head views (the kernel dispatch picks; named)
//   naive      baseline in the same run: per-head BLAS attention (S = QK^T by sgemm, row
//              softmax, O = PV by sgemm), materialising the S x S score matrix
//   out_proj   the output projection: one cblas_sgemm [B*S, d_model] x [d_model, d_model]
//   layer      MultiHeadAttention::forward end to end (includes buffer allocation and RoPE)
// proj% is the projections' share of qkv_proj + attn + out_proj; the second proj% is their
// share when the attention costs what the naive BLAS baseline costs.
// FLOP rates: projections 2*M*N*K; attention 4*B*Hq*S^2*D (non-causal), half that causal.
//
// usage: bench_mha [--reps N] [--causal] [--quick] [--d-model A,B] [--seq A,B] [--batch B]
//                  [--skip-qkv-attention]   (time projections and the naive baseline only: useful
//                                            while the float64 reference is the only kernel)
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/mha.hpp"

namespace {

double median_ms(int reps, const std::function<void()>& f) {
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const auto a = std::chrono::steady_clock::now();
    f();
    const auto b = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::milli>(b - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::vector<std::int64_t> parse_list(const char* s) {
  std::vector<std::int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoll(item));
  return v;
}

void fill(const qkv::TensorView& t, std::uint32_t seed, float sd) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, sd);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = nd(rng);
}

// Naive attention with BLAS: scores materialised per head, softmax, then PV.
void naive_attention(const float* qkv_buf, std::int64_t B, std::int64_t S, std::int64_t H, std::int64_t D,
                     bool causal, float* out, std::vector<float>& scores) {
  const std::int64_t N = 3 * H * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  scores.resize(static_cast<std::size_t>(S * S));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const float* q = qkv_buf + b * S * N + h * D;
      const float* k = q + H * D;
      const float* v = q + 2 * H * D;
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(S), static_cast<int>(S),
                  static_cast<int>(D), scale, q, static_cast<int>(N), k, static_cast<int>(N), 0.0f,
                  scores.data(), static_cast<int>(S));
#pragma omp parallel for schedule(static)
      for (std::int64_t i = 0; i < S; ++i) {
        float* row = scores.data() + i * S;
        const std::int64_t n = causal ? i + 1 : S;
        float m = -INFINITY;
        for (std::int64_t j = 0; j < n; ++j) m = std::max(m, row[j]);
        float sum = 0;
        for (std::int64_t j = 0; j < n; ++j) sum += (row[j] = std::exp(row[j] - m));
        const float inv = 1.0f / sum;
        for (std::int64_t j = 0; j < n; ++j) row[j] *= inv;
        for (std::int64_t j = n; j < S; ++j) row[j] = 0.0f;
      }
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(S), static_cast<int>(D),
                  static_cast<int>(S), 1.0f, scores.data(), static_cast<int>(S), v, static_cast<int>(N), 0.0f,
                  out + b * S * H * D + h * D, static_cast<int>(H * D));
    }
}

}  // namespace

int main(int argc, char** argv) {
  int reps = 5;
  bool causal = false, skip_attn = false;
  std::vector<std::int64_t> dms{512, 1024}, seqs{1024, 4096};
  std::int64_t B = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--reps" && i + 1 < argc)
      reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--causal")
      causal = true;
    else if (a == "--skip-qkv-attention")
      skip_attn = true;
    else if (a == "--quick") {
      dms = {512};
      seqs = {1024};
      reps = 3;
    } else if (a == "--d-model" && i + 1 < argc)
      dms = parse_list(argv[++i]);
    else if (a == "--seq" && i + 1 < argc)
      seqs = parse_list(argv[++i]);
    else if (a == "--batch" && i + 1 < argc)
      B = std::max(1, std::atoi(argv[++i]));
    else {
      std::fprintf(stderr,
                   "usage: bench_mha [--reps N] [--causal] [--quick] [--d-model A,B] [--seq A,B] [--batch B] "
                   "[--skip-qkv-attention]\n");
      return 2;
    }
  }
  std::printf("bench_mha: B=%lld, head_dim 64, %s, median of %d runs, times in ms\n",
              static_cast<long long>(B), causal ? "causal" : "non-causal", reps);
  std::printf("%7s %6s %3s | %9s %9s %9s %9s | %9s | %6s %8s %8s | %9s %6s | %s\n", "d_model", "S", "Hq",
              "qkv_proj", "attn", "out_proj", "sum", "layer", "proj%", "projGF/s", "attnGF/s", "naive",
              "proj%", "kernel");
  for (std::int64_t dm : dms)
    for (std::int64_t S : seqs) {
      const std::int64_t H = dm / 64, D = 64;
      qkv::MhaConfig cfg;
      cfg.d_model = dm;
      cfg.num_heads = H;
      qkv::MultiHeadAttention layer(cfg);
      fill(layer.in_proj_weight(), 1, 1.0f / std::sqrt(static_cast<float>(dm)));
      fill(layer.w_o(), 2, 1.0f / std::sqrt(static_cast<float>(dm)));
      qkv::Tensor x(qkv::DType::f32, {B, S, dm}), y(qkv::DType::f32, {B, S, dm});
      fill(x.view(), 3, 1.0f);
      const std::int64_t N = 3 * dm;
      qkv::Tensor proj(qkv::DType::f32, {B, S, N}), o(qkv::DType::f32, {B, S, dm});
      const auto* w = layer.in_proj_weight().data_as<const float>();
      auto qkv_proj = [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(B * S), static_cast<int>(N),
                    static_cast<int>(dm), 1.0f, x.data_as<float>(), static_cast<int>(dm), w,
                    static_cast<int>(dm), 0.0f, proj.data_as<float>(), static_cast<int>(N));
      };
      auto out_proj = [&] {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<int>(B * S), static_cast<int>(dm),
                    static_cast<int>(dm), 1.0f, o.data_as<float>(), static_cast<int>(dm),
                    layer.w_o().data_as<const float>(), static_cast<int>(dm), 0.0f, y.data_as<float>(),
                    static_cast<int>(dm));
      };
      float* pd = proj.data_as<float>();
      const qkv::TensorView q(pd, qkv::DType::f32, {B, H, S, D}, {S * N, D, N, 1});
      const qkv::TensorView k(pd + H * D, qkv::DType::f32, {B, H, S, D}, {S * N, D, N, 1});
      const qkv::TensorView v(pd + 2 * H * D, qkv::DType::f32, {B, H, S, D}, {S * N, D, N, 1});
      const qkv::TensorView ov(o.data(), qkv::DType::f32, {B, H, S, D}, {S * dm, D, dm, 1});
      qkv::AttentionParams ap;
      ap.causal = causal;
      qkv::MhaOptions mo;
      mo.attention = ap;
      qkv_proj();
      std::string kernel = qkv::explain_dispatch(q, k, v, ov, ap);
      const auto pos = kernel.find(": chosen");
      if (pos == std::string::npos) {
        kernel = "?";
      } else {
        const auto nl = kernel.rfind('\n', pos);
        const std::size_t start = nl == std::string::npos ? 0 : nl + 1;
        kernel = kernel.substr(start, pos - start);
      }
      const double t_qkv = median_ms(reps, qkv_proj);
      const double t_attn = skip_attn ? NAN : median_ms(reps, [&] { qkv::attention(q, k, v, ov, ap); });
      std::vector<float> scores;
      const double t_naive =
          median_ms(reps, [&] { naive_attention(pd, B, S, H, D, causal, o.data_as<float>(), scores); });
      const double t_out = median_ms(reps, out_proj);
      const double t_layer = skip_attn ? NAN : median_ms(reps, [&] { layer.forward(x, y, mo); });
      const double sum = t_qkv + t_attn + t_out;
      const double proj_flops = 2.0 * B * S * dm * (N + dm);
      const double attn_flops = 4.0 * B * H * S * S * D * (causal ? 0.5 : 1.0);
      std::printf(
          "%7lld %6lld %3lld | %9.2f %9.2f %9.2f %9.2f | %9.2f | %5.1f%% %8.1f %8.1f | %9.2f %5.1f%% | %s\n",
          static_cast<long long>(dm), static_cast<long long>(S), static_cast<long long>(H), t_qkv, t_attn,
          t_out, sum, t_layer, 100.0 * (t_qkv + t_out) / sum, proj_flops / ((t_qkv + t_out) * 1e6),
          attn_flops / (t_attn * 1e6), t_naive, 100.0 * (t_qkv + t_out) / (t_qkv + t_out + t_naive),
          kernel.c_str());
      std::fflush(stdout);
    }
  return 0;
}
