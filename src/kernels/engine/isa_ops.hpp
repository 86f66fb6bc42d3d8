#pragma once
// IsaOps: what the engine (src/kernels/engine/) needs from an instruction set. Each ISA file
// (src/kernels/simd/<isa>/engine_<isa>.cpp) defines a struct Ops that models it; the engine's
// templates are constrained on it, so a missing or mistyped member is reported at the ISA file,
// not deep inside an instantiation. V is that ISA's vector of W floats (float itself when W = 1).
//
// Nothing here emits code, so the concept lives outside the ISA-private namespace: it is only
// checked, once per ISA translation unit.
#include <concepts>
#include <cstdint>

namespace qkv::detail {

/// Members every ISA has.
template <class Ops>
concept IsaOpsCore = requires(typename Ops::V v, float x, const float* src, float* dst,
                              const float* const* rows, const std::uint16_t* h, std::int64_t n,
                              const std::int8_t* i8, const std::uint8_t* u8) {
  // Tile traits (constexpr): the vector width, rows per query block, keys per key tile,
  // vector registers a microkernel may fill with accumulators, vectors of Dv per PV microkernel.
  requires std::same_as<decltype(Ops::W), const int>;
  requires std::same_as<decltype(Ops::kBq), const int>;
  requires std::same_as<decltype(Ops::kBk), const int>;
  requires std::same_as<decltype(Ops::kAccRegs), const int>;
  requires std::same_as<decltype(Ops::kPvCols), const int>;
  // Whether fma_mask/nonzero exist (a branch-free zero-weight skip in PV), and whether the
  // AVX512_BF16 dot-product kernels below exist.
  requires std::same_as<decltype(Ops::kMaskedFma), const bool>;
  requires std::same_as<decltype(Ops::kHasDpbf16), const bool>;
  // A block is whole vectors of queries, at most 8 of them (the QK^T dispatch); bf16 pairs of
  // keys need an even tile; a PV microkernel holds at least one row.
  requires Ops::W >= 1 && Ops::kBq % Ops::W == 0 && Ops::kBq / Ops::W <= 8;
  requires Ops::kBk % 2 == 0 && Ops::kAccRegs >= Ops::kPvCols && Ops::kPvCols >= 1;

  { Ops::zero() } -> std::same_as<typename Ops::V>;     // every lane 0.0f
  { Ops::set1(x) } -> std::same_as<typename Ops::V>;    // every lane x
  { Ops::load(src) } -> std::same_as<typename Ops::V>;  // W floats from src (any alignment)
  Ops::store(dst, v);                                   // W floats to dst (any alignment)
  { Ops::fma(v, v, v) } -> std::same_as<typename Ops::V>;  // a * b + c per lane (vector ISAs: fused)
  { Ops::mul(v, v) } -> std::same_as<typename Ops::V>;     // a * b per lane
  { Ops::add(v, v) } -> std::same_as<typename Ops::V>;     // a + b per lane
  { Ops::sub(v, v) } -> std::same_as<typename Ops::V>;     // a - b per lane
  { Ops::div(v, v) } -> std::same_as<typename Ops::V>;     // a / b per lane, correctly rounded
  { Ops::max(v, v) } -> std::same_as<typename Ops::V>;     // larger of a and b per lane
  { Ops::safe_max(v) } -> std::same_as<typename Ops::V>;   // -inf lanes to 0, others unchanged
  // e^x per lane, exactly 0 for x = -inf (and NaN kept); its accuracy is stated in the ISA file.
  { Ops::exp(v) } -> std::same_as<typename Ops::V>;
  // range_select(x, lo, hi, g): x in lanes where lo <= g < hi, -inf elsewhere (a select).
  { Ops::range_select(v, v, v, v) } -> std::same_as<typename Ops::V>;
  // Sum of the W lanes, in an order fixed by the ISA (hsum_w must reproduce it).
  { Ops::hsum(v) } -> std::same_as<float>;
  // dst[c * ld + x] = rows[x][c] for x, c < W: a W x W block of 32-bit words moved unchanged.
  Ops::transpose(rows, dst, n);
  { Ops::load_bf16(h) } -> std::same_as<typename Ops::V>;  // W bfloat16 to fp32 (exact)
  { Ops::load_f16(h) } -> std::same_as<typename Ops::V>;   // W float16 to fp32 (exact)
  Ops::f16_to_f32(h, dst, n);                              // n float16 from h to fp32 at dst (exact)
  // The codes of the quantized KV formats (tensor/kv_codec.hpp), exactly, before their scale.
  { Ops::load_i8(i8) } -> std::same_as<typename Ops::V>;    // W int8 to fp32
  { Ops::load_e4m3(u8) } -> std::same_as<typename Ops::V>;  // W float8 e4m3fn to fp32
};

/// Ops::kMaskedFma: PV skips zero weights under a lane mask instead of a branch.
template <class Ops>
concept IsaOpsMaskedFma = requires(typename Ops::V v) {
  // nonzero(p): the lanes where p != 0 (NaN included); fma_mask(a, b, c, k): a * b + c in the
  // lanes of k, c unchanged in the others.
  { Ops::fma_mask(v, v, v, Ops::nonzero(v)) } -> std::same_as<typename Ops::V>;
};

/// W >= 4: the grouped decode scores (DecodeFast::fast_qk_4w) reduce W accumulators at once.
template <class Ops>
concept IsaOpsGroupedScores = requires(const typename Ops::V* a, typename Ops::V v, float* dst,
                                       std::int64_t ld) {
  requires Ops::W % 4 == 0;
  // Lane i of the result = hsum(a[i]) bit for bit, for i < W.
  { Ops::hsum_w(a) } -> std::same_as<typename Ops::V>;
  // Lanes r W/4 .. (r + 1) W/4 - 1 of v to dst + r * ld, for r < 4.
  Ops::store_quarters(dst, ld, v);
};

/// Ops::kHasDpbf16: the bf16 dot-product path of the block processor (bf16 inputs).
template <class Ops>
concept IsaOpsDpbf16 = requires(typename Ops::V v, const std::uint32_t* qp, const std::uint16_t* k, const float* s, float* out,
                                std::uint32_t* packed, const std::uint32_t* pp, const float* alpha,
                                std::int64_t stride, int i) {
  // qk_bf16(qp, nqv, k, ks, D, kt, s, ssp): s[j * ssp + r] = q_r . k_j for kt key rows (stride
  // ks, bf16, read in place) and nqv vectors of queries packed as bf16 pairs qp[d/2][nqv W].
  Ops::qk_bf16(qp, i, k, stride, stride, i, out, i);
  // pack_p_bf16(s, ssp, nqv, kt, pp): pp[j/2][r] = (bf16(s[j][r]), bf16(s[j+1][r])), rounded to
  // nearest even, a missing last key paired with 0.
  Ops::pack_p_bf16(s, i, i, i, packed);
  // pack_v_bf16(v, vs, Dv, nvec, kt, vp): vp[j/2][x] = (v[j][x], v[j+1][x]) for x < nvec W,
  // zero beyond Dv and past the last key.
  Ops::pack_v_bf16(k, stride, stride, i, i, packed);
  // pv_bf16(pp, sp, vp, nvec, kt2, o, os, alpha, n): o[r] = alpha[r] o[r] + sum over the kt2
  // key pairs of P V, for n rows, accumulated in fp32.
  Ops::pv_bf16(pp, i, pp, i, i, out, stride, alpha, i);
  // dot_pairs(acc, a, b): acc + the W lanes' pair sums a[x] . b[x] in qk_bf16's order.
  { Ops::dot_pairs(v, pp, pp) } -> std::same_as<typename Ops::V>;
  // dp_load(h): 2 W bf16 (W pairs) as the bits of a vector; dp(acc, a, b): dot_pairs on two such.
  { Ops::dp_load(k) } -> std::same_as<typename Ops::V>;
  { Ops::dp(v, v, v) } -> std::same_as<typename Ops::V>;
};

/// Everything the engine needs from an ISA: the core, and each optional part its flags promise.
template <class Ops>
concept IsaOps = IsaOpsCore<Ops> && (!Ops::kMaskedFma || IsaOpsMaskedFma<Ops>) &&
                 (Ops::W < 4 || IsaOpsGroupedScores<Ops>) && (!Ops::kHasDpbf16 || IsaOpsDpbf16<Ops>);

}  // namespace qkv::detail
