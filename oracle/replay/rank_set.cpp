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

}  // namespace lossguard::oracle
