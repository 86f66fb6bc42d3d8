// The CPU as Linux describes it (/proc/cpuinfo, /sys/devices/system/cpu/cpu0/cache), for reports.
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <utility>

#include "bench_support.hpp"

namespace qkv::bench {
namespace {

std::string trim(std::string s) {
  const auto b = s.find_first_not_of(" \t\n");
  const auto e = s.find_last_not_of(" \t\n");
  return b == std::string::npos ? std::string() : s.substr(b, e - b + 1);
}

std::string read_line(const std::string& path) {
  std::ifstream f(path);
  std::string line;
  std::getline(f, line);
  return trim(line);
}

// "0-3,8" -> 5
int count_cpu_list(const std::string& list) {
  int n = 0;
  std::istringstream in(list);
  for (std::string part; std::getline(in, part, ',');) {
    const auto dash = part.find('-');
    try {
      n += dash == std::string::npos ? 1 : std::stoi(part.substr(dash + 1)) - std::stoi(part.substr(0, dash)) + 1;
    } catch (const std::exception&) {
      return 0;
    }
  }
  return n;
}

// "48K" -> 49152; "480M" -> 503316480
std::int64_t parse_size(const std::string& s) {
  if (s.empty()) return 0;
  std::int64_t v = 0;
  try {
    v = std::stoll(s);
  } catch (const std::exception&) {
    return 0;
  }
  switch (s.back()) {
    case 'K': return v << 10;
    case 'M': return v << 20;
    case 'G': return v << 30;
    default: return v;
  }
}

std::string size_text(std::int64_t bytes) {
  if (bytes >= (1 << 20) && bytes % (1 << 20) == 0) return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (1 << 10) && bytes % (1 << 10) == 0) return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " B";
}

}  // namespace

CpuDescription describe_cpu() {
  CpuDescription cpu;
  std::ifstream f("/proc/cpuinfo");
  std::set<std::pair<std::string, std::string>> cores;
  std::set<std::string> sockets;
  std::string physical;
  for (std::string line; std::getline(f, line);) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = trim(line.substr(0, colon)), value = trim(line.substr(colon + 1));
    if (key == "processor") ++cpu.logical_cpus;
    else if (key == "model name" && cpu.model.empty()) cpu.model = value;
    else if (key == "physical id") sockets.insert(physical = value);
    else if (key == "core id") cores.emplace(physical, value);
    else if (key == "flags" && (" " + value + " ").find(" hypervisor ") != std::string::npos) cpu.hypervisor = true;
  }
  cpu.cores = static_cast<int>(cores.size());
  cpu.sockets = static_cast<int>(sockets.size());
  for (int i = 0;; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    const std::string level = read_line(dir + "level");
    if (level.empty()) break;
    CpuCache c;
    c.level = std::atoi(level.c_str());
    c.type = read_line(dir + "type");
    c.bytes = parse_size(read_line(dir + "size"));
    c.shared_by = count_cpu_list(read_line(dir + "shared_cpu_list"));
    cpu.caches.push_back(c);
  }
  return cpu;
}

std::string cache_summary(const CpuDescription& cpu) {
  std::string s;
  for (const CpuCache& c : cpu.caches) {
    if (!s.empty()) s += ", ";
    s += "L" + std::to_string(c.level);
    if (c.type == "Data") s += "d";
    if (c.type == "Instruction") s += "i";
    s += " " + size_text(c.bytes);
    if (c.shared_by > 1) s += " (shared by " + std::to_string(c.shared_by) + " CPUs)";
  }
  return s.empty() ? "unknown" : s;
}

}  // namespace qkv::bench
