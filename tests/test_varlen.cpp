// attention_varlen and attention_varlen_backward against the float64 reference run sequence by
// sequence: mixed batches (a one-token sequence beside a long one, equal lengths, Sq < Sk, empty
// sequences), head pairs (4,4), (8,2), (9,3), D in {64, 96, 128}, every option per sequence, every
// ISA level this machine supports, 1 and 2 threads (bitwise the same); argument errors.
#include <gtest/gtest.h>

#include <string>

#include "attention_diff.hpp"  // test_isas, IsaCap
#include "qkv/backward.hpp"
#include "qkv/error.hpp"
#include "serving_case.hpp"

using namespace qkv;
using namespace qkv::test;

namespace {

// Scaled-down mixes of (1, 7812), (2345, 2345), (134, 5131), with empty sequences between.
const Seqs kMixed = {{1, 781}, {0, 40}, {234, 234}, {13, 513}, {5, 0}, {0, 0}};

struct Opt { const char* name; AttentionParams p; };
std::vector<Opt> options() {
  std::vector<Opt> v;
  v.push_back({"plain", {}});
  AttentionParams c; c.causal = true; v.push_back({"causal", c});
  AttentionParams t; t.causal = true; t.align = Alignment::top_left; v.push_back({"causal top_left", t});
  AttentionParams w; w.window_left = 37; w.window_right = 5; v.push_back({"window(37,5)", w});
  AttentionParams s; s.softcap = 2.5; s.scale = 0.3; s.causal = true; s.window_left = 300; v.push_back({"softcap scale", s});
  AttentionParams wt; wt.window_left = 20; wt.window_right = 0; wt.align = Alignment::top_left; v.push_back({"window top_left", wt});
  return v;
}

// fp32 accumulation over up to ~800 keys of N(0,1) data: |error| <= 1.5e-6 measured; inputs in bf16/fp16 are
// exact in fp32, so the same bounds hold against the reference on the same rounded inputs.
constexpr double kTolOut = 5e-6, kTolLse = 5e-6;  // measured: at most 1.5e-6

void check_case(const Packed& pk, const AttentionParams& params, const std::string& what) {
  Tensor ref_o, ref_l;
  reference_packed(pk, params, ref_o, ref_l);
  Tensor first_o(DType::f32, {pk.Tq, pk.Hq, pk.Dv}), first_l(DType::f32, {pk.Hq, pk.Tq});
  for (detail::Isa isa : test_isas(pk.dtype)) {
    IsaCap cap(isa);
    bool have_first = false;  // each ISA level has its own bits (engine/serving_item.hpp)
    for (int threads : {1, 2}) {
      Tensor o(DType::f32, {pk.Tq, pk.Hq, pk.Dv}), l(DType::f32, {pk.Hq, pk.Tq});
      AttentionParams p = params;
      p.num_threads = threads;
      attention_varlen(pk.q, pk.k, pk.v, o, pk.cu_q, pk.cu_k, p, l.view());
      const std::string tag = what + " isa " + detail::isa_name(isa) + " threads " + std::to_string(threads);
      if (!have_first) {
        EXPECT_LE(max_err(o, ref_o, tag + " out"), kTolOut) << tag;
        EXPECT_LE(max_err(l, ref_l, tag + " lse"), kTolLse) << tag;
        std::memcpy(first_o.data(), o.data(), o.nbytes());
        std::memcpy(first_l.data(), l.data(), l.nbytes());
        have_first = true;
      } else {
        EXPECT_TRUE(same_bits(o, first_o)) << tag << ": out differs from the first run";
        EXPECT_TRUE(same_bits(l, first_l)) << tag << ": softmax_lse differs from the first run";
      }
    }
  }
}

}  // namespace

TEST(Varlen, MixedBatchesAgainstReference) {
  const std::pair<i64, i64> heads[] = {{4, 4}, {8, 2}, {9, 3}};
  const auto opts = options();
  std::uint64_t seed = 1;
  int o = 0;
  for (const auto& [hq, hkv] : heads)
    for (i64 d : {64, 96, 128}) {
      const DType dt = seed % 3 == 0 ? DType::bf16 : seed % 3 == 1 ? DType::f32 : DType::f16;
      const Packed pk = make_packed(kMixed, hq, hkv, d, d, dt, ++seed);
      const Opt& op = opts[static_cast<std::size_t>(o++) % opts.size()];
      check_case(pk, op.p, std::string(op.name) + " Hq" + std::to_string(hq) + " Hkv" + std::to_string(hkv) + " D" +
                               std::to_string(d) + " " + std::string(dtype_name(dt)));
    }
}

