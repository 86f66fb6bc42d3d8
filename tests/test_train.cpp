// The trainer (qkv/train.hpp): the tasks, every parameter's gradient against central finite
// differences of the float64 specification of the loss (reference_loss), bitwise determinism
// over thread counts, that training learns, and the errors.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "qkv/error.hpp"
#include "qkv/train.hpp"

namespace {

using namespace qkv::train;

TEST(TrainTasks, RecallIsWellFormed) {
  TaskConfig t;
  t.task = Task::recall;
  t.n_keys = 6;
  t.n_values = 5;
  t.n_pairs = 4;
  t.n_queries = 3;
  const Batch b = make_batch(t, 50, 7, 3);
  ASSERT_EQ(b.T, 14);
  ASSERT_EQ(vocab_size(t), 11);
  for (std::int64_t s = 0; s < b.batch; ++s) {
    const std::int32_t* tok = b.tokens.data() + s * b.T;
    const std::int32_t* tgt = b.targets.data() + s * b.T;
    std::set<std::int32_t> keys;
    for (int i = 0; i < 4; ++i) {
      EXPECT_LT(tok[2 * i], 6);
      EXPECT_GE(tok[2 * i + 1], 6);
      EXPECT_LT(tok[2 * i + 1], 11);
      keys.insert(tok[2 * i]);
      EXPECT_EQ(tgt[2 * i], -1);
      EXPECT_EQ(tgt[2 * i + 1], -1);
    }
    EXPECT_EQ(keys.size(), 4u) << "keys must be distinct";
    std::set<std::int32_t> queried;
    for (int j = 0; j < 3; ++j) {
      const int p = 8 + 2 * j;
      const std::int32_t q = tok[p];
      queried.insert(q);
      int found = -1;
      for (int i = 0; i < 4; ++i)
        if (tok[2 * i] == q) found = i;
      ASSERT_GE(found, 0) << "the query is one of the keys";
      EXPECT_EQ(tgt[p], tok[2 * found + 1]) << "the target is the key's value";
      EXPECT_EQ(tok[p + 1], tgt[p]) << "the answer follows the query";
      EXPECT_EQ(tgt[p + 1], -1);
    }
    EXPECT_EQ(queried.size(), 3u);
  }
  // The same (seed, index) gives the same batch; another index another.
  EXPECT_EQ(make_batch(t, 50, 7, 3).tokens, b.tokens);
  EXPECT_NE(make_batch(t, 50, 7, 4).tokens, b.tokens);
}

TEST(TrainTasks, CopyIsWellFormed) {
  TaskConfig t;
  t.task = Task::copy;
  t.n_symbols = 9;
  t.n_copy = 5;
  const Batch b = make_batch(t, 20, 1, 0);
  ASSERT_EQ(b.T, 11);
  for (std::int64_t s = 0; s < b.batch; ++s) {
    const std::int32_t* tok = b.tokens.data() + s * b.T;
    const std::int32_t* tgt = b.targets.data() + s * b.T;
    EXPECT_EQ(tok[5], 9);
    for (int i = 0; i < 5; ++i) {
      EXPECT_EQ(tok[6 + i], tok[i]);
      EXPECT_EQ(tgt[i], -1);
      EXPECT_EQ(tgt[5 + i], tok[6 + i]);
    }
    EXPECT_EQ(tgt[10], -1);
    EXPECT_EQ(std::set<std::int32_t>(tok, tok + 5).size(), 5u);
  }
}

TEST(TrainTasks, Errors) {
  TaskConfig t;
  t.n_pairs = 20;  // > n_keys
  EXPECT_THROW(make_batch(t, 1, 0, 0), qkv::Error);
  try {
    check_task(t);
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("n_pairs"), std::string::npos) << e.what();
  }
  EXPECT_THROW(make_batch(TaskConfig{}, 0, 0, 0), qkv::Error);
  EXPECT_THROW(parse_task("sort"), qkv::Error);
  EXPECT_EQ(parse_task("copy"), Task::copy);
}

// A small model of two blocks after a few training steps (so the weights are not at their
// initial values), on a fresh batch.
struct Small {
  TrainConfig cfg;
  Small(Task task, double scale, int layers = 2) {
    cfg.task.task = task;
    cfg.task.n_keys = cfg.task.n_values = 4;
    cfg.task.n_pairs = 3;
    cfg.task.n_queries = 2;
    cfg.task.n_symbols = 6;
    cfg.task.n_copy = 4;
    cfg.model.d_model = 8;
    cfg.model.num_heads = 2;
    cfg.model.d_k = 4;
    cfg.model.d_ff = 12;
    cfg.model.n_layers = layers;
    cfg.model.scale = scale;
    cfg.batch = 3;
    cfg.warmup = 0;
    cfg.lr = 1e-2;
    cfg.seed = 5;
    cfg.threads = 1;
  }
};

