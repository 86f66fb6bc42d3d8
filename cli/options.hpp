#pragma once
// Parsing of option values shared by several subcommands.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "qkv/attention.hpp"
#include "qkv/error.hpp"

namespace qkv::cli {

/// Parses `--window LEFT,RIGHT` (two integers; -1 = unbounded, checked by the attention op).
inline std::pair<std::int64_t, std::int64_t> parse_window(const std::string& s) {
  auto bad = [&] { return Error("--window: expected LEFT,RIGHT (integers >= -1), got '" + s + "'"); };
  const auto comma = s.find(',');
  if (comma == std::string::npos) throw bad();
  try {
    std::size_t n1 = 0, n2 = 0;
    const std::string a = s.substr(0, comma), b = s.substr(comma + 1);
    const long long l = std::stoll(a, &n1), r = std::stoll(b, &n2);
    if (n1 != a.size() || n2 != b.size()) throw bad();
    return {l, r};
  } catch (const std::logic_error&) {
    throw bad();
  }
}

/// The attention options that `attend` and `explain` share (--scale, --softcap, --causal,
/// --align top-left|bottom-right, --window LEFT,RIGHT) as AttentionParams; the rest at defaults.
template <class Options>
AttentionParams attention_params(const Options& o) {
  AttentionParams p;
  p.scale = o.scale;
  p.softcap = o.softcap;
  p.causal = o.causal;
  p.align = o.align == "top-left" ? Alignment::top_left : Alignment::bottom_right;
  if (!o.window.empty()) std::tie(p.window_left, p.window_right) = parse_window(o.window);
  return p;
}

}  // namespace qkv::cli
