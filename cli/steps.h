// The steps a command decides on (SPEC §1 "Steps and layout"): each optimizer step a dump holds,
// with the trainer's own layout where the dump records one, or the one step --step selects.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "cli/command.h"
#include "cli/report.h"
#include "core/batch.h"

namespace lossguard::cli {

struct StepView {
  int64_t step = 0;
  const Batch* batch = nullptr;       // the step's samples, numbered from 0
  const Placement* layout = nullptr;  // the trainer's DP x micro-batch layout; null: none
  std::string layout_source;          // "the dump's dp_shards (slime format 2)"
  int64_t global_batch_size = 0;      // as the dump states it; 0: not stated
  int64_t num_steps = 1;              // in the dump
};

// B of the sample-mean objectives: `given` (--global-batch-size) when set, else the batch's
// metadata global_batch_size, else 0 (the step's samples, resolved by the oracle).
int64_t global_batch_size_of(int64_t given, const Batch& batch);

// Runs `body` once per step (only step `only_step` when >= 0). With several steps, each step's
// text is headed "step k", its JSON results go to results()["steps"][k] with "step": k, JUnit case
// names get a "step k: " prefix, and the report's verdict is the worst step's.
void run_per_step(const Batch& batch, int64_t only_step, Report& report, Context& ctx,
                  const std::function<void(const StepView&)>& body);

}  // namespace lossguard::cli
