#include "io/atomic_file.hpp"

#include <unistd.h>

#include <fstream>
#include <string>
#include <system_error>

#include "qkv/error.hpp"

namespace qkv::detail {
namespace {

// A target that cannot become a file, refused before anything is written: renaming a finished
// file over a directory fails only at the end, after the other files of a set are in place. (A
// symbolic link is replaced by the rename, wherever it points, so it is not followed here.)
void check_target(const std::filesystem::path& path) {
  if (path.empty()) throw Error("expected a file path, got ''");
  std::error_code ec;
  if (std::filesystem::is_directory(std::filesystem::symlink_status(path, ec)))
    throw Error(path.string() + ": is a directory");
}

}  // namespace

void write_file_atomically(const std::filesystem::path& path, const std::function<void(std::ostream&)>& write) {
  check_target(path);
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

AtomicFileSet::~AtomicFileSet() {
  if (!committed_) discard();
}

void AtomicFileSet::discard() noexcept {
  std::error_code ec;
  for (const File& f : files_) std::filesystem::remove(f.staging, ec);
  files_.clear();
}

void AtomicFileSet::add(const std::string& what, const std::filesystem::path& path,
                        const std::function<void(const std::filesystem::path& staging)>& write) {
  try {
    check_target(path);
  } catch (const Error& e) {
    discard();
    throw Error(what + ": " + e.what());
  }
  // Hidden, beside the path, with its extension (writers that choose a format by it still do).
  std::string name = ".";
  name += path.filename().string();
  name += ".part";
  name += std::to_string(::getpid());
  name += path.extension().string();
  const std::filesystem::path staging = path.parent_path() / name;
  files_.push_back({what, staging, path});
  try {
    write(staging);
  } catch (const Error& e) {
    // The writer names the staging file; the user named the path.
    std::string msg = e.what();
    const std::string s = staging.string();
    for (std::size_t at = msg.find(s); at != std::string::npos; at = msg.find(s, at + path.string().size()))
      msg.replace(at, s.size(), path.string());
    discard();
    throw Error(what + ": " + msg);
  } catch (...) {
    discard();
    throw;
  }
}

void AtomicFileSet::commit() {
  std::error_code ec;
  for (std::size_t i = 0; i < files_.size(); ++i) {
    std::filesystem::rename(files_[i].staging, files_[i].path, ec);
    if (ec) {
      const File f = files_[i];
      files_.erase(files_.begin(), files_.begin() + static_cast<std::ptrdiff_t>(i));  // those are in place
      discard();
      throw Error(f.what + ": " + f.path.string() + ": cannot rename the finished file into place");
    }
  }
  committed_ = true;
}

std::vector<std::filesystem::path> AtomicFileSet::paths() const {
  std::vector<std::filesystem::path> v;
  for (const File& f : files_) v.push_back(f.path);
  return v;
}

}  // namespace qkv::detail
