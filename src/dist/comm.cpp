#include "dist/comm.hpp"

#include <time.h>

#include <chrono>
#include <cstring>

#include "qkv/error.hpp"

namespace qkv::dist::detail {

void agree(MPI_Comm comm, const std::string& err, const std::vector<std::int64_t>& values,
           const std::vector<const char*>& names) {
  int bad = err.empty() ? 0 : 1, any = 0;
  MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, comm);
  if (bad) throw Error(err);
  if (any) throw Error("dist: another rank of the communicator refused the call (its error names the argument)");
  std::vector<std::int64_t> lo(values), hi(values);
  const int n = static_cast<int>(values.size());
  MPI_Allreduce(values.data(), lo.data(), n, MPI_INT64_T, MPI_MIN, comm);
  MPI_Allreduce(values.data(), hi.data(), n, MPI_INT64_T, MPI_MAX, comm);
  for (int i = 0; i < n; ++i)
    if (lo[static_cast<std::size_t>(i)] != hi[static_cast<std::size_t>(i)])
      throw Error(std::string(names[static_cast<std::size_t>(i)]) + ": expected the same value on every rank, got values from " +
                  std::to_string(lo[static_cast<std::size_t>(i)]) + " to " + std::to_string(hi[static_cast<std::size_t>(i)]));
}

namespace {
// Copies rows [s0, s0 + n) of every (b, h) between a strided [B,H,S,X] view and a contiguous
// [B,H,nl,X] tensor at row r0.
void copy_rows(const TensorView& view, std::int64_t s0, char* local, std::int64_t nl, std::int64_t r0, std::int64_t n,
               bool to_local) {
  const std::int64_t es = static_cast<std::int64_t>(dtype_size(view.dtype())), X = view.size(3);
  for (std::int64_t b = 0; b < view.size(0); ++b)
    for (std::int64_t h = 0; h < view.size(1); ++h)
      for (std::int64_t s = 0; s < n; ++s) {
        char* g = static_cast<char*>(view.data()) + (b * view.stride(0) + h * view.stride(1) + (s0 + s) * view.stride(2)) * es;
        char* l = local + (((b * view.size(1) + h) * nl) + r0 + s) * X * es;
        if (to_local) std::memcpy(l, g, static_cast<std::size_t>(X * es));
        else std::memcpy(g, l, static_cast<std::size_t>(X * es));
      }
}
}  // namespace

Tensor gather(const TensorView& t, const std::vector<Segment>& segs) {
  std::int64_t n = 0;
  for (const Segment& s : segs) n += s.length;
  Tensor out(t.dtype(), {t.size(0), t.size(1), n, t.size(3)});
  std::int64_t r = 0;
  for (const Segment& s : segs) {
    copy_rows(t, s.start, static_cast<char*>(out.data()), n, r, s.length, true);
    r += s.length;
  }
  return out;
}

void scatter(const TensorView& local, const std::vector<Segment>& segs, const TensorView& t) {
  std::int64_t r = 0;
  for (const Segment& s : segs) {
    copy_rows(t, s.start, static_cast<char*>(local.data()), local.size(2), r, s.length, false);
    r += s.length;
  }
}

double now() {
  int init = 0;
  MPI_Initialized(&init);
  if (init) return MPI_Wtime();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

ProgressThread::ProgressThread(MPI_Request* req, int n, bool on) {
  if (!on) return;
  thread_ = std::thread([this, req, n] {
    int done = 0;
    while (!stop_.load(std::memory_order_relaxed) && !done) {
      MPI_Testall(n, req, &done, MPI_STATUSES_IGNORE);
      std::this_thread::yield();
    }
  });
}

ProgressThread::~ProgressThread() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
}

double thread_cpu() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

}  // namespace qkv::dist::detail
