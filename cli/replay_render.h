// `replay`'s renderers: the text report (outcomes grouped by rank sets), the metrics line, the SVG
// rank grid, the JSON results and the JUnit cases of one step. They only read the result.
#pragma once
#include <optional>
#include <string>

#include "cli/command.h"
#include "cli/replay_run.h"

namespace lossguard::cli {

void render_replay(const ReplayRun& run, const std::optional<oracle::ReplayMetrics>& metrics,
                   const Batch& batch, const ReplayOptions& options, Report& report, Context& ctx);

}  // namespace lossguard::cli
