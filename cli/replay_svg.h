// An SVG of the rank grid (pipeline stages x ranks within a stage), coloured by replay outcome.
#pragma once
#include <string>

#include "oracle/replay/replay.h"

namespace lossguard::cli {

std::string replay_svg(const oracle::ReplayInputs& in, const oracle::ReplayResult& result,
                       const std::string& title);

}  // namespace lossguard::cli
