// Data placement (SPEC §7): a global batch split over DP ranks, then into micro-batches.
#pragma once
#include <cstdint>
#include <vector>

#include "core/layout.h"
#include "core/modes.h"

namespace lossguard::oracle {

using lossguard::Placement;  // core/layout.h

// Splits samples 0..S-1 over `dp` ranks (contiguous: the first S % dp ranks take one more, as
// numpy.array_split; round-robin: sample i to rank i % dp), then each rank's samples into
// `microbatches` contiguous micro-batches the same way.
Placement place_samples(int64_t num_samples, int64_t dp, int64_t microbatches, Split split);

// Each shard (a trainer's per-rank dump) is one DP rank's samples: shard_of_sample[i] is sample i's
// rank.
Placement place_shards(const std::vector<int>& shard_of_sample, int64_t num_shards,
                       int64_t microbatches);

}  // namespace lossguard::oracle
