// Shapes, FLOP and byte counts, inputs, timing, memory and the OpenBLAS environment of the
// benchmarks.
#include <cblas.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>

#include "platform/cpu_features.hpp"
#include "qkv/backward.hpp"
#include "qkv/error.hpp"
#include "bench_support.hpp"

namespace qkv::bench {

std::string shape_label(const BenchShape& s) {
  std::ostringstream o;
  o << "B=" << s.B << " Hq=" << s.Hq << " Hkv=" << s.Hkv << " Sq=" << s.Sq << " Sk=" << s.Sk
    << " D=" << s.D;
  return o.str();
}

double unmasked_pairs(const BenchShape& s, bool causal) {
  if (!causal) return static_cast<double>(s.Sq) * static_cast<double>(s.Sk);
  double n = 0;
  for (std::int64_t i = 0; i < s.Sq; ++i)
    n += static_cast<double>(std::clamp<std::int64_t>(i + s.Sk - s.Sq + 1, 0, s.Sk));
  return n;
}

double forward_flops(const BenchShape& s, bool causal) {
  return 4.0 * static_cast<double>(s.B * s.Hq * s.D) * unmasked_pairs(s, causal);
}

double backward_flops(const BenchShape& s, bool causal) { return 2.5 * forward_flops(s, causal); }

double kv_bytes(const BenchShape& s, DType dtype) {
  return 2.0 * static_cast<double>(s.B * s.Hkv * s.Sk * s.D) * static_cast<double>(dtype_size(dtype));
}

Inputs make_inputs(const BenchShape& s, DType dtype, std::uint64_t seed) {
  if (dtype != DType::f32 && dtype != DType::bf16 && dtype != DType::f16)
    throw Error("bench: dtype must be float32, bfloat16 or float16, got " + std::string(dtype_name(dtype)));
  Inputs in{Tensor(dtype, {s.B, s.Hq, s.Sq, s.D}), Tensor(dtype, {s.B, s.Hkv, s.Sk, s.D}),
            Tensor(dtype, {s.B, s.Hkv, s.Sk, s.D}), Tensor(DType::f32, {s.B, s.Hq, s.Sq, s.D})};
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  // Values are rounded to bfloat16 whatever the dtype, so that every dtype holds exactly the same
  // numbers for a seed and one float32 baseline run checks all of them.
  for (const Tensor* t : {&in.q, &in.k, &in.v}) {
    const std::int64_t n = t->numel();
    for (std::int64_t i = 0; i < n; ++i) {
      const std::uint16_t b = float_to_bf16(dist(rng));
      if (dtype == DType::f32)
        t->data_as<float>()[i] = bf16_to_float(b);
      else if (dtype == DType::bf16)
        t->data_as<std::uint16_t>()[i] = b;
      else
        t->data_as<std::uint16_t>()[i] = float_to_half(bf16_to_float(b));
    }
  }
  return in;
}

BackwardInputs make_backward_inputs(const BenchShape& s, DType dtype, DType grad_dtype,
                                    const AttentionParams& params, std::uint64_t seed) {
  BackwardInputs b{make_inputs(s, dtype, seed), Tensor(DType::f32, {s.B, s.Hq, s.Sq}),
                   Tensor(dtype, {s.B, s.Hq, s.Sq, s.D}), Tensor(grad_dtype, {s.B, s.Hq, s.Sq, s.D}),
                   Tensor(grad_dtype, {s.B, s.Hkv, s.Sk, s.D}), Tensor(grad_dtype, {s.B, s.Hkv, s.Sk, s.D})};
  // dO from its own stream, rounded to bfloat16 like the inputs (the same values in every dtype).
  std::mt19937_64 rng(seed ^ 0x9e3779b97f4a7c15ull);
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  for (std::int64_t i = 0; i < b.grad_out.numel(); ++i) {
    const std::uint16_t h = float_to_bf16(dist(rng));
    if (dtype == DType::f32)
      b.grad_out.data_as<float>()[i] = bf16_to_float(h);
    else if (dtype == DType::bf16)
      b.grad_out.data_as<std::uint16_t>()[i] = h;
    else
      b.grad_out.data_as<std::uint16_t>()[i] = float_to_half(bf16_to_float(h));
  }
  // Make the gradients' pages resident (the tensors start as untouched zero pages).
  for (const Tensor* g : {&b.grad_q, &b.grad_k, &b.grad_v})
    std::memset(g->data(), 0xff, g->nbytes());
  AttentionParams fwd = params;
  if (fwd.kernel != KernelKind::reference) fwd.kernel = KernelKind::automatic;
  attention(b.in.q, b.in.k, b.in.v, b.in.out, fwd, TensorView(b.lse));
  // O in the inputs' dtype, as a training framework keeps the forward's output.
  if (dtype != DType::f32) {
    Tensor out(dtype, b.in.out.shape());
    const float* o = b.in.out.data_as<float>();
    for (std::int64_t i = 0; i < out.numel(); ++i)
      out.data_as<std::uint16_t>()[i] = dtype == DType::bf16 ? float_to_bf16(o[i]) : float_to_half(o[i]);
    b.in.out = std::move(out);
  }
  return b;
}

void run_backward(const BackwardInputs& b, const AttentionParams& params) {
  attention_backward(b.in.q, b.in.k, b.in.v, b.in.out, b.lse, b.grad_out, b.grad_q, b.grad_k, b.grad_v, params);
}

namespace {
// The chosen line of an explain_dispatch() text, as "name (detail)", e.g. "flash (avx512amx)".
std::string chosen_kernel(const std::string& text) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const auto pos = line.find(": chosen");
    if (pos == std::string::npos) continue;
    std::string rest = line.substr(pos + 8);
    while (!rest.empty() && rest.front() == ' ') rest.erase(rest.begin());
    return rest.empty() ? line.substr(0, pos) : line.substr(0, pos) + " " + rest;
  }
  return "unknown";
}
}  // namespace

