#pragma once
/// @file kv_quant.hpp
/// Storage formats of cached keys and values, quantized ones included, chosen separately for K
/// and V (KVCache, PagedKVCache, attention_varlen / attention_paged on QuantizedKV operands).
///
///   format  data dtype  scales (dtype, shape for data [N, H, S, D] or [T, H, D])  value
///   f32     float32     none                                                     x
///   bf16    bfloat16    none                                                     x
///   f16     float16     none                                                     x
///   int8    int8        float32 [N, H, S] / [T, H]: one per (token, head)        q * s
///   q8_0    int8        float16 [N, H, S, nb] / [T, H, nb], nb = ceil(D / 32)    q * d_block
///   fp8     uint8       float32 [H]: one per head                                e4m3(q) * s_head
///
/// int8: s = max|x| / 127 over the row (fp32), q = round(x / s) in [-127, 127] (absmax
/// quantization, the per-token int8 of onnxruntime/ZeroQuant). q8_0: llama.cpp's block layout,
/// blocks of 32 consecutive elements of head_dim (the last block may be shorter), d = fp16(max|x|
/// / 127), q = round(x / d) in [-127, 127]. fp8: float8 e4m3fn (OCP FP8 spec; vLLM's and
/// FlashAttention-3's fp8 KV cache), x / s_head rounded, finite range +-448; the per-head scales are
/// set by the cache's owner before any key is stored (default 1, vLLM's default k_scale).
/// Every rounding is to nearest, ties to even; values beyond the range saturate (int8, q8_0: to
/// +-127; fp8: to +-448; a q8_0 scale beyond float16's range to 65504). A dequantized value is
/// the float32 product code * scale, so
///   |x - dequant(quant(x))| <= s / 2 (+ the float32 rounding of the product)   int8, q8_0 (s = d)
///   |x - dequant(quant(x))| <= s * ulp_e4m3(x / s) / 2, ulp = 2^(floor(log2|x/s|) - 3), >= 2^-9
///                                                                             fp8, |x / s| <= 448
/// Quantizing a NaN or an infinity is an error (qkv::Error naming the token and head).
#include <cstdint>
#include <string_view>

#include "qkv/tensor.hpp"

namespace qkv {

enum class KVFormat : std::uint8_t { f32, bf16, f16, int8, q8_0, fp8 };

/// Elements of head_dim per q8_0 block.
inline constexpr std::int64_t kQ8Block = 32;

/// "f32", "bf16", "f16", "int8", "q8_0", "fp8".
std::string_view kv_format_name(KVFormat f) noexcept;
/// The inverse of kv_format_name. @throws qkv::Error naming `what` and the accepted names.
KVFormat parse_kv_format(std::string_view name, std::string_view what = "kv format");
/// True for int8, q8_0 and fp8.
bool kv_format_quantized(KVFormat f) noexcept;
/// Dtype of the stored codes: float32, bfloat16, float16, int8, int8, uint8.
DType kv_format_dtype(KVFormat f) noexcept;
/// The float format of a dtype (float32, bfloat16, float16). @throws qkv::Error for another dtype.
KVFormat kv_format_of(DType d, std::string_view what);
/// Dtype and shape of the scales for data of shape `data_shape` ([..., H, ..., D] with the head
/// axis 1): see the table above; an empty shape for the float formats.
DType kv_scales_dtype(KVFormat f) noexcept;
Shape kv_scales_shape(KVFormat f, const Shape& data_shape);

/// A K or V operand in any format: the codes and their scales (the float formats have no scales).
/// data [N, H, S, D] (a pool or a cache) or [T, H, D] (packed), the last dimension contiguous;
/// for int8 and q8_0 every other stride of data is a multiple of D and the matching stride of
/// scales is that stride / D (int8) or that stride / D * nb (q8_0), the last one 1: scales are
/// laid out like the rows of data (any view of a C-contiguous cache and its scales qualifies).
struct QuantizedKV {
  KVFormat format = KVFormat::f32;
  TensorView data;
  TensorView scales;
};

/// Quantizes x (float32, float64, float16 or bfloat16, the shape of dst.data) into dst: writes the
/// codes, and for int8 and q8_0 the scales; fp8 reads its per-head scales from dst.scales.
/// @throws qkv::Error naming `name`: shapes or dtypes that do not match the format, a scale of
///   fp8 that is not finite and > 0, or a NaN/inf in x ("k: expected finite values, got nan at
///   token 3, head 1"); then nothing is written.
void quantize_kv(const TensorView& x, const QuantizedKV& dst, std::string_view name = "x");
/// Dequantizes src into out (float32 or float64, the shape of src.data): code * scale in float32.
/// @throws qkv::Error for mismatched shapes or dtypes.
void dequantize_kv(const QuantizedKV& src, const TensorView& out);

}  // namespace qkv