// GQA groups of more than kServingRows (32) query heads per KV head: a decode item then has G
// rows per head, more than the tile path's fixed arrays once held (bf16, D a multiple of 32).
TEST(Varlen, LargeGqaGroups) {
  const Seqs seqs = {{1, 300}, {1, 1100}, {3, 40}};
  std::uint64_t seed = 900;
  for (const auto& [hq, hkv] : {std::pair<i64, i64>{64, 1}, {48, 1}, {66, 2}}) {
    const Packed pk = make_packed(seqs, hq, hkv, 64, 64, DType::bf16, ++seed);
    AttentionParams c; c.causal = true;
    check_case(pk, c, "Hq" + std::to_string(hq) + " Hkv" + std::to_string(hkv) + " bf16");
  }
}

// Every option on one small batch (odd sizes, Dv != D, a sequence of one key).
TEST(Varlen, EveryOptionSmall) {
  const Seqs seqs = {{7, 19}, {1, 1}, {17, 3}, {0, 9}, {33, 33}};
  std::uint64_t seed = 100;
  for (const Opt& op : options()) {
    const Packed pk = make_packed(seqs, 6, 2, 24, 40, DType::f32, ++seed);
    check_case(pk, op.p, op.name);
  }
}

// Attention sinks on the serving kernel (one more partial of its merge): sequences across split
// boundaries, empty rows (O = 0, lse = z), GQA, every option above, f32 and bf16.
TEST(Varlen, SinksAgainstReference) {
  std::uint64_t seed = 300;
  int o = 0;
  const auto opts = options();
  for (const auto& [hq, hkv] : {std::pair<i64, i64>{4, 4}, {6, 2}}) {
    Tensor z(DType::f32, {hq});
    for (i64 h = 0; h < hq; ++h) z.data_as<float>()[h] = 0.7f * static_cast<float>(h) - 1.5f;
    for (DType dt : {DType::f32, DType::bf16}) {
      const Packed pk = make_packed(kMixed, hq, hkv, 40, 40, dt, ++seed);
      for (int r = 0; r < 2; ++r) {
        const Opt& op = opts[static_cast<std::size_t>(o++) % opts.size()];
        AttentionParams p = op.p;
        p.sinks = z.view();
        Tensor out(DType::f32, {pk.Tq, pk.Hq, pk.Dv});
        const std::string e = explain_dispatch(pk.q, pk.k, pk.v, out, pk.cu_q, pk.cu_k, p);
        ASSERT_NE(e.find("serving: chosen"), std::string::npos) << e;
        check_case(pk, p, std::string("sinks ") + op.name + " Hq" + std::to_string(hq) + " " + std::string(dtype_name(dt)));
      }
    }
  }
}

// Forced kernels: one qkv::attention call per sequence.
TEST(Varlen, ForcedKernelsPerSequence) {
  const Packed pk = make_packed({{3, 50}, {40, 40}, {0, 4}, {2, 0}}, 4, 2, 32, 32, DType::f32, 7);
  AttentionParams params;
  params.causal = true;
  Tensor ref_o, ref_l;
  reference_packed(pk, params, ref_o, ref_l);
  for (KernelKind kind : {KernelKind::reference, KernelKind::flash}) {
    Tensor o(DType::f32, {pk.Tq, pk.Hq, pk.Dv}), l(DType::f32, {pk.Hq, pk.Tq});
    AttentionParams p = params;
    p.kernel = kind;
    attention_varlen(pk.q, pk.k, pk.v, o, pk.cu_q, pk.cu_k, p, l.view());
    EXPECT_LE(max_err(o, ref_o, "out"), kTolOut);
    EXPECT_LE(max_err(l, ref_l, "lse"), kTolLse);
  }
  // float64 inputs go to the reference.
  const Packed pd = make_packed({{3, 5}, {4, 4}}, 2, 1, 8, 8, DType::f64, 8);
  Tensor ro, rl;
  reference_packed(pd, params, ro, rl);
  Tensor o(DType::f64, {pd.Tq, pd.Hq, pd.Dv});
  attention_varlen(pd.q, pd.k, pd.v, o, pd.cu_q, pd.cu_k, params);
  EXPECT_LE(max_err(o, ro, "f64 out"), 1e-12);
}

