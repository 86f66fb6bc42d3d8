// Every public entry point's call is explained by the one registry (src/dispatch): for a call of
// each entry (dense forward with few and many query rows, dense backward, packed forward over
// float and quantized keys, packed backward, paged over float and quantized pools) the
// explanation has exactly one "chosen" line and names every kernel the registry has for that
// entry; forcing the chosen kernel's kind (where it has one) gives the same bits as the automatic
// choice; a forced kernel that cannot run the call throws with its reason, before writing.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "dispatch/dispatch.hpp"
#include "kernels/isa_kernels.hpp"
#include "qkv/backward.hpp"
#include "qkv/error.hpp"
#include "qkv/info.hpp"
#include "qkv/kv_quant.hpp"
#include "serving_case.hpp"

using namespace qkv;
using namespace qkv::test;

namespace {

using detail::Entry;

// Checks the form of an explanation of `entry`'s call and returns the chosen line.
std::string chosen_line(const std::string& e, Entry entry) {
  std::vector<std::string> lines;
  std::istringstream in(e);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  std::string chosen;
  int n_chosen = 0;
  std::size_t kernels = 0;
  for (const detail::KernelEntry& k : detail::kernel_registry()) {
    if (!(k.entries & detail::entry_bit(entry))) continue;
    ++kernels;
    int named = 0;
    for (const std::string& l : lines) {
      if (l.rfind(std::string(k.name) + ": ", 0) != 0) continue;
      ++named;
      if (l.find(": chosen") != std::string::npos) { ++n_chosen; chosen = l; }
    }
    EXPECT_EQ(named, 1) << "kernel '" << k.name << "' in:\n" << e;
  }
  std::size_t probs = 0;
  for (const std::string& l : lines) probs += l.rfind("probs: ", 0) == 0;
  EXPECT_EQ(lines.size(), kernels + probs) << e;
  EXPECT_EQ(n_chosen, 1) << e;
  return chosen;
}

std::string name_of(const std::string& chosen_line) { return chosen_line.substr(0, chosen_line.find(':')); }

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.data(), b.data(), a.numel() * dtype_size(a.dtype())) == 0;
}

KernelKind kind_named(const std::string& name) {
  return name == "decode" ? KernelKind::decode : name == "flash" ? KernelKind::flash
                                                                 : name == "reference" ? KernelKind::reference
                                                                                       : KernelKind::automatic;
}

void expect_throw_with(const std::function<void()>& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no error, expected: " << text;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

// A dense call: q [1, 4, Sq, 32] over 2 KV heads of 80 keys (BSHD views of packed tensors), causal.
struct Dense {
  Packed pk;
  TensorView q, k, v;
  Tensor out, lse;
  AttentionParams p;
  Dense(i64 sq, DType dt)
      : pk(make_packed({{sq, 80}}, 4, 2, 32, 32, dt, 11 + static_cast<std::uint64_t>(sq))),
        q(seq_view(pk.q, 0, sq)), k(seq_view(pk.k, 0, 80)), v(seq_view(pk.v, 0, 80)),
        out(dt == DType::f64 ? DType::f64 : DType::f32, {1, 4, sq, 32}), lse(DType::f32, {1, 4, sq}) {
    p.causal = true;
  }
  // Runs the call with `kind` forced; returns out and lse.
  std::pair<Tensor, Tensor> run(KernelKind kind) {
    AttentionParams pk = p;
    pk.kernel = kind;
    Tensor o(out.dtype(), out.shape()), l(DType::f32, lse.shape());
    attention(q, k, v, o, pk, l.view());
    return {std::move(o), std::move(l)};
  }
};

}  // namespace

