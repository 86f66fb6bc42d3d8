#pragma once
// Measurement support shared by `qkv bench` and the Google Benchmark program: the naive unfused
// baselines (forward and backward), machine peaks (FMA, bf16 dot product, read bandwidth) and the
// SGEMM rate of OpenBLAS, the CPU's description, FLOP and byte counts of the benchmark shapes,
// timing, and the OpenBLAS environment.
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/tensor.hpp"

namespace qkv::bench {

/// One attention problem: q [B,Hq,Sq,D], k and v [B,Hkv,Sk,D].
struct BenchShape {
  std::int64_t B = 1, Hq = 8, Hkv = 8, Sq = 256, Sk = 256, D = 64;
};

/// "B=1 Hq=8 Hkv=8 Sq=256 Sk=256 D=64"
std::string shape_label(const BenchShape& s);

/// Number of (i, j) score pairs that a causal mask (bottom-right alignment, the qkv default)
/// keeps in one head: sum over i of clamp(i + Sk - Sq + 1, 0, Sk). Sq * Sk when not causal.
double unmasked_pairs(const BenchShape& s, bool causal);
/// FLOPs of a forward pass counting only unmasked scores: 4 * B * Hq * D * unmasked_pairs
/// (2 for QK^T and 2 for PV per pair and head dimension).
double forward_flops(const BenchShape& s, bool causal);
/// FLOPs of a backward pass: 2.5 x forward_flops(), FlashAttention's convention (five matrix
/// products per unmasked score pair, QK^T recomputed, dV, dP, dQ, dK, against the forward's two).
double backward_flops(const BenchShape& s, bool causal);
/// Bytes of K and V when each is read once per KV head: 2 * B * Hkv * Sk * D * sizeof(dtype).
double kv_bytes(const BenchShape& s, DType dtype);

/// q, k, v (dtype, BHSD contiguous, uniform in [-1, 1] rounded to bfloat16 so that every dtype
/// holds the same values for a seed) and a float32 output.
struct Inputs {
  Tensor q, k, v, out;
};
Inputs make_inputs(const BenchShape& s, DType dtype, std::uint64_t seed = 42);

/// What a backward call needs beyond q, k, v: the forward's out (in the dtype of q) and softmax_lse ([B,Hq,Sq],
/// float32), dO (grad_out, in the dtype of q, uniform in [-1, 1] rounded to bfloat16 as the
/// inputs) and the gradients (grad_dtype, every page touched).
struct BackwardInputs {
  Inputs in;
  Tensor lse, grad_out, grad_q, grad_k, grad_v;
};
/// make_inputs(s, dtype, seed), then one qkv::attention() call with `params` writes out and lse.
BackwardInputs make_backward_inputs(const BenchShape& s, DType dtype, DType grad_dtype,
                                    const AttentionParams& params, std::uint64_t seed = 42);
/// Runs qkv::attention_backward() on `b` with `params`.
void run_backward(const BackwardInputs& b, const AttentionParams& params);

/// The kernel that qkv::attention() dispatches for these arguments, from explain_dispatch():
/// the chosen line, e.g. "flash (AVX-512, fp32)" or "reference".
std::string dispatched_kernel(const Inputs& in, const AttentionParams& params);
/// The kernel that qkv::attention_backward() runs for `b`, from its explain_dispatch(): the
/// chosen line, e.g. "flash (avx512amx)" or "reference".
std::string dispatched_backward_kernel(const BackwardInputs& b, const AttentionParams& params);

// ---- naive unfused baseline -------------------------------------------------------------------

/// Plain attention as three steps per head: S = scale * Q K^T (cblas_sgemm), a row softmax
/// (causal masking when asked, bottom-right alignment), O = P V (cblas_sgemm). Heads are spread
/// over OpenMP threads; each sgemm runs single-threaded. fp32 only; materialises Sq x Sk floats
/// per thread (allocated once, reused across calls). GQA: query head h reads KV head h / (Hq/Hkv),
/// once per query head.
class NaiveBaseline {
public:
  NaiveBaseline(const BenchShape& s, int threads);
  /// q, k, v float32 BHSD contiguous as from make_inputs(); out float32 [B,Hq,Sq,D].
  void run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, bool causal);
  /// Bytes of score workspace held (threads x Sq x Sk x 4).
  std::size_t workspace_bytes() const { return scores_.size() * sizeof(float); }

private:
  BenchShape shape_;
  int threads_;
  std::vector<float> scores_;
};

