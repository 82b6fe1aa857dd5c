// Data placement (SPEC §7): a global batch split over DP ranks, then into micro-batches.
#pragma once
#include <cstdint>
#include <string>
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

// Dynamic batch size (slime and Relax --use-dynamic-batch-size --max-tokens-per-gpu): each DP
// rank's samples, in order, cut into micro-batches of at most `max_tokens` total tokens (a sample
// longer than that alone). DP ranks may then hold different numbers of micro-batches.
Placement pack_by_tokens(const Placement& placement, const std::vector<int64_t>& total_lengths,
                         int64_t max_tokens);

// What keeps a placement from being a partition of samples 0..S-1: "sample 3 is placed twice (DP
// rank 1 micro-batch 0 again)", "sample 5 is placed nowhere", an index out of range.
std::vector<std::string> placement_problems(const Placement& placement, int64_t num_samples);

// Relax's dynamic CP (SPEC §2, `dynamic_cp_split_data`): for micro-batch index k, cp_k is the
// smallest power of two >= ceil(max T / max_tokens_per_gpu) over every DP rank's micro-batch k
// (the MAX all-reduce over DP), at most static_cp, then doubled while static_cp / cp_k exceeds the
// smallest sample count of micro-batch k over DP ranks. Each micro-batch is then trained by
// static_cp / cp_k sub-groups, its samples dealt by sequence length (longest first, to the
// sub-group with the fewest tokens so far: a balanced partition; any partition gives the same N).
StepLayout dynamic_cp_layout(const std::vector<int64_t>& total_lengths, const Placement& placement,
                             int64_t static_cp, int64_t max_tokens_per_gpu);

}  // namespace lossguard::oracle
