#pragma once
// Writing a file so that a failure leaves nothing behind: every writer of qkv (.npy,
// safetensors, images, benchmark reports) goes through here.
#include <filesystem>
#include <functional>
#include <ostream>
#include <string_view>

namespace qkv::detail {

/// Writes `path` through a temporary file beside it (`<path>.tmp<pid>`) that `write` fills and
/// that is renamed over `path` only once it is complete; on any failure the temporary file is
/// removed and qkv::Error names `path` ("cannot open for writing", "write failed", "cannot
/// rename the finished file into place"). An exception thrown by `write` propagates after the
/// same clean-up.
void write_file_atomically(const std::filesystem::path& path, const std::function<void(std::ostream&)>& write);
/// The same for bytes already in memory.
void write_file_atomically(const std::filesystem::path& path, std::string_view bytes);

}  // namespace qkv::detail
