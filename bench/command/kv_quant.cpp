// `qkv bench --kv-quant`: attention over quantized KV caches (qkv/kv_quant.hpp).
//   decode   Sq 1, Sk 32768 (--quick: 4096), Hq 8, Hkv 8 and 2, D 128, one sequence, for every
//            format of K and V (the same for both): time, GB/s of the cache's bytes (codes and
//            scales) against the read bandwidth of a 512 MiB buffer measured in the same run, and
//            the time against bf16's; warm (the same cache every call, which a large L3 may
//            partly hold) and cold (each call on the next of copies of the cache that together
//            hold twice the 512 MiB, so that every call reads from DRAM, as a server's caches do);
//   prefill  a causal prefill of 2048 tokens (--quick: 512) over the cache, Hq 8, Hkv 2, D 128:
//            each format through the serving kernel against the bf16 cache through the same
//            kernel and through the tiled flash kernel (kernel = flash, not chunking invariant).
// Medians of --repeats timed runs; the ratios are measured in the same run.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "rows.hpp"
#include "qkv/kv_quant.hpp"
#include "qkv/varlen.hpp"

namespace qkv::cli::benchcmd {
namespace {

using i64 = std::int64_t;

struct Cache {
  KVFormat f;
  Tensor k, v, ks, vs;
  double bytes = 0;
  QuantizedKV kq() const { return {f, k.view(), ks.view()}; }
  QuantizedKV vq() const { return {f, v.view(), vs.view()}; }
};

// Packed [S, Hkv, D] keys and values of N(0, 1) entries stored in format f.
Cache make_cache(KVFormat f, i64 S, i64 Hkv, i64 D) {
  Cache c;
  c.f = f;
  Tensor x(DType::f32, {S, Hkv, D});
  std::mt19937_64 rng(1);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (Tensor* dst : {&c.k, &c.v}) {
    for (i64 i = 0; i < x.numel(); ++i) x.data_as<float>()[i] = n(rng);
    *dst = Tensor(kv_format_dtype(f), x.shape());
    Tensor sc(kv_scales_dtype(f), kv_format_quantized(f) ? kv_scales_shape(f, x.shape()) : Shape{1});
    if (f == KVFormat::fp8) sc.data_as<float>()[0] = 1.0f;
    if (f == KVFormat::fp8)
      for (i64 h = 0; h < Hkv; ++h) sc.data_as<float>()[h] = 1.0f / 64;  // |x| <= 448 / 64 = 7
    quantize_kv(x, {f, dst->view(), kv_format_quantized(f) ? sc.view() : TensorView()}, "x");
    c.bytes += static_cast<double>(dst->nbytes()) + (kv_format_quantized(f) ? static_cast<double>(sc.nbytes()) : 0.0);
    (dst == &c.k ? c.ks : c.vs) = std::move(sc);
  }
  return c;
}

Tensor copy_of(const Tensor& t) {
  Tensor c(t.dtype(), t.shape());
  std::memcpy(c.data(), t.data(), t.nbytes());
  return c;
}

// Fresh copies of c that together hold at least `bytes`, at least two.
std::vector<Cache> cold_copies(const Cache& c, double bytes) {
  const int n = std::max(2, static_cast<int>(std::ceil(bytes / c.bytes)));
  std::vector<Cache> out(static_cast<std::size_t>(n));
  for (Cache& x : out) {
    x.f = c.f;
    x.k = copy_of(c.k);
    x.v = copy_of(c.v);
    x.ks = copy_of(c.ks);
    x.vs = copy_of(c.vs);
    x.bytes = c.bytes;
  }
  return out;
}

Tensor cu(i64 n) {
  Tensor t(DType::i32, {2});
  t.data_as<std::int32_t>()[0] = 0;
  t.data_as<std::int32_t>()[1] = static_cast<std::int32_t>(n);
  return t;
}

}  // namespace

KvQuantDecode measure_kv_quant_decode(KVFormat f, i64 Sk, i64 Hkv, const BenchOptions& o, int threads) {
  const i64 Hq = kKvQuantHq, D = kKvQuantD;
  AttentionParams p;
  p.causal = true;
  p.num_threads = threads;
  Tensor q(DType::f32, {1, Hq, D}), out(DType::f32, {1, Hq, D});
  std::mt19937_64 rng(2);
  std::normal_distribution<float> n(0.0f, 1.0f);
  for (i64 i = 0; i < q.numel(); ++i) q.data_as<float>()[i] = n(rng);
  const Tensor cq = cu(1), ck = cu(Sk);
  const Cache c = make_cache(f, Sk, Hkv, D);
  KvQuantDecode d;
  d.bytes = c.bytes;
  d.warm = time_median([&] { attention_varlen(q, c.kq(), c.vq(), out, cq, ck, p); }, o);
  const std::vector<Cache> copies = cold_copies(c, 2.0 * o.read_mib * (1 << 20));
  std::size_t next = 0;
  d.cold = time_median([&] {
    const Cache& x = copies[next++ % copies.size()];
    attention_varlen(q, x.kq(), x.vq(), out, cq, ck, p);
  }, o);
  return d;
}

void run_bench_kv_quant(const BenchOptions& o_in) {
  const BenchOptions o = with_defaults(o_in, o_in.quick ? 3 : 9, o_in.quick ? 0 : 0.3);
  const int threads = run_threads(o);
  const i64 Sk = o.quick ? 4096 : 32768, Hq = kKvQuantHq, D = kKvQuantD, Sp = o.quick ? 512 : 2048;
  const KVFormat formats[] = {KVFormat::f32, KVFormat::bf16, KVFormat::f16, KVFormat::int8, KVFormat::q8_0, KVFormat::fp8};
  std::printf("qkv bench --kv-quant: %d threads; decode Sq 1, Sk %lld, Hq %lld, D %lld; prefill %lld tokens, Hkv 2\n",
              threads, static_cast<long long>(Sk), static_cast<long long>(Hq), static_cast<long long>(D),
              static_cast<long long>(Sp));
  const double dram = bench::measure_read_bandwidth(threads, o.read_mib * (1 << 20), o.peak_seconds);
  std::printf("read bandwidth of a %.0f MiB buffer: %.1f GB/s\n\n", o.read_mib, dram);
  AttentionParams p;
  p.causal = true;
  p.num_threads = threads;
  std::printf("%-8s %-5s %5s %10s %11s %9s %8s %14s %10s %9s %8s %14s\n", "rows", "kv", "Hkv", "time ms", "MiB read", "GB/s",
              "of DRAM", "time / bf16's", "cold ms", "GB/s", "of DRAM", "time / bf16's");
  for (const i64 Hkv : {i64{8}, i64{2}}) {
    std::vector<double> secs, cold_secs;
    double bf16_s = 0, bf16_cold = 0;
    for (KVFormat f : formats) {
      const KvQuantDecode d = measure_kv_quant_decode(f, Sk, Hkv, o, threads);
      const double s = d.warm.seconds, cold = d.cold.seconds;
      if (f == KVFormat::bf16) { bf16_s = s; bf16_cold = cold; }
      secs.push_back(s);
      cold_secs.push_back(cold);
      const double gbps = d.bytes / s / 1e9, cold_gbps = d.bytes / cold / 1e9;
      char rel[16] = "", cold_rel[16] = "";
      if (bf16_s > 0) {
        std::snprintf(rel, sizeof rel, "%.2f", s / bf16_s);
        std::snprintf(cold_rel, sizeof cold_rel, "%.2f", cold / bf16_cold);
      }
      std::printf("%-8s %-5s %5lld %10.3f %11.1f %9.1f %8.2f %14s %10.3f %9.1f %8.2f %14s\n", "decode",
                  std::string(kv_format_name(f)).c_str(), static_cast<long long>(Hkv), s * 1e3, d.bytes / (1 << 20),
                  gbps, gbps / dram, rel, cold * 1e3, cold_gbps, cold_gbps / dram, cold_rel);
    }
    std::printf("decode Hkv %lld: bf16 / int8 time %.2f warm, %.2f cold (int8 speed-up over bf16)\n\n",
                static_cast<long long>(Hkv), secs[1] / secs[3], cold_secs[1] / cold_secs[3]);
  }
  {
    const i64 Hkv = 2;
    Tensor q(DType::f32, {Sp, Hq, D}), out(DType::f32, {Sp, Hq, D});
    std::mt19937_64 rng(3);
    std::normal_distribution<float> n(0.0f, 1.0f);
    for (i64 i = 0; i < q.numel(); ++i) q.data_as<float>()[i] = n(rng);
    const Tensor cq = cu(Sp), ck = cu(Sp);
    const Cache b = make_cache(KVFormat::bf16, Sp, Hkv, D);
    Tensor qb(DType::bf16, {Sp, Hq, D});
    for (i64 i = 0; i < q.numel(); ++i) qb.data_as<std::uint16_t>()[i] = float_to_bf16(q.data_as<float>()[i]);
    AttentionParams tiled = p;
    tiled.kernel = KernelKind::flash;
    const double flash_s = time_median([&] { attention_varlen(qb, b.k, b.v, out, cq, ck, tiled); }, o).seconds;
    double serving_bf16 = 0;
    std::printf("%-8s %-5s %5s %10s %24s %24s\n", "rows", "kv", "Hkv", "time ms", "time / bf16 serving", "time / bf16 flash");
    for (KVFormat f : formats) {
      const Cache c = make_cache(f, Sp, Hkv, D);
      const double s = time_median([&] { attention_varlen(q, c.kq(), c.vq(), out, cq, ck, p); }, o).seconds;
      if (f == KVFormat::bf16) serving_bf16 = s;
      // Formats before bf16 in the list have no bf16 serving time yet: that cell stays empty.
      char vs_bf16[32] = "";
      if (serving_bf16 > 0) std::snprintf(vs_bf16, sizeof vs_bf16, "%.2f", s / serving_bf16);
      std::printf("%-8s %-5s %5lld %10.3f %24s %24.2f\n", "prefill", std::string(kv_format_name(f)).c_str(),
                  static_cast<long long>(Hkv), s * 1e3, vs_bf16, s / flash_s);
    }
    std::printf("%-8s %-5s %5lld %10.3f   (tiled flash kernel, bf16 q/k/v)\n", "prefill", "bf16", static_cast<long long>(Hkv),
                flash_s * 1e3);
  }
  std::printf("(a shared machine: read the ratios, measured in the same run)\n");
}

}  // namespace qkv::cli::benchcmd
