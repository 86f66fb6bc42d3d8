#pragma once
/// @file explain.hpp
/// Attention opened up: the steps of scaled dot-product attention for given Q/K/V, the
/// scaling argument measured on random vectors, and attention-weight heatmaps.
///
/// Source: Vaswani et al. 2017, "Attention Is All You Need", sec. 3.2.1 (scaled dot-product
/// attention, and footnote 4: for q, k with independent zero-mean unit-variance entries, q.k has
/// mean 0 and variance d_k, which is why the scores are scaled by 1/sqrt(d_k)).
///
/// A trace computes, in float64 and with exactly the semantics of qkv::reference::attention
/// (see attention.hpp and docs/semantics.md), for every (b, h, i, j):
///   1. scores  [B,Hq,Sq,Sk]  q_i.k_j                              (the dot product)
///   2. scaled  [B,Hq,Sq,Sk]  scale * q_i.k_j, then softcap c*tanh(s/c) if c > 0, then the
///                            additive mask term: the logits the softmax reads
///   3. masks   [B,Hq,Sq,Sk]  why a key is excluded (causal/window, key length, explicit mask);
///                            excluded entries are -inf in scores and scaled
///   4. weights [B,Hq,Sq,Sk]  alpha_ij = softmax_j(scaled_ij); 0 where excluded; each row sums to
///                            1 (a row with no admissible key is all 0); with sinks the row's
///                            sink weight (sink_weights) makes up the rest of 1
///   5. output  [B,Hq,Sq,Dv]  z_i = sum_j alpha_ij v_j  (equals qkv::attention's out)
/// plus softmax_lse [B,Hq,Sq] (natural log; -inf for an empty row).
///
/// Feeding a model layer (the `qkv explain --model` path): a model runner captures one layer's
/// projected, position-encoded (RoPE) q [1,Hq,S,D] and k, v [1,Hkv,S,D] as views in any strides
/// with a contiguous last dimension (e.g. views into its KV cache), sets the AttentionParams it
/// runs that layer with (causal = true, its scale), and calls
///     trace_attention(q, k, v, params)            -> Trace
///     head_weights(trace, 0)                      -> [Hq, S, S] view of the weights
///     write_heatmap("layer.png", head_weights(trace, 0), labels, labels, options)
///     format_row(trace, 0, h, i, labels)          -> the steps of one row as text
/// with labels = the decoded prompt tokens, one per position. Nothing here depends on the model.
///
/// Thread safety: every function is reentrant; none keeps global state.

#include <array>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/tensor.hpp"

namespace qkv::explain {

// ---- the step trace ----------------------------------------------------------------------------

/// Why a key is, or is not, admitted for a query row.
enum class KeyStatus : std::uint8_t {
  admitted = 0,
  outside_window = 1,  ///< excluded by causal or the sliding window (around the diagonal)
  beyond_kv_len = 2,   ///< j >= kv_lens[b]
  masked = 3,          ///< excluded by the explicit mask (bool false, or additive -inf)
};
/// "admitted", "causal/window", "kv_len", "mask".
const char* key_status_name(KeyStatus s) noexcept;

/// Every intermediate of one attention call, float64, C-contiguous row-major arrays.
struct Trace {
  std::int64_t B = 0, Hq = 0, Hkv = 0, Sq = 0, Sk = 0, D = 0, Dv = 0;
  double scale = 1.0;      ///< the scale actually used (default 1/sqrt(D))
  double softcap = 0.0;    ///< 0 = off
  EffectiveWindow window;  ///< effective (left, right); -1 = unbounded
  Alignment align = Alignment::bottom_right;
  bool has_mask = false;              ///< an explicit mask was given
  bool additive_mask = false;         ///< ... and it is a float (additive) mask
  std::vector<std::int64_t> kv_lens;  ///< [B]; Sk for each batch when not given

