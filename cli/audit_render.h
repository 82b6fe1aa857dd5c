// `audit`'s renderers: each step's checks, the contracts that reproduce its weights, its findings,
// JSON and JUnit cases, and the SVG of the first step's measured ratios. They only read the result:
// every verdict, ratio and sentence is the library's (oracle::audit_captures).
#pragma once
#include <string>

#include "cli/command.h"
#include "oracle/audit/audit.h"

namespace lossguard::cli {

// `explain`: a step whose weights are exact also lists every preset its weights match (on a failure
// the presets that reproduce the measured weights are always listed).
void render_audit(const oracle::AuditResult& result, bool explain, const std::string& svg_path,
                  Report& report, Context& ctx);

}  // namespace lossguard::cli