TEST(Dispatch, DenseForwardFewAndManyRows) {
  for (i64 sq : {1, 64}) {
    Dense d(sq, DType::f32);
    const std::string line = chosen_line(explain_dispatch(d.q, d.k, d.v, d.out, d.p, d.lse.view()), Entry::forward);
    EXPECT_EQ(name_of(line), sq == 1 ? "decode" : "flash");
    EXPECT_NE(line.find("(" + active_isa_string()), std::string::npos) << line;
    const auto [o, l] = d.run(KernelKind::automatic);
    const auto [fo, fl] = d.run(kind_named(name_of(line)));
    EXPECT_TRUE(same_bits(o, fo) && same_bits(l, fl)) << "Sq " << sq << ": forcing '" << name_of(line) << "'";
  }
  // Asked for the weights: a note, still one choice.
  Dense d(64, DType::f32);
  Tensor probs(DType::f32, {1, 4, 64, 80});
  const std::string e = explain_dispatch(d.q, d.k, d.v, d.out, d.p, std::nullopt, probs.view());
  EXPECT_EQ(name_of(chosen_line(e, Entry::forward)), "flash");
  EXPECT_NE(e.find("probs: "), std::string::npos) << e;
  // A forced kernel that refuses says why, and writes nothing.
  d.p.kernel = KernelKind::decode;
  d.out.data_as<float>()[0] = 7.0f;
  expect_throw_with([&] { attention(d.q, d.k, d.v, d.out, d.p); },
                    "kernel: the requested kernel 'decode' cannot run this call: Sq = 64 > 16");
  expect_throw_with([&] { explain_dispatch(d.q, d.k, d.v, d.out, d.p); }, "Sq = 64 > 16");
  EXPECT_EQ(d.out.data_as<float>()[0], 7.0f);
  // float64 inputs: the reference, the tiled kernels refused.
  Dense f(64, DType::f64);
  const std::string ef = explain_dispatch(f.q, f.k, f.v, f.out, f.p);
  EXPECT_EQ(chosen_line(ef, Entry::forward), "reference: chosen");
  EXPECT_NE(ef.find("flash: refused (float64 inputs"), std::string::npos) << ef;
  // bf16 inputs: the chosen line names the level's bf16 form where it has one.
  Dense b(64, DType::bf16);
  bool dot = false;
  detail::active_isa_kernels(dot);
  const std::string eb = chosen_line(explain_dispatch(b.q, b.k, b.v, b.out, b.p), Entry::forward);
  EXPECT_EQ(eb.find("bf16") != std::string::npos, dot) << eb;
}

TEST(Dispatch, DenseBackward) {
  for (DType dt : {DType::f32, DType::f64}) {
    Dense d(24, dt);
    const std::pair<Tensor, Tensor> fwd = d.run(KernelKind::automatic);
    const Tensor &o = fwd.first, &l = fwd.second;
    Tensor dout(dt, o.shape());
    std::mt19937_64 rng(3);
    fill_normal(dout, rng);
    auto grads = [&](KernelKind kind) {
      std::vector<Tensor> g;
      for (const TensorView* t : {&d.q, &d.k, &d.v}) g.emplace_back(DType::f32, t->shape());
      AttentionParams p = d.p;
      p.kernel = kind;
      attention_backward(d.q, d.k, d.v, o, l, dout, g[0], g[1], g[2], p);
      return g;
    };
    std::vector<Tensor> g = grads(KernelKind::automatic);
    const std::string e = explain_dispatch(d.q, d.k, d.v, o, l, dout, g[0], g[1], g[2], d.p);
    const std::string line = chosen_line(e, Entry::backward);
    EXPECT_EQ(name_of(line), dt == DType::f64 ? "reference" : "flash") << e;
    const std::vector<Tensor> forced = grads(kind_named(name_of(line)));
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(same_bits(g[static_cast<std::size_t>(i)], forced[static_cast<std::size_t>(i)]));
    AttentionParams p = d.p;
    p.kernel = KernelKind::decode;
    expect_throw_with([&] { explain_dispatch(d.q, d.k, d.v, o, l, dout, g[0], g[1], g[2], p); },
                      "kernel: expected automatic, flash or reference for the backward pass, got 'decode'");
    if (dt == DType::f64) {
      p.kernel = KernelKind::flash;
      expect_throw_with([&] { grads(KernelKind::flash); },
                        "kernel: the requested kernel 'flash' cannot run this backward call: float64 inputs");
    }
  }
}

