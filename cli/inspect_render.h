// `inspect`'s renderers: each dump's fields, the per-sample table, the totals and listed samples,
// the recorded steps, the findings and the JSON results. They only read the batch and its summary.
#pragma once
#include <cstdint>

#include "cli/command.h"
#include "cli/inputs.h"
#include "oracle/count/findings.h"

namespace lossguard::cli {

void render_inspect(const LoadedBatch& loaded, const oracle::BatchSummary& summary,
                    int64_t max_rows, Report& report, Context& ctx);

}  // namespace lossguard::cli
