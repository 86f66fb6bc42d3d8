#pragma once
// A call's work items on an OpenMP team, or on the calling thread alone.
//
// A team of one thread still passes libgomp's barriers, and each ends in a futex wake-up system
// call: three per small attention call (B = H = S = 1, D = 8), a third of its 1.6 us. A call
// given one thread therefore runs its body on the calling thread, whose loops are plain loops;
// a call given more forms a team, whose loops are OpenMP worksharing loops (each ending in its
// implicit barrier). Either way the body is compiled once, and every item is computed the same:
// results never depend on which was taken.
#include <cstdint>

#include <omp.h>

namespace qkv::detail {

/// The loops of a team body: `dynamic` shares items out one at a time, `fixed` in equal ranges;
/// both return when every item is done. thread() is this thread's index in the team.
struct TeamLoops {
  bool team;
  int thread() const noexcept { return team ? omp_get_thread_num() : 0; }
  template <class F>
  void dynamic(std::int64_t n, F&& f) const {
    if (!team) {
      for (std::int64_t i = 0; i < n; ++i) f(i);
      return;
    }
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t i = 0; i < n; ++i) f(i);
  }
  template <class F>
  void fixed(std::int64_t n, F&& f) const {
    if (!team) {
      for (std::int64_t i = 0; i < n; ++i) f(i);
      return;
    }
#pragma omp for schedule(static)
    for (std::int64_t i = 0; i < n; ++i) f(i);
  }
};

/// body(const TeamLoops&) on a team of `threads` threads, or on this thread when threads <= 1.
template <class Body>
void run_team(int threads, Body&& body) {
  if (threads <= 1) {
    body(TeamLoops{false});
    return;
  }
#pragma omp parallel num_threads(threads)
  body(TeamLoops{true});
}

}  // namespace qkv::detail
