// Inside the effective token weights (oracle/weights/weights.h), not their API: what a contract
// reads of the masks, and its weights on a layout as owner runs, shared by contract_weights.cpp,
// diagnosis.cpp and invariance.cpp. Where samples and tokens are placed (OwnedRun, SampleSlot,
// PlacedSamples, place_sample_slots, owned_runs) is count/'s: oracle/count/token_placement.h.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/contract.h"
#include "core/layout.h"
#include "oracle/count/token_placement.h"
#include "oracle/weights/weights.h"

namespace lossguard::oracle::weights_detail {

// contract_weights.cpp: masks, factors and the weights as runs.

// The counted mask's CP-local counts of every sample on each of its zig-zag owners, per CP size:
// they depend on the sample, the CP size and the padding, not on where the sample sits, so the ten
// layouts I5 weighs share four of them instead of reading every mask byte ten times. Filled on
// first use under a lock (variations run on threads); index i·cs + owner.
struct OwnedCounts {
  std::mutex mu;
  std::map<int64_t, std::shared_ptr<const std::vector<int64_t>>> by_cp_size;
  std::optional<ShardLayout> shard;  // the geometry they were counted under
};

// What a contract reads of a batch's masks, once per batch and contract: each sample's effective
// tokens (its own mask), and the mask it counts (its own, or main's for count-of=main) with its
// sums per sample.
struct TermMasks {
  std::vector<int64_t> own_sum;                                          // [S]
  std::vector<int64_t> counted_sum;                                      // [S]
  const std::vector<uint8_t>* counted = nullptr;                         // [sum R]
  std::shared_ptr<OwnedCounts> owned = std::make_shared<OwnedCounts>();  // shared by copies
};
TermMasks term_masks(const Batch& b, const Contract& contract, const ObjectiveSizes& sizes);

// A contract on a layout, before it is spread over tokens: a token of sample i owned by static CP
// rank c in micro-batch k weighs factor[k * cp + c] · per_sample[i] when its mask is 1.
struct ContractFactors {
  std::vector<int64_t> count;  // as ContractWeights::count
  int64_t global_count = 0;
  std::vector<double> factor;      // [num_mb * cp]
  std::vector<double> per_sample;  // [S]
};

// A contract's weights on a layout as runs: per sample, its owner runs, each weighing one factor
// on its mask-1 tokens (0 outside every run). The I5 comparison walks these instead of per-token
// vectors: a variation costs a pass over the samples' runs, not over their tokens.
struct LayoutWeights {
  const StepLayout* layout = nullptr;
  PlacedSamples own;                     // when the caller gave no placement
  const PlacedSamples* given = nullptr;  // the caller's (shared by the terms)
  ContractFactors factors;
  const PlacedSamples& placed() const { return given != nullptr ? *given : own; }
};
LayoutWeights layout_weights(const Batch& b, const StepLayout& l, const Contract& contract,
                             const ObjectiveSizes& sizes, const TermMasks& masks,
                             const PlacedSamples* placed);

// A weight run of one sample: [begin, end) weighs `value` (owner -1 and 0 between runs).
struct ValueRun {
  int64_t begin = 0, end = 0;
  int16_t owner = -1;
  double value = 0.0;
};
// Sample i's value runs on w's layout, in index order (`scratch`: its owner runs); none when the
// sample is placed nowhere.
void value_runs(const Batch& b, int64_t i, const LayoutWeights& w, std::vector<OwnedRun>& scratch,
                std::vector<ValueRun>& out);

// diagnosis.cpp: weight comparison, and the diagnosis read from a contract's runs.

// Whether `a` and `b` are equal token by token within the relative tolerance `tol` (a non-finite
// weight equals nothing).
bool same_weights(const std::vector<double>& a, const std::vector<double>& b, double tol);

// The contract's weights on w's layout, read from its runs, diagnosed against the truth given as
// one weight per sample.
WeightDiagnosis diagnose_layout_weights(const Batch& b, const LayoutWeights& w,
                                        const std::vector<double>& truth_per_sample,
                                        int64_t true_count);

}  // namespace lossguard::oracle::weights_detail
