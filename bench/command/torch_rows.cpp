// `qkv bench --report`: PyTorch's rows. bench/torch_sdpa.py is embedded in the binary at build
// time (build_info.hpp) and run as `python -c SCRIPT --json FILE` in a child process, so the
// report needs neither the source tree nor a file next to the binary.
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "build_info.hpp"
#include "report.hpp"

extern char** environ;

namespace qkv::cli::benchcmd {

const TorchRow* TorchRun::find(std::int64_t D, std::int64_t S, bool causal, const std::string& dtype) const {
  for (const TorchRow& r : rows)
    if (r.D == D && r.S == S && r.causal == causal && r.dtype == dtype) return &r;
  return nullptr;
}

TorchRun run_torch_sdpa(const std::string& python, std::int64_t D, const std::vector<std::int64_t>& seqlens,
                        int threads, int repeats) {
  TorchRun run;
  std::string json_path = (std::filesystem::temp_directory_path() / "qkv_report_torch_XXXXXX").string();
  const int fd = mkstemp(json_path.data());
  if (fd < 0) {
    run.error = std::string("torch rows not run: no temporary file (") + std::strerror(errno) + ")";
    return run;
  }
  close(fd);
  std::string seqs;
  for (std::int64_t s : seqlens) {
    if (!seqs.empty()) seqs += ',';
    seqs += std::to_string(s);
  }
  std::vector<std::string> args = {python, "-c", kTorchSdpaScript, "--threads", std::to_string(threads),
                                   "--repeats", std::to_string(repeats), "--head-dims", std::to_string(D),
                                   "--seqlens", seqs, "--json", json_path};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, STDERR_FILENO, STDOUT_FILENO);  // its table: progress, on stderr
  std::fflush(stderr);
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, python.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  int status = 0;
  if (rc != 0) {
    run.error = "torch not importable: '" + python + "' could not be started (" + std::strerror(rc) + ")";
  } else if (waitpid(pid, &status, 0) < 0) {
    run.error = std::string("torch rows: waitpid failed (") + std::strerror(errno) + ")";
  }
  if (run.error.empty()) {
    nlohmann::json doc;
    try {
      std::ifstream f(json_path);
      doc = nlohmann::json::parse(f);
    } catch (const std::exception&) {
      doc = nlohmann::json();
    }
    if (doc.is_object() && doc.contains("error")) {
      run.error = doc["error"].get<std::string>();
    } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || !doc.is_object() || !doc.contains("rows")) {
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      // Exit status 1 without a JSON file: '-c' itself failed, e.g. an interpreter that is not
      // Python 3 or a Python too old for the script.
      run.error = "torch rows not measured: bench/torch_sdpa.py under '" + python + "' " +
                  (code >= 0 ? "exited with status " + std::to_string(code) : std::string("was killed")) +
                  (doc.is_object() ? "" : " and wrote no JSON");
    } else {
      try {
        run.version = doc.value("torch_version", "");
        run.capability = doc.value("cpu_capability", "");
        run.threads = doc.value("threads", 0);
        for (const auto& r : doc["rows"])
          run.rows.push_back({r.at("D").get<std::int64_t>(), r.at("S").get<std::int64_t>(), r.at("causal").get<bool>(),
                              r.at("dtype").get<std::string>(), r.value("backend", "unknown"),
                              r.at("forward_seconds").get<double>(), r.at("forward_backward_seconds").get<double>()});
      } catch (const std::exception& e) {
        run.rows.clear();
        run.error = std::string("torch rows not measured: unexpected JSON from bench/torch_sdpa.py (") + e.what() + ")";
      }
    }
  }
  std::error_code ec;
  std::filesystem::remove(json_path, ec);
  return run;
}

}  // namespace qkv::cli::benchcmd
