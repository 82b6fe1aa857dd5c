// Inside the audit (oracle/audit/audit.cpp), not its API: the step rebuilt from the captures
// (rebuild.cpp), the checks (checks.cpp) and the terms besides main (terms.cpp), as the step's
// orchestration and each other read them.
#pragma once
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/batch.h"
#include "core/layout.h"
#include "core/rank_capture.h"
#include "core/term.h"
#include "oracle/audit/audit.h"
#include "oracle/weights/weights.h"

namespace lossguard::oracle::audit_detail {

// rebuild.cpp: the captures of one step checked against each other (exit 2 when they contradict
// each other) and rebuilt into the batch, the layout and the loss-computing ranks.

// A global sample index -> its position in the rebuilt batch (looked up once per sample per rank).
// Global sample index -> position in the rebuilt batch: a table when the indices are dense (the
// usual 0..N-1 of a sampler), a hash map otherwise. at() throws std::out_of_range as a map's does.
class SamplePositions {
 public:
  void assign_dense(std::vector<int64_t> table) { dense_ = std::move(table); }
  void set(int64_t idx, int64_t pos) { sparse_[idx] = pos; }
  int64_t at(int64_t idx) const {
    if (!sparse_.empty()) return sparse_.at(idx);
    if (idx < 0 || idx >= static_cast<int64_t>(dense_.size()) || dense_[idx] < 0)
      throw std::out_of_range(fmt::format("sample index {} is not in the batch", idx));
    return dense_[idx];
  }

 private:
  std::vector<int64_t> dense_;  // [max index + 1], -1 where absent
  std::unordered_map<int64_t, int64_t> sparse_;
};

// A rank named for messages: its number, coordinates and file.
std::string where(const RankCapture& c);

// Metadata every capture of a step must share, and each capture's own place in the world.
void check_metadata(int64_t step, const std::vector<const RankCapture*>& all);

struct LossRanks {
  // The loss-computing ranks, one per (DP, CP) coordinate; TP peers are compared with them.
  std::map<std::pair<int64_t, int64_t>, const RankCapture*> by_coord;
  std::vector<const RankCapture*> tp_peers;
};
LossRanks loss_ranks(int64_t step, const std::vector<const RankCapture*>& all);

// 1. The global batch, by sample index; every rank that holds a sample must hold the same one.
// A dummy micro-batch's samples are not part of it: one that holds effective tokens or weight is
// a coverage problem (its loss would be dropped or counted where it must not be).
struct RebuiltBatch {
  Batch batch;
  SamplePositions position;  // global sample index -> position in the batch
  std::vector<std::string> dummy_problems;
};
RebuiltBatch rebuild_batch(int64_t step, const LossRanks& ranks);

// 2. The layout each rank trained: its micro-batches, their CP size and sub-groups.
StepLayout rebuild_layout(int64_t step, const RankCapture& first, const LossRanks& ranks,
                          const SamplePositions& position);

// checks.cpp: the checks (coverage, counts, weights, loss, stages, decision, metrics) and the
// measurement of main's weights they read.

// The first few problems of one kind, and how many there were.
struct Problems {
  std::vector<std::string> items;
  int64_t total = 0;
  void add(std::string text) {
    if (total++ < 3) items.push_back(std::move(text));
  }
  bool empty() const { return total == 0; }
  std::string text() const {
    return fmt::format("{}{}", fmt::join(items, "; "),
                       total > 3 ? fmt::format(" (and {} more)", total - 3) : "");
  }
};

// A float record that is inf or NaN, named by its place, the name formatted only then (the
// per-token loops: formatting a name for every token was a tenth of a large audit's time).
template <typename Name>
void check_finite_lazy(Problems& p, const RankCapture& c, double v, Name&& record) {
  if (!std::isfinite(v)) p.add(fmt::format("{}: {} = {}", where(c), record(), v));
}

// 3. Each loss rank's measured weights placed on the tokens it owns; the per-micro-batch counts
// and loss consistency on the way.
struct Measurement {
  std::vector<double> measured;  // [sum R] sum over ranks of token_weight · grad_scale
  std::vector<int32_t> held;     // [sum R] how many ranks hold each token
  Problems counts, loss, nonfinite_weights, nonfinite_loss;
  std::string masked_weighted;
  int64_t nan_losses = 0;  // micro-batch means over zero tokens: NaN values, zero gradients
  std::string first_nan;
  int64_t num_tokens_seen = 0;
  // Micro-batches whose num_tokens is the whole samples' count on every CP rank of a CP > 1
  // micro-batch (slime: each CP rank counts whole samples and multiplies its loss by cp, so the
  // reduced count is cp x N): consistent when num_tokens_reduced is cp x N.
  int64_t whole_sample_counts = 0;
  bool loss_seen = false, token_loss_seen = false;
  std::string term_without_loss;  // a term hooked without its token_loss: the loss sum is unknown
};

// Calls fn(t, j, p) for every response token t the rank owns in micro-batch mb, in the rank's local
// order (per sample, owned response indices ascending; j = 0, 1, ...; p the sample's position in
// the micro-batch). Returns how many it owns.
template <typename Fn>
int64_t for_owned(const RankCapture& c, const CapturedMicroBatch& mb, const AuditStep& out,
                  const SamplePositions& position, Fn&& fn) {
  const Batch& b = out.batch;
  int64_t j = 0;
  for (std::size_t p = 0; p < mb.sample_indices.size(); ++p) {
    const int64_t i = position.at(mb.sample_indices[p]);
    for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
      if (out.place.owner[t] != c.cp_rank) continue;
      fn(t, j, p);
      ++j;
    }
  }
  return j;
}

