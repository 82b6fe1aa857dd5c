// What both trainer implementations share, free of LibTorch and of kernel code (only the kernels'
// inline chunk-size rule): the trainer's own zig-zag split, by token positions and independent of
// the ownership rule of SPEC §2, and its loss coefficients from the counts each implementation
// computes its own way.
#pragma once
#include <cstdint>
#include <vector>

#include "core/batch.h"
#include "core/modes.h"

namespace lossguard::trainer {

struct OwnedRow {
  int64_t row;  // global response row
  int64_t sample;
  int8_t chunk;  // which of the owner's two chunks
};

struct ShardPlan {
  std::vector<std::vector<OwnedRow>> owned;  // per CP rank
  std::vector<int32_t> row_rank;             // per response row: owner (-1: none)
  std::vector<int8_t> row_chunk;
};

// Rank r holds token positions [r*cs, (r+1)*cs) and [(2cp-1-r)*cs, (2cp-r)*cs); the logit at
// position q predicts token q+1. Throws InputError when a row would have two owners.
ShardPlan plan_shards(const Batch& batch, int64_t cp, const ShardLayout& layout);

// The trainer's denominators from per-sample effective-token counts m_i (summed over CP ranks) and
// the fixed count n_fixed (their sum), under the spec's policy and reduction.
struct TrainerDenominators {
  int64_t denominator = 0;           // what the trainer reports (N, B, K or L_norm)
  int64_t n = 0;                     // the per-token count after the policy
  double cp_scale = 1.0;             // slime multiplies the per-token loss by cp
  std::vector<int64_t> m;            // per sample
  std::vector<double> sample_denom;  // d_i per sample: the dump's own, else m_i (SPEC §3)
  int64_t k_nonempty = 0;
  double batch_size = 1.0, l_norm = 1.0;
};
TrainerDenominators trainer_denominators(const Batch& batch, const LossSpec& spec, int64_t cp,
                                         std::vector<int64_t> m, int64_t n_fixed);

// c_t for a token of `sample` with mask weight w: loss = sum_t c_t l_t.
double token_coefficient(const TrainerDenominators& d, const LossSpec& spec, int64_t sample,
                         double w);

}  // namespace lossguard::trainer
