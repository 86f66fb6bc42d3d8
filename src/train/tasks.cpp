// The training tasks, generated from a seed (tensor/random.hpp: the same data on any standard
// library). Each batch has its own stream, mix(seed, index), so batch i never depends on how many
// batches were drawn before it.
#include <numeric>
#include <random>
#include <string>

#include "qkv/error.hpp"
#include "qkv/train.hpp"
#include "tensor/random.hpp"

namespace qkv::train {
using detail::Rng;
using detail::mix;

Task parse_task(const std::string& name) {
  if (name == "recall") return Task::recall;
  if (name == "copy") return Task::copy;
  throw Error("task: expected 'recall' or 'copy', got '" + name + "'");
}

const char* task_name(Task task) noexcept { return task == Task::recall ? "recall" : "copy"; }

std::int64_t vocab_size(const TaskConfig& t) {
  return t.task == Task::recall ? t.n_keys + t.n_values : t.n_symbols + 1;
}

std::int64_t seq_len(const TaskConfig& t) {
  return t.task == Task::recall ? 2 * (t.n_pairs + t.n_queries) : 2 * t.n_copy + 1;
}

namespace {
void need(bool ok, const std::string& field, const std::string& want, std::int64_t got) {
  if (!ok) throw Error("task: " + field + ": expected " + want + ", got " + std::to_string(got));
}
}  // namespace

void check_task(const TaskConfig& t) {
  constexpr std::int64_t kMax = 1 << 20;
  if (t.task == Task::recall) {
    need(t.n_keys >= 1 && t.n_keys <= kMax, "n_keys", "1 .. 2^20", t.n_keys);
    need(t.n_values >= 1 && t.n_values <= kMax, "n_values", "1 .. 2^20", t.n_values);
    need(t.n_pairs >= 1 && t.n_pairs <= t.n_keys, "n_pairs", "1 .. n_keys (" + std::to_string(t.n_keys) + ")",
         t.n_pairs);
    need(t.n_queries >= 1 && t.n_queries <= t.n_pairs,
         "n_queries", "1 .. n_pairs (" + std::to_string(t.n_pairs) + ")", t.n_queries);
  } else {
    need(t.n_symbols >= 1 && t.n_symbols <= kMax, "n_symbols", "1 .. 2^20", t.n_symbols);
    need(t.n_copy >= 1 && t.n_copy <= t.n_symbols, "n_copy", "1 .. n_symbols (" + std::to_string(t.n_symbols) + ")",
         t.n_copy);
  }
}

Batch make_batch(const TaskConfig& t, std::int64_t batch, std::uint64_t seed, std::uint64_t index) {
  check_task(t);
  if (batch < 1 || batch > (1 << 20)) throw Error("batch: expected 1 .. 2^20, got " + std::to_string(batch));
  Batch b;
  b.batch = batch;
  b.T = seq_len(t);
  b.tokens.assign(static_cast<std::size_t>(batch * b.T), 0);
  b.targets.assign(b.tokens.size(), -1);
  Rng rng(mix(seed, index));
  std::vector<std::int32_t> perm;
  for (std::int64_t s = 0; s < batch; ++s) {
    std::int32_t* tok = b.tokens.data() + s * b.T;
    std::int32_t* tgt = b.targets.data() + s * b.T;
    if (t.task == Task::recall) {
      const auto nk = static_cast<std::int32_t>(t.n_keys);
      perm.resize(static_cast<std::size_t>(nk));
      std::iota(perm.begin(), perm.end(), 0);
      rng.shuffle_prefix(perm, t.n_pairs);  // the first n_pairs entries: distinct keys
      std::vector<std::int32_t> val(static_cast<std::size_t>(t.n_pairs));
      for (std::int64_t i = 0; i < t.n_pairs; ++i) {
        val[static_cast<std::size_t>(i)] = nk + static_cast<std::int32_t>(rng.below(t.n_values));
        tok[2 * i] = perm[static_cast<std::size_t>(i)];
        tok[2 * i + 1] = val[static_cast<std::size_t>(i)];
      }
      std::vector<std::int32_t> which(static_cast<std::size_t>(t.n_pairs));
      std::iota(which.begin(), which.end(), 0);
      rng.shuffle_prefix(which, t.n_queries);  // distinct queried pairs
      for (std::int64_t j = 0; j < t.n_queries; ++j) {
        const std::int64_t p = 2 * t.n_pairs + 2 * j;
        const auto i = static_cast<std::size_t>(which[static_cast<std::size_t>(j)]);
        tok[p] = perm[i];
        tok[p + 1] = val[i];
        tgt[p] = val[i];  // at the query, predict its value
      }
    } else {
      const auto ns = static_cast<std::int32_t>(t.n_symbols);
      perm.resize(static_cast<std::size_t>(ns));
      std::iota(perm.begin(), perm.end(), 0);
      rng.shuffle_prefix(perm, t.n_copy);
      const std::int64_t n = t.n_copy;
      for (std::int64_t i = 0; i < n; ++i) tok[i] = tok[n + 1 + i] = perm[static_cast<std::size_t>(i)];
      tok[n] = ns;  // the separator
      // Position p predicts token p + 1: from the separator on, every next token is a copy.
      for (std::int64_t p = n; p < 2 * n; ++p) tgt[p] = tok[p + 1];
    }
  }
  return b;
}

}  // namespace qkv::train
