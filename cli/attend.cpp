// `qkv attend`: scaled dot-product attention on .npy files.
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "attend.hpp"
#include "commands.hpp"
#include "io/atomic_file.hpp"
#include "options.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/error.hpp"
#include "qkv/npy.hpp"
#include "qkv/varlen.hpp"

namespace qkv::cli {

// Reads a 4-D input (the caller permutes BSHD files to a [B,H,S,D] view).
NpyArray read_input(const std::string& flag, const std::string& path) {
  NpyArray a;
  try {
    a = read_npy(path);
  } catch (const Error& e) {
    throw Error(flag + ": " + e.what());
  }
  if (a.shape().size() != 4)
    throw Error(flag + ": expected a 4-D array, got shape " + shape_str(a.shape()) + " in " + path +
                (a.shape().size() == 3 ? " (packed 3-D inputs need --cu-seqlens-q and --cu-seqlens-k)" : ""));
  return a;
}

namespace {
NpyArray read_packed(const std::string& flag, const std::string& path, const char* axes) {
  NpyArray a;
  try {
    a = read_npy(path);
  } catch (const Error& e) {
    throw Error(flag + ": " + e.what());
  }
  if (a.shape().size() != 3)
    throw Error(flag + ": expected a packed 3-D array " + axes + " (with --cu-seqlens-q/--cu-seqlens-k), got shape " +
                shape_str(a.shape()) + " in " + path);
  return a;
}

// --explain: each pass's explanation (qkv::explain_dispatch) under the entry point it calls,
// printed once all are formed, so that an error prints none.
void print_explanations(const std::vector<std::pair<const char*, std::string>>& passes) {
  std::string text;
  for (const auto& [entry, why] : passes) {
    text += std::string(entry) + ":\n";
    for (std::size_t a = 0, b; a < why.size(); a = b + 1) {
      b = why.find('\n', a);
      if (b == std::string::npos) b = why.size();
      text += "  " + why.substr(a, b - a) + "\n";
    }
  }
  std::fputs(text.c_str(), stdout);
  std::fflush(stdout);
}

// The command's output files as one set: all are written, then all renamed into place, so a
// failure leaves every path as it was (qkv::detail::AtomicFileSet).
struct Writer {
  qkv::detail::AtomicFileSet files;
  void operator()(const char* flag, const std::string& path, const TensorView& t) {
    files.add(flag, path, [&](const std::filesystem::path& staging) { write_npy(staging, t); });
  }
};

}  // namespace

void read_score_options(const AttendOptions& o, AttentionParams& p, ScoreFiles& files) {
  if (!o.sinks.empty()) {
    try { files.sinks = read_npy(o.sinks); } catch (const Error& e) { throw Error(std::string("--sinks: ") + e.what()); }
    p.sinks = files.sinks.view();
  }
  if (!o.alibi_slopes.empty()) {
    try { files.slopes = read_npy(o.alibi_slopes); } catch (const Error& e) { throw Error(std::string("--alibi-slopes: ") + e.what()); }
    p.alibi_slopes = files.slopes.view();
  }
  p.window_keep_first = o.keep_first;
}

namespace {

// Packed sequences: q [total_q,Hq,D], k and v [total_k,Hkv,X], cu_seqlens int32 [batch + 1].
void run_attend_varlen(const AttendOptions& o, const AttentionParams& p, bool want_grads) {
  if (o.cu_q.empty() || o.cu_k.empty())
    throw Error(std::string(o.cu_q.empty() ? "--cu-seqlens-q" : "--cu-seqlens-k") +
                ": expected both --cu-seqlens-q and --cu-seqlens-k for packed inputs, got one");
  if (o.layout_given)
    throw Error("--layout: expected none with --cu-seqlens-q (packed inputs are [total,H,D]), got " + o.layout);
  if (!o.mask.empty()) throw Error("--mask: expected none with --cu-seqlens-q (packed inputs take causal and window masks), got " + o.mask);
  if (!o.kv_lens.empty()) throw Error("--kv-lens: expected none with --cu-seqlens-q (the key lengths are --cu-seqlens-k), got " + o.kv_lens);
  if (!o.probs.empty()) throw Error("--probs: expected none with --cu-seqlens-q, got " + o.probs);
  const NpyArray qa = read_packed("--q", o.q, "[total_q,Hq,D]"), ka = read_packed("--k", o.k, "[total_k,Hkv,D]"),
                 va = read_packed("--v", o.v, "[total_k,Hkv,Dv]");
  NpyArray cq, ck;
  try { cq = read_npy(o.cu_q); } catch (const Error& e) { throw Error(std::string("--cu-seqlens-q: ") + e.what()); }
  try { ck = read_npy(o.cu_k); } catch (const Error& e) { throw Error(std::string("--cu-seqlens-k: ") + e.what()); }
  const TensorView q = qa.view(), k = ka.view(), v = va.view();
  const std::int64_t Tq = q.size(0), Hq = q.size(1), Dv = v.size(2);
  Tensor out(DType::f32, {Tq, Hq, Dv});
  std::optional<Tensor> lse;
  if (!o.lse.empty() || want_grads) lse.emplace(DType::f32, Shape{Hq, Tq});
  std::optional<NpyArray> dout;
  std::optional<Tensor> dq, dk, dv, dz;
  if (want_grads) {
    dout = read_packed("--grad-out", o.grad_out, "[total_q,Hq,Dv]");
    dq.emplace(DType::f32, q.shape());
    dk.emplace(DType::f32, k.shape());
    dv.emplace(DType::f32, v.shape());
    if (!o.grad_sinks.empty()) dz.emplace(DType::f32, Shape{Hq});
  }
  std::optional<TensorView> lse_view;
  if (lse) lse_view = lse->view();
  if (o.explain) {
    std::vector<std::pair<const char*, std::string>> passes = {
        {"qkv::attention_varlen", explain_dispatch(q, k, v, out, cq.view(), ck.view(), p, lse_view)}};
    if (want_grads)
      passes.emplace_back("qkv::attention_varlen_backward",
                          explain_dispatch(q, k, v, out, *lse_view, dout->view(), *dq, *dk, *dv, cq.view(), ck.view(), p));
    print_explanations(passes);
  }
  attention_varlen(q, k, v, out, cq.view(), ck.view(), p, lse_view);
  if (want_grads && dz)
    attention_varlen_backward(q, k, v, out, *lse_view, dout->view(), *dq, *dk, *dv, cq.view(), ck.view(), *dz, p);
  else if (want_grads)
    attention_varlen_backward(q, k, v, out, *lse_view, dout->view(), *dq, *dk, *dv, cq.view(), ck.view(), p);
  Writer write;
  write("--out", o.out, out.view());
  if (!o.lse.empty()) write("--lse", o.lse, lse->view());
  if (!o.grad_q.empty()) write("--grad-q", o.grad_q, dq->view());
  if (!o.grad_k.empty()) write("--grad-k", o.grad_k, dk->view());
  if (!o.grad_v.empty()) write("--grad-v", o.grad_v, dv->view());
  if (dz) write("--grad-sinks", o.grad_sinks, dz->view());
  write.files.commit();
}

void run_attend(const AttendOptions& o) {
  if (o.threads < 0)
    throw Error("--threads: expected an integer >= 0 (0 = all cores), got " + std::to_string(o.threads));
  if (o.keep_first < 0)
    throw Error("--keep-first: expected an integer >= 0 (0 = off), got " + std::to_string(o.keep_first));
  // Each output is renamed into place: two flags naming one path would silently keep only one.
  const std::pair<const char*, const std::string*> outs[] = {{"--out", &o.out},       {"--lse", &o.lse},
                                                             {"--probs", &o.probs},   {"--grad-q", &o.grad_q},
                                                             {"--grad-k", &o.grad_k}, {"--grad-v", &o.grad_v},
                                                             {"--grad-sinks", &o.grad_sinks}};
  for (std::size_t a = 0; a < std::size(outs); ++a)
    for (std::size_t b = a + 1; b < std::size(outs); ++b)
      if (!outs[a].second->empty() && !outs[b].second->empty() &&
          std::filesystem::weakly_canonical(*outs[a].second) == std::filesystem::weakly_canonical(*outs[b].second))
        throw Error(std::string(outs[b].first) + ": expected a path different from " + outs[a].first + ", got '" +
                    *outs[b].second + "' for both");
  if (o.distributed || o.simulate_ranks > 0) {
    if (o.explain)
      throw Error("--explain: not available with --distributed or --simulate-ranks (each rank dispatches its own blocks)");
    return run_attend_distributed(o);
  }
  const bool want_grads = !o.grad_q.empty() || !o.grad_k.empty() || !o.grad_v.empty() || !o.grad_sinks.empty();
  if (want_grads && o.grad_out.empty())
    throw Error("--grad-out: expected dO (.npy, the shape of out) to compute --grad-q/--grad-k/--grad-v/--grad-sinks, got none");
  if (!o.grad_out.empty() && !want_grads)
    throw Error("--grad-out: expected at least one of --grad-q, --grad-k, --grad-v, --grad-sinks to write, got none");
  if (!o.grad_sinks.empty() && o.sinks.empty())
    throw Error("--grad-sinks: expected --sinks (the sink logits whose gradient it is), got none");
  ScoreFiles score_files;
  if (!o.cu_q.empty() || !o.cu_k.empty()) {
    AttentionParams p = attention_params(o);
    p.kernel = o.reference ? KernelKind::reference : KernelKind::automatic;
    p.num_threads = o.threads;
    read_score_options(o, p, score_files);
    return run_attend_varlen(o, p, want_grads);
  }
  const bool bshd = o.layout == "bshd";
  auto to_bhsd = [&](const TensorView& t) { return bshd ? t.permute({0, 2, 1, 3}) : t; };

  const NpyArray qa = read_input("--q", o.q), ka = read_input("--k", o.k), va = read_input("--v", o.v);
  const TensorView q = to_bhsd(qa.view()), k = to_bhsd(ka.view()), v = to_bhsd(va.view());

  AttentionParams p = attention_params(o);
  p.kernel = o.reference ? KernelKind::reference : KernelKind::automatic;
  p.num_threads = o.threads;

  NpyArray mask, lens;
  if (!o.mask.empty()) {
    try { mask = read_npy(o.mask); } catch (const Error& e) { throw Error(std::string("--mask: ") + e.what()); }
    p.mask = mask.view();
  }
  if (!o.kv_lens.empty()) {
    try { lens = read_npy(o.kv_lens); } catch (const Error& e) { throw Error(std::string("--kv-lens: ") + e.what()); }
    p.kv_lens = lens.view();
  }
  read_score_options(o, p, score_files);

  const std::int64_t B = q.size(0), Hq = q.size(1), Sq = q.size(2), Sk = k.size(2), Dv = v.size(3);
  const Shape out_shape = bshd ? Shape{B, Sq, Hq, Dv} : Shape{B, Hq, Sq, Dv};
  Tensor out(DType::f32, out_shape);
  std::optional<Tensor> lse, probs;
  std::optional<TensorView> lse_view, probs_view;
  if (!o.lse.empty() || want_grads) { lse.emplace(DType::f32, Shape{B, Hq, Sq}); lse_view = lse->view(); }
  if (!o.probs.empty()) {
    checked_numel({B, Hq, Sq, Sk}, 4, "--probs");
    probs.emplace(DType::f32, Shape{B, Hq, Sq, Sk});
    probs_view = probs->view();
  }
  // The gradients, float32 in the input layout: dQ like q, dK like k, dV like v.
  std::optional<NpyArray> dout_file;
  std::optional<Tensor> dq, dk, dv, dz;
  if (!o.grad_sinks.empty()) dz.emplace(DType::f32, Shape{Hq});
  if (want_grads) {
    dout_file = read_input("--grad-out", o.grad_out);
    auto like = [&](const TensorView& t) {
      return Tensor(DType::f32, bshd ? Shape{t.size(0), t.size(2), t.size(1), t.size(3)} : t.shape());
    };
    dq.emplace(like(q));
    dk.emplace(like(k));
    dv.emplace(like(v));
  }
  try {
    if (o.explain) {
      std::vector<std::pair<const char*, std::string>> passes = {
          {"qkv::attention", explain_dispatch(q, k, v, to_bhsd(out.view()), p, lse_view, probs_view)}};
      if (want_grads)
        passes.emplace_back("qkv::attention_backward",
                            explain_dispatch(q, k, v, to_bhsd(out.view()), *lse_view, to_bhsd(dout_file->view()),
                                             to_bhsd(dq->view()), to_bhsd(dk->view()), to_bhsd(dv->view()), p));
      print_explanations(passes);
    }
    attention(q, k, v, to_bhsd(out.view()), p, lse_view, probs_view);
    if (want_grads && dz)
      attention_backward(q, k, v, to_bhsd(out.view()), *lse_view, to_bhsd(dout_file->view()), to_bhsd(dq->view()),
                         to_bhsd(dk->view()), to_bhsd(dv->view()), *dz, p);
    else if (want_grads)
      attention_backward(q, k, v, to_bhsd(out.view()), *lse_view, to_bhsd(dout_file->view()), to_bhsd(dq->view()),
                         to_bhsd(dk->view()), to_bhsd(dv->view()), p);
  } catch (const Error& e) {
    // The library speaks of [B,H,S,X] views; say so when the files hold [B,S,H,X].
    if (bshd) throw Error(std::string(e.what()) + " (--layout bshd: shapes shown as [B,H,S,X] views of the [B,S,H,X] files)");
    throw;
  }

  Writer write;
  write("--out", o.out, out.view());
  if (!o.lse.empty()) write("--lse", o.lse, lse->view());
  if (probs) write("--probs", o.probs, probs->view());
  if (!o.grad_q.empty()) write("--grad-q", o.grad_q, dq->view());
  if (!o.grad_k.empty()) write("--grad-k", o.grad_k, dk->view());
  if (!o.grad_v.empty()) write("--grad-v", o.grad_v, dv->view());
  if (dz) write("--grad-sinks", o.grad_sinks, dz->view());
  write.files.commit();
}

}  // namespace

void add_attend(CLI::App& app) {
  auto o = std::make_shared<AttendOptions>();
  auto* cmd = app.add_subcommand("attend", "Attention on .npy files: O = softmax(QK^T * scale) V");
  cmd->add_option("--q", o->q, "queries, [B,Hq,Sq,D] (bhsd) or [B,Sq,Hq,D] (bshd); packed [total_q,Hq,D] with --cu-seqlens-q")->required();
  cmd->add_option("--k", o->k, "keys, [B,Hkv,Sk,D] or [B,Sk,Hkv,D]")->required();
  cmd->add_option("--v", o->v, "values, [B,Hkv,Sk,Dv] or [B,Sk,Hkv,Dv]")->required();
  cmd->add_option("--out", o->out, "output O, float32, in the input layout")->required();
  cmd->add_option("--lse", o->lse, "write softmax_lse, float32 [B,Hq,Sq] (natural log); packed: [Hq,total_q]");
  cmd->add_option("--probs", o->probs, "write the attention weights, float32 [B,Hq,Sq,Sk]");
  cmd->add_option("--layout", o->layout, "axis order of q, k, v and out")
      ->check(CLI::IsMember({"bhsd", "bshd"}))
      ->each([o](const std::string&) { o->layout_given = true; });
  cmd->add_option("--scale", o->scale, "score scale (default 1/sqrt(D))");
  cmd->add_flag("--causal", o->causal, "causal mask: window (-1, 0)");
  cmd->add_option("--align", o->align, "diagonal alignment when Sq != Sk")
      ->check(CLI::IsMember({"bottom-right", "top-left"}));
  cmd->add_option("--window", o->window, "sliding window LEFT,RIGHT (-1 = unbounded)");
  cmd->add_option("--mask", o->mask, "bool (true = attend) or additive float mask, broadcastable to [B,Hq,Sq,Sk]");
  cmd->add_option("--kv-lens", o->kv_lens, "int32/int64 [B] key lengths");
  cmd->add_option("--softcap", o->softcap, "softcap c > 0: score = c*tanh(score/c)");
  cmd->add_option("--grad-out", o->grad_out, "dO, the gradient of the loss by out (the shape of out): computes the backward pass");
  cmd->add_option("--grad-q", o->grad_q, "write dQ, float32, the shape of q");
  cmd->add_option("--grad-k", o->grad_k, "write dK, float32, the shape of k");
  cmd->add_option("--grad-v", o->grad_v, "write dV, float32, the shape of v");
  cmd->add_option("--sinks", o->sinks, "float32 [Hq] attention-sink logits z_h: a value-less extra logit in each row's softmax (gpt-oss)");
  cmd->add_option("--alibi-slopes", o->alibi_slopes,
                  "float32 [Hq] or [B,Hq] ALiBi slopes: score -= slope * |i + offset - j| (offset: the causal diagonal's)");
  cmd->add_option("--keep-first", o->keep_first,
                  "N >= 0: keys 0..N-1 join every row's window, right bound and masks still applying (StreamingLLM)");
  cmd->add_option("--grad-sinks", o->grad_sinks, "write dL/dz of --sinks, float32 [Hq] (with --grad-out)");
  cmd->add_option("--cu-seqlens-q", o->cu_q,
                  "int32 [batch+1] prefix sums of the query tokens: q, out (and dO) are packed [total_q,H,X]");
  cmd->add_option("--cu-seqlens-k", o->cu_k, "int32 [batch+1] prefix sums of the keys: k, v are packed [total_k,Hkv,X]");
  cmd->add_flag("--reference", o->reference, "run the float64 reference kernels");
  cmd->add_flag("--explain", o->explain,
                "print to stdout which kernel each pass (forward, backward) runs and why not the others, then run");
  cmd->add_option("--threads", o->threads, "threads (0 = all)");
  // Context parallelism (qkv::dist, docs/distributed.md): under `mpirun -np P`, each rank reads
  // its slice of the files, rank 0 writes the whole results.
  cmd->add_flag("--distributed", o->distributed, "split the sequence across the MPI ranks (run under mpirun): ring attention");
  cmd->add_flag("--decode", o->decode, "with --distributed: q on every rank, the keys split by position (decoding across ranks)");
  cmd->add_option("--simulate-ranks", o->simulate_ranks, "run the --distributed schedule of P ranks in this one process");
  cmd->add_option("--placement", o->placement, "positions per rank: auto (zigzag if causal), contiguous, zigzag")
      ->check(CLI::IsMember({"auto", "contiguous", "zigzag"}));
  cmd->add_option("--progress", o->progress,
                  "transfers progress during compute: poll (MPI_Test between tiles), thread (a second thread) or none")
      ->check(CLI::IsMember({"poll", "thread", "none"}));
  cmd->add_option("--tile-rows", o->tile_rows, "query rows per tile of the distributed schedule");
  cmd->add_option("--bench", o->bench, "with --distributed: run N times and print timings (JSON, rank 0)");
  cmd->callback([o] { run_attend(*o); });
}

}  // namespace qkv::cli
