// `count`'s renderers: the text table, the JSON results and the JUnit cases of one step's
// CountResult. They only read it.
#pragma once
#include <string>

#include "cli/command.h"
#include "cli/placement_options.h"
#include "oracle/count/count_result.h"

namespace lossguard::cli {

// What the report says of the layout besides the result: how it was given.
struct CountView {
  const ShardLayout* layout = nullptr;
  const CpLayoutOptions* cp_layout = nullptr;
  const oracle::Placement* placement = nullptr;  // null: no split given
  bool placement_from_dump = false;
  std::string placement_text;  // "2 DP rank(s) x 4 micro-batch(es), split contiguous"
  int64_t microbatches = 1;    // --microbatches (JSON, a split from flags)
  int64_t max_rows = 40;
};

void render_count(const oracle::CountResult& result, const Batch& batch, const CountView& view,
                  Report& report, Context& ctx);

}  // namespace lossguard::cli