std::string dispatched_backward_kernel(const BackwardInputs& b, const AttentionParams& params) {
  return chosen_kernel(explain_dispatch(b.in.q, b.in.k, b.in.v, b.in.out, b.lse, b.grad_out, b.grad_q, b.grad_k,
                                        b.grad_v, params));
}

std::string dispatched_kernel(const Inputs& in, const AttentionParams& params) {
  return chosen_kernel(explain_dispatch(in.q, in.k, in.v, in.out, params));
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::vector<double> time_runs(const std::function<void()>& fn, int repeats, double budget_s, double min_s) {
  using Clock = std::chrono::steady_clock;
  auto once = [&] {
    const auto t0 = Clock::now();
    fn();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  const double warm = once();
  int n = std::max(1, repeats);
  if (warm * n > budget_s) n = std::max(1, static_cast<int>(budget_s / std::max(warm, 1e-9)));
  // At least n runs; then more while the timed runs add up to less than min_s (the warm-up call,
  // which starts threads and touches fresh memory, says little about the length of the others),
  // never past the budget, at most a million.
  std::vector<double> t;
  double total = 0;
  while (static_cast<int>(t.size()) < n || (total < min_s && total < budget_s && t.size() < 1000000)) {
    t.push_back(once());
    total += t.back();
  }
  return t;
}

namespace {

// A field of /proc/self/status in kB ("VmHWM", "VmRSS"), as MiB; 0 if absent.
double status_mib(const char* field) {
  std::ifstream f("/proc/self/status");
  const std::string key = std::string(field) + ":";
  for (std::string line; std::getline(f, line);)
    if (line.rfind(key, 0) == 0) return std::strtod(line.c_str() + key.size(), nullptr) / 1024.0;
  return 0.0;
}

// Peak-RSS counters start from the process's state at fork; this resets them to the current
// resident set (Linux >= 4.0), so that only what is allocated afterwards counts.
void reset_peak_rss() {
  if (FILE* cr = std::fopen("/proc/self/clear_refs", "w")) {
    std::fputs("5", cr);
    std::fclose(cr);
  }
}

}  // namespace

double peak_rss_mib() { return status_mib("VmHWM"); }

namespace {

// Runs `child` in a forked child process, which first resets its peak-RSS counter; `child` fills
// everything but extra_mib (computed here). Throws if the child fails.
MemoryUse in_child(const BenchShape& s, const std::function<MemoryUse()>& child) {
  int fds[2];
  if (pipe(fds) != 0) throw Error("bench: memory: pipe() failed");
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) throw Error("bench: memory: fork() failed");
  if (pid == 0) {
    close(fds[0]);
    MemoryUse m;
    int rc = 0;
    try {
      reset_peak_rss();
      m = child();
    } catch (const std::exception& e) {
      m.kernel = std::string("error: ") + e.what();
      rc = 1;
    }
    char buf[512];
    const int len = std::snprintf(buf, sizeof buf, "%.17g %.17g %.17g %s", m.rss_inputs_mib,
                                  m.hwm_mib, m.seconds, m.kernel.c_str());
    if (write(fds[1], buf, static_cast<std::size_t>(std::min<int>(len, sizeof buf - 1))) < 0) rc = 1;
    close(fds[1]);
    _exit(rc);
  }
  close(fds[1]);
  std::string msg;
  char buf[512];
  for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) msg.append(buf, static_cast<std::size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  MemoryUse m;
  std::istringstream in(msg);
  in >> m.rss_inputs_mib >> m.hwm_mib >> m.seconds;
  std::getline(in >> std::ws, m.kernel);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw Error("bench: memory measurement for " + shape_label(s) + " failed: " +
                (m.kernel.empty() ? std::string("child terminated abnormally") : m.kernel));
  m.extra_mib = m.hwm_mib - m.rss_inputs_mib;
  return m;
}

}  // namespace

MemoryUse measure_memory(const BenchShape& s, DType dtype, bool causal, int threads) {
  return in_child(s, [&] {
    MemoryUse m;
    Inputs in = make_inputs(s, dtype);
    // Make every output page resident now, so that only the call's own memory counts below.
    float* o = in.out.data_as<float>();
    for (std::int64_t i = 0; i < in.out.numel(); ++i) o[i] = 1.0f;
    AttentionParams p;
    p.causal = causal;
    p.num_threads = threads;
    m.kernel = dispatched_kernel(in, p);
    m.rss_inputs_mib = status_mib("VmRSS");
    const auto t0 = std::chrono::steady_clock::now();
    attention(in.q, in.k, in.v, in.out, p);
    m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    m.hwm_mib = status_mib("VmHWM");
    return m;
  });
}

MemoryUse measure_backward_memory(const BenchShape& s, DType dtype, bool causal, int threads) {
  return in_child(s, [&] {
    MemoryUse m;
    AttentionParams p;
    p.causal = causal;
    p.num_threads = threads;
    const DType grad_dtype = dtype == DType::f32 ? DType::f32 : dtype;
    // The forward writes out and softmax_lse (every page); the gradients are touched on creation.
    const BackwardInputs b = make_backward_inputs(s, dtype, grad_dtype, p);
    m.kernel = dispatched_backward_kernel(b, p);
    // Only the backward call's own memory counts: forget the forward's (and the probe's) peak.
    reset_peak_rss();
    m.rss_inputs_mib = status_mib("VmRSS");
    const auto t0 = std::chrono::steady_clock::now();
    run_backward(b, p);
    m.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    m.hwm_mib = status_mib("VmHWM");
    return m;
  });
}

// ---- OpenBLAS environment ----------------------------------------------------------------------

namespace {

constexpr const char* kMarker = "QKV_BENCH_BLAS_ENV";

// OpenBLAS cores whose sgemm uses AVX-512 (0.3.21 names).
bool avx512_core(const std::string& name) {
  for (const char* c : {"SkylakeX", "Cooperlake", "SapphireRapids"})
    if (name == c) return true;
  return false;
}

// Replaces this process with a fresh copy of the program (same arguments, current environment).
// Returns only if that fails.
void reexec(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  execv("/proc/self/exe", argv.data());
  std::fprintf(stderr, "qkv bench: warning: could not re-execute to reset the OpenBLAS environment: %s\n",
               std::strerror(errno));
  setenv(kMarker, "re-execution failed, environment as inherited", 1);
}

}  // namespace

std::vector<std::string> self_cmdline() {
  std::ifstream f("/proc/self/cmdline", std::ios::binary);
  std::vector<std::string> args;
  std::string a;
  while (std::getline(f, a, '\0')) args.push_back(a);
  return args;
}

void reexec_with_clean_blas_env(const std::vector<std::string>& args, const std::string& coretype) {
  if (args.empty()) return;
  const char* marker = std::getenv(kMarker);
  const char* cur = std::getenv("OPENBLAS_CORETYPE");
  if (marker == nullptr) {
    const bool l2 = std::getenv("OPENBLAS_L2_SIZE") != nullptr;
    const bool need = coretype.empty() ? (cur != nullptr || l2) : (l2 || cur == nullptr || coretype != cur);
    if (!need) {
      setenv(kMarker, coretype.empty() ? "clean" : ("forced " + coretype).c_str(), 1);
    } else {
      unsetenv("OPENBLAS_L2_SIZE");
      if (coretype.empty()) {
        unsetenv("OPENBLAS_CORETYPE");
        setenv(kMarker, "unset", 1);
      } else {
        setenv("OPENBLAS_CORETYPE", coretype.c_str(), 1);
        setenv(kMarker, ("forced " + coretype).c_str(), 1);
      }
      reexec(args);
      return;
    }
  }
  // With the variables unset, OpenBLAS 0.3.21 may not know a newer CPU and fall back to a core
  // without AVX-512 kernels; then try SkylakeX (its AVX-512 sgemm), once.
  const std::string now = std::getenv(kMarker) ? std::getenv(kMarker) : "";
  if ((now == "unset" || now == "clean") && coretype.empty() && qkv::detail::cpu_features().avx512() &&
      !avx512_core(blas_core_name())) {
    const std::string fell_back = blas_core_name();
    setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
    setenv(kMarker, ("fallback SkylakeX (detected " + fell_back + ")").c_str(), 1);
    reexec(args);
  }
}

std::string blas_core_name() {
  const char* n = openblas_get_corename();
  return n ? n : "unknown";
}

std::string blas_env_note() {
  const char* m = std::getenv(kMarker);
  const std::string how = m == nullptr ? "environment as inherited"
                          : std::string(m) == "unset" ? "OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset"
                          : std::string(m) == "clean" ? "OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE were not set"
                                                      : std::string("OPENBLAS_CORETYPE: ") + m;
  return "openblas core: " + blas_core_name() + " (" + how + ")";
}

}  // namespace qkv::bench
