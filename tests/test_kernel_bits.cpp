// The exact bits of the fast kernels, pinned: a fixed grid of calls (every dtype, option and
// kernel, odd shapes, BSHD views, GQA) is run on every ISA level this CPU has, and a hash of
// each output and softmax_lse is compared with tests/data/kernel_bits.txt. A refactoring of the
// kernels must leave every line unchanged; a deliberate change of the arithmetic regenerates
// the file (QKV_WRITE_KERNEL_BITS=path) and says why in its commit.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "attention_diff.hpp"
#include "kernels/isa_kernels.hpp"
#include "qkv/attention.hpp"
#include "qkv/tensor.hpp"

namespace qkv::test {
namespace {

// splitmix64: the same inputs on every platform and standard library.
struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53 * 4.0 - 2.0; }  // [-2, 2)
};

std::uint64_t fnv1a(const void* data, std::size_t n, std::uint64_t h = 0xcbf29ce484222325ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

struct GridCase {
  std::string name;
  std::int64_t B, Hq, Hkv, Sq, Sk, D, Dv;
  DType dtype = DType::f32;
  bool bshd = false;
  bool causal = false;
  Alignment align = Alignment::bottom_right;
  std::int64_t wl = -1, wr = -1;
  double softcap = 0.0;
  int mask = 0;  // 0 none, 1 bool [Sq, Sk], 2 additive f32 [B, 1, Sq, Sk]
  bool kv_lens = false;
};

std::vector<GridCase> grid() {
  std::vector<GridCase> g;
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    const std::string t(dtype_name(dt));
    // flash shapes: tile tails, odd D, Sq != Sk both alignments
    g.push_back({t + ".plain", 1, 2, 2, 97, 97, 64, 64, dt});
    g.push_back({t + ".d128_causal", 1, 2, 2, 200, 200, 128, 128, dt, false, true});
    g.push_back({t + ".odd_d", 2, 3, 3, 33, 71, 59, 37, dt});
    g.push_back({t + ".d1", 1, 1, 1, 17, 29, 1, 1, dt});
    g.push_back({t + ".topleft", 1, 2, 1, 130, 70, 64, 64, dt, false, true, Alignment::top_left});
    g.push_back({t + ".bottomright", 1, 2, 1, 70, 130, 64, 64, dt, false, true});
    g.push_back({t + ".window", 1, 4, 2, 150, 150, 32, 32, dt, true, false, Alignment::bottom_right, 20, 5});
    g.push_back({t + ".softcap", 1, 2, 2, 65, 80, 64, 64, dt, false, false, Alignment::bottom_right, -1, -1, 5.0});
    g.push_back({t + ".boolmask", 1, 2, 2, 66, 90, 40, 40, dt, false, false, Alignment::bottom_right, -1, -1, 0.0, 1});
    g.push_back({t + ".addmask", 2, 2, 1, 50, 77, 16, 24, dt, true, true, Alignment::bottom_right, -1, -1, 0.0, 2});
    g.push_back({t + ".kvlens", 3, 2, 2, 40, 100, 64, 64, dt, false, true, Alignment::bottom_right, -1, -1, 0.0, 0, true});
    g.push_back({t + ".gqa8", 1, 8, 1, 100, 300, 128, 128, dt, true});
    // decode shapes (Sq <= 16): fast paths (MHA, GQA 2/4/8) and the tile engine
    g.push_back({t + ".dec_mha", 2, 4, 4, 1, 5000, 128, 128, dt});
    g.push_back({t + ".dec_mha_d64", 1, 2, 2, 1, 4500, 64, 64, dt, true});
    g.push_back({t + ".dec_gqa4", 1, 8, 2, 1, 9000, 128, 128, dt});
    g.push_back({t + ".dec_gqa8", 1, 8, 1, 3, 333, 64, 64, dt, false, true});
    g.push_back({t + ".dec_odd", 1, 4, 2, 5, 777, 59, 33, dt, false, true});
    g.push_back({t + ".dec_window", 1, 4, 2, 2, 2000, 64, 64, dt, false, false, Alignment::bottom_right, 300, 0});
    g.push_back({t + ".dec_softcap", 1, 2, 1, 1, 600, 64, 64, dt, false, false, Alignment::bottom_right, -1, -1, 8.0});
    g.push_back({t + ".dec_mask", 1, 2, 2, 4, 500, 32, 32, dt, false, false, Alignment::bottom_right, -1, -1, 0.0, 1});
    g.push_back({t + ".dec_kvlens", 3, 4, 1, 1, 700, 64, 64, dt, false, false, Alignment::bottom_right, -1, -1, 0.0, 0, true});
  }
  return g;
}

