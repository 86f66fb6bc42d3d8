#pragma once
/// @file llama2c.hpp
/// Reader of llama2.c checkpoints (Llama-2 architecture weights as written by llama2.c's
/// export.py; https://github.com/karpathy/llama2.c, MIT licence).
///
/// Three layouts, told apart by the first 4 bytes (all little-endian):
/// - version 0 (legacy, float32): a 28-byte header of 7 int32 (dim, hidden_dim, n_layers, n_heads,
///   n_kv_heads, vocab_size, max_seq_len); then float32 token_embedding [vocab, dim],
///   rms_att [L, dim], wq [L, dim, dim], wk [L, kv_dim, dim], wv [L, kv_dim, dim], wo [L, dim, dim],
///   rms_ffn [L, dim], w1 [L, hidden, dim], w2 [L, dim, hidden], w3 [L, hidden, dim], rms_final [dim],
///   two RoPE tables [max_seq_len, head_dim/2] (cos, sin; skipped: a runner recomputes them), and,
///   when vocab_size is negative (an unshared classifier), wcls [vocab, dim].
/// - version 1 (float32) and version 2 (Q8_0): uint32 magic 0x616b3432 ("ak42"), int32 version, the 7
///   int32 config fields (vocab_size positive), uint8 shared_classifier, for version 2 an int32
///   group_size, zero padding to 256 bytes; then float32 rms_att [L, dim], rms_ffn [L, dim],
///   rms_final [dim]; then token_embedding, wq, wk, wv, wo, w1, w2, w3 (layer by layer) and, when
///   not shared, wcls. Version 1 stores these matrices as float32; version 2 stores each as its int8
///   values followed by one float32 scale per group of group_size consecutive values (groups run
///   over the flattened matrix), and the reader dequantises at load: w = float(q) * scale in
///   float32, exactly as llama2.c's runq.c does.
///
/// Every matrix is row-major [out, in], so y = W x is y[o] = sum_i W[o, i] x[i] (cblas_sgemv with
/// CblasRowMajor, CblasNoTrans). All weights are returned as float32 in one owned, 64-byte-aligned
/// buffer; each tensor starts on a 64-byte boundary.
///
/// Validation happens before anything is allocated: every config field must be positive and at
/// most 2^24, dim % n_heads == 0, n_heads % n_kv_heads == 0, head_dim even (RoPE rotates pairs),
/// the group size must divide every quantised matrix, no size computation may overflow, and the
/// file length must equal the length the config implies. Anything else is refused with qkv::Error
/// naming the file and what is wrong; the reader never reads outside the file.

#include <cstddef>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "qkv/tensor.hpp"

namespace qkv {

/// The model's hyperparameters, as stored in the header plus the values derived from them.
struct Llama2cConfig {
  int version = 0;                ///< file layout: 0 (legacy float32), 1 (float32), 2 (Q8_0)
  int dim = 0;                    ///< model width (embedding size)
  int hidden_dim = 0;             ///< feed-forward inner width
  int n_layers = 0;               ///< number of Transformer blocks
  int n_heads = 0;                ///< query heads, Hq
  int n_kv_heads = 0;             ///< key/value heads, Hkv (grouped-query attention when < Hq)
  int vocab_size = 0;             ///< number of tokens (always positive here, whatever the file's sign)
  int max_seq_len = 0;            ///< longest sequence the model was trained for
  int head_dim = 0;               ///< D = dim / n_heads
  int kv_dim = 0;                 ///< n_kv_heads * head_dim
  bool shared_classifier = true;  ///< wcls is the token embedding
  int group_size = 0;             ///< Q8_0 group size (version 2), 0 otherwise
};

/// One Transformer block's weights: float32, C-contiguous views into Llama2cModel::storage.
struct Llama2cLayer {
  TensorView rms_att;  ///< [dim], RMSNorm gain before attention
  TensorView wq;       ///< [dim, dim]
  TensorView wk;       ///< [kv_dim, dim]
  TensorView wv;       ///< [kv_dim, dim]
  TensorView wo;       ///< [dim, dim]
  TensorView rms_ffn;  ///< [dim], RMSNorm gain before the feed-forward
  TensorView w1;       ///< [hidden_dim, dim], gate projection (SiLU applied to its output)
  TensorView w2;       ///< [dim, hidden_dim], down projection
  TensorView w3;       ///< [hidden_dim, dim], up projection
};

/// A loaded checkpoint. Copies share the weight buffer (views stay valid while any copy lives);
/// the weights are meant to be read only.
struct Llama2cModel {
  Llama2cConfig config;
  TensorView token_embedding;             ///< [vocab_size, dim]
  std::vector<Llama2cLayer> layers;       ///< n_layers entries
  TensorView rms_final;                   ///< [dim]
  TensorView wcls;                        ///< [vocab_size, dim]; the token_embedding view when shared
  std::shared_ptr<const Tensor> storage;  ///< owns every float the views point into
};

/// Parses and validates only the header of a checkpoint held in memory, including the check that
/// `bytes.size()` equals the length the config implies. `name` is used in messages.
/// @throws qkv::Error on a truncated, inconsistent or unknown-format header.
Llama2cConfig parse_llama2c_config(std::span<const std::byte> bytes, const std::string& name = "<memory>");

/// Parses a whole checkpoint held in memory (weights are copied, dequantised for version 2).
/// @throws qkv::Error as parse_llama2c_config.
Llama2cModel parse_llama2c(std::span<const std::byte> bytes, const std::string& name = "<memory>");

/// Reads a checkpoint file (memory-mapped while parsing).
/// @throws qkv::Error on a missing or unreadable file, or as parse_llama2c.
Llama2cModel read_llama2c(const std::filesystem::path& path);

}  // namespace qkv