// Tolerances. The finite differences are central, in float64, with h = 1e-6 on a loss of size
// ~2: the estimate is exact to ~1e-9 (truncation ~h^2, rounding ~1e-16 / h). The model's
// gradients are float32 through about a dozen chained float32 steps (two blocks of norm,
// attention, FFN, each with inner sizes <= 24), so their error is a few thousand units of
// float32 rounding (6e-8) relative to the tensor's largest gradient at most; measured, it is at
// most 6e-7 (printed). The bound, 1e-4 of max |grad| plus 1e-7 for all-small tensors, leaves a
// margin of over 100, while a wrong index, sign or missing term gives errors of order max |grad|.
constexpr double kFdStep = 1e-6, kRelTol = 1e-4, kAbsTol = 1e-7;

void check_gradients(Task task, double scale) {
  Small s(task, scale);
  Trainer tr(s.cfg);
  for (int i = 0; i < 5; ++i) tr.step();
  const Batch batch = make_batch(s.cfg.task, 3, 99, 0);
  Model& m = tr.model();
  m.forward_backward(batch, false, 1);
  std::vector<std::vector<double>> p64 = parameters_f64(m);
  const double l32 = m.loss(batch, 1), l64 = reference_loss(m, batch, p64);
  EXPECT_NEAR(l32, l64, 2e-6 * std::abs(l64)) << "the float32 forward against the float64 one";
  const std::vector<Param> ps = m.parameters();
  ASSERT_EQ(ps.size(), 3u + 10u * 2u + 2u);
  double worst_ratio = 0;
  for (std::size_t k = 0; k < ps.size(); ++k) {
    const float* g = ps[k].grad.data_as<const float>();
    std::vector<double>& w = p64[k];
    std::vector<double> fd(w.size());
    double gmax = 0;
    for (std::size_t i = 0; i < w.size(); ++i) {
      const double keep = w[i];
      w[i] = keep + kFdStep;
      const double lp = reference_loss(m, batch, p64);
      w[i] = keep - kFdStep;
      const double lm = reference_loss(m, batch, p64);
      w[i] = keep;
      fd[i] = (lp - lm) / (2 * kFdStep);
      gmax = std::max(gmax, std::abs(fd[i]));
    }
    // Every tensor but the embedding rows of unused tokens gets a gradient: the check means
    // something only if most gradients are not zero.
    EXPECT_GT(gmax, 1e-4) << ps[k].name;
    const double tol = kRelTol * gmax + kAbsTol;
    double worst = 0;
    int bad = 0;
    for (std::size_t i = 0; i < w.size(); ++i) {
      const double e = std::abs(g[i] - fd[i]);
      worst = std::isnan(e) ? INFINITY : std::max(worst, e);
      if (!(e <= tol) && bad++ < 3)
        ADD_FAILURE() << ps[k].name << "[" << i << "] = " << g[i] << ", finite differences " << fd[i];
    }
    EXPECT_LE(worst, tol) << ps[k].name << " (max |grad| " << gmax << ")";
    worst_ratio = std::max(worst_ratio, worst / (gmax + 1e-30));
  }
  std::printf("[ info ] %s, scale %g: worst |grad - fd| / max|grad| over tensors = %.2e\n", task_name(task), scale,
              worst_ratio);
}

TEST(TrainGradients, RecallEveryScale) {
  for (const double scale : {0.5, 1.0, 0.25}) check_gradients(Task::recall, scale);  // 1/sqrt(4), 1, 1/4
}

TEST(TrainGradients, Copy) { check_gradients(Task::copy, 0.5); }

