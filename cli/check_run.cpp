// `check`'s run over one step (cli/check_run.h), with a progress line on a terminal.
#include "cli/check_run.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "oracle/check/loss.h"

namespace lossguard::cli {

namespace {

// A progress line on a terminal for a check that runs over a second: cases done and rows compared.
class CheckProgress {
 public:
  CheckProgress(Context& ctx, int64_t cases, int64_t rows)
      : ctx_(ctx), cases_(cases), rows_(rows), start_(std::chrono::steady_clock::now()) {}
  void at(int64_t rows_done) {
    if (!ctx_.err_is_terminal) return;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (elapsed < 1.0) return;
    const double done =
        static_cast<double>(case_) +
        static_cast<double>(rows_done) / static_cast<double>(std::max<int64_t>(rows_, 1));
    const double total = static_cast<double>(std::max<int64_t>(cases_, 1));
    const double eta = done > 0 ? elapsed * (total - done) / done : 0.0;
    ctx_.err << fmt::format(
                    "\r\x1b[Kcheck: case {}/{}, {}/{} rows ({:.0f}%), {:.1f} s, ~{:.0f} s left",
                    case_ + 1, cases_, rows_done, rows_, 100.0 * done / total, elapsed, eta)
             << std::flush;
    shown_ = true;
  }
  void case_done() { ++case_; }
  ~CheckProgress() {
    if (shown_) ctx_.err << "\r\x1b[K" << std::flush;
  }

 private:
  Context& ctx_;
  int64_t cases_, rows_, case_ = 0;
  std::chrono::steady_clock::time_point start_;
  bool shown_ = false;
};

// Every candidate on every CP size against one (loss, reduction)'s truth.
oracle::CheckGroup run_group(const CheckPlan& plan, const Batch& b, LossSpec spec,
                             const Placement& placement, int64_t global_batch_size,
                             const std::vector<oracle::RowStats>& logits_stats,
                             CheckProgress& progress) {
  const HostArray& input = loss_input_array(b, loss_input(b, spec.loss));
  spec = oracle::with_rounding_slack(spec, input.dtype, plan.settings);
  const oracle::OracleLoss want =
      oracle::oracle_loss(b, spec, /*with_logits_grad=*/false, &logits_stats);
  oracle::CheckGroup group{spec.loss, spec.reduce,      want.input,     input.shape, input.dtype,
                           want.loss, want.denominator, want.no_signal, {}};
  Contract contract;
  if (!plan.contract.empty()) contract = parse_contract(plan.contract, spec.reduce);
  const int64_t vocab = input.shape.size() == 2 ? input.shape[1] : 1;
  for (int64_t cp : plan.cp_sizes) {
    for (trainer::Impl impl : plan.impls) {
      trainer::CandidateInput in;
      in.batch = &b;
      in.spec = spec;
      in.cp = cp;
      in.layout = plan.layout;
      in.impl = impl;
      in.device = plan.device;
      if (!plan.contract.empty()) {
        in.contract = &contract;
        in.placement = &placement;
        in.tp = plan.tp;
        in.global_batch_size = global_batch_size;
      }
      // The candidate streams its gradient into the judge block by block (SPEC §5 "Scale").
      oracle::CaseJudge judge(b, spec, want, input.dtype,
                              trainer::arithmetic_of(impl, vocab, plan.device), plan.settings,
                              [&](int64_t rows_done) { progress.at(rows_done); });
      in.sink = judge.sink();
      const trainer::CandidateOutput got = trainer::run_candidate(in);
      progress.case_done();
      group.cases.push_back({cp, mode_name(impl), impl == trainer::Impl::kTorch, got.dtype,
                             got.denominator, got.loss, got.skip_flag, judge.finish(got)});
    }
  }
  return group;
}

}  // namespace

oracle::CheckResult run_check_step(const CheckPlan& plan, const Batch& b,
                                   const Placement& placement, int64_t global_batch_size,
                                   Context& ctx) {
  oracle::CheckResult result;
  // The oracle's one pass over the logits, shared by every (loss, reduction) case.
  const std::vector<oracle::RowStats> logits_stats = oracle::oracle_logits_stats(b);
  CheckProgress progress(ctx,
                         static_cast<int64_t>(plan.losses.size() * plan.reduces.size() *
                                              plan.cp_sizes.size() * plan.impls.size()),
                         b.num_response_tokens());
  for (LossKind loss : plan.losses) {
    for (Reduction reduce : plan.reduces) {
      LossSpec spec;
      spec.loss = loss;
      spec.reduce = reduce;
      spec.policy = plan.policy;
      spec.eps_low = plan.eps_low;
      spec.eps_high = plan.eps_high;
      if (!plan.contract.empty()) spec.global_batch_size = global_batch_size;
      result.groups.push_back(
          run_group(plan, b, spec, placement, global_batch_size, logits_stats, progress));
    }
  }
  // `given` takes the dump's token_loss as the truth: it must itself be the per-token loss the
  // oracle computes from the dump's logits or log-probs.
  if (std::find(plan.losses.begin(), plan.losses.end(), LossKind::kGiven) != plan.losses.end()) {
    LossSpec spec;
    spec.eps_low = plan.eps_low;
    spec.eps_high = plan.eps_high;
    oracle::TokenLossCheck t = oracle::check_token_loss(
        b, spec, plan.settings,
        trainer::arithmetic_of(trainer::Impl::kTorch, b.logits ? b.vocab_size() : 1,
                               kernels::Device::kCpu),
        &logits_stats);
    if (t.ran) result.token_loss = std::move(t);
  }
  result.findings = oracle::check_findings(b, plan.policy, result.token_loss, &logits_stats);
  return result;
}

}  // namespace lossguard::cli
