// `weights`'s renderers: the text report, the JSON results, the JUnit cases and the SVG of one
// step's oracle::WeightsResult. They only read it.
#pragma once
#include <string>
#include <vector>

#include "cli/command.h"
#include "oracle/weights/weights_result.h"

namespace lossguard::cli {

// How the run was asked for, as the report shows it.
struct WeightsView {
  const StepLayout* layout = nullptr;
  std::string layout_source;  // "flags", "the dumps: one per DP rank", the dump's own
  Split split = Split::kContiguous;
  std::vector<std::string> vary_names;  // --vary as given
  bool per_token = false;
  int64_t step = 0;      // the step number the JSON carries
  std::string svg_path;  // "" none
};

void render_weights(const oracle::WeightsResult& result, const Batch& batch,
                    const WeightsView& view, Report& report, Context& ctx);

}  // namespace lossguard::cli
