// Small text formatters the reports of every layer share (core/format.h).
#include "core/format.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace lossguard {

std::string format_index_list(const std::vector<int64_t>& v, std::size_t max_shown) {
  std::string s;
  for (std::size_t k = 0; k < v.size() && k < max_shown; ++k)
    s += (k ? ", " : "") + std::to_string(v[k]);
  if (v.size() > max_shown) s += fmt::format(", ... ({} in all)", v.size());
  return s;
}

std::string format_rank_set(const std::vector<int64_t>& r, std::size_t max_runs) {
  std::vector<std::string> runs;
  std::size_t i = 0, shown = 0;
  while (i < r.size()) {
    std::size_t j = i + 1;
    if (j < r.size()) {
      const int64_t step = r[j] - r[i];
      while (j + 1 < r.size() && r[j + 1] - r[j] == step) ++j;
      if (j - i + 1 >= 3) {
        if (shown < max_runs) {
          runs.push_back(step == 1 ? fmt::format("{}-{}", r[i], r[j])
                                   : fmt::format("{}-{} step {}", r[i], r[j], step));
        }
        ++shown;
        i = j + 1;
        continue;
      }
    }
    if (shown < max_runs) runs.push_back(std::to_string(r[i]));
    ++shown;
    ++i;
  }
  std::string s = fmt::format("{}", fmt::join(runs, ", "));
  if (shown > max_runs) s += ", ...";
  return s;
}

std::string ranks_phrase(const std::vector<int64_t>& sorted_ranks, std::size_t max_runs) {
  if (sorted_ranks.empty()) return "none";
  return fmt::format("{} {}", sorted_ranks.size() == 1 ? "rank" : "ranks",
                     format_rank_set(sorted_ranks, max_runs));
}

}  // namespace lossguard
