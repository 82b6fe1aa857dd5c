// `check`'s run over one step: every (loss, reduction), CP size and candidate, each judged by the
// oracle as it streams its gradient, gathered into an oracle::CheckResult. Wiring only: the
// verdicts are oracle/check/check.h's.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "cli/command.h"
#include "core/batch.h"
#include "core/contract.h"
#include "kernels/device.h"
#include "oracle/check/check.h"
#include "trainer/candidate.h"

namespace lossguard::cli {

struct CheckPlan {
  Policy policy = Policy::kFixed;
  std::vector<LossKind> losses;
  std::vector<Reduction> reduces;
  std::vector<int64_t> cp_sizes;
  std::vector<trainer::Impl> impls;
  kernels::Device device = kernels::Device::kCpu;
  ShardLayout layout;
  double eps_low = 0.2, eps_high = 0.2;
  oracle::CheckSettings settings;  // tolerances, token_loss_is
  std::string contract;            // empty: the candidate normalises by the policy
  int64_t tp = 1;
};

// `placement` and `global_batch_size` are the step's (used under a contract).
oracle::CheckResult run_check_step(const CheckPlan& plan, const Batch& batch,
                                   const Placement& placement, int64_t global_batch_size,
                                   Context& ctx);

}  // namespace lossguard::cli
