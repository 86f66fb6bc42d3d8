#pragma once
/// @file version.hpp
/// Library version.
namespace qkv {
/// The library version, "MAJOR.MINOR.PATCH".
const char* version() noexcept;
}  // namespace qkv
