// `weights`'s result (SPEC §9, §11): every declared term weighed on the layout under its contract,
// judged relative to the main term's scale, with I5 over the layout's variations, the findings and
// the verdict, decided here once; the CLI only renders it.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "core/judgement.h"
#include "core/term.h"
#include "oracle/count/findings.h"
#include "oracle/weights/weights.h"

namespace lossguard::oracle {

// The most (terms x micro-batches) rows one weights run models: one term at --dp 2^20 x M 4.
inline constexpr double kMaxTermRows = 4194304.0;  // 2^22

struct WeightsRequest {
  std::vector<TermContract> terms;  // main first (parse_term_contracts)
  StepLayout layout;
  Split split = Split::kContiguous;
  Variations vary;
  ObjectiveSizes sizes;       // resolved (resolve_sizes)
  bool strict_scale = false;  // a uniform scale of main fails too
  bool per_token = false;     // keep every token's weight and truth (else spans of equal weights)
};

// One term weighed: its own batch (its mask), truth, contract weights, diagnosis and I5. Terms
// other than main are judged relative to main: their truth carries main's uniform scale (a policy
// term off by x2 under Adam is harmless; a KL term that is not off with it is not).
struct TermWeights {
  TermContract tc;
  std::optional<Batch> own;           // the term's batch when its mask is not the loss mask
  const Batch* step_batch = nullptr;  // else the step's
  const Batch& batch() const { return own ? *own : *step_batch; }
  std::vector<double> truth_per_sample;  // w*_t = m_t · this[i]
  std::vector<double> truth;             // per token: with per_token only
  ContractWeights got;                   // weight and place: with per_token only
  int64_t effective = 0;
  WeightDiagnosis dg;
  std::string summary;  // dg in one line a person reads (set with the verdict)
  // "as declared", its summary, or "changes with the layout (first on dp=2)" (set with the verdict)
  std::string status;
  std::vector<InvarianceResult> invariance;
  std::vector<ShardRatio> shards;
  WeightsVerdict verdict;
  ObjectiveSizes sizes;
  bool strict_scale = false;
  bool is_main() const { return tc.term.name == kMainTerm; }
};

struct WeightsResult {
  std::vector<TermWeights> terms;  // main first
  double main_scale = 1.0;         // main's uniform scale, the other terms' reference
  std::vector<Finding> findings;   // a term weighted unlike main, per term
  bool multi() const { return terms.size() > 1; }
  bool fails() const;
  Judgement judgement() const { return Judgement::verified(fails()); }
  std::string verdict_text() const;  // "pass: ...", "FAIL: ... (terms kl, mtp)"
};

// `--vary dp,microbatches,cp` or `none`; throws InputError naming a bad name.
Variations parse_variations(const std::vector<std::string>& names);

WeightsResult evaluate_weights(const Batch& batch, const WeightsRequest& request);

}  // namespace lossguard::oracle