// Every loss rank's recorded weights placed on the step's tokens (each rank's AuditRank in
// out.ranks), and the finding for micro-batch means over zero tokens.
void measure_ranks(AuditStep& out, const LossRanks& ranks, const SamplePositions& position,
                   bool per_token_objective, double loss_tol, Measurement& m);

// TP peers compute the same loss: their weights must agree exactly with TP rank 0's.
std::string tp_disagreement(const LossRanks& ranks);

// Coverage: every effective token held by exactly one rank and masked tokens weighing 0 (else the
// first problem: a dummy micro-batch, the placement, the recorded batch size, a token, TP peers).
AuditCheck coverage_check(const AuditStep& out, const Measurement& m,
                          const std::vector<std::string>& placement_problems,
                          const std::vector<std::string>& dummy_problems,
                          const std::string& tp_problem, std::optional<int64_t> recorded_batch);

// Pipeline stages (SPEC §10): a stage before the last computes no loss; it must apply the scaling
// the last stage of its (DP, CP) coordinate applied and hold the count that stage reduced
// (Megatron's finalize_model_grads broadcasts it from the last stage). Judged only when PP > 1.
AuditCheck stages_check(const LossRanks& ranks, const std::vector<const RankCapture*>& all);

// The skip decision: expected from the global fixed count, identical on every rank; a stepping
// rank's norm finite, a skipping rank's 0.
AuditCheck decision_check(const AuditStep& out, const std::vector<const RankCapture*>& all);

// Metrics: every recording rank's metrics finite and normalising (SPEC §6).
AuditCheck metrics_check(const std::vector<const RankCapture*>& all);

// What the diagnosis names a ratio by: PP and B of the step, the objective, the trainer's
// declared scales on main and the function its loss comes from (capture metadata).
ScaleContext scale_context(const RankCapture& first, const ObjectiveSizes& sizes, Reduction reduce,
                           bool main);

// The presets that reproduce a step's weights, those of the trainer that wrote the captures first
// (metadata `trainer`): an HF bug is named by an HF preset before an identical Megatron one. The
// order within each group is kept. A Megatron, slime or Relax run is not explained by another
// trainer's preset (hf-ga, trl-bnpo) unless `every_trainer` (audit --explain): its own presets,
// truth and the single component changes stay.
void order_for_trainer(std::vector<std::string>& matches, const std::string& trainer,
                       bool every_trainer);

// The checks that need one weight per token (counts, weights, loss, each term's), the diagnosis and
// the contracts that reproduce the measured weights.
void weigh_step(AuditStep& out, const Measurement& m, const std::vector<const RankCapture*>& all,
                const LossRanks& ranks, const SamplePositions& position,
                const ObjectiveSizes& sizes, const AuditOptions& opt, const ContractWeights& owned,
                bool per_token_objective);

// terms.cpp: the terms besides main (SPEC §11), each weighed over its own mask from its own records
// relative to main's scale `relative_to`: their checks, diagnoses and findings in `out`.
void audit_terms(AuditStep& out, const LossRanks& ranks, const std::vector<Term>& declared,
                 const SamplePositions& position, const ObjectiveSizes& main_sizes,
                 const AuditOptions& opt, double relative_to, const PlacedTokens& placed);

}  // namespace lossguard::oracle::audit_detail
