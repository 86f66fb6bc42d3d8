// `qkv info`: version, CPU features, and the kernels compiled into this build.
#include <omp.h>

#include <cstdio>
#include <cstdlib>

#include "commands.hpp"
#include "qkv/info.hpp"
#include "qkv/version.hpp"

namespace qkv::cli {

void add_info(CLI::App& app) {
  auto* cmd = app.add_subcommand("info", "Print the version, CPU features and compiled kernels");
  cmd->callback([] {
    std::printf("qkv %s\n", qkv::version());
    std::printf("cpu features: %s\n", qkv::cpu_features_string().c_str());
    const char* cap = std::getenv("QKV_ISA");
    std::printf("kernel ISA: %s%s%s\n", qkv::active_isa_string().c_str(), cap ? ", capped by QKV_ISA=" : "",
                cap ? cap : "");
    std::printf("bf16 dot products: %s\n", qkv::bf16_dot_string().c_str());
    std::printf("threads (OpenMP default): %d\n", omp_get_max_threads());
    std::printf("kernels, in dispatch priority order:\n");
    for (const auto& k : qkv::compiled_kernels())
      std::printf("  %-10s %s\n", k.name.c_str(), k.description.c_str());
  });
}

}  // namespace qkv::cli