/// The gradients by the same naive method, per (batch, KV head) and each query head of its
/// group: P = softmax(scale Q K^T) recomputed (cblas_sgemm and the row softmax of NaiveBaseline,
/// causal bottom-right), D_i = rowsum(dO * O) from the given O, dV += P^T dO, dP = dO V^T,
/// dS = P * (dP - D) * scale, dQ = dS K, dK += dS^T Q (five cblas_sgemm, dK and dV summed over
/// the group with beta = 1). (batch, KV head) pairs are spread over OpenMP threads; each sgemm
/// runs single-threaded. fp32 only, BHSD contiguous; two Sq x Sk float buffers per thread
/// (allocated once, reused across calls).
class NaiveBackwardBaseline {
public:
  NaiveBackwardBaseline(const BenchShape& s, int threads);
  /// Every tensor float32 BHSD contiguous: q, out, grad_out, grad_q [B,Hq,Sq,D]; k, v, grad_k,
  /// grad_v [B,Hkv,Sk,D]. out is the forward's output for q, k, v.
  void run(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& grad_out,
           const Tensor& grad_q, const Tensor& grad_k, const Tensor& grad_v, bool causal);
  /// Bytes of workspace held (threads x (2 Sq x Sk + Sq) x 4).
  std::size_t workspace_bytes() const {
    return (probs_.size() + dprobs_.size() + rowdot_.size()) * sizeof(float);
  }

private:
  BenchShape shape_;
  int threads_;
  std::vector<float> probs_, dprobs_, rowdot_;
};

// ---- machine peaks -----------------------------------------------------------------------------

/// Measured peak figures. 0 where not measurable on this CPU (e.g. no AVX512_BF16).
struct Peaks {
  int threads = 1;
  double fma_gflops = 0;   ///< fp32 FMA throughput (AVX-512, else AVX2), GFLOP/s, 2 FLOP per FMA lane
  double bf16_gflops = 0;  ///< vdpbf16ps throughput, GFLOP/s, 4 FLOP per fp32 lane
  double amx_gflops = 0;   ///< AMX tdpbf16ps throughput, GFLOP/s (0 without AMX)
  double read_gbps = 0;    ///< streaming reads of a read_mib buffer (far beyond the caches), GB/s (1e9 B)
  double read_mib = 512;
  std::string fma_isa;     ///< "avx512", "avx2" or "scalar"
};
/// The peak a row of `dtype` is judged against: "amx_gflops" for bfloat16 on AMX tiles,
/// "bf16_gflops" for bfloat16 on the AVX512_BF16 dot products, "fma_gflops" otherwise (fp32,
/// fp16, and bfloat16 widened to fp32); and its value in `p` (0 if not measured).
std::string compute_peak_name(DType dtype);
double compute_peak_value(const Peaks& p, const std::string& name);
/// Runs the three microbenchmarks with `threads` OpenMP threads, each for about `seconds`.
Peaks measure_peaks(int threads, double seconds = 0.25, double read_mib = 512);
/// The compute microbenchmarks only: fma_gflops (unless !fma), bf16_gflops and amx_gflops
/// (unless !bf16, or no AVX512_BF16 / AMX), fma_isa; the figures not measured and read_gbps
/// stay 0.
Peaks measure_compute_peaks(int threads, double seconds = 0.25, bool fma = true, bool bf16 = true);
/// Read bandwidth in GB/s of `threads` threads streaming through a buffer of about `bytes`
/// (split evenly, first touched by its reader), best pass of those in about `seconds`. On this
/// kind of machine the figure depends strongly on the size (caches, and in virtual machines the
/// host's memory layout), so decode rows are judged against a buffer of their own K+V size.
double measure_read_bandwidth(int threads, double bytes, double seconds = 0.25);
/// The same bytes split over two buffers (K and V) that each thread reads in alternating tiles of
/// 32 KiB (64 keys of D = 128 in fp32), as decode reads K and V. A reference for decode rows
/// (JSON kv_read_gbps) next to the one-stream figure that their peak fraction divides by.
double measure_kv_read_bandwidth(int threads, double bytes, double seconds = 0.25);

/// The rate of a tuned matrix product: OpenBLAS's cblas_sgemm, C = A B on n x n float32 matrices
/// (row-major, entries uniform in [-1, 1]), on `threads` OpenBLAS threads. What a well-fed fp32
/// microkernel reaches on this machine, next to the FMA loop's peak, which no real kernel feeds.
struct SgemmRate {
  int threads = 1, n = 0, runs = 0;  ///< runs: timed calls behind the median
  double seconds = 0;                ///< median time of one call
  double gflops = 0;                 ///< 2 n^3 / seconds / 1e9
};
/// One warm-up call, then `repeats` timed calls (bench::time_runs with a 30 s budget); median.
SgemmRate measure_sgemm(int threads, int n = 2048, int repeats = 7);