TEST(Dispatch, VarlenForwardAndBackward) {
  const Seqs seqs = {{3, 50}, {20, 20}, {0, 4}, {2, 0}};
  for (DType dt : {DType::f32, DType::f64}) {
    const Packed pk = make_packed(seqs, 4, 2, 32, 32, dt, 5);
    AttentionParams p;
    p.causal = true;
    auto forward = [&](KernelKind kind, Tensor& o, Tensor& l) {
      AttentionParams pf = p;
      pf.kernel = kind;
      attention_varlen(pk.q, pk.k, pk.v, o, pk.cu_q, pk.cu_k, pf, l.view());
    };
    Tensor o(dt, {pk.Tq, pk.Hq, pk.Dv}), l(DType::f32, {pk.Hq, pk.Tq});
    forward(KernelKind::automatic, o, l);
    const std::string e = explain_dispatch(pk.q, pk.k, pk.v, o, pk.cu_q, pk.cu_k, p, l.view());
    const std::string line = chosen_line(e, Entry::varlen);
    EXPECT_EQ(name_of(line), dt == DType::f64 ? "per-sequence" : "serving") << e;
    if (dt == DType::f64) {
      // Each sequence's own choice is the reference: forcing it gives the same bits.
      EXPECT_NE(line.find("reference for 4"), std::string::npos) << line;
      Tensor fo(dt, o.shape()), fl(DType::f32, l.shape());
      forward(KernelKind::reference, fo, fl);
      EXPECT_TRUE(same_bits(o, fo) && same_bits(l, fl));
    }
    // A forced tiled kernel: one qkv::attention call per sequence, the same bits as those calls.
    if (dt == DType::f32) {
      AttentionParams pf = p;
      pf.kernel = KernelKind::flash;
      const std::string ef = explain_dispatch(pk.q, pk.k, pk.v, o, pk.cu_q, pk.cu_k, pf);
      EXPECT_NE(chosen_line(ef, Entry::varlen).find("per-sequence: chosen (one qkv::attention call per sequence: flash ("),
                std::string::npos) << ef;
      EXPECT_NE(ef.find("serving: not requested"), std::string::npos) << ef;
      Tensor fo(dt, o.shape()), fl(DType::f32, l.shape()), so(dt, o.shape()), sl(DType::f32, l.shape());
      forward(KernelKind::flash, fo, fl);
      for (std::size_t b = 0; b < seqs.size(); ++b)
        attention(seq_view(pk.q, pk.q0(b), seqs[b].first), seq_view(pk.k, pk.k0(b), seqs[b].second),
                  seq_view(pk.v, pk.k0(b), seqs[b].second), seq_view(so, pk.q0(b), seqs[b].first), pf,
                  lse_view(sl, pk.q0(b), seqs[b].first));
      EXPECT_TRUE(same_bits(fo, so) && same_bits(fl, sl));
      // decode cannot run the 20-row sequence: the error before any sequence is written.
      pf.kernel = KernelKind::decode;
      Tensor keep(dt, o.shape());
      std::memcpy(keep.data(), fo.data(), fo.numel() * dtype_size(dt));
      expect_throw_with([&] { forward(KernelKind::decode, fo, fl); },
                        "kernel: the requested kernel 'decode' cannot run this call: Sq = 20 > 16");
      EXPECT_TRUE(same_bits(fo, keep));
    }
    // The backward: one attention_backward call per sequence.
    Tensor dout(dt, o.shape()), dq(DType::f32, pk.q.shape()), dk(DType::f32, pk.k.shape()), dv(DType::f32, pk.v.shape());
    std::mt19937_64 rng(9);
    fill_normal(dout, rng);
    attention_varlen_backward(pk.q, pk.k, pk.v, o, l, dout, dq, dk, dv, pk.cu_q, pk.cu_k, p);
    const std::string eb = explain_dispatch(pk.q, pk.k, pk.v, o, l, dout, dq, dk, dv, pk.cu_q, pk.cu_k, p);
    const std::string lb = chosen_line(eb, Entry::varlen_backward);
    const std::string nested = dt == DType::f64 ? "reference" : "flash";
    EXPECT_NE(lb.find("one qkv::attention_backward call per sequence: " + nested), std::string::npos) << lb;
    AttentionParams pf = p;
    pf.kernel = kind_named(nested);
    Tensor fq(DType::f32, dq.shape()), fk(DType::f32, dk.shape()), fv(DType::f32, dv.shape());
    attention_varlen_backward(pk.q, pk.k, pk.v, o, l, dout, fq, fk, fv, pk.cu_q, pk.cu_k, pf);
    EXPECT_TRUE(same_bits(dq, fq) && same_bits(dk, fk) && same_bits(dv, fv));
    pf.kernel = KernelKind::decode;
    expect_throw_with([&] { explain_dispatch(pk.q, pk.k, pk.v, o, l, dout, dq, dk, dv, pk.cu_q, pk.cu_k, pf); },
                      "for the backward pass, got 'decode'");
  }
}

