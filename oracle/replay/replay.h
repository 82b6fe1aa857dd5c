// The skip decision of a step replayed over a topology (SPEC §7): the simulator of every rank's
// program (oracle/replay/replay_program.h) over simulated collectives, the verdict and findings
// from the ranks' outcomes (shared with the real backends), and the last stage's loss metric.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/judgement.h"
#include "oracle/count/findings.h"
#include "oracle/replay/rank_set.h"
#include "oracle/replay/replay_program.h"
#include "oracle/replay/replay_protocol.h"

namespace lossguard::oracle {

struct ReplayResult {
  std::vector<RankResult> ranks;
  bool expected_skip = false;
  std::string expected_reason;  // "no effective tokens", "non-finite gradient on rank(s) 3", ""
  int64_t global_tokens = 0;
  bool fault = false;           // an error, block or mismatch
  bool wrong_decision = false;  // some rank decided differently from the expected decision
  std::vector<Finding> findings;
  bool ok() const { return !fault && !wrong_decision; }
  // A rank that reached a decision other than the expected one.
  bool decided_wrong(const RankResult& r) const { return r.skip && *r.skip != expected_skip; }
  // What a failing case names: the ranks with a wrong outcome (drift, a lost step, a non-finite or
  // unsynced step: the findings' rank sets, "; "-joined), and the ranks that faulted.
  std::string wrong_decision_message() const;
  std::string fault_message() const;
};

// Called for each collective a rank issues that reaches the backend (torch.distributed rejected it
// otherwise), in the simulator's event order: what a Flight Recorder would record.
using IssueObserver = std::function<void(int64_t rank, const CollectiveCall& call)>;
ReplayResult simulate(const ReplayInputs& in, const IssueObserver& on_issue = {});
// Verdict and findings from per-rank results (shared by the simulator and real backends).
ReplayResult summarize(const ReplayInputs& in, std::vector<RankResult> ranks);

// The last stage's reported loss metric, values = [denominator, loss numerator] (SPEC §6): the
// global token count under per-token, the global batch size under sample-mean; the numerator from
// the batch's `token_loss` (or -log_probs). nullopt when the batch has neither field.
std::optional<std::vector<double>> loss_metric_values(const Batch& batch, ReduceMode reduce,
                                                      int64_t global_tokens);

// The last stage's loss metric as the trainer reports it (SPEC §6): its values, the normalised
// loss, or the fail-fast error that makes the step a distributed fault (a non-zero numerator over a
// zero denominator).
struct ReplayMetrics {
  std::vector<double> values;
  double loss = 0.0;  // normalised
  bool no_signal = false;
  std::string error;  // non-empty: the trainer fails fast
  bool faults() const { return !error.empty(); }
  std::vector<Finding> findings() const;  // metrics_fail_fast when it faults
};
// nullopt when the batch has neither token_loss nor log_probs.
std::optional<ReplayMetrics> replay_metrics(const Batch& batch, ReduceMode reduce,
                                            int64_t global_tokens);

// A replayed step's judgement: nothing verified without samples; a fault when a rank errored,
// blocked or mismatched or the metric fails fast; failed when a rank decided wrong.
Judgement replay_judgement(const Batch& batch, const ReplayResult& result,
                           const std::optional<ReplayMetrics>& metrics);

}  // namespace lossguard::oracle
