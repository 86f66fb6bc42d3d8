// `qkv bench --serving`: the serving path (docs/serving.md) on serving-shaped work.
//   decode     32 sequences of one new token each, keys spread from 1k to 32k (--quick: 256..4k),
//              bf16 K/V, Hq 32, Hkv 4, D 128: GB/s of K and V read against the read bandwidth of
//              a 512 MiB buffer measured in the same run; packed (attention_varlen) and paged
//              (attention_paged, 16-key blocks on a random block table over the same keys) side by
//              side, and the tiled decode kernel per sequence (kernel = decode, not batch invariant)
//              as the baseline;
//   mix        the same batch with 4 of the sequences taking a 32-token prefill chunk instead;
//   generate   stories260K: 32 prompts through LlamaBatch (continuous batching, batch 32) against
//              one prompt at a time (Llama, batch_invariant), total tokens/s of each.
// Medians of --repeats timed runs; the ratios are measured in the same run.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "rows.hpp"
#include "serving.hpp"
#include "models.hpp"
#include "qkv/llama.hpp"
#include "qkv/sampler.hpp"
#include "qkv/varlen.hpp"

namespace qkv::cli::benchcmd {
namespace {

using i64 = std::int64_t;

Tensor cu_of(const std::vector<i64>& lens) {
  Tensor t(DType::i32, {static_cast<i64>(lens.size()) + 1});
  t.data_as<std::int32_t>()[0] = 0;
  for (std::size_t b = 0; b < lens.size(); ++b)
    t.data_as<std::int32_t>()[b + 1] = t.data_as<std::int32_t>()[b] + static_cast<std::int32_t>(lens[b]);
  return t;
}

void fill(const Tensor& t, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, 1.0f);
  auto* p = t.data_as<std::uint16_t>();
  if (t.dtype() == DType::f32) {
    for (i64 i = 0; i < t.numel(); ++i) t.data_as<float>()[i] = n(rng);
  } else {
    for (i64 i = 0; i < t.numel(); ++i) p[i] = float_to_bf16(n(rng));
  }
}

}  // namespace

ServingBatch::ServingBatch(bool quick) : lo(quick ? 256 : 1024), hi(quick ? 4096 : 32768) {
  const i64 nseq = kSequences, Hkv = kHkv, D = kD, bs = kBlock;
  const DType dt = DType::bf16;
  klens.resize(static_cast<std::size_t>(nseq));
  for (i64 b = 0; b < nseq; ++b) klens[static_cast<std::size_t>(b)] = lo + (hi - lo) * b / (nseq - 1);
  // Spread, not sorted: the batch order is irrelevant to the results, a long one may come first.
  std::shuffle(klens.begin(), klens.end(), std::mt19937_64(7));
  total_keys = std::accumulate(klens.begin(), klens.end(), i64{0});
  kv_bytes = 2.0 * static_cast<double>(total_keys) * Hkv * D * 2;

  // Packed keys, and the same keys on random blocks of a pool.
  k_ = Tensor(dt, {total_keys, Hkv, D});
  v_ = Tensor(dt, {total_keys, Hkv, D});
  fill(k_, 1);
  fill(v_, 2);
  i64 nblocks = 0;
  for (i64 L : klens) nblocks += (L + bs - 1) / bs;
  std::vector<std::int32_t> perm(static_cast<std::size_t>(nblocks));
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937_64(8));
  i64 max_blocks = 0;
  for (i64 L : klens) max_blocks = std::max(max_blocks, (L + bs - 1) / bs);
  k_pool_ = Tensor(dt, {nblocks, Hkv, bs, D});
  v_pool_ = Tensor(dt, {nblocks, Hkv, bs, D});
  table_ = Tensor(DType::i32, {nseq, max_blocks});
  lens_ = Tensor(DType::i32, {nseq});
  std::int32_t* table = table_.data_as<std::int32_t>();
  std::fill_n(table, table_.numel(), 0);
  i64 used = 0, t0 = 0;
  for (i64 b = 0; b < nseq; ++b) {
    const i64 L = klens[static_cast<std::size_t>(b)];
    lens_.data_as<std::int32_t>()[b] = static_cast<std::int32_t>(L);
    for (i64 c = 0; c < (L + bs - 1) / bs; ++c) table[b * max_blocks + c] = perm[static_cast<std::size_t>(used++)];
    for (i64 j = 0; j < L; ++j)
      for (i64 h = 0; h < Hkv; ++h) {
        const i64 blk = table[b * max_blocks + j / bs];
        const i64 dst = ((blk * Hkv + h) * bs + j % bs) * D, src = ((t0 + j) * Hkv + h) * D;
        std::copy_n(k_.data_as<std::uint16_t>() + src, D, k_pool_.data_as<std::uint16_t>() + dst);
        std::copy_n(v_.data_as<std::uint16_t>() + src, D, v_pool_.data_as<std::uint16_t>() + dst);
      }
    t0 += L;
  }
}

