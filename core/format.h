// Small text formatters the reports of every layer share: index lists ("3, 7, 12") and rank sets
// ("0-3, 8-11", "ranks 0-3, 8"). Plain text from plain integers: they need nothing of the oracle.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lossguard {

// "3, 7, 12" (the first `max_shown`, then "... (N in all)").
std::string format_index_list(const std::vector<int64_t>& v, std::size_t max_shown = 12);

// "0-3, 8-11" / "0-4094 step 2": rank lists compressed into arithmetic runs.
std::string format_rank_set(const std::vector<int64_t>& sorted_ranks, std::size_t max_runs = 8);

// "rank 3", "ranks 0-3, 8": a rank set in a sentence ("none" when empty).
std::string ranks_phrase(const std::vector<int64_t>& sorted_ranks, std::size_t max_runs = 8);

}  // namespace lossguard
