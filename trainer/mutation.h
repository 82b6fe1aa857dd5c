// Test-only mutations of the candidate (LOSSGUARD_TEST_MUTATION), in the style of
// LOSSGUARD_INJECT_FAULT: each plants one known bug into what the candidate computes, so that the
// tests can show `check` rejecting it with the exact coordinates. Never set in production.
//
//   shift-target    the first effective row of an RL sample predicts target + 1 (mod V)
//   drop-row        the first effective owned row's gradient is never written (left 0)
//   swap-chunk      CP rank 0's first effective rows of its two chunks exchange gradients
//   scale-grad:F    the largest element of the first effective row's gradient times F
//   masked-row      the first masked row gets a gradient of 1e-3 at vocab index 0
//   sample-denom    the first sample with effective tokens is divided by m_i + 1 (sample-mean)
//   weight-token:E  the first effective token's weight times 1 + E (a planted weight error)
//   weight-sample:E every token of the first sample with effective tokens: weight times 1 + E
//   weight-rank:E   every token CP rank 0 owns: weight times 1 + E
#pragma once
#include <optional>
#include <string>

#include "core/batch.h"
#include "core/candidate_result.h"
#include "core/modes.h"

namespace lossguard::trainer {

struct Mutation {
  std::string kind;
  double factor = 1.0;
};
// The mutation $LOSSGUARD_TEST_MUTATION asks for, if any; throws InputError for an unknown one.
std::optional<Mutation> mutation_from_environment();

// The batch the candidate sees (shift-target, sample-denom); nullopt: the batch as it is.
std::optional<Batch> mutate_input(const Mutation& m, const Batch& batch);
// Each response row's weight factor (weight-*), for CandidateInput::weight_scale; empty: none.
std::vector<double> mutate_weights(const Mutation& m, const Batch& batch, int64_t cp,
                                   const ShardLayout& layout);
// Whether `m` changes the candidate's output (then the candidate's gradient is collected whole,
// mutated and only then streamed to the check).
bool mutates_output(const Mutation& m);
// After the candidate ran (drop-row, swap-chunk, scale-grad, masked-row).
void mutate_output(const Mutation& m, const Batch& batch, CandidateResult* result);

}  // namespace lossguard::trainer