ServingBatch::Paths ServingBatch::time_paths(const std::vector<i64>& qlens, const BenchOptions& o, int threads) const {
  AttentionParams p;
  p.causal = true;
  p.num_threads = threads;
  const i64 Tq = std::accumulate(qlens.begin(), qlens.end(), i64{0});
  Tensor q(DType::bf16, {Tq, kHq, kD}), out(DType::f32, {Tq, kHq, kD});
  fill(q, 3);
  const Tensor cq = cu_of(qlens), ck = cu_of(klens);
  Paths r;
  r.packed = time_median([&] { attention_varlen(q, k_, v_, out, cq, ck, p); }, o);
  r.paged = time_median([&] { attention_paged(q, k_pool_, v_pool_, out, cq, lens_, table_, p); }, o);
  AttentionParams tiled = p;
  tiled.kernel = Tq == kSequences ? KernelKind::decode : KernelKind::flash;
  r.tiled = time_median([&] { attention_varlen(q, k_, v_, out, cq, ck, tiled); }, o);
  return r;
}

void run_bench_serving(const BenchOptions& o_in) {
  const BenchOptions o = with_defaults(o_in, o_in.quick ? 3 : 7, o_in.quick ? 0 : 0.5);
  const int threads = run_threads(o);
  const ServingBatch batch(o.quick);
  std::printf("qkv bench --serving: %d threads; %lld sequences, keys %lld..%lld (%lld in all), Hq %lld, Hkv %lld, D %lld, bf16 K/V (%.0f MiB)\n",
              threads, static_cast<long long>(batch.kSequences), static_cast<long long>(batch.lo),
              static_cast<long long>(batch.hi), static_cast<long long>(batch.total_keys),
              static_cast<long long>(batch.kHq), static_cast<long long>(batch.kHkv), static_cast<long long>(batch.kD),
              batch.kv_bytes / (1 << 20));
  const double dram = bench::measure_read_bandwidth(threads, o.read_mib * (1 << 20), o.peak_seconds);
  std::printf("read bandwidth of a %.0f MiB buffer: %.1f GB/s\n\n", o.read_mib, dram);

  auto decode_rows = [&](const char* what, const std::vector<i64>& qlens) {
    const ServingBatch::Paths t = batch.time_paths(qlens, o, threads);
    const bool decode = static_cast<i64>(qlens.size()) == std::accumulate(qlens.begin(), qlens.end(), i64{0});
    auto line = [&](const char* path, const Timing& x) {
      const double gbps = batch.kv_bytes / x.seconds / 1e9;
      std::printf("%-8s %-34s %9.3f ms %8.1f GB/s %6.2f of DRAM  (%d runs)\n", what, path, x.seconds * 1e3, gbps,
                  gbps / dram, x.runs);
    };
    line("packed (attention_varlen)", t.packed);
    line("paged (attention_paged, bs 16)", t.paged);
    line(decode ? "tiled decode kernel, per sequence" : "tiled flash kernel, per sequence", t.tiled);
    std::printf("%-8s paged / packed time %.3f; serving / tiled time %.2f\n\n", what, t.paged.seconds / t.packed.seconds,
                t.packed.seconds / t.tiled.seconds);
  };
  decode_rows("decode", std::vector<i64>(static_cast<std::size_t>(batch.kSequences), 1));
  std::vector<i64> mix(static_cast<std::size_t>(batch.kSequences), 1);
  for (std::size_t b = 0; b < 4; ++b) mix[b] = std::min<i64>(32, batch.klens[b]);
  decode_rows("mix", mix);

  // Batched generation on stories260K.
  auto [weights, tok] = load_model("", "");
  const char* texts[] = {"Once upon a time", "Lily and Ben", "The cat sat", "Tom had a big red ball", "Sue",
                         "One day, a little dog", "The sun was hot", "Mom said"};
  std::vector<std::vector<int>> prompts;
  for (int i = 0; i < 32; ++i) prompts.push_back(tok.encode(texts[i % 8], true, false));
  const int steps = o.quick ? 64 : weights.config.max_seq_len;
  SamplerConfig sc;
  sc.temperature = 0;
  LlamaOptions lopt;
  lopt.batch_invariant = true;
  lopt.num_threads = threads;
  std::int64_t toks_one = 0, toks_batch = 0;
  const Timing one = time_median([&] {
    Llama m(weights, lopt);
    Sampler s(sc);
    toks_one = 0;
    for (const auto& pr : prompts) toks_one += static_cast<i64>(generate(m, pr, steps, [&](std::span<const float> l) { return s.sample(l); }).size());
  }, o);
  const Timing batched = time_median([&] {
    LlamaBatch m(weights, 32, lopt);
    Sampler s(sc);
    toks_batch = 0;
    for (const auto& seq : generate_batch(m, prompts, steps, 32, [&](std::size_t, std::span<const float> l) { return s.sample(l); }))
      toks_batch += static_cast<i64>(seq.size());
  }, o);
  std::printf("generate stories260K, 32 prompts, %d steps, greedy: one at a time %.0f tok/s (%.1f ms), batch 32 %.0f tok/s (%.1f ms); batched / one at a time %.2f; same tokens %s\n",
              steps, toks_one / one.seconds, one.seconds * 1e3, toks_batch / batched.seconds, batched.seconds * 1e3,
              one.seconds / batched.seconds, toks_one == toks_batch ? "yes" : "NO");
  std::printf("(a shared machine: read the ratios, measured in the same run)\n");
}

}  // namespace qkv::cli::benchcmd
