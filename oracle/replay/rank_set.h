// Rank sets as people write them: --nan-ranks "3,5-7", and reports' "0-3, 8-11" / "0-4094 step 2".
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lossguard::oracle {

// --nan-ranks: "3,5-7" -> {3, 5, 6, 7}; throws InputError naming a rank outside [0, world).
std::vector<int64_t> parse_rank_list(const std::string& text, int64_t world);

// "0-3, 8-11" / "0-4094 step 2": rank lists compressed into arithmetic runs.
std::string format_rank_set(const std::vector<int64_t>& sorted_ranks, std::size_t max_runs = 8);

// "rank 3", "ranks 0-3, 8": a rank set in a sentence ("none" when empty).
std::string ranks_phrase(const std::vector<int64_t>& sorted_ranks, std::size_t max_runs = 8);

}  // namespace lossguard::oracle
