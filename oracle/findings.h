// Findings: facts about a batch worth a person's attention that are not input errors (NaN/Inf, T =
// 0, an SFT mask that is not pre-shifted). Reported in text and JSON; they do not change the exit
// code.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/batch.h"

namespace lossguard::oracle {

struct Finding {
  std::string kind;     // stable identifier: "non_finite", "zero_length_sample",
                        // "sft_mask_not_preshifted", ...
  std::string message;  // one readable line
  nlohmann::json detail = nlohmann::json::object();
};

// NaN/Inf in float fields (first `max_reported` with coordinates, then a count), samples with T =
// 0, SFT samples whose last mask entry is 1.
std::vector<Finding> batch_findings(const Batch& batch, std::size_t max_reported = 20);

}  // namespace lossguard::oracle
