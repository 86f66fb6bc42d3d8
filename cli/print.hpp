#pragma once
// Small helpers to print labelled matrices on a terminal.
#include <cstdio>
#include <string>
#include <vector>

namespace qkv::cli {

/// Prints a rows x cols row-major matrix with optional row and column labels.
inline void print_matrix(const std::string& title, const double* m, int rows, int cols,
                         const std::vector<std::string>& row_labels = {},
                         const std::vector<std::string>& col_labels = {}, int precision = 3) {
  std::printf("%s\n", title.c_str());
  const int w = precision + 6;
  std::printf("%8s", "");
  for (int c = 0; c < cols; ++c)
    std::printf(" %*s", w, c < static_cast<int>(col_labels.size()) ? col_labels[c].c_str() : std::to_string(c).c_str());
  std::printf("\n");
  for (int r = 0; r < rows; ++r) {
    std::printf("%8s", r < static_cast<int>(row_labels.size()) ? row_labels[r].c_str() : std::to_string(r).c_str());
    for (int c = 0; c < cols; ++c) std::printf(" %*.*f", w, precision, m[r * cols + c]);
    std::printf("\n");
  }
  std::printf("\n");
}

}  // namespace qkv::cli
