// The verdict of one `check` case (SPEC §5): a candidate's plain result against the oracle's truth,
// with the tolerances it was judged by and the reasons a person reads. The CLI only renders it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/candidate_result.h"
#include "oracle/compare.h"
#include "oracle/loss.h"

namespace lossguard::oracle {

struct CheckSettings {
  double rtol = -1.0, atol = -1.0;  // >= 0: the user's override of the derived tolerances
  bool judge_denominator = true;    // false under a contract: the trainer's own count is shown only
};

struct CheckCase {
  bool den_ok = true, loss_ok = true, flag_ok = true;
  double loss_bound = 0.0, loss_diff = 0.0;
  Tolerance tol, grad_tol;  // the loss's base tolerance and the gradient's
  GradComparison grad;
  std::vector<std::string> why;  // readable reasons and notes, worst first
  bool ok() const { return den_ok && loss_ok && grad.ok() && flag_ok; }
};

// The spec a case is computed with: ppo-clip's clip-boundary slack follows the input dtype's
// rounding (rho = exp(lp - old) and the bounds are each rounded in it: a few unit round-offs) or
// the override.
LossSpec with_rounding_slack(LossSpec spec, DType input, const CheckSettings& settings);

// Judges `got` against `want` (from oracle_loss with the same spec). `input` is the dtype of the
// loss input the candidate read (logits, log_probs or token_loss).
CheckCase evaluate_check(const Batch& batch, const LossSpec& spec, const OracleLoss& want,
                         const CandidateResult& got, DType input, const CheckSettings& settings);

}  // namespace lossguard::oracle
