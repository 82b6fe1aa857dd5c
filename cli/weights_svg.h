// An SVG of the weight ratio w/w* per micro-batch (rows) and CP rank (columns): a per-micro-batch
// or per-rank normalisation bug shows as a striped picture at a glance.
#pragma once
#include <string>
#include <vector>

#include "core/contract.h"
#include "core/layout.h"
#include "oracle/weights.h"

namespace lossguard::cli {

std::string weights_svg(const StepLayout& layout, const std::vector<oracle::ShardRatio>& shards,
                        const oracle::WeightDiagnosis& diagnosis, const Contract& contract);

}  // namespace lossguard::cli
