#pragma once
// The stored keys and values of a KV cache, in their formats (qkv/kv_quant.hpp), shared by
// KVCache (slot n = sequence, S = capacity) and PagedKVCache (slot n = block, S = block_size):
//   K [N, H, S, D] and V [N, H, S, Dv], C-contiguous, of the format's dtype (the codes), with the
//   scales laid out like the rows (int8 [N, H, S] float32, q8_0 [N, H, S, ceil(D/32)] float16,
//   fp8 [H] float32, starting at 1).
// Row r = (n * H + h) * S + s holds one token's key (value) of KV head h. The caches decide which
// row a token goes to; this class writes float rows there (rounded to a float dtype, or quantized
// with their scales after checking that they are finite) and hands out the views the attention
// ops read (QuantizedKV for attention_varlen / attention_paged, TensorView for qkv::attention).
#include <cstdint>
#include <span>
#include <string_view>

#include "qkv/kv_quant.hpp"
#include "qkv/tensor.hpp"

namespace qkv::detail {

class KVStorage {
 public:
  /// One new token of one KV head: where its k and v rows are read and the row they go to.
  struct RowWrite {
    std::int64_t k_src = 0, v_src = 0;  // element offsets of its k row and v row in the sources
    std::int64_t row = 0;               // destination row (n * H + h) * S + s
    std::int64_t head = 0;              // h, which picks fp8's scale
    std::int64_t batch = -1;            // in error messages: the batch index, or < 0 for none
    std::int64_t token = 0;             // in error messages: the token's index in the sources
  };

  KVStorage() = default;
  /// K and V in formats k_format and v_format (codes of kv_format_dtype, zeroed; fp8 scales 1).
  /// @throws qkv::Error (from Tensor) for a byte size that overflows.
  KVStorage(KVFormat k_format, KVFormat v_format, std::int64_t N, std::int64_t H, std::int64_t S,
            std::int64_t D, std::int64_t Dv);
  /// K and V as floats of `dtype` (float32, float64, bfloat16 or float16; no scales). Float64 has
  /// no KVFormat: such storage is read through key_data()/value_data() only, and k_format()
  /// reports f32.
  KVStorage(DType dtype, std::int64_t N, std::int64_t H, std::int64_t S, std::int64_t D, std::int64_t Dv);

  KVFormat k_format() const noexcept { return k_.format; }
  KVFormat v_format() const noexcept { return v_.format; }
  /// True when K or V is quantized, or K and V are in different formats.
  bool mixed_or_quantized() const noexcept;
  /// The element dtype of K (the codes' dtype when quantized).
  DType dtype() const noexcept { return k_.data.dtype(); }

  /// K [N, H, S, D] and V [N, H, S, Dv], writable; their scales (empty for a float format).
  TensorView key_data() const { return k_.data.view(); }
  TensorView value_data() const { return v_.data.view(); }
  TensorView key_scales() const { return k_.scales.view(); }
  TensorView value_scales() const { return v_.scales.view(); }

  /// The whole storage as attention_paged's operands (pools [N, H, S, D|Dv] with their scales).
  QuantizedKV keys() const { return {k_.format, k_.data.view(), k_.scales.view()}; }
  QuantizedKV values() const { return {v_.format, v_.data.view(), v_.scales.view()}; }
  /// Positions [0, length) of slot n as packed [length, H, D|Dv] operands of attention_varlen
  /// (strides D * S between heads), with their scales (fp8: the [H] scales).
  QuantizedKV slot_keys(std::int64_t n, std::int64_t length) const { return slot(k_, n, length); }
  QuantizedKV slot_values(std::int64_t n, std::int64_t length) const { return slot(v_, n, length); }
  /// Positions [0, length) of every slot, [N, H, length, D|Dv] strided views of the data.
  TensorView leading_keys(std::int64_t length) const { return leading(k_, length); }
  TensorView leading_values(std::int64_t length) const { return leading(v_, length); }

  /// Sets the per-head scales of fp8 K and V (each of H entries; a part in another format ignores
  /// its span). The caller checks that nothing is stored yet.
  /// @throws qkv::Error "<prefix>k_scales: ..." for a size other than H or a scale not finite
  ///         and > 0; then nothing changes.
  void set_fp8_scales(std::span<const float> k_scales, std::span<const float> v_scales,
                      std::string_view prefix);

  /// Writes rows of k and v (float32, float64, bfloat16 or float16; rows of D and Dv contiguous
  /// elements at the offsets of `rows`): rounded to a float format, or quantized (round to
  /// nearest even, saturating). Rows are written in order, so the last of two writes to one row
  /// stays.
  /// @throws qkv::Error "<prefix>k: expected finite values for the int8 cache, got inf at
  ///         [batch b, ]token t, head h" for a NaN or infinity going to a quantized part (every
  ///         K row is checked, then every V row, before anything is written).
  void write(const TensorView& k, const TensorView& v, std::span<const RowWrite> rows,
             std::string_view prefix);

 private:
  struct Part {
    KVFormat format = KVFormat::f32;
    Tensor data, scales;
    std::int64_t N = 0, H = 0, S = 0, X = 0;  // slots, heads, positions per slot, row length (D or Dv)
  };
  static Part make_part(KVFormat f, DType dtype, std::int64_t N, std::int64_t H, std::int64_t S,
                        std::int64_t X);
  static QuantizedKV slot(const Part& p, std::int64_t n, std::int64_t length);
  static TensorView leading(const Part& p, std::int64_t length);
  Part k_, v_;
};

}  // namespace qkv::detail
