// The training scaling study: the same model and data trained with each scale rule, d_k and
// seed; its CSV and its summary table. The figures are in study_plot.cpp.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <map>
#include <string>
#include <tuple>

#include "qkv/error.hpp"
#include "qkv/train.hpp"
#include "train/study_common.hpp"

namespace qkv::train {

double scale_of(ScaleRule rule, std::int64_t d_k) noexcept {
  const double d = static_cast<double>(d_k);
  switch (rule) {
    case ScaleRule::inv_sqrt_dk: return 1.0 / std::sqrt(d);
    case ScaleRule::one: return 1.0;
    case ScaleRule::inv_dk: return 1.0 / d;
  }
  return 1.0;
}

const char* scale_rule_name(ScaleRule rule) noexcept {
  switch (rule) {
    case ScaleRule::inv_sqrt_dk: return "1/sqrt(d_k)";
    case ScaleRule::one: return "1";
    case ScaleRule::inv_dk: return "1/d_k";
  }
  return "?";
}

std::vector<StudyRow> run_study(const StudyOptions& o,
                                const std::function<void(std::size_t, std::size_t, double)>& progress) {
  if (o.d_k.empty() || o.rules.empty() || o.seeds.empty())
    throw Error("study: expected at least one d_k, one scale rule and one seed");
  if (o.base.steps < 1) throw Error("study: steps: expected >= 1, got " + std::to_string(o.base.steps));
  if (o.parallel_runs < 1)
    throw Error("study: parallel_runs: expected >= 1, got " + std::to_string(o.parallel_runs));
  struct Job {
    std::int64_t d_k;
    ScaleRule rule;
    std::uint64_t seed;
  };
  std::vector<Job> jobs;
  for (const std::int64_t d_k : o.d_k)
    for (const ScaleRule rule : o.rules)
      for (const std::uint64_t seed : o.seeds) jobs.push_back({d_k, rule, seed});
  for (const Job& j : jobs) {  // every config is checked before anything runs
    TrainConfig c = o.base;
    c.model.d_k = j.d_k;
    c.model.scale = scale_of(j.rule, j.d_k);
    c.steps = 0;
    Trainer check(c);
  }
  std::vector<std::vector<StudyRow>> out(jobs.size());
  std::exception_ptr failure;
  const auto n = static_cast<std::int64_t>(jobs.size());
#pragma omp parallel for num_threads(o.parallel_runs) schedule(dynamic, 1)
  for (std::int64_t i = 0; i < n; ++i) {
    try {
      const Job& j = jobs[static_cast<std::size_t>(i)];
      const auto t0 = std::chrono::steady_clock::now();
      TrainConfig c = o.base;
      c.model.d_k = j.d_k;
      c.model.scale = scale_of(j.rule, j.d_k);
      c.seed = j.seed;
      Trainer tr(c);
      std::vector<StudyRow>& rows = out[static_cast<std::size_t>(i)];
      for (std::int64_t s = 1; s <= c.steps; ++s) rows.push_back({j.rule, c.model.scale, j.d_k, j.seed, s, tr.step()});
      const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
#pragma omp critical(qkv_train_progress)
      if (progress) progress(static_cast<std::size_t>(i), jobs.size(), sec);
    } catch (...) {
#pragma omp critical(qkv_train_failure)
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
  std::vector<StudyRow> rows;
  for (auto& r : out) rows.insert(rows.end(), r.begin(), r.end());
  return rows;
}

std::string study_csv(const std::vector<StudyRow>& rows) {
  std::string out =
      "scale_rule,scale,d_k,seed,step,loss,accuracy,max_weight,entropy,saturated_frac,grad_wq,grad_wk,grad_norm\n";
  char line[512];
  for (const StudyRow& r : rows) {
    const StepStats& s = r.stats;
    std::snprintf(line, sizeof line, "%s,%.9g,%lld,%llu,%lld,%.9g,%.9g,%.9g,%.9g,%.9g,%.9g,%.9g,%.9g\n",
                  scale_rule_name(r.rule), r.scale, static_cast<long long>(r.d_k),
                  static_cast<unsigned long long>(r.seed), static_cast<long long>(r.step), s.loss, s.accuracy,
                  s.max_weight, s.entropy, s.saturated, s.grad_wq, s.grad_wk, s.grad_norm);
    out += line;
  }
  return out;
}

namespace study_detail {

std::vector<Run> group_runs(const std::vector<StudyRow>& rows) {
  std::vector<Run> runs;
  for (const StudyRow& r : rows) {
    if (runs.empty() || runs.back().rule != r.rule || runs.back().d_k != r.d_k || runs.back().seed != r.seed)
      runs.push_back({r.rule, r.d_k, r.seed, {}});
    runs.back().steps.push_back(&r);
  }
  return runs;
}

double smoothed(const Run& run, std::size_t i, double StepStats::*field, std::size_t window) {
  const std::size_t lo = i + 1 >= window ? i + 1 - window : 0;
  double s = 0;
  for (std::size_t k = lo; k <= i; ++k) s += run.steps[k]->stats.*field;
  return s / static_cast<double>(i + 1 - lo);
}

}  // namespace study_detail

namespace {

using study_detail::Run;

std::string fmt(const char* f, double x) {
  char b[64];
  std::snprintf(b, sizeof b, f, x);
  return b;
}

// Mean of `field` over the last 10% of a run's steps (at least one).
double tail_mean(const Run& r, double StepStats::*field) {
  const std::size_t n = r.steps.size(), k = std::max<std::size_t>(1, n / 10);
  double s = 0;
  for (std::size_t i = n - k; i < n; ++i) s += r.steps[i]->stats.*field;
  return s / static_cast<double>(k);
}

std::string mean_range(const std::vector<double>& v, const char* f) {
  double s = 0;
  for (const double x : v) s += x;
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return fmt(f, s / static_cast<double>(v.size())) + " (" + fmt(f, *lo) + ".." + fmt(f, *hi) + ")";
}

}  // namespace

std::string study_summary(const std::vector<StudyRow>& rows, const StudyOptions& o) {
  const std::vector<Run> runs = study_detail::group_runs(rows);
  std::string out = "| scale | d_k | steps to accuracy " + fmt("%.2f", o.target_accuracy) +
                    " (median, min..max; reached/seeds) | final loss, mean (min..max) | final accuracy | "
                    "largest weight, step 1 -> end | saturated rows, end |\n|---|---|---|---|---|---|---|\n";
  std::map<std::tuple<std::int64_t, int>, std::vector<const Run*>> groups;
  for (const Run& r : runs) groups[{r.d_k, static_cast<int>(r.rule)}].push_back(&r);
  for (const auto& [key, rs] : groups) {
    std::vector<double> reach, loss, acc, w0, w1, sat;
    for (const Run* r : rs) {
      // The first step whose accuracy, averaged over the last 10 steps, reaches the target.
      for (std::size_t i = 0; i < r->steps.size(); ++i)
        if (study_detail::smoothed(*r, i, &StepStats::accuracy, 10) >= o.target_accuracy) {
          reach.push_back(static_cast<double>(r->steps[i]->step));
          break;
        }
      loss.push_back(tail_mean(*r, &StepStats::loss));
      acc.push_back(tail_mean(*r, &StepStats::accuracy));
      w0.push_back(r->steps.front()->stats.max_weight);
      w1.push_back(tail_mean(*r, &StepStats::max_weight));
      sat.push_back(tail_mean(*r, &StepStats::saturated));
    }
    std::string reached = "-";
    if (!reach.empty()) {
      std::sort(reach.begin(), reach.end());
      reached = fmt("%.0f", reach[reach.size() / 2]) + ", " + fmt("%.0f", reach.front()) + ".." +
                fmt("%.0f", reach.back());
    }
    reached += "; " + std::to_string(reach.size()) + "/" + std::to_string(rs.size());
    double m0 = 0, m1 = 0;
    for (std::size_t i = 0; i < w0.size(); ++i) m0 += w0[i] / static_cast<double>(w0.size());
    for (std::size_t i = 0; i < w1.size(); ++i) m1 += w1[i] / static_cast<double>(w1.size());
    out += std::string("| ") + scale_rule_name(rs.front()->rule) + " | " + std::to_string(std::get<0>(key)) + " | " +
           reached + " | " + mean_range(loss, "%.3f") + " | " + mean_range(acc, "%.2f") + " | " + fmt("%.2f", m0) +
           " -> " + fmt("%.2f", m1) + " | " + mean_range(sat, "%.2f") + " |\n";
  }
  return out;
}

}  // namespace qkv::train
