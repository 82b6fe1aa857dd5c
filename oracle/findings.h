// Findings: facts about a batch worth a person's attention that are not input errors (NaN/Inf, T =
// 0, an SFT mask that is not pre-shifted). Reported in text and JSON; they do not change the exit
// code.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/batch.h"
#include "oracle/row_math.h"

namespace lossguard::oracle {

struct Finding {
  std::string kind;     // stable identifier: "non_finite", "zero_length_sample",
                        // "sft_mask_not_preshifted", ...
  std::string message;  // one readable line
  nlohmann::json detail = nlohmann::json::object();
};

// The one classification of a sample that every report uses (SPEC §1): what kind of response it
// has, and whether it is an SFT sample (R == T) whose mask is pre-shifted.
enum class SampleClass { kRl, kTZero, kEmptyResponse, kFullyMasked };
struct SampleNote {
  SampleClass cls = SampleClass::kRl;
  bool sft = false;
  bool sft_not_preshifted =
      false;  // its last mask entry is 1: counted at CP = 1, never owned at CP > 1
  std::string text()
      const;  // "T = 0", "empty response", "fully masked", "SFT", "SFT, mask not pre-shifted"
};
SampleNote classify_sample(const Batch& batch, int64_t sample, int64_t mask_sum);

// Relax before PR #285 took a sample's targets as tokens[-R:], which for R = 0 is all T tokens: one
// finding naming the samples with R = 0 and T > 0, if there are any.
std::vector<Finding> legacy_slicing_findings(const Batch& batch);

// NaN/Inf in float fields (first `max_reported` with coordinates, then a count), samples with T =
// 0, SFT samples whose last mask entry is 1. With `logits_stats` (oracle_logits_stats of this
// batch), only the logits rows it flags non_finite are read, instead of a pass over all of them.
std::vector<Finding> batch_findings(const Batch& batch, std::size_t max_reported = 20,
                                    const std::vector<RowStats>* logits_stats = nullptr);

}  // namespace lossguard::oracle