  std::vector<double> scores;     ///< [B,Hq,Sq,Sk] q_i.k_j; -inf where excluded
  std::vector<double> scaled;     ///< [B,Hq,Sq,Sk] softmax logits; -inf where excluded
  std::vector<double> mask_add;   ///< [B,Hq,Sq,Sk] additive mask term (empty unless additive_mask)
  std::vector<KeyStatus> status;  ///< [B,Hq,Sq,Sk]
  std::vector<double> weights;    ///< [B,Hq,Sq,Sk] alpha_ij; 0 where excluded
  std::vector<double> output;     ///< [B,Hq,Sq,Dv] z_i
  std::vector<double> lse;        ///< [B,Hq,Sq] softmax_lse, natural log
  /// Score options (AttentionParams): the sink logits z_h [Hq] and each row's sink weight
  /// exp(z_h - lse) [B,Hq,Sq] (both empty without sinks); the ALiBi slopes per (b, h) [B,Hq]
  /// (empty without), whose bias -slope |diag - j| is in `scaled`; window_keep_first.
  std::vector<double> sinks;
  std::vector<double> sink_weights;
  std::vector<double> alibi_slopes;
  std::int64_t keep_first = 0;

  std::int64_t at(std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) const noexcept {
    return ((b * Hq + h) * Sq + i) * Sk + j;
  }
  /// The KV head that query head h reads (grouped-query attention).
  std::int64_t kv_head(std::int64_t h) const noexcept { return h / (Hkv ? Hq / Hkv : 1); }
  /// Key position of query row i's diagonal in batch b (see Alignment).
  std::int64_t diag(std::int64_t b, std::int64_t i) const noexcept;

