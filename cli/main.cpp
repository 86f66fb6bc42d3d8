// The qkv command: attention on files, a demo, the steps explained, text generation, the
// attention layer, benchmarks, machine information, and training a small model.
#include <cstdio>
#include <exception>
#include <iostream>
#include <string>

#include "commands.hpp"
#include "qkv/error.hpp"

namespace {
// One line on stderr, whatever the message holds.
int fail(const std::string& msg) {
  std::string line = msg;
  for (char& c : line)
    if (c == '\n' || c == '\r') c = ' ';
  std::fprintf(stderr, "qkv: error: %s\n", line.c_str());
  return 2;
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"qkv: exact, fast scaled dot-product attention"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("qkv ") + QKV_VERSION);
  qkv::cli::add_attend(app);
  qkv::cli::add_demo(app);
  qkv::cli::add_explain(app);
  qkv::cli::add_generate(app);
  qkv::cli::add_info(app);
  qkv::cli::add_mha(app);
  qkv::cli::add_bench(app);
  qkv::cli::add_train(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    return fail(e.what());
  } catch (const qkv::Error& e) {
    return fail(e.what());
  } catch (const std::bad_alloc&) {
    return fail("out of memory");
  } catch (const std::exception& e) {
    return fail(e.what());
  }
  return 0;
}
