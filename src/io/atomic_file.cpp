#include "io/atomic_file.hpp"

#include <unistd.h>

#include <fstream>
#include <string>

#include "qkv/error.hpp"

namespace qkv::detail {

void write_file_atomically(const std::filesystem::path& path, const std::function<void(std::ostream&)>& write) {
  std::filesystem::path tmp = path;
  tmp += ".tmp" + std::to_string(::getpid());
  std::error_code ec;
  try {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    if (!f) throw Error(path.string() + ": cannot open for writing");
    write(f);
    f.flush();
    if (!f) throw Error(path.string() + ": write failed");
  } catch (...) {
    std::filesystem::remove(tmp, ec);
    throw;
  }
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ec);
    throw Error(path.string() + ": cannot rename the finished file into place");
  }
}

void write_file_atomically(const std::filesystem::path& path, std::string_view bytes) {
  write_file_atomically(path, [&](std::ostream& f) { f.write(bytes.data(), static_cast<std::streamsize>(bytes.size())); });
}

}  // namespace qkv::detail
