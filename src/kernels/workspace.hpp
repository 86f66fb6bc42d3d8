#pragma once
// Scratch memory of the fast kernels, kept per calling thread and reused from call to call.
#include <cstddef>

namespace qkv::detail {

/// A 64-byte aligned buffer of at least `bytes` bytes for the calling thread's current call.
/// It is the thread's own buffer, grown when a call needs more and otherwise reused, so a
/// stream of calls (decode steps, a layer's heads) does not allocate, fault in and free fresh
/// pages every time: those first touches cost more than small calls themselves. The buffer lives
/// until the thread exits and holds the largest workspace the thread has needed: O(threads x
/// tile) for flash, about 1-2 MiB at D = 128 with 2 threads; for decode also the chunk partials,
/// up to about 16 MiB for long multi-sequence calls (docs/threads.md). Valid until the next call
/// from the same thread; never shared between threads, so concurrent calls from different
/// threads do not interfere. @throws std::bad_alloc when the memory cannot be had.
char* thread_workspace(std::size_t bytes);

}  // namespace qkv::detail
