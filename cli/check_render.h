// `check`'s renderers: the text table, the JSON results and the JUnit cases of one step's
// oracle::CheckResult. They only read it.
#pragma once
#include <string>
#include <vector>

#include "cli/check_run.h"
#include "cli/command.h"
#include "oracle/check/check.h"

namespace lossguard::cli {

// The run as the user asked for it (names as given).
struct CheckView {
  const CheckPlan* plan = nullptr;
  std::vector<std::string> impl_names;
  std::string device_name;
  std::string token_loss_is;  // --token-loss-is as given; "" none
};

// The heading, printed before the cases run (an error while they run follows it).
void render_check_heading(const Batch& batch, const CheckView& view, std::ostream& out);
void render_check(const oracle::CheckResult& result, const CheckView& view, Report& report,
                  Context& ctx);

}  // namespace lossguard::cli
