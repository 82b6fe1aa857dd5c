// The coefficient of every owned token's loss under a normalisation contract (SPEC §9), computed
// the way a trainer computes it: rank by rank, micro-batch by micro-batch, each CP rank counting
// the rows it owns (plan_shards), the counts all-reduced as the contract says, then the scales
// applied. Independent of oracle/weights/contract_weights.cpp (which works sample by sample from
// the ownership rule).
#pragma once
#include <cstdint>
#include <vector>

#include "core/batch.h"
#include "core/contract.h"
#include "core/layout.h"
#include "trainer/shard_plan.h"

namespace lossguard::trainer {

struct ContractRun {
  const Contract* contract = nullptr;
  const Placement* placement = nullptr;  // [dp][mb] -> samples
  int64_t tp = 1;
  int64_t global_batch_size = 0;  // B; 0: the batch's samples
  double l_norm = 0.0;            // 0: the longest response
};

struct ContractCoefficients {
  std::vector<double> coeff;  // [sum R]: loss = sum_t coeff_t * l_t over the whole step
  int64_t global_count = 0;   // the contract's counts summed over every rank and micro-batch
};

// `plan` is the split at CP size `cp` (every micro-batch of the step trained at that size).
ContractCoefficients contract_coefficients(const Batch& batch, const ShardPlan& plan, int64_t cp,
                                           const ContractRun& run);

}  // namespace lossguard::trainer
