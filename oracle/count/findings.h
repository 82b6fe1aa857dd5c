// Findings: facts about a batch worth a person's attention that are not input errors (NaN/Inf, T =
// 0, an SFT mask that is not pre-shifted). Reported in text and JSON; they do not change the exit
// code.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/judgement.h"
#include "oracle/math/row_math.h"

namespace lossguard::oracle {

struct Finding {
  std::string kind;     // stable identifier: "non_finite", "zero_length_sample",
                        // "sft_mask_not_preshifted", ...
  std::string message;  // one readable line
  nlohmann::json detail = nlohmann::json::object();
};

// What `inspect` reports of a batch: each sample's class and mask sum, the samples per kind, the
// effective tokens, the samples without effective tokens or SFT, each recorded step's effective
// tokens, and the findings.
struct BatchSummary {
  std::vector<SampleClass> classes;
  std::vector<int64_t> mask_sums;
  int64_t kinds[3] = {0, 0, 0};  // by SampleKind: rl, sft, empty
  int64_t effective_tokens = 0;
  std::vector<int64_t> empty_responses, fully_masked, sft;
  std::vector<int64_t> step_effective_tokens;  // per batch.steps
  std::vector<Finding> findings;
  // A batch of samples with no effective token: a trainer must skip optimizer.step() (SPEC §7).
  bool must_skip() const { return effective_tokens == 0 && !classes.empty(); }
};
BatchSummary summarize_batch(const Batch& batch);

// SPEC §8: a batch without samples verifies nothing (exit 4). samples_judgement says so;
// require_samples throws it as UnverifiedError before a command starts its work.
inline constexpr const char* kNoSamplesReason = "the dumps hold no samples";
Judgement samples_judgement(const Batch& batch);
void require_samples(const Batch& batch);

// Relax before PR #285 took a sample's targets as tokens[-R:], which for R = 0 is all T tokens: one
// finding naming the samples with R = 0 and T > 0, if there are any.
std::vector<Finding> legacy_slicing_findings(const Batch& batch);

// NaN/Inf in float fields (first `max_reported` with coordinates, then a count), samples with T =
// 0, SFT samples whose last mask entry is 1. With `logits_stats` (oracle_logits_stats of this
// batch), only the logits rows it flags non_finite are read, instead of a pass over all of them.
std::vector<Finding> batch_findings(const Batch& batch, std::size_t max_reported = 20,
                                    const std::vector<RowStats>* logits_stats = nullptr);

}  // namespace lossguard::oracle
