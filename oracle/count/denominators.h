// Token denominators (SPEC §3): per-sample, per-CP-rank effective token counts, the three counting
// policies, global denominators and invariants I1-I4, exactly, as integers.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/layout.h"
#include "oracle/count/cp_shard.h"
#include "oracle/count/placement.h"

namespace lossguard::oracle {

// Owned effective-token counts under the ownership rule, for every sample and CP size. cp = 1
// counts m_i (an unsharded trainer sums the whole mask).
struct OwnedCounts {
  std::vector<int64_t> cp_sizes;
  std::vector<int64_t> samples;    // the global sample indices counted, in order
  std::vector<int64_t> mask_sums;  // m_i, per counted sample
  std::vector<std::vector<int64_t>>
      per_rank;  // per_rank[c][k * cp + r]: counted sample k on rank r
  int64_t count(std::size_t c, std::size_t k, int64_t rank) const {
    return per_rank[c][k * static_cast<std::size_t>(cp_sizes[c]) + static_cast<std::size_t>(rank)];
  }
};

// One pass over each sample's mask. `samples` null: every sample of the batch.
OwnedCounts count_owned_tokens(const Batch& batch, const std::vector<int64_t>& cp_sizes,
                               const ShardLayout& layout,
                               const std::vector<int64_t>* samples = nullptr);

// The same counts from a per-token formulation on one step layout per CP size (layouts[c] has
// CP size cp_sizes[c]): every token's owner (place_tokens: zig-zag or all-gather, static or
// dynamic CP), summed per sample and static CP rank. Needed where a token's owner depends on its
// micro-batch, not on its sample alone. `problems` gets samples placed twice or nowhere.
OwnedCounts count_owned_tokens(const Batch& batch, const std::vector<StepLayout>& layouts,
                               std::vector<std::string>* problems);

// What rank r of a CP group of size cp counts for a sample under `policy` (SPEC §3 table).
int64_t policy_rank_count(Policy policy, int64_t owned, int64_t mask_sum, int64_t cp);
// The per-rank counts of `policy` summed over the CP group, divided by cp under `slime` (whose
// per-token loss is multiplied by cp), so that every policy's value is comparable with m_i.
int64_t effective_sample_count(Policy policy, const OwnedCounts& counts, std::size_t c,
                               std::size_t k);
// N: the SUM of the per-rank counts over the CP group and the counted samples (the DP×CP group and
// micro-batches when the samples are a whole global batch).
int64_t global_denominator(Policy policy, const OwnedCounts& counts, std::size_t c);

struct InvariantResult {
  std::string name;   // "I1".."I4"
  std::string title;  // "CP-consistency"
  bool ok = true;
  std::string detail;  // readable; on failure names the samples responsible and by how much
  nlohmann::json data = nlohmann::json::object();
};

// I1-I4 under `policy` (counts must include cp = 1). `placement` (may be null) is the DP x
// micro-batch split recounted independently for I3.
std::vector<InvariantResult> check_invariants(const Batch& batch, const OwnedCounts& counts,
                                              Policy policy, const ShardLayout& layout,
                                              const Placement* placement);

}  // namespace lossguard::oracle
