// `topo`'s renderer: the rank table (rank, coordinates, its pipeline's last rank) and every group,
// as text (the first --max-rows ranks, eight groups a kind) and in the JSON results (all of them).
#pragma once
#include <cstdint>

#include "cli/command.h"
#include "oracle/replay/topology.h"

namespace lossguard::cli {

void render_topo(const oracle::Topology& t, int64_t max_rows, Report& report, Context& ctx);

}  // namespace lossguard::cli