// Output and softmax_lse of one case on the current ISA and `threads` threads, hashed.
std::uint64_t run_case(const GridCase& c, int threads) {
  Rng rng{fnv1a(c.name.data(), c.name.size())};
  auto make = [&](std::int64_t H, std::int64_t S, std::int64_t X) {
    Tensor t(c.dtype, c.bshd ? Shape{c.B, S, H, X} : Shape{c.B, H, S, X});
    for (std::int64_t i = 0; i < t.numel(); ++i) store_from_double(t.data(), c.dtype, i, rng.uniform());
    return t;
  };
  Tensor q = make(c.Hq, c.Sq, c.D), k = make(c.Hkv, c.Sk, c.D), v = make(c.Hkv, c.Sk, c.Dv);
  Tensor o(DType::f32, c.bshd ? Shape{c.B, c.Sq, c.Hq, c.Dv} : Shape{c.B, c.Hq, c.Sq, c.Dv});
  Tensor lse(DType::f32, {c.B, c.Hq, c.Sq});
  auto view = [&](const Tensor& t) { return c.bshd ? t.view().permute({0, 2, 1, 3}) : t.view(); };
  AttentionParams p;
  p.causal = c.causal;
  p.align = c.align;
  p.window_left = c.wl;
  p.window_right = c.wr;
  p.softcap = c.softcap;
  p.num_threads = threads;
  Tensor mask, lens(DType::i64, {c.B});
  if (c.mask == 1) {
    mask = Tensor(DType::b8, {c.Sq, c.Sk});
    auto* m = static_cast<std::uint8_t*>(mask.data());
    for (std::int64_t i = 0; i < mask.numel(); ++i) m[i] = (rng.next() % 5) != 0;
    p.mask = mask.view();
  } else if (c.mask == 2) {
    mask = Tensor(DType::f32, {c.B, 1, c.Sq, c.Sk});
    auto* m = static_cast<float*>(mask.data());
    for (std::int64_t i = 0; i < mask.numel(); ++i)
      m[i] = rng.next() % 7 == 0 ? -std::numeric_limits<float>::infinity() : static_cast<float>(rng.uniform());
    p.mask = mask.view();
  }
  if (c.kv_lens) {
    auto* l = static_cast<std::int64_t*>(lens.data());
    for (std::int64_t b = 0; b < c.B; ++b) l[b] = c.Sk - static_cast<std::int64_t>(rng.next() % (c.Sk / 2 + 1));
    p.kv_lens = lens.view();
  }
  attention(view(q), view(k), view(v), view(o), p, lse.view());
  const std::uint64_t h = fnv1a(o.data(), static_cast<std::size_t>(o.numel()) * 4);
  return fnv1a(lse.data(), static_cast<std::size_t>(lse.numel()) * 4, h);
}

std::map<std::string, std::string> read_golden(const std::string& path) {
  std::map<std::string, std::string> m;
  std::ifstream f(path);
  std::string isa, name, hash;
  while (f >> isa >> name >> hash) m[isa + " " + name] = hash;
  return m;
}

std::string hex(std::uint64_t h) {
  std::ostringstream s;
  s << std::hex << h;
  return s.str();
}

TEST(KernelBits, FixedGridOnEveryIsa) {
  const std::string golden_path = std::string(QKV_SOURCE_DIR) + "/tests/data/kernel_bits.txt";
  const char* write_to = std::getenv("QKV_WRITE_KERNEL_BITS");
  const auto golden = read_golden(golden_path);
  std::ostringstream written;
  int compared = 0;
  for (int l = 0; l <= static_cast<int>(detail::Isa::avx512amx); ++l) {
    const auto isa = static_cast<detail::Isa>(l);
    if (!detail::isa_compiled(isa) || !detail::isa_supported(isa)) continue;
    IsaCap cap(isa);
    if (detail::active_isa() != isa) continue;  // above a QKV_ISA cap
    for (const GridCase& c : grid()) {
      const std::uint64_t h1 = run_case(c, 1);
      const std::uint64_t h2 = run_case(c, 2);
      ASSERT_EQ(h1, h2) << c.name << " on " << detail::isa_name(isa) << ": 1 and 2 threads differ";
      const std::string key = std::string(detail::isa_name(isa)) + " " + c.name;
      written << key << " " << hex(h1) << "\n";
      if (write_to) continue;
      const auto it = golden.find(key);
      ASSERT_NE(it, golden.end()) << key << " is missing from " << golden_path;
      EXPECT_EQ(it->second, hex(h1)) << key << ": the kernel's bits changed";
      ++compared;
    }
  }
  if (write_to) {
    std::ofstream(write_to) << written.str();
    GTEST_SKIP() << "wrote " << write_to;
  }
  EXPECT_GT(compared, 0);
}

// Which form computes a bf16 call (and so its bits) is a fact of the CPU and the requested
// level, never of a timing: processes exchanging partial results (the ranks of one distributed
// call) must all choose the same, and a rate measured on a busy machine once chose differently.
TEST(KernelBits, Bf16DotChoiceIsACpuFact) {
  using detail::Isa;
  {
    IsaCap cap(Isa::avx512);
    EXPECT_FALSE(detail::bf16_dot_enabled()) << "no bf16 dot products below avx512bf16";
  }
  if (detail::active_isa() == Isa::avx512amx) EXPECT_TRUE(detail::bf16_dot_enabled()) << "AMX tiles";
  if (detail::active_isa() == Isa::avx512bf16 && !detail::bf16_dot_requested()) {
    const bool before = detail::bf16_dot_enabled();
    EXPECT_EQ(before, !detail::cpu_features().amx_hw);
    (void)detail::bf16_dot_rate();  // a timing, taken now: must not move the choice
    EXPECT_EQ(detail::bf16_dot_enabled(), before);
  }
  {
    IsaCap cap(Isa::avx512bf16);
    if (detail::active_isa() == Isa::avx512bf16) EXPECT_TRUE(detail::bf16_dot_enabled()) << "asked for by name";
  }
}

}  // namespace
}  // namespace qkv::test
