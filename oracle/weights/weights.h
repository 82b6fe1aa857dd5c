// Effective token weights (SPEC §9): the weight w_t with which each token's loss enters the
// gradient the optimizer applies, as the objective says (truth) and as a contract gives it on a
// layout; the diagnosis of their ratio; split invariance (I5). Weights are ratios of integer
// counts, computed in double; "equal" means within kWeightRelTol.
//
// Shared parameters:
//   batch    the step's samples (masks, lengths)
//   layout   where each sample was computed: DP rank, micro-batch, CP size and sub-group
//   (core/layout.h) reduce   the objective (SPEC §4); fixes the true weights sizes    B (global
//   batch size in samples, as the trainer counts it) and L_norm
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/contract.h"
#include "core/layout.h"
#include "oracle/count/token_placement.h"
#include "oracle/weights/scale_names.h"

namespace lossguard::oracle {

inline constexpr double kWeightRelTol = 1e-12;

struct ObjectiveSizes {
  int64_t global_batch_size = 0;  // B; 0: the number of samples of the step
  double l_norm = 0.0;            // seq-mean-token-sum-norm; 0: the largest response length
  // A loss term's batch (SPEC §11) carries the term's mask; a contract with count-of=main counts
  // under the main term's mask instead: this one, [sum R] (null: the batch's own mask).
  const std::vector<uint8_t>* main_mask = nullptr;
};
// B and L_norm with their defaults resolved.
ObjectiveSizes resolve_sizes(const Batch& batch, ObjectiveSizes sizes);

// w*_t per response token (mask index), [sum R].
std::vector<double> true_weights(const Batch& batch, Reduction reduce, const ObjectiveSizes& sizes);
// The same as one weight per sample, [S]: w*_t = m_t · (this)[i] (0 for a sample without effective
// tokens).
std::vector<double> true_sample_weights(const Batch& batch, Reduction reduce,
                                        const ObjectiveSizes& sizes);
// Per-sample weights spread over the tokens: w_t = m_t · per_sample[i], [sum R].
std::vector<double> per_token_weights(const Batch& batch, const std::vector<double>& per_sample);

struct ContractWeights {
  std::vector<double> weight;  // [sum R]
  TokenPlace place;
  // Each rank's count per micro-batch as the contract counts it: count[mb * cp + c] for
  // layout.microbatches[mb] on static CP rank c; and their sum over every rank and micro-batch.
  std::vector<int64_t> count;
  int64_t global_count = 0;
  std::vector<std::string> problems;  // a sample placed twice or not at all (coverage)
};

// Throws InputError when the layout cannot hold the batch (a sample index out of range). `placed`:
// place_tokens(batch, layout) when the caller has it (loss terms of one step share it).
ContractWeights contract_weights(const Batch& batch, const StepLayout& layout,
                                 const Contract& contract, const ObjectiveSizes& sizes,
                                 const PlacedTokens* placed = nullptr);

// Where a token sits, for reports.
struct TokenCoord {
  int64_t sample = -1, response_index = -1, dp_rank = -1, microbatch = -1, cp_rank = -1;
  double got = 0.0, want = 0.0, ratio = 0.0;
  int64_t unit_tokens =
      0;  // effective tokens in the unit the diagnosis names (rank, micro-batch, ...)
};

// The uniform scales s an optimizer hides (SPEC §9: a uniform scale passes unless --strict-scale).
// Adam (and AdamW) fed gradients ×s step exactly as Adam fed the true gradients with eps/s
// (m ×s, sqrt(v) ×s): hidden while eps/s stays far below the gradients' magnitude. Below 2^-10
// the default eps 1e-8 becomes >= 1e-5, the order of a large model's per-element gradient (norm 1
// over 10^10 parameters): the update shrinks towards SGD's, or stops (×1e-30). Above 2^64 a loss
// or gradient ×s overflows float16 at once and leaves float32/bfloat16 (3.4e38) little headroom.
// The derivation is written out in docs/semantics.md.
inline constexpr double kHiddenScaleMin = 1.0 / 1024.0;
inline constexpr double kHiddenScaleMax = 18446744073709551616.0;  // 2^64
// Why a uniform scale is not hidden by the optimizer, or "" when it is.
std::string scale_problem(double scale);

struct WeightDiagnosis {
  std::string kind;    // exact, non-finite, zero, negative-scale, uniform-scale, masked-weight,
                       // per-rank, per-microbatch, per-cp-shard, per-sample, mixed
  double scale = 1.0;  // uniform-scale, negative-scale: the common ratio
  std::string scale_problem;  // uniform-scale: why no optimizer hides it ("" when one does)
  std::string named;          // uniform-scale: "1/cp", "dp*cp", ... when a simple product fits
  // uniform-scale: `named` holds a layout size (cp, dp, tp, pp, M) and no declared scale equals
  // it: the same step under another layout applies another update (SPEC §9): fails by default.
  bool layout_dependent = false;
  std::string same_step;  // "the same step at CP = 1 applies ×2 this update"
  std::string declared;   // uniform-scale: the trainer's declared scale equal to it
  // per-rank, per-microbatch, per-cp-shard, per-sample: the ratio as one formula over the unit's
  // own counts ("1/n") and what to change, for the worst unit, in the trainer's terms.
  std::string factor;
  std::string advice;
  double min_ratio = 1.0, max_ratio = 1.0;
  int64_t tokens = 0;           // tokens with w* > 0
  int64_t mismatched = 0;       // of those, ratio != 1
  int64_t masked_weighted = 0;  // tokens with w* = 0 but w != 0
  int64_t non_finite = 0;       // tokens whose w or w* is inf or NaN (never a pass)
  TokenCoord worst;  // the greatest |log ratio|, or the first non-finite or masked-but-weighted
  // Fails the gate: anything but exact, and a uniform scale only when strict or when no optimizer
  // hides it (scale_problem). A non-finite weight, a step whose every weight is 0 (a trainer that
  // applies no gradient) and a negative scale (gradient ascent) always fail.
  bool exact() const { return kind == "exact"; }
  bool hidden_scale() const {
    return kind == "uniform-scale" && scale_problem.empty() && !layout_dependent;
  }
  bool fails(bool strict_scale) const {
    return !(kind == "exact" || (hidden_scale() && !strict_scale));
  }
  std::string summary() const;  // one line a person reads (the advice is its own line: `advice`)
};

// `got` [sum R] against `want` [sum R]; `place` and `layout` give the coordinates and units.
// `true_count` N and `contract_count` N' (the contract's global count), when given, name a uniform
// scale N/N' that no product of sizes explains (a count that includes what it should not). `scale`
// names the ratio in the trainer's terms (B, PP, the objective, declared scales; N defaults to
// true_count).
WeightDiagnosis diagnose_weights(const Batch& batch, const std::vector<double>& got,
                                 const std::vector<double>& want, const TokenPlace& place,
                                 const StepLayout& layout, int64_t true_count = 0,
                                 int64_t contract_count = 0, double rel_tol = kWeightRelTol,
                                 const ScaleContext& scale = {});

// The ratio w/w* over one CP rank's share of one micro-batch (tokens with w* > 0), for tables and
// the SVG: shard[mb * cp + c].
struct ShardRatio {
  int64_t tokens = 0;
  double min_ratio = 1.0, max_ratio = 1.0;
  int64_t masked_weighted = 0;
};
std::vector<ShardRatio> shard_ratios(const Batch& batch, const std::vector<double>& got,
                                     const std::vector<double>& want, const TokenPlace& place,
                                     const StepLayout& layout);

struct InvarianceResult {
  nlohmann::ordered_json layout;  // {"dp", "cp", "microbatches"}
  std::string label;              // "DP 4"
  bool ok = true;                 // the same weights as on the base layout (true when skipped)
  std::string skipped;            // not weighed: a layout the trainer cannot produce, and why
  double max_rel_diff = 0.0;
  TokenCoord worst;
  WeightDiagnosis against_truth;  // the contract on this layout against the objective
  std::string summary;            // against_truth in one line a person reads
};
// Which layout dimensions I5 varies (a trainer without CP need not be invariant under CP).
struct Variations {
  bool dp = true, microbatches = true, cp = true;
};
// I5: the contract's weights on `base` varied in DP (1, 2, 4, 8), micro-batches (1, 2, 4, 8) and CP
// (1, 2, 4, 8), one at a time, each compared with its weights on `base` (`base_weights` when the
// caller has them, else computed) and with `truth`.
std::vector<InvarianceResult> check_split_invariance(const Batch& batch, const StepLayout& base,
                                                     const Contract& contract,
                                                     const ObjectiveSizes& sizes, Split split,
                                                     const std::vector<double>& truth,
                                                     Variations vary = {},
                                                     const ContractWeights* base_weights = nullptr);

// I5 of several loss terms of one step (SPEC §11) at once: their batches differ only in the mask,
// so each variation's placement is computed once and shared. Result [term][variation], as
// check_split_invariance gives for each term alone.
struct TermInvariance {
  const Batch* batch = nullptr;  // the term's batch (its mask); every term's has the same samples
  const Contract* contract = nullptr;
  ObjectiveSizes sizes;
  const std::vector<double>* truth = nullptr;
  const ContractWeights* base_weights = nullptr;  // on `base`
  // diagnose_weights of base_weights against truth, when the caller has it.
  const WeightDiagnosis* base_diagnosis = nullptr;
  // The truth as one weight per sample (true_sample_weights, times any scale): when given, layouts
  // are diagnosed from their owner runs, and `truth` and `base_weights` may be null.
  const std::vector<double>* truth_per_sample = nullptr;
  // Diagnose every variation whose weights differ (against_truth); false: only the first, the
  // others' against_truth.kind is "not-run" (a failing term's ten diagnoses were most of its cost).
  bool diagnose_every_break = true;
};
std::vector<std::vector<InvarianceResult>> check_split_invariance_terms(
    const std::vector<TermInvariance>& terms, const StepLayout& base, Split split,
    Variations vary = {});

// The contract's weights on a layout against the truth, without a per-token vector (what
// `weights` reports unless asked for every token): the diagnosis and shard table that
// diagnose_weights and shard_ratios give for contract_weights against the truth expanded from
// `truth_per_sample` (a test holds them equal), read from each sample's owner runs.
struct WeightsSummary {
  WeightDiagnosis diagnosis;
  std::vector<ShardRatio> shards;
  int64_t global_count = 0;           // ContractWeights::global_count
  std::vector<std::string> problems;  // ContractWeights::problems
};
WeightsSummary summarize_weights(const Batch& batch, const StepLayout& layout,
                                 const Contract& contract, const ObjectiveSizes& sizes,
                                 const std::vector<double>& truth_per_sample, int64_t true_count,
                                 const ScaleContext& scale = {});

// The verdict of `weights`: the contract on the given layout, and on every variation of it. A
// contract whose weights change with the layout fails even where it happens to be right or only
// uniformly off: the same batch then trains differently under another DP, micro-batch or CP size
// (bug 1 is exactly this at CP = 1 against CP > 1).
struct WeightsVerdict {
  bool here_fails = false;                        // on the given layout (or a sample placed twice)
  const InvarianceResult* first_break = nullptr;  // the first variation whose weights differ
  bool fails = false;
};
WeightsVerdict weights_verdict(const WeightDiagnosis& diagnosis, const ContractWeights& weights,
                               const std::vector<InvarianceResult>& invariance, bool strict_scale);

// The contracts whose weights on `layout` equal `got` (to `rel_tol`): the presets first, then, when
// none does, every single-component change of the truth's contract ("norm=global:dp").
// `placed`: place_tokens(batch, layout) when the caller has it (every candidate shares it).
std::vector<std::string> matching_presets(const Batch& batch, const StepLayout& layout,
                                          const std::vector<double>& got, Reduction reduce,
                                          const ObjectiveSizes& sizes,
                                          double rel_tol = kWeightRelTol,
                                          const PlacedTokens* placed = nullptr);

}  // namespace lossguard::oracle
