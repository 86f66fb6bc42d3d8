#pragma once
// What the MPI drivers share: agreeing on errors (a rank that refuses a call must not leave the
// others waiting in a collective) and gathering shards in one process for the simulations.
#include <mpi.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "qkv/dist.hpp"
#include "qkv/tensor.hpp"

namespace qkv::dist::detail {

/// Every rank learns whether any rank's checks failed (err non-empty): the failing rank throws
/// its own message, the others "another rank refused the call". Then checks that `values`
/// (dimensions that must agree) are equal on every rank, naming the first that is not.
void agree(MPI_Comm comm, const std::string& err, const std::vector<std::int64_t>& values,
           const std::vector<const char*>& names);

/// The rows of a [B,H,S,X] view at the positions of `segs`, concatenated, as a contiguous tensor.
Tensor gather(const TensorView& t, const std::vector<Segment>& segs);
/// Writes the rows of a contiguous local [B,H,n,X] tensor back to the positions `segs` of t.
void scatter(const TensorView& local, const std::vector<Segment>& segs, const TensorView& t);

/// Progress::thread: while it lives, a thread calls MPI_Testall on req[0..n) (yielding between
/// calls) until they complete. Destroy it before any other MPI call touches those requests.
class ProgressThread {
public:
  ProgressThread(MPI_Request* req, int n, bool on);
  ~ProgressThread();
  ProgressThread(const ProgressThread&) = delete;
  ProgressThread& operator=(const ProgressThread&) = delete;

private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

/// Seconds since an arbitrary origin (MPI_Wtime when MPI is initialised, else steady_clock).
double now();
/// CPU seconds of the calling thread.
double thread_cpu();

}  // namespace qkv::dist::detail