// The backward, sequence by sequence, against the float64 reference backward; keys of a sequence
// without queries get zero gradients.
TEST(Varlen, BackwardAgainstReference) {
  const Seqs seqs = {{1, 78}, {0, 6}, {23, 23}, {13, 51}, {4, 0}};
  for (const auto& [hq, hkv] : std::vector<std::pair<i64, i64>>{{4, 4}, {9, 3}}) {
    const Packed pk = make_packed(seqs, hq, hkv, 64, 64, DType::f32, 20 + hq);
    AttentionParams params;
    params.causal = hq == 4;
    params.softcap = hq == 9 ? 3.0 : 0.0;
    Tensor o(DType::f32, {pk.Tq, pk.Hq, pk.Dv}), l(DType::f32, {pk.Hq, pk.Tq});
    attention_varlen(pk.q, pk.k, pk.v, o, pk.cu_q, pk.cu_k, params, l.view());
    Tensor dout(DType::f32, {pk.Tq, pk.Hq, pk.Dv});
    std::mt19937_64 rng(5);
    fill_normal(dout, rng);
    Tensor dq(DType::f32, {pk.Tq, pk.Hq, pk.D}), dk(DType::f32, {pk.Tk, pk.Hkv, pk.D}), dv(DType::f32, {pk.Tk, pk.Hkv, pk.Dv});
    std::memset(dk.data(), 0x7f, dk.nbytes());  // every element must be written
    attention_varlen_backward(pk.q, pk.k, pk.v, o, l, dout, dq, dk, dv, pk.cu_q, pk.cu_k, params);
    Tensor rq(DType::f64, {pk.Tq, pk.Hq, pk.D}), rk(DType::f64, {pk.Tk, pk.Hkv, pk.D}), rv(DType::f64, {pk.Tk, pk.Hkv, pk.Dv});
    for (std::size_t b = 0; b < seqs.size(); ++b) {
      const auto [sq, sk] = seqs[b];
      const i64 q0 = pk.q0(b), k0 = pk.k0(b);
      reference::attention_backward(seq_view(pk.q, q0, sq), seq_view(pk.k, k0, sk), seq_view(pk.v, k0, sk),
                                    seq_view(o, q0, sq), lse_view(l, q0, sq), seq_view(dout, q0, sq),
                                    seq_view(rq, q0, sq), seq_view(rk, k0, sk), seq_view(rv, k0, sk), params);
    }
    EXPECT_LE(max_err(dq, rq, "dq"), 1e-4);
    EXPECT_LE(max_err(dk, rk, "dk"), 1e-4);
    EXPECT_LE(max_err(dv, rv, "dv"), 1e-4);
    for (i64 e = pk.k0(1) * pk.Hkv * pk.D; e < pk.k0(2) * pk.Hkv * pk.D; ++e) EXPECT_EQ(dk.data_as<float>()[e], 0.0f);
  }
}

namespace {
void expect_error(const std::function<void()>& f, const std::string& start) {
  try {
    f();
    ADD_FAILURE() << "no error, expected one starting '" << start << "'";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind(start, 0), 0u) << e.what();
  }
}
}  // namespace

TEST(Varlen, ErrorsNameTheArgument) {
  const Packed pk = make_packed({{3, 5}, {2, 2}}, 4, 2, 8, 8, DType::f32, 3);
  Tensor o(DType::f32, {pk.Tq, pk.Hq, pk.Dv});
  auto run = [&](const TensorView& q, const TensorView& cq, const TensorView& ck, AttentionParams p = {}) {
    attention_varlen(q, pk.k, pk.v, o, cq, ck, p);
  };
  Tensor q4(DType::f32, {1, pk.Tq, pk.Hq, pk.D});
  expect_error([&] { run(q4, pk.cu_q, pk.cu_k); }, "q: expected a 3-D tensor [total_q,Hq,D], got rank 4");
  Tensor cu64(DType::i64, {3});
  expect_error([&] { run(pk.q, cu64, pk.cu_k); }, "cu_seqlens_q: expected dtype int32, got int64");
  Tensor bad = cu_seqlens({3, 1});
  expect_error([&] { run(pk.q, bad, pk.cu_k); }, "cu_seqlens_q: expected the last entry == total_q (5), got 4");
  Tensor three = cu_seqlens({3, 1, 1});
  expect_error([&] { run(pk.q, three, pk.cu_k); }, "cu_seqlens_k: expected [batch + 1] = 4 entries, got 3");
  Tensor dec = cu_seqlens({3, 2});
  dec.data_as<std::int32_t>()[1] = 6;
  expect_error([&] { run(pk.q, dec, pk.cu_k); }, "cu_seqlens_q: expected non-decreasing prefix sums");
  Tensor lens(DType::i32, {2});
  AttentionParams kl;
  kl.kv_lens = lens.view();
  expect_error([&] { run(pk.q, pk.cu_q, pk.cu_k, kl); }, "kv_lens: expected none");
  Tensor lse(DType::f32, {pk.Tq, pk.Hq});
  expect_error([&] { attention_varlen(pk.q, pk.k, pk.v, o, pk.cu_q, pk.cu_k, {}, lse.view()); },
               "softmax_lse: expected shape [Hq,total_q] = [4,5], got [5,4]");
  Tensor o2(DType::f32, {pk.Tq, pk.Hq, 9});
  expect_error([&] { attention_varlen(pk.q, pk.k, pk.v, o2, pk.cu_q, pk.cu_k); }, "out: expected [total_q,Hq,Dv] with Dv == v.Dv (8)");
  AttentionParams sc;
  sc.softcap = -1;
  expect_error([&] { run(pk.q, pk.cu_q, pk.cu_k, sc); }, "softcap: expected a finite number >= 0");
  // The output overlapping the queries.
  expect_error([&] { attention_varlen(pk.q, pk.k, pk.v, pk.q, pk.cu_q, pk.cu_k); }, "out: expected memory disjoint from q");
}
