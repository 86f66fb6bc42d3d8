#pragma once
// One function per subcommand: each registers its options on the app and sets the callback
// that runs it. A callback throws qkv::Error on bad input; main() turns that into exit 2.
#include <CLI/CLI.hpp>

namespace qkv::cli {
void add_attend(CLI::App& app);
void add_demo(CLI::App& app);
void add_explain(CLI::App& app);
void add_generate(CLI::App& app);
void add_info(CLI::App& app);
void add_mha(CLI::App& app);
void add_bench(CLI::App& app);
void add_train(CLI::App& app);
}  // namespace qkv::cli
