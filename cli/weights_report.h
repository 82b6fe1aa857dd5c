// Reports of a weight diagnosis (weights, audit): its JSON, and an SVG of the weight ratio w/w* per
// micro-batch (rows) and CP rank (columns): a per-micro-batch or per-rank normalisation bug shows
// as a striped picture at a glance.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/contract.h"
#include "core/layout.h"
#include "oracle/weights/weights.h"

namespace lossguard::cli {

// The diagnosis as SPEC §8's JSON: kind, scale, named, ratios, worst token (null when exact).
nlohmann::ordered_json diagnosis_json(const oracle::WeightDiagnosis& diagnosis);

std::string weights_svg(const StepLayout& layout, const std::vector<oracle::ShardRatio>& shards,
                        const std::string& summary, const Contract& contract);

}  // namespace lossguard::cli
