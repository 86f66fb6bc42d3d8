#pragma once
// What the study's summary (study.cpp) and its figures (study_plot.cpp) share: the rows of one
// run, grouped, and a trailing moving average.
#include <cstdint>
#include <vector>

#include "qkv/train.hpp"

namespace qkv::train::study_detail {

// The rows of one (rule, d_k, seed) run, in step order.
struct Run {
  ScaleRule rule;
  std::int64_t d_k;
  std::uint64_t seed;
  std::vector<const StudyRow*> steps;
};

// Consecutive rows of equal (rule, d_k, seed) as runs (run_study's order).
std::vector<Run> group_runs(const std::vector<StudyRow>& rows);

// Mean of `field` over steps i - window + 1 .. i of a run (fewer at the start).
double smoothed(const Run& run, std::size_t i, double StepStats::*field, std::size_t window);

}  // namespace qkv::train::study_detail
