// Rank sets as people write them (oracle/replay/rank_set.h).
#include "oracle/replay/rank_set.h"

#include <fmt/format.h>

#include <algorithm>
#include <string>

#include "core/errors.h"

namespace lossguard::oracle {

std::vector<int64_t> parse_rank_list(const std::string& text, int64_t world) {
  std::vector<int64_t> ranks;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(pos, end - pos);
    long long lo = 0, hi = 0;
    char extra = 0;
    if (std::sscanf(item.c_str(), "%lld-%lld%c", &lo, &hi, &extra) == 2) {
    } else if (std::sscanf(item.c_str(), "%lld%c", &lo, &extra) == 1) {
      hi = lo;
    } else {
      throw_input_error("--nan-ranks: '{}' is not a rank or a range A-B (in '{}')", item, text);
    }
    if (lo < 0 || hi >= world || lo > hi) {
      throw_input_error("--nan-ranks: '{}' is outside the world's ranks 0-{}", item, world - 1);
    }
    for (long long r = lo; r <= hi; ++r) ranks.push_back(r);
    pos = end + 1;
  }
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  return ranks;
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

}  // namespace lossguard::oracle