  /// Views of the arrays, float64: [B,Hq,Sq,Sk] (scores, scaled, weights), [B,Hq,Sq,Dv].
  TensorView scores_view() const;
  TensorView scaled_view() const;
  TensorView weights_view() const;
  TensorView output_view() const;
};

/// Most entries a trace may hold per [B,Hq,Sq,Sk] array (2^24: 128 MiB per float64 array).
inline constexpr std::int64_t kMaxTraceEntries = std::int64_t{1} << 24;

/// Traces attention on q [B,Hq,Sq,D], k [B,Hkv,Sk,D], v [B,Hkv,Sk,Dv] (BHSD views, any strides
/// with a contiguous last dimension; permute({0,2,1,3}) a BSHD view), dtype float32, float64,
/// float16 or bfloat16, with every option of AttentionParams (kernel and num_threads ignored).
/// Computed in float64 exactly as qkv::reference::attention computes it.
/// @throws qkv::Error as qkv::attention() does for bad arguments, and when B*Hq*Sq*Sk exceeds
///   kMaxTraceEntries (the message names q, k and the count).
Trace trace_attention(const TensorView& q, const TensorView& k, const TensorView& v,
                      const AttentionParams& params = {});

/// The weights of batch b as a float64 [Hq, Sq, Sk] view into the trace (for the heatmaps).
/// @throws qkv::Error if b is out of [0, B).
TensorView head_weights(const Trace& trace, std::int64_t b);

/// The weights of batch b with the sinks' share as one more key column: float64 [Hq, Sq, Sk + 1],
/// column Sk the sink weight exp(z_h - lse) (0 without sinks), so that every row with an
/// admissible key or a sink sums to 1 (the heatmap's "sink" column).
/// @throws qkv::Error if b is out of [0, B).
Tensor head_weights_with_sink(const Trace& trace, std::int64_t b);

/// One key and its weight.
struct KeyWeight {
  std::int64_t key = 0;
  double weight = 0.0;
};
/// The `count` admitted keys of row (b, h, i) with the largest weights, largest first (ties: the
/// lower key index first). @throws qkv::Error for an index out of range.
std::vector<KeyWeight> top_keys(const Trace& trace, std::int64_t b, std::int64_t h, std::int64_t i,
                                std::int64_t count);

/// Labels of the query rows from key labels: query i is labelled with the key at its diagonal
/// position (query i sits at key i + Sk - Sq bottom-right, at key i top-left); an index when
/// that position is outside [0, Sk). Empty key_labels gives "0", "1", ... for both.
std::vector<std::string> query_labels(const Trace& trace, const std::vector<std::string>& key_labels,
                                      std::int64_t b = 0);

/// The steps of row (b, h, i) as text: per key the raw score q.k, the scaled score, the softcap
/// and mask terms when those options are on, the logit, the weight, or why the key is excluded;
/// then the sum of the weights, softmax_lse, z_i, and the `top` keys by weight. Numbers are
/// printed with %.6g. key_labels: one per key (Sk) or empty.
/// @throws qkv::Error for an index out of range or a label count other than 0 or Sk.
std::string format_row(const Trace& trace, std::int64_t b, std::int64_t h, std::int64_t i,
                       const std::vector<std::string>& key_labels = {}, std::int64_t top = 3);

// ---- q, k, v from token vectors ----------------------------------------------------------------

/// Q, K, V projected from token vectors, float64, BHSD.
struct Projected {
  Tensor q, k, v;  ///< [B, H, S, d_k], [B, H, S, d_k], [B, H, S, d_v]
};

/// Projects token vectors with the row-vector convention of Vaswani et al. 2017 (sec. 3.2.2):
/// Q = X W^Q, K = X W^K, V = X W^V, each token a row of X.
///   x          [S, d_model] or [B, S, d_model]
///   wq, wk     [d_model, H * d_k]; head h uses columns [h*d_k, (h+1)*d_k)
///   wv         [d_model, H * d_v]
/// Any float dtype (converted to float64; products by BLAS dgemm).
/// @throws qkv::Error naming the argument for a wrong rank, a d_model mismatch, num_heads < 1 or
///   a column count not divisible by num_heads, or differing columns of wq and wk.
Projected project_qkv(const TensorView& x, const TensorView& wq, const TensorView& wk, const TensorView& wv,
                      std::int64_t num_heads = 1);

// ---- heatmaps ----------------------------------------------------------------------------------

/// An 8-bit RGB image, row-major, 3 bytes per pixel.
struct Image {
  int width = 0, height = 0;
  std::vector<std::uint8_t> rgb;
};

/// The colour map: viridis (van der Walt & Smith, matplotlib 1.5; perceptually uniform,
/// readable in grey and by colour-blind readers), t clamped to [0, 1]. Returns {r, g, b}.
std::array<std::uint8_t, 3> viridis(double t) noexcept;

struct HeatmapOptions {
  std::string title;                      ///< above the grid; empty = none
  std::vector<std::string> panel_titles;  ///< one per head; empty = "head 0", "head 1", ...
  double vmin = 0.0;                      ///< colour scale bounds; vmax <= vmin means the data's max
  double vmax = -1.0;
  int cell_px = 0;  ///< PNG cell size in pixels; 0 = chosen from Sq, Sk (4..32)
  int columns = 0;  ///< panels per grid row; 0 = ceil(sqrt(H))
};

/// Renders weights [H, Sq, Sk] (or [Sq, Sk]; any float dtype, any strides) as a grid of H
/// panels, query rows down, key columns across, labels on both axes (ASCII; other bytes shown
/// as '?'; labels are thinned when cells are smaller than the font), and one colour bar with
/// numeric ticks for all panels. row_labels: Sq or empty; col_labels: Sk or empty.
/// @throws qkv::Error for a wrong rank, label count or an image above 2^28 pixels.
Image render_heatmap(const TensorView& weights, const std::vector<std::string>& row_labels,
                     const std::vector<std::string>& col_labels, const HeatmapOptions& options = {});

/// The same grid as a self-contained SVG document: cells as rects (a tooltip with the query,
/// key and weight), labels as real text (UTF-8, escaped), the colour bar as a gradient.
std::string heatmap_svg(const TensorView& weights, const std::vector<std::string>& row_labels,
                        const std::vector<std::string>& col_labels, const HeatmapOptions& options = {});

/// Writes the heatmap as .png, .svg or .html (a page holding the SVG) by the path's extension,
/// atomically (a temporary file renamed on success).
/// @throws qkv::Error for another extension or an I/O failure, and as render_heatmap().
void write_heatmap(const std::filesystem::path& path, const TensorView& weights,
                   const std::vector<std::string>& row_labels, const std::vector<std::string>& col_labels,
                   const HeatmapOptions& options = {});

/// Encodes an image as PNG bytes (stb_image_write).
std::vector<std::uint8_t> encode_png(const Image& image);

// ---- the scaling argument, measured ------------------------------------------------------------

struct ScalingOptions {
  std::vector<std::int64_t> d_k = {4, 16, 64, 256, 1024};
  std::int64_t n_keys = 64;     ///< keys per softmax
  std::int64_t samples = 1000;  ///< independent (q, k_1..k_n) draws per d_k
  std::uint64_t seed = 1;       ///< std::mt19937_64 seed; normals by Box-Muller (portable)
  /// A row's gradient counts as vanished when ||J||_F is below this (uniform over 64 keys: 0.124).
  double vanish_threshold = 0.01;
};

/// Sample statistics for one d_k over `samples` x `n_keys` dot products q.k_j, q and k_j with
/// independent N(0,1) entries. Softmax statistics are means over the samples of the per-sample
/// value, for the unscaled scores s_j = q.k_j and the scaled scores s_j / sqrt(d_k).
struct ScalingRow {
  std::int64_t d_k = 0;
  double mean_dot = 0, var_dot = 0;              ///< of q.k: expected 0 and d_k
  double mean_scaled = 0, var_scaled = 0;        ///< of q.k/sqrt(d_k): expected 0 and 1
  double max_weight = 0, max_weight_scaled = 0;  ///< mean largest softmax weight (1/n .. 1)
  double entropy = 0, entropy_scaled = 0;        ///< mean entropy in nats (0 .. ln n)
  /// Frobenius norm of the softmax Jacobian d alpha / d s = diag(alpha) - alpha alpha^T, how much
  /// gradient reaches the logits s (0 for one-hot, sqrt(1/n - 1/n^2) for uniform): the mean and
  /// the median over samples, and the fraction of samples below options.vanish_threshold. The
  /// mean is held up by the rows where two keys nearly tie; the median shows the typical row.
  /// (With scaling, the chain rule adds a factor 1/sqrt(d_k) from s to q.k; not included.)
  double jacobian = 0, jacobian_scaled = 0;
  double jacobian_median = 0, jacobian_median_scaled = 0;
  double vanished = 0, vanished_scaled = 0;
  /// Fraction of samples whose largest weight exceeds 0.99 (effectively one-hot).
  double one_hot = 0, one_hot_scaled = 0;
  /// Standard error of var_dot, estimated from the per-sample means of (q.k)^2 (samples are
  /// independent; the n keys of one sample share q).
  double var_dot_stderr = 0;
};

/// Runs the measurement for every d_k in options.
/// @throws qkv::Error for d_k < 1, n_keys < 2 or samples < 2.
std::vector<ScalingRow> scaling_study(const ScalingOptions& options = {});

/// The Frobenius norm of diag(a) - a a^T for a probability vector a of length n, in O(n):
/// ||J||_F^2 = sum a_i^2 - 2 sum a_i^3 + (sum a_i^2)^2.
double softmax_jacobian_frobenius(const double* a, std::int64_t n) noexcept;

/// The results as a text table with the expectations beside the measurements.
std::string format_scaling(const std::vector<ScalingRow>& rows, const ScalingOptions& options);

/// The curves against d_k (score standard deviation, mean largest weight, mean entropy, median
/// Jacobian norm; unscaled and scaled) as a 2x2 panel plot, written as .png, .svg or .html by extension.
/// @throws qkv::Error for another extension, an empty table or an I/O failure.
void write_scaling_plot(const std::filesystem::path& path, const std::vector<ScalingRow>& rows,
                        const ScalingOptions& options);

}  // namespace qkv::explain
