// `qkv mha`: a multi-head attention layer (PyTorch nn.MultiheadAttention weights) on .npy inputs.
#include "qkv/mha.hpp"

#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "commands.hpp"
#include "qkv/error.hpp"
#include "qkv/npy.hpp"
#include "qkv/safetensors.hpp"

namespace qkv::cli {
namespace {

struct MhaCliOptions {
  std::string x, x_kv, weights, out, prefix, rope, rope_angles = "f64", key_padding_mask, attn_mask, probs;
  std::int64_t heads = 0, kv_heads = 0;
  double rope_theta = 10000.0;
  bool causal = false, average_probs = false, reference = false;
  int threads = 0;
};

// Reads [B,S,d_model] or [S,d_model] activations as float32 [B,S,d_model].
Tensor read_activations(const std::string& flag, const std::string& path, bool& was_2d) {
  NpyArray a;
  try {
    a = read_npy(path);
  } catch (const Error& e) {
    throw Error(flag + ": " + e.what());
  }
  if (a.shape().size() != 2 && a.shape().size() != 3)
    throw Error(flag + ": expected [B,S,d_model] or [S,d_model], got shape " + shape_str(a.shape()) + " in " +
                path);
  if (a.dtype() != DType::f32 && a.dtype() != DType::f64 && a.dtype() != DType::f16)
    throw Error(flag + ": expected a float array, got " + std::string(dtype_name(a.dtype())) + " in " + path);
  was_2d = a.shape().size() == 2;
  Tensor t = to_contiguous(a.view(), DType::f32);
  if (!was_2d) return t;
  Tensor t3(DType::f32, {1, a.shape()[0], a.shape()[1]});
  if (t.numel()) std::memcpy(t3.data(), t.data(), t.nbytes());
  return t3;
}

std::int64_t metadata_int(const std::map<std::string, std::string>& md, const std::string& key) {
  auto it = md.find(key);
  if (it == md.end()) return 0;
  try {
    std::size_t n = 0;
    const long long v = std::stoll(it->second, &n);
    if (n == it->second.size() && v > 0) return v;
  } catch (const std::logic_error&) {
  }
  throw Error("--weights: __metadata__ '" + key + "' is not a positive integer: '" + it->second + "'");
}

void run_mha(const MhaCliOptions& o) {
  // Weights (and the head counts from the file's metadata when not given).
  std::map<std::string, Tensor> weights;
  std::map<std::string, std::string> md;
  try {
    if (std::filesystem::is_directory(o.weights)) {
      weights = read_weights(o.weights);
    } else {
      const SafetensorsFile f = SafetensorsFile::open(o.weights);
      weights = f.load_all();
      md = f.metadata();
    }
  } catch (const Error& e) {
    throw Error(std::string("--weights: ") + e.what());
  }
  std::int64_t heads = o.heads ? o.heads : metadata_int(md, "num_heads");
  if (!heads) throw Error("--heads: required (the weights file has no __metadata__ 'num_heads')");
  const std::int64_t kv_heads = o.kv_heads ? o.kv_heads : metadata_int(md, "num_kv_heads");
  MhaConfig cfg = infer_mha_config(weights, heads, kv_heads, o.prefix);
  if (!o.rope.empty()) {
    RopeConfig r;
    r.style = o.rope == "half" ? RopeStyle::half_split : RopeStyle::interleaved;
    r.theta = o.rope_theta;
    r.angles = o.rope_angles == "llama2c" ? RopeAngles::llama2c_f32 : RopeAngles::f64;
    cfg.rope = r;
  }
  MultiHeadAttention layer(cfg);
  layer.load_weights(weights, o.prefix);
  weights.clear();

  bool x_2d = false, kv_2d = false;
  const Tensor x = read_activations("--x", o.x, x_2d);
  std::optional<Tensor> x_kv;
  if (!o.x_kv.empty()) x_kv = read_activations("--x-kv", o.x_kv, kv_2d);
  const std::int64_t B = x.shape()[0], Sq = x.shape()[1], Sk = x_kv ? x_kv->shape()[1] : Sq;

  MhaOptions opt;
  opt.attention.causal = o.causal;
  opt.attention.kernel = o.reference ? KernelKind::reference : KernelKind::automatic;
  opt.attention.num_threads = o.threads;
  NpyArray kpm, am;
  std::optional<TensorView> kpm_v, am_v;
  if (!o.key_padding_mask.empty()) {
    try {
      kpm = read_npy(o.key_padding_mask);
    } catch (const Error& e) {
      throw Error(std::string("--key-padding-mask: ") + e.what());
    }
    kpm_v = kpm.view();
  }
  if (!o.attn_mask.empty()) {
    try {
      am = read_npy(o.attn_mask);
    } catch (const Error& e) {
      throw Error(std::string("--attn-mask: ") + e.what());
    }
    am_v = am.view();
  }
  Tensor mask;
  try {
    mask = mask_from_torch(am_v, kpm_v, B, cfg.num_heads, Sq, Sk);
  } catch (const Error& e) {
    throw Error(std::string(kpm_v ? "--key-padding-mask/--attn-mask: " : "--attn-mask: ") + e.what());
  }
  if (mask.numel() || am_v || kpm_v) opt.attention.mask = mask.view();

  std::optional<Tensor> probs;
  if (!o.probs.empty()) {
    const Shape ps = o.average_probs ? Shape{B, Sq, Sk} : Shape{B, cfg.num_heads, Sq, Sk};
    checked_numel(ps, 4, "--probs");
    probs.emplace(DType::f32, ps);
    opt.probs = probs->view();
    opt.average_heads = o.average_probs;
  }

  Tensor y(DType::f32, {B, Sq, cfg.d_model});
  if (x_kv)
    layer.forward(x, *x_kv, y, opt);
  else
    layer.forward(x, y, opt);

  const TensorView yv = x_2d ? TensorView(y.data(), DType::f32, {Sq, cfg.d_model}) : y.view();
  write_npy(o.out, yv);
  if (probs) {
    try {
      write_npy(o.probs, probs->view());
    } catch (...) {
      std::error_code ec;
      std::filesystem::remove(o.out, ec);
      throw;
    }
  }
}

}  // namespace

void add_mha(CLI::App& app) {
  auto o = std::make_shared<MhaCliOptions>();
  auto* cmd = app.add_subcommand(
      "mha", "Multi-head attention layer on .npy files, with PyTorch nn.MultiheadAttention weights");
  cmd->add_option("--x", o->x,
                  "input (queries; also keys/values without --x-kv), [B,S,d_model] or [S,d_model]")
      ->required();
  cmd->add_option("--x-kv", o->x_kv, "cross-attention keys/values input, [B,Sk,d_model] or [Sk,d_model]");
  cmd->add_option(
         "--weights", o->weights,
         "safetensors file (or directory of <name>.npy): in_proj_weight, in_proj_bias, out_proj.weight, "
         "out_proj.bias, or q_proj/k_proj/v_proj/o_proj .weight/.bias")
      ->required();
  cmd->add_option("--out", o->out, "output y, float32, same rank as --x")->required();
  cmd->add_option("--prefix", o->prefix, "prefix of the weight names, e.g. 'self_attn.'");
  cmd->add_option("--heads", o->heads, "number of query heads Hq (default: __metadata__ num_heads)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--kv-heads", o->kv_heads, "number of key/value heads Hkv (default: Hq)")
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--causal", o->causal, "causal mask (bottom-right aligned when Sq != Sk)");
  cmd->add_option("--rope", o->rope, "rotary position embedding on q and k")
      ->check(CLI::IsMember({"interleaved", "half"}));
  cmd->add_option("--rope-theta", o->rope_theta, "RoPE base theta (default 10000)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--rope-angles", o->rope_angles,
                  "RoPE angle precision: f64, or llama2c (float, as llama2.c)")
      ->check(CLI::IsMember({"f64", "llama2c"}));
  cmd->add_option("--key-padding-mask", o->key_padding_mask,
                  "PyTorch key_padding_mask [B,Sk]: bool True = padding (ignored), or additive float");
  cmd->add_option("--attn-mask", o->attn_mask,
                  "PyTorch attn_mask [Sq,Sk] or [B*Hq,Sq,Sk]: bool True = not allowed, or additive float");
  cmd->add_option("--probs", o->probs, "write the attention weights, float32 [B,Hq,Sq,Sk]");
  cmd->add_flag("--average-probs", o->average_probs, "average --probs over the heads: [B,Sq,Sk]");
  cmd->add_flag("--reference", o->reference, "run the attention on the float64 reference kernel");
  cmd->add_option("--threads", o->threads, "attention threads (0 = all)")->check(CLI::NonNegativeNumber);
  cmd->callback([o] { run_mha(*o); });
}

}  // namespace qkv::cli
