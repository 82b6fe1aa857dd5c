// Rank sets as people write them: --nan-ranks "3,5-7". Reports' "0-3, 8-11" / "0-4094 step 2" are
// core/format.h's format_rank_set and ranks_phrase.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace lossguard::oracle {

// --nan-ranks: "3,5-7" -> {3, 5, 6, 7}; throws InputError naming a rank outside [0, world).
std::vector<int64_t> parse_rank_list(const std::string& text, int64_t world);

}  // namespace lossguard::oracle
