#pragma once
// Inner loops of the peak microbenchmarks, one translation unit per ISA (compiled with that ISA's
// flags, called only after checking the CPU at run time).
#include <cstddef>
#include <cstdint>

namespace qkv::bench::detail {

/// Independent accumulator chains per loop iteration: more than latency x FMA pipes (4 x 2 on
/// current AVX-512 cores), so the loop is bound by FMA throughput, not by latency.
inline constexpr int kChains = 16;
/// AVX2 has 16 ymm registers: 12 chains plus the two operands fit without spilling.
inline constexpr int kChainsAvx2 = 12;

/// `iters` iterations of kChains independent vfmadd231ps on zmm registers (16 lanes):
/// 32 * kChains * iters FLOP. Returns a value depending on every result.
float fma_loop_avx512(std::int64_t iters) noexcept;
/// The same with vdpbf16ps (32 bf16 pairs -> 16 fp32 lanes): 64 * kChains * iters FLOP.
float bf16_loop_avx512(std::int64_t iters) noexcept;
/// `iters` iterations of four independent tdpbf16ps (16 x 16 fp32 results of 32 bf16 products
/// each) on AMX tiles: 4 * 16 * 16 * 32 * 2 * iters FLOP. Needs AMX and the OS's permission.
float amx_loop(std::int64_t iters) noexcept;
/// The same with ymm FMA (8 lanes): 16 * kChainsAvx2 * iters FLOP.
float fma_loop_avx2(std::int64_t iters) noexcept;
/// Sums n floats (n a multiple of 64, p 64-byte aligned) with aligned 512-bit loads.
float read_sum_avx512(const float* p, std::size_t n) noexcept;

}  // namespace qkv::bench::detail
