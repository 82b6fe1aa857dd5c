// The verdict of one `check` case (SPEC §5): a candidate's plain result against the oracle's truth,
// with the tolerances it was judged by and the reasons a person reads. The CLI only renders it.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/candidate_result.h"
#include "core/judgement.h"
#include "oracle/check/compare.h"
#include "oracle/check/grad_stream.h"
#include "oracle/check/loss.h"
#include "oracle/count/findings.h"

namespace lossguard::oracle {

struct CheckSettings {
  std::optional<double> rtol, atol;  // the user's override of the derived tolerances
  // The candidate trains under a normalisation contract (check --contract): its own count is shown,
  // not judged (slime's full-sample count is cp·N by design); its loss and gradient say whether the
  // tokens are weighted right.
  bool under_contract = false;
  // What the user states the dump's token_loss is (--token-loss-is): then it must be that loss of
  // the dump's inputs. Unstated, token_loss may hold any per-token loss (a KL or entropy term
  // added, SPEC §4, §11): whether it is the nll or ppo-clip loss is a finding, not a failure.
  std::optional<LossKind> token_loss_is;
};

struct CheckCase {
  bool den_ok = true, loss_ok = true, flag_ok = true;
  double loss_bound = 0.0, loss_diff = 0.0;
  // The loss bound from the per-dtype defaults, and the one derived from the candidate's
  // arithmetic (-1: none); loss_bound is the smaller.
  double loss_bound_default = 0.0, loss_bound_derived = -1.0;
  Tolerance tol, grad_tol;  // the loss's base tolerance and the gradient's
  // The element bounds the gradient was judged by: [0] the defaults', [1] the derived one if any.
  std::vector<ElementBound> grad_bounds;
  GradComparison grad;
  std::vector<std::string> why;  // readable reasons and notes, worst first
  // From logits with the default tolerances, each gradient element's absolute slack is |c| u + half
  // the smallest subnormal (c its token's weight), not atol.
  bool atol_scaled_by_weight = false;
  bool ok() const { return den_ok && loss_ok && grad.ok() && flag_ok; }
};

// The spec a case is computed with: ppo-clip's clip-boundary slack follows the input dtype's
// rounding (rho = exp(lp - old) and the bounds are each rounded in it: a few unit round-offs) or
// the override.
LossSpec with_rounding_slack(LossSpec spec, DType input, const CheckSettings& settings);

// One case judged while the candidate runs: its tolerances are fixed first (the per-dtype defaults
// and, when the candidate's arithmetic is known and no --rtol/--atol is given, the tighter bounds
// derived from that arithmetic: check.cpp), the candidate streams its gradient into sink(), and
// finish() gives the verdict. `input` is the dtype of the loss input the candidate read.
class CaseJudge {
 public:
  CaseJudge(const Batch& batch, const LossSpec& spec, const OracleLoss& want, DType input,
            const Arithmetic& arithmetic, const CheckSettings& settings,
            std::function<void(int64_t rows_done)> progress = {});
  GradSink sink() { return stream_->sink(); }
  CheckCase finish(const CandidateResult& got);

 private:
  const Batch& b_;
  const LossSpec& spec_;
  const OracleLoss& want_;
  CheckCase c_;
  bool judge_denominator_ = true;
  std::unique_ptr<GradStream> stream_;
};

// The dump's own per-token `token_loss` against the oracle's per-token losses (SPEC §5): on every
// token with mask 1 it should be the nll (from logits, else -log_probs) or the ppo-clip loss (when
// log_probs, old_log_probs and advantages are there). A token_loss 10% too large used to pass
// `check --loss given`, which takes it as the truth.
struct TokenLossCheck {
  bool ran = false;     // the dump has token_loss, and logits or log_probs
  std::string matches;  // "nll", "ppo-clip", or "" when it matches neither
  int64_t checked = 0;  // tokens with mask 1
  int64_t mismatched_nll = 0;
  int64_t mismatched_ppo = -1;     // -1: the ppo-clip loss cannot be computed from this dump
  GradLocation worst;              // the worst token against the closer of the two (vocab_index -1)
  std::optional<LossKind> stated;  // settings.token_loss_is
  // Judged only against what the user stated; otherwise `matches` is reported, never failed.
  bool judged() const { return ran && stated.has_value(); }
  bool ok() const {
    if (!judged()) return true;
    return *stated == LossKind::kNll ? mismatched_nll == 0 : mismatched_ppo == 0;
  }
};
// `trainer`: how the dump's trainer is assumed to have computed token_loss from logits (its error
// is allowed on top of the dtype's tolerance; see derive_bounds).
TokenLossCheck check_token_loss(const Batch& batch, const LossSpec& spec,
                                const CheckSettings& settings, const Arithmetic& trainer,
                                const std::vector<RowStats>* logits_stats = nullptr);

// A TokenLossCheck that is not judged and matches neither loss: a finding (a KL, entropy or other
// term?); none otherwise.
std::vector<Finding> token_loss_findings(const TokenLossCheck& check);
// "; worst: sample 3, response index 1: token_loss 1.1, oracle 1" when the check fails, else "".
std::string token_loss_worst_text(const TokenLossCheck& check);

// One case of `check`: a candidate on a CP size, what it computed, and the judge's verdict.
struct CheckCaseResult {
  int64_t cp = 1;
  std::string impl;          // "torch", "kernels"
  bool default_impl = true;  // the LibTorch candidate (case names carry no [impl])
  std::string dtype;         // the candidate's working dtype
  int64_t denominator = 0;   // the candidate's
  double loss = 0.0;         // the candidate's
  std::optional<bool> skip;  // the kernels' device zero-token flag; none: not computed
  CheckCase verdict;
};
// The cases of one (loss, reduction): the oracle's truth once, each candidate against it.
struct CheckGroup {
  LossKind loss = LossKind::kNll;
  Reduction reduce = Reduction::kPerToken;
  LossInput input = LossInput::kLogits;
  std::vector<int64_t> input_shape;
  DType input_dtype = DType::kFloat32;
  double want_loss = 0.0;
  int64_t want_denominator = 0;
  bool no_signal = false;  // zero effective tokens: loss and gradient must be exactly 0
  std::vector<CheckCaseResult> cases;
};
// A check of one step: every group, the token_loss check when `given` was among the losses, and
// the findings in the order they are reported.
struct CheckResult {
  std::vector<CheckGroup> groups;
  std::optional<TokenLossCheck> token_loss;  // set when it ran
  std::vector<Finding> findings;
  bool ok() const;
  Judgement judgement() const { return Judgement::verified(!ok()); }
};
// The findings of a checked step, in report order: legacy response slicing (policy legacy), the
// token_loss finding, then the batch's own (batch_findings).
std::vector<Finding> check_findings(const Batch& batch, Policy policy,
                                    const std::optional<TokenLossCheck>& token_loss,
                                    const std::vector<RowStats>* logits_stats);

// The same for a candidate whose whole gradient is in got.grad (tests, small batches).
CheckCase evaluate_check(const Batch& batch, const LossSpec& spec, const OracleLoss& want,
                         const CandidateResult& got, DType input, const CheckSettings& settings,
                         const Arithmetic& arithmetic = {});

}  // namespace lossguard::oracle