TEST(Dispatch, QuantizedAndPaged) {
  const Seqs seqs = {{1, 40}, {12, 33}, {0, 5}};
  const Packed pk = make_packed(seqs, 4, 2, 32, 32, DType::f32, 21);
  AttentionParams p;
  p.causal = true;
  Tensor o(DType::f32, {pk.Tq, pk.Hq, pk.Dv});
  // int8 K and V, packed.
  const Shape ks = pk.k.shape();
  Tensor kc(kv_format_dtype(KVFormat::int8), ks), kscale(kv_scales_dtype(KVFormat::int8), kv_scales_shape(KVFormat::int8, ks));
  Tensor vc(kv_format_dtype(KVFormat::int8), ks), vscale(kv_scales_dtype(KVFormat::int8), kv_scales_shape(KVFormat::int8, ks));
  const QuantizedKV K{KVFormat::int8, kc.view(), kscale.view()}, V{KVFormat::int8, vc.view(), vscale.view()};
  quantize_kv(pk.k, K);
  quantize_kv(pk.v, V);
  const std::string eq = explain_dispatch(pk.q, K, V, o, pk.cu_q, pk.cu_k, p);
  EXPECT_NE(chosen_line(eq, Entry::varlen).find("serving: chosen (" + active_isa_string()), std::string::npos) << eq;
  EXPECT_NE(eq.find("per-sequence: refused (K and V in formats int8/int8"), std::string::npos) << eq;
  AttentionParams pr = p;
  pr.kernel = KernelKind::reference;
  EXPECT_EQ(chosen_line(explain_dispatch(pk.q, K, V, o, pk.cu_q, pk.cu_k, pr), Entry::varlen), "reference: chosen");
  // Float K and V of q's dtype through QuantizedKV: the float form, any kernel.
  const QuantizedKV Kf{KVFormat::f32, pk.k.view(), {}}, Vf{KVFormat::f32, pk.v.view(), {}};
  pr.kernel = KernelKind::flash;
  EXPECT_EQ(name_of(chosen_line(explain_dispatch(pk.q, Kf, Vf, o, pk.cu_q, pk.cu_k, pr), Entry::varlen)), "per-sequence");

  // Paged: blocks of one slot, the pools views of the packed keys, sequence b's table its keys.
  const i64 Tk = pk.Tk, Hkv = pk.Hkv, D = pk.D;
  const TensorView kpool(pk.k.data(), DType::f32, {Tk, Hkv, 1, D}, {Hkv * D, D, D, 1});
  const TensorView vpool(pk.v.data(), DType::f32, {Tk, Hkv, 1, D}, {Hkv * D, D, D, 1});
  Tensor table(DType::i32, {3, 40}), lens(DType::i32, {3});
  for (std::size_t b = 0; b < seqs.size(); ++b) {
    lens.data_as<std::int32_t>()[b] = static_cast<std::int32_t>(seqs[b].second);
    for (i64 j = 0; j < 40; ++j)
      table.data_as<std::int32_t>()[b * 40 + j] = static_cast<std::int32_t>(j < seqs[b].second ? pk.k0(b) + j : 0);
  }
  const std::string ep = explain_dispatch(pk.q, kpool, vpool, o, pk.cu_q, lens, table, p);
  EXPECT_EQ(name_of(chosen_line(ep, Entry::paged)), "serving") << ep;
  Tensor po(DType::f32, o.shape()), vo(DType::f32, o.shape());
  attention_paged(pk.q, kpool, vpool, po, pk.cu_q, lens, table, p);
  attention_varlen(pk.q, pk.k, pk.v, vo, pk.cu_q, pk.cu_k, p);
  EXPECT_TRUE(same_bits(po, vo)) << "paged and packed keys: one serving kernel, one result";
  pr.kernel = KernelKind::reference;
  EXPECT_EQ(chosen_line(explain_dispatch(pk.q, kpool, vpool, o, pk.cu_q, lens, table, pr), Entry::paged),
            "reference: chosen");
  // Quantized pools.
  const Shape ps{Tk, Hkv, 1, D};
  Tensor kq(kv_format_dtype(KVFormat::q8_0), ps), kqs(kv_scales_dtype(KVFormat::q8_0), kv_scales_shape(KVFormat::q8_0, ps));
  const QuantizedKV KP{KVFormat::q8_0, kq.view(), kqs.view()}, VP{KVFormat::f32, vpool, {}};
  quantize_kv(kpool, KP);
  const std::string epq = explain_dispatch(pk.q, KP, VP, o, pk.cu_q, lens, table, p);
  EXPECT_EQ(name_of(chosen_line(epq, Entry::paged)), "serving") << epq;
  EXPECT_NE(epq.find("reference: usable, lower priority"), std::string::npos) << epq;
}
