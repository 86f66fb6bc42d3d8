#pragma once
/// @file error.hpp
/// The one exception type of qkv.
///
/// Every argument check happens at the public boundary (api, io, layers, CLI); kernels never
/// throw. Messages use the axis letters of docs/semantics.md and name the argument, the expected
/// and the actual value, e.g. `q: expected [B,Hq,Sq,D] with D == k.D (64), got D = 80`.

#include <stdexcept>
#include <string>

namespace qkv {

/// Thrown for invalid arguments, malformed files and unsatisfiable requests.
/// Derives from std::invalid_argument so callers may catch either.
class Error : public std::invalid_argument {
public:
  explicit Error(const std::string& what) : std::invalid_argument(what) {}
};

}  // namespace qkv
