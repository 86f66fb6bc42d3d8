#pragma once
// Writing a file so that a failure leaves nothing behind: every writer of qkv (.npy,
// safetensors, images, benchmark reports) goes through here.
#include <filesystem>
#include <functional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

namespace qkv::detail {

/// Writes `path` through a temporary file beside it (`<path>.tmp<pid>`) that `write` fills and
/// that is renamed over `path` only once it is complete; on any failure the temporary file is
/// removed and qkv::Error names `path` ("cannot open for writing", "write failed", "cannot
/// rename the finished file into place"). An empty path or one that names a directory is refused
/// before `write` runs. An exception thrown by `write` propagates after the same clean-up.
void write_file_atomically(const std::filesystem::path& path, const std::function<void(std::ostream&)>& write);
/// The same for bytes already in memory.
void write_file_atomically(const std::filesystem::path& path, std::string_view bytes);

/// Several output files of one command as one: add() has `write` fill a staging file beside the
/// path (`.<name>.part<pid><extension>`; any writer that takes a path, such as write_npy), and commit()
/// renames every staging file over its path once all of them are complete. A failure in add()
/// (an empty path or one that names a directory included, refused before `write` runs) removes
/// the staging files and leaves every path as it was (a file already there is kept), as does
/// destroying the set before commit(); its qkv::Error reads "<what>: <path>: <reason>". Only a
/// rename failing inside commit() (after every file is complete) can leave some paths replaced
/// and others not.
class AtomicFileSet {
 public:
  AtomicFileSet() = default;
  AtomicFileSet(const AtomicFileSet&) = delete;
  AtomicFileSet& operator=(const AtomicFileSet&) = delete;
  ~AtomicFileSet();
  /// `what` names the output in errors (a command-line flag, say). Not after commit().
  void add(const std::string& what, const std::filesystem::path& path,
           const std::function<void(const std::filesystem::path& staging)>& write);
  void commit();
  /// The paths added, in order.
  std::vector<std::filesystem::path> paths() const;

 private:
  struct File {
    std::string what;
    std::filesystem::path staging, path;
  };
  void discard() noexcept;
  std::vector<File> files_;
  bool committed_ = false;
};

}  // namespace qkv::detail
