// Zig-zag context-parallel sharding (SPEC §2): which CP rank owns which response tokens of a
// sample.
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>
#include <string>

#include "core/modes.h"

namespace lossguard::oracle {

// A half-open range of loss-mask indices.
struct IndexRange {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end > begin ? end - begin : 0; }
};

// The mask indices owned by CP rank `rank` through each of its two chunks (chunk r, then 2cp-1-r).
// The owner of a response token is the rank holding the logit that predicts it (position t-1). For
// an RL sample (R < T) indices are response indices; for an SFT sample (R == T) predictor indices,
// so index T-1 is never owned. Valid for cp >= 1 (cp = 1 owns everything the two chunks cover).
inline std::array<IndexRange, 2> owned_mask_ranges(int64_t t, int64_t r, int64_t cp, int64_t rank,
                                                   int64_t cs) {
  // SPEC §2 literally: logits_k = [max(chunk.start, P-1), min(chunk.end, T-1)).
  const int64_t p = t - r;
  const bool sft = r == t;
  const int64_t chunks[2] = {rank, 2 * cp - 1 - rank};
  std::array<IndexRange, 2> out{};
  for (int k = 0; k < 2; ++k) {
    const int64_t start = chunks[k] * cs, end = (chunks[k] + 1) * cs;
    const int64_t lo = std::max(start, p - 1), hi = std::min(end, t - 1);  // logit positions
    if (lo >= hi) continue;
    // RL: the predicted tokens are lo+1 .. hi, i.e. response indices lo+1-P .. hi-P.
    out[k] = sft ? IndexRange{lo, hi} : IndexRange{lo + 1 - p, hi + 1 - p};
  }
  return out;
}

}  // namespace lossguard::oracle
