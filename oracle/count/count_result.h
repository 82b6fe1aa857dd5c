// `count`'s result (SPEC §2, §3): every sample's owned counts per CP size under a policy, the
// global denominators, invariants I1-I4 and the verdict, decided here once; the CLI only renders
// it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/judgement.h"
#include "core/layout.h"
#include "oracle/count/denominators.h"
#include "oracle/count/findings.h"
#include "oracle/count/placement.h"

namespace lossguard::oracle {

// The CP sizes counted: the requested ones sorted and unique, with 1 added (I1 compares against the
// unsharded count) when it was not requested. Throws InputError on a size below 1.
struct CountSizes {
  std::vector<int64_t> cp_sizes;
  bool cp1_requested = true;  // false: cp_sizes[0] = 1 is counted but not reported
};
CountSizes count_sizes(std::vector<int64_t> requested);

struct CountRequest {
  Policy policy = Policy::kFixed;
  CountSizes sizes;
  ShardLayout layout;
  const Placement* placement = nullptr;  // the DP x micro-batch split I3 recounts; null: none
  // One per CP size where a token's owner depends on its micro-batch (all-gather, dynamic CP);
  // empty: zig-zag owners, a function of the sample alone.
  std::vector<StepLayout> step_layouts;
};

struct CountResult {
  Policy policy = Policy::kFixed;
  CountSizes sizes;
  OwnedCounts counts;
  std::vector<SampleClass> classes;  // per counted sample
  std::vector<uint8_t> straddles;    // per counted sample: tokens on more than one CP rank
  std::vector<int64_t> empty, fully_masked, sft, straddling;  // global sample indices
  std::vector<int64_t> denominators;                          // N per CP size (sizes.cp_sizes)
  std::vector<InvariantResult> invariants;
  std::vector<Finding> findings;

  // What `rank` of CP size c counts for counted sample k under the policy.
  int64_t rank_count(std::size_t c, std::size_t k, int64_t rank) const {
    return policy_rank_count(policy, counts.count(c, k, rank), counts.mask_sums[k],
                             sizes.cp_sizes[c]);
  }
  // Whether CP size c is reported (1 is counted for I1 even when not requested).
  bool reported(std::size_t c) const { return sizes.cp_sizes[c] != 1 || sizes.cp1_requested; }
  bool ok() const;                                           // every invariant holds
  bool verified() const { return !counts.samples.empty(); }  // SPEC §8: else nothing verified
  Judgement judgement() const;  // nothing verified without samples, else failed unless ok()
};

// Counts, denominators and invariants of one step; a placement that is not a partition breaks I3.
CountResult evaluate_count(const Batch& batch, const CountRequest& request);

}  // namespace lossguard::oracle
