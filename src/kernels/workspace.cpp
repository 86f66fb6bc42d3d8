#include "kernels/workspace.hpp"

#include <memory>
#include <new>

namespace qkv::detail {

namespace {
struct AlignedFree {
  void operator()(char* p) const noexcept { ::operator delete[](p, std::align_val_t(64)); }
};
struct Buffer {
  std::unique_ptr<char[], AlignedFree> data;
  std::size_t size = 0;
};
}  // namespace

char* thread_workspace(std::size_t bytes) {
  thread_local Buffer buf;
  if (buf.size < bytes || !buf.data) {
    buf.data.reset();  // release first: never hold the old and the new buffer at once
    buf.size = 0;
    buf.data.reset(new (std::align_val_t(64)) char[bytes == 0 ? 1 : bytes]);
    buf.size = bytes;
  }
  return buf.data.get();
}

}  // namespace qkv::detail
