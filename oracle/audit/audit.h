// Audit (SPEC §10): a trainer's own numbers, recorded on every rank (core/capture.h), judged
// against the truth: coverage of every effective token, the counts, the measured effective weights
// with the diagnosis of §9 and the contracts that reproduce them, the loss, the skip decision on
// every rank, the metrics. Captures that do not fit together throw InputError (exit 2).
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/judgement.h"
#include "core/layout.h"
#include "core/rank_capture.h"
#include "oracle/count/findings.h"
#include "oracle/weights/weights.h"

namespace lossguard::oracle {

struct AuditCheck {
  std::string name;        // coverage, counts, weights, loss, decision, metrics
  std::optional<bool> ok;  // nullopt: not run (its records are absent, or not judged)
  std::string detail;      // one line; on failure names rank, micro-batch, sample and token
};

struct AuditRank {
  int64_t rank = 0, dp_rank = 0, cp_rank = 0, tp_rank = 0, pp_rank = 0;
  int64_t microbatches = 0, owned_tokens = 0;
  double grad_scale = 1.0;
  std::optional<bool> skipped;
  std::optional<double> grad_norm;
  std::string file;
};

// One loss term besides main (SPEC §11), measured from its own records (mb.{k}.term.NAME.*) and
// judged over its own mask, relative to the main term's scale.
struct AuditTerm {
  Term term;                            // as declared (an undeclared term: its name only)
  bool declared = true;                 // in metadata `terms`
  bool hooked = false;                  // some loss rank recorded it
  int64_t tokens = 0;                   // N_k: tokens under the term's mask
  double relative_to = 1.0;             // main's uniform scale, which the term's truth carries
  WeightDiagnosis diagnosis;            // kind "not-run" when it was not weighed
  std::vector<std::string> matches;     // contracts reproducing its weights (when not exact)
  std::vector<double> measured, truth;  // [sum R]
};

struct AuditStep {
  int64_t step = 0;
  Reduction reduce = Reduction::kPerToken;
  Batch batch;
  StepLayout layout;
  std::vector<AuditRank> ranks;
  std::vector<AuditCheck> checks;
  WeightDiagnosis diagnosis;
  std::vector<std::string>
      matches;  // presets (or single component changes) reproducing the weights
  std::vector<double> measured, truth;  // [sum R]
  TokenPlace place;
  int64_t global_tokens = 0;
  bool expected_skip = false;
  double weight_rel_tol = 1e-5;       // main's weights: from the dtype its records support
  double term_weight_rel_tol = 1e-5;  // named terms' weights: from the claimed dtype
  DType dtype = DType::kFloat32;  // the dtype main's weight tolerance comes from (believed claim)
  std::vector<Finding> findings;
  std::vector<AuditTerm> terms;  // declared or hooked terms besides main; empty: single-term
  // Decided once by audit_captures under its options, for every renderer to read:
  bool failed = false;             // a check failed, or the diagnosis fails (under strict_scale)
  std::string summary;             // the diagnosis in one line a person reads
  std::vector<ShardRatio> shards;  // measured / truth per micro-batch and CP rank: the first
                                   // step's, with AuditOptions::shard_ratios (the SVG)
};

// What every step's captures share, as the first capture states it (the report's header).
struct AuditHeader {
  std::size_t captures = 0;
  int64_t world_size = 1, tp = 1, pp = 1, cp = 1, dp = 1;
};

// `audit`'s one result: the header, every step in step order with its verdict, the verdict.
struct AuditResult {
  AuditHeader header;
  std::vector<AuditStep> steps;
  bool failed = false;  // some step failed
  Judgement judgement() const { return Judgement::verified(failed); }
};

// The relative tolerances of the weights and loss checks for a trainer that computed its per-token
// loss in `dtype` (argued in audit.cpp): float32 1e-5, float64 1e-9, bf16 4u / 8u, fp16 4u / 8u.
struct AuditTolerance {
  double weight = 1e-5, loss = 1e-5;
};
AuditTolerance audit_tolerance(DType dtype);

struct AuditOptions {
  std::optional<Reduction> reduce;  // overrides the objective the captures claim
  std::optional<double>
      weight_rel_tol;  // none: from the trainer's recorded dtype (audit_tolerance)
  bool strict_scale = false;
  bool strict_records = false;  // a record the format does not name is an input error
  // Name the presets (or single component changes) that reproduce the measured weights: a pass
  // over the tokens per candidate contract, the bulk of a small audit's time.
  bool match_presets = true;
  // Offer every trainer's presets as explanations: by default a Megatron, slime or Relax run is
  // matched against its own family's presets, truth and single component changes only.
  bool every_trainer_preset = false;
  // The first step's measured / truth ratio per micro-batch and CP rank (AuditStep::shards;
  // `--svg`): a pass over the tokens and a row per micro-batch and CP rank, asked for only where
  // drawn.
  bool shard_ratios = false;
};

// The captures judged step by step under `options` (one AuditStep per step, in step order).
AuditResult audit_captures(const std::vector<RankCapture>& captures, const AuditOptions& options);

}  // namespace lossguard::oracle