// ---- the CPU -----------------------------------------------------------------------------------

/// One cache of cpu0, from /sys/devices/system/cpu/cpu0/cache/index*.
struct CpuCache {
  int level = 0;
  std::string type;           ///< "Data", "Instruction" or "Unified"
  std::int64_t bytes = 0;
  int shared_by = 0;          ///< logical CPUs sharing it (0: unknown)
};
/// The machine as Linux describes it; fields it does not give stay empty or 0.
struct CpuDescription {
  std::string model;          ///< /proc/cpuinfo "model name"
  int logical_cpus = 0;       ///< "processor" entries of /proc/cpuinfo
  int cores = 0;              ///< distinct (physical id, core id) pairs
  int sockets = 0;            ///< distinct physical ids
  bool hypervisor = false;    ///< the "hypervisor" CPU flag: a virtual machine
  std::vector<CpuCache> caches;
};
CpuDescription describe_cpu();
/// "L1d 48 KiB, L1i 32 KiB, L2 2 MiB, L3 480 MiB (shared by 2 CPUs)"; "unknown" without sysfs.
std::string cache_summary(const CpuDescription& cpu);

// ---- timing ------------------------------------------------------------------------------------

double median(std::vector<double> v);
/// Calls fn once to warm up, then `repeats` times (fewer when the warm-up run says they would take
/// more than `budget_s`, at least 1), then again while the timed runs add up to less than `min_s`
/// seconds and to less than `budget_s` (a median of many short runs is not moved by a short slow
/// phase of a shared machine). Returns every timed duration in seconds.
std::vector<double> time_runs(const std::function<void()>& fn, int repeats, double budget_s, double min_s = 0);

// ---- memory ------------------------------------------------------------------------------------

/// Resident-memory figures of one attention call, measured in a forked child process so that
/// nothing else in this process counts: inputs are allocated and touched first (rss_inputs),
/// then the call runs; hwm is the child's peak resident set (VmHWM) afterwards.
struct MemoryUse {
  double rss_inputs_mib = 0;  ///< resident after allocating q, k, v, out
  double hwm_mib = 0;         ///< peak resident set of the child
  double extra_mib = 0;       ///< hwm - rss_inputs: what the call itself added at its peak
  double seconds = 0;         ///< duration of the call
  std::string kernel;
};
/// Throws qkv::Error if the child fails. Call it before this process runs any OpenMP parallel
/// region: OpenMP (libgomp) is not usable in a child forked after its threads exist.
MemoryUse measure_memory(const BenchShape& s, DType dtype, bool causal, int threads);
/// The same for one attention_backward() call: the child allocates and touches q, k, v, out,
/// softmax_lse, dO and the gradients (float32 for float32 inputs, else the input dtype), runs the
/// forward that fills out and softmax_lse, resets its peak counter, and then runs the backward;
/// rss_inputs counts all of those tensors, extra what the backward call added at its peak.
MemoryUse measure_backward_memory(const BenchShape& s, DType dtype, bool causal, int threads);

/// Current process's peak resident set in MiB (VmHWM from /proc/self/status; 0 if unavailable).
double peak_rss_mib();

// ---- OpenBLAS environment ----------------------------------------------------------------------

/// OpenBLAS reads OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE once, when the library loads. If either
/// is set (or `coretype` is non-empty and differs from OPENBLAS_CORETYPE), re-executes this
/// program once with both removed (and OPENBLAS_CORETYPE=coretype when given), guarded by the
/// marker variable QKV_BENCH_BLAS_ENV. `args` are the program's arguments, argv[0] first. Returns
/// only if no re-execution was needed or it failed (then the second line of blas_env_note()
/// says why).
void reexec_with_clean_blas_env(const std::vector<std::string>& args, const std::string& coretype = "");
/// The program's arguments as the kernel recorded them (/proc/self/cmdline), for re-execution
/// from code that does not hold argv.
std::vector<std::string> self_cmdline();
/// openblas_get_corename(), e.g. "Cooperlake".
std::string blas_core_name();
/// One line saying which OpenBLAS core the baseline uses and how the environment was set.
std::string blas_env_note();

}  // namespace qkv::bench