// Losses and every weight are bitwise equal on 1 and 2 threads (attention and BLAS), with sizes
// where both split their work.
TEST(TrainDeterminism, OneAndTwoThreadsBitwise) {
  auto run = [](int threads, std::vector<double>& losses) {
    omp_set_num_threads(threads);
    TrainConfig c;
    c.model.d_model = 64;
    c.model.d_k = 64;
    c.model.num_heads = 2;
    c.model.n_layers = 2;
    c.model.scale = 0.125;
    c.batch = 16;
    c.steps = 6;
    c.threads = threads;
    Trainer tr(c);
    for (int i = 0; i < 6; ++i) {
      const StepStats st = tr.step();
      for (const double v : {st.loss, st.accuracy, st.grad_norm, st.grad_wq, st.grad_wk, st.max_weight, st.entropy,
                             st.saturated})
        losses.push_back(v);
    }
    std::vector<float> w;
    for (const Param& p : tr.model().parameters())
      w.insert(w.end(), p.value.data_as<const float>(), p.value.data_as<const float>() + p.value.numel());
    return w;
  };
  const int before = omp_get_max_threads();
  std::vector<double> l1, l2;
  const std::vector<float> w1 = run(1, l1), w2 = run(2, l2);
  omp_set_num_threads(before);
  ASSERT_EQ(l1.size(), l2.size());
  ASSERT_EQ(w1.size(), w2.size());
  EXPECT_EQ(std::memcmp(l1.data(), l2.data(), l1.size() * sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(w1.data(), w2.data(), w1.size() * sizeof(float)), 0);
  EXPECT_NE(l1[0], l1[l1.size() - 8]) << "the loss moved";
}

// The study's rows do not depend on how many runs train at once.
TEST(TrainStudy, ParallelRunsGiveTheSameRows) {
  StudyOptions o;
  o.base.task.n_pairs = 4;
  o.base.task.n_queries = 2;
  o.base.model.d_model = 16;
  o.base.model.d_ff = 32;
  o.base.batch = 4;
  o.base.steps = 5;
  o.base.threads = 1;
  o.d_k = {4, 8};
  o.seeds = {1, 2};
  std::vector<std::vector<StudyRow>> got;
  for (const int jobs : {1, 2}) {
    o.parallel_runs = jobs;
    got.push_back(run_study(o));
  }
  ASSERT_EQ(got[0].size(), 2u * 3u * 2u * 5u);
  ASSERT_EQ(got[1].size(), got[0].size());
  // Bitwise, field by field (a struct's padding bytes are not part of its value).
  auto bits = [](const std::vector<StudyRow>& rows) {
    std::vector<double> v;
    for (const StudyRow& r : rows)
      for (const double x : {r.scale, static_cast<double>(r.d_k), static_cast<double>(r.seed),
                             static_cast<double>(r.step), static_cast<double>(r.rule), r.stats.loss, r.stats.accuracy,
                             r.stats.grad_norm, r.stats.grad_wq, r.stats.grad_wk, r.stats.max_weight, r.stats.entropy,
                             r.stats.saturated})
        v.push_back(x);
    return v;
  };
  const std::vector<double> a = bits(got[0]), b = bits(got[1]);
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(double)), 0);
  EXPECT_EQ(study_csv(got[0]), study_csv(got[1]));
  o.parallel_runs = 0;
  EXPECT_THROW(run_study(o), qkv::Error);
  o.parallel_runs = 2;
  o.d_k = {4, 0};
  EXPECT_THROW(run_study(o), qkv::Error);
}

// Training learns recall with the standard scale: the loss falls from about ln(V) = ln(32) (the
// initial logits are not quite uniform) and the accuracy rises far above chance (1/16).
TEST(TrainLearning, RecallLearns) {
  TrainConfig c;
  c.model.d_k = 16;
  c.model.scale = 0.25;
  c.steps = 150;
  c.threads = 1;
  c.attention_stats = false;
  Trainer tr(c);
  StepStats first = tr.step(), last;
  for (int i = 1; i < 150; ++i) last = tr.step();
  EXPECT_NEAR(first.loss, std::log(32.0), 1.0);
  EXPECT_LT(last.loss, 0.5 * first.loss);
  EXPECT_GT(last.accuracy, 0.5);
}

TEST(TrainErrors, NamedFields) {
  TrainConfig c;
  c.lr = 0;
  EXPECT_THROW(Trainer{c}, qkv::Error);
  c = TrainConfig{};
  c.model.d_k = 0;
  try {
    Trainer tr(c);
    ADD_FAILURE() << "d_k = 0 accepted";
  } catch (const qkv::Error& e) {
    EXPECT_NE(std::string(e.what()).find("d_k"), std::string::npos) << e.what();
  }
  c = TrainConfig{};
  c.model.scale = INFINITY;
  EXPECT_THROW(Trainer{c}, qkv::Error);
  Trainer tr(TrainConfig{});
  Batch b = make_batch(TaskConfig{}, 2, 0, 0);
  b.tokens[3] = 1000;
  EXPECT_THROW(tr.model().loss(b, 1), qkv::Error);
}

}  // namespace
