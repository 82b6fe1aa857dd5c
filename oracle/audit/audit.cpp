// Audit of a trainer's captures (SPEC §10). The global batch is rebuilt by sample index from the
// loss-computing ranks (last pipeline stage, TP rank 0), the layout from what each rank says it
// trained, each rank's token_weight mapped to tokens through the ownership rule (§2), and every
// check run on that. Captures that contradict each other are an input error (exit 2); a value the
// trainer recorded that is wrong, infinite or NaN is a failed check (exit 1), never a pass.
// Here each step is run and the AuditResult built; the step is rebuilt in rebuild.cpp and judged
// in checks.cpp and terms.cpp (oracle/audit/audit_detail.h).
#include "oracle/audit/audit.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>

#include "core/contract.h"
#include "core/errors.h"
#include "oracle/audit/audit_detail.h"

namespace lossguard::oracle {

using namespace audit_detail;

namespace {

bool step_failed(const AuditStep& s, bool strict_scale) {
  for (const auto& c : s.checks) {
    if (c.ok.has_value() && !*c.ok) return true;
  }
  return s.diagnosis.fails(strict_scale);
}

}  // namespace

AuditTolerance audit_tolerance(DType dtype) {
  // u: the unit roundoff of the dtype the trainer computed its per-token loss in.
  // Weights: the hook's gradient dL/dl_t passes through at most a few ops in that dtype (the
  // reduction's division, a compensation factor, the gradient-accumulation division), each
  // rounding by at most u: 4u bounds four roundings. Loss: the scalar is a rounding of a sum
  // accumulated in float32 or wider (u), divided or scaled up to three times (3u), against
  // sum(w·l) whose every w carries the weight's 4u: 8u of the summed magnitude.
  // float32 keeps the 1e-5 used since the first round (~170u: its reductions run over millions of
  // terms with a float accumulator); float64 1e-9.
  switch (dtype) {
    case DType::kBFloat16:
      return {4 * 0x1p-9, 8 * 0x1p-9};  // 7.8e-3, 1.6e-2 (PyTorch's bf16 rtol is 1.6e-2)
    case DType::kFloat16:
      return {4 * 0x1p-11, 8 * 0x1p-11};  // 2.0e-3, 3.9e-3
    case DType::kFloat64:
      return {1e-9, 1e-9};
    default:
      return {1e-5, 1e-5};
  }
}

namespace {

// B and L_norm as the captures record them (the trainer's own global batch size when any rank
// records it), resolved for the step's batch.
ObjectiveSizes recorded_sizes(const Batch& b, const std::vector<const RankCapture*>& all,
                              std::optional<int64_t>* recorded_batch) {
  for (const RankCapture* c : all) {
    if (c->global_batch_size) *recorded_batch = c->global_batch_size;
  }
  ObjectiveSizes sizes;
  if (*recorded_batch) sizes.global_batch_size = **recorded_batch;
  if (all.front()->l_norm) sizes.l_norm = *all.front()->l_norm;
  return resolve_sizes(b, sizes);
}

// Records no part of the format names (a misspelled `skiped`): a finding per rank, an input error
// under --strict.
void report_unknown_records(AuditStep& out, const std::vector<const RankCapture*>& all,
                            bool strict) {
  for (const RankCapture* c : all) {
    if (c->unknown_records.empty()) continue;
    const std::string names = fmt::format("'{}'", fmt::join(c->unknown_records, "', '"));
    if (strict) {
      throw_input_error(
          "{}: record(s) {} are not part of the capture format (SPEC §10, §11); a misspelling? "
          "(without --strict: a warning)",
          c->file, names);
    }
    out.findings.push_back(
        {"unknown_record",
         fmt::format("step {}: {}: record(s) {} are not part of the capture format and were "
                     "ignored (a misspelling? --strict makes this an error)",
                     out.step, c->file, names),
         {{"rank", c->rank}, {"records", c->unknown_records}}});
  }
}

// A recorded B below the samples held is right only when B counts something coarser than samples
// (slime's step_global_batch_size counts rollouts); counted in samples, the objective divides by
// too few. A finding, not a failure; not raised when the captures say B counts rollouts.
void note_batch_size_below_samples(AuditStep& out, int64_t recorded_batch) {
  const int64_t held = out.batch.num_samples();
  if (recorded_batch >= held) return;
  out.findings.push_back(
      {"global_batch_size_below_samples",
       fmt::format("step {}: the captures record global_batch_size = {} but hold {} samples: the "
                   "objective divides by {} (right if B counts rollouts of several samples; if it "
                   "counts samples, samples were duplicated or B is miscounted)",
                   out.step, recorded_batch, held, recorded_batch),
       {{"step", out.step}, {"global_batch_size", recorded_batch}, {"samples", held}}});
}

// The first main-term value (token_weight, token_loss) of any loss-computing rank that `dtype`
// cannot hold, as "file: record[i] = v"; "" when every one fits.
std::string value_outside(DType dtype, const LossRanks& ranks) {
  for (const auto& entry : ranks.by_coord) {
    const RankCapture* c =
        entry.second;  // (a lambda may not capture a structured binding in C++17)
    for (const CapturedMicroBatch& mb : c->microbatches) {
      auto first_outside = [&](const std::vector<double>& values, const char* record) {
        for (std::size_t t = 0; t < values.size(); ++t) {
          if (!dtype_holds(dtype, values[t]))
            return fmt::format("{}: mb.{}.{}[{}] = {:.9g}", c->file, mb.index, record, t,
                               values[t]);
        }
        return std::string();
      };
      std::string found = first_outside(mb.token_weight, "token_weight");
      if (found.empty() && mb.token_loss) found = first_outside(*mb.token_loss, "token_loss");
      if (!found.empty()) return found;
    }
  }
  return {};
}

// Tolerances from the dtype the step claims, its least precise rank's (SPEC §10). One trainer
// computes its per-token loss in one dtype, and every value it records is one that dtype holds:
// where any loss-computing rank's main records hold a value the claimed bf16/fp16 cannot, the
// claim is not believed for the main term (a float32 trainer, or one rank's metadata, cannot
// widen the tolerance to pass a 0.5% weight error) and a finding names the value. Named terms
// keep the claim (a bf16 KL beside a float32 policy loss is common), and so does the loss check,
// a sum over every term. Returns the loss tolerance.
double set_tolerances(AuditStep& out, const std::vector<const RankCapture*>& all,
                      const LossRanks& ranks, const AuditOptions& opt) {
  DType claimed = all.front()->dtype;
  const RankCapture* claimant = all.front();
  for (const RankCapture* c : all) {
    if (audit_tolerance(c->dtype).loss > audit_tolerance(claimed).loss) {
      claimed = c->dtype;
      claimant = c;
    }
  }
  DType main = claimed;
  if (claimed == DType::kBFloat16 || claimed == DType::kFloat16) {
    if (const std::string outside = value_outside(claimed, ranks); !outside.empty()) {
      main = DType::kFloat32;
      out.findings.push_back(
          {"dtype_claim",
           fmt::format("step {}: {} claims dtype = {}, but {} is not a {} value: the main term's "
                       "records were not computed in {}; judged with float32's tolerance",
                       out.step, claimant->file, dtype_name(claimed), outside, dtype_name(claimed),
                       dtype_name(claimed)),
           {{"claimed", std::string(dtype_name(claimed))}, {"value", outside}}});
    }
  }
  out.weight_rel_tol = opt.weight_rel_tol.value_or(audit_tolerance(main).weight);
  out.term_weight_rel_tol = opt.weight_rel_tol.value_or(audit_tolerance(claimed).weight);
  out.dtype = main;
  return audit_tolerance(claimed).loss;
}

AuditStep audit_step(int64_t step, const std::vector<const RankCapture*>& all,
                     const AuditOptions& opt) {
  AuditStep out;
  out.step = step;
  check_metadata(step, all);
  report_unknown_records(out, all, opt.strict_records);
  const RankCapture& first = *all.front();
  const LossRanks ranks = loss_ranks(step, all);
  if (opt.reduce) {
    out.reduce = *opt.reduce;
  } else if (!first.reduce.empty() && !parse_reduction(first.reduce, &out.reduce)) {
    throw_input_error("{}: metadata reduce = '{}' is not {}", first.file, first.reduce,
                      mode_choices<Reduction>());
  }
  RebuiltBatch rebuilt = rebuild_batch(step, ranks);
  out.batch = std::move(rebuilt.batch);
  const Batch& b = out.batch;
  if (b.num_samples() == 0 && rebuilt.dummy_problems.empty()) {
    throw UnverifiedError(fmt::format(
        "step {}: the {} capture(s) hold no sample in any micro-batch (first: {}): nothing to "
        "audit",
        step, all.size(), first.file));
  }
  out.layout = rebuild_layout(step, first, ranks, rebuilt.position);

  // 3. The truth, the ownership of every token, and each rank's measured weights placed on it.
  for (uint8_t mk : b.loss_mask) out.global_tokens += mk;
  out.expected_skip = out.global_tokens == 0;
  std::optional<int64_t> recorded_batch;
  const ObjectiveSizes sizes = recorded_sizes(b, all, &recorded_batch);
  const bool in_rollouts = std::any_of(all.begin(), all.end(), [](const RankCapture* c) {
    return c->global_batch_unit == "rollouts";  // fewer than the samples, by design
  });
  if (recorded_batch && !in_rollouts) note_batch_size_below_samples(out, *recorded_batch);
  out.truth = true_weights(b, out.reduce, sizes);
  // The ownership each rank's weights are mapped through (a sample placed twice is owned where
  // first placed: the second holder's weights then land on no token of its own, and coverage
  // names the duplicate).
  const ContractWeights owned =
      contract_weights(b, out.layout, preset_contract("truth", out.reduce), sizes);
  out.place = owned.place;
  const double loss_tol = set_tolerances(out, all, ranks, opt);
  const bool per_token_objective =
      out.reduce == Reduction::kPerToken || out.reduce == Reduction::kTokenMean;
  Measurement m;
  m.measured.assign(static_cast<std::size_t>(b.num_response_tokens()), 0.0);
  m.held.assign(static_cast<std::size_t>(b.num_response_tokens()), 0);
  if (owned.problems.empty())
    measure_ranks(out, ranks, rebuilt.position, per_token_objective, loss_tol, m);
  out.measured = m.measured;

  // 4. The checks. A layout that holds a sample twice has no single weight per token: the checks
  // that need one are not run, and coverage names the duplicate.
  out.checks.push_back(coverage_check(out, m, owned.problems, rebuilt.dummy_problems,
                                      tp_disagreement(ranks), recorded_batch));
  if (!owned.problems.empty()) {
    const std::string why = "not run: the layout holds a sample twice (see coverage)";
    for (const char* name : {"counts", "weights", "loss"})
      out.checks.push_back({name, std::nullopt, why});
    for (const Term& t : first.terms)
      out.checks.push_back({t.name + ".weights", std::nullopt, why});
    out.diagnosis.kind = "not-run";  // not diagnosed; coverage fails the step
  } else {
    weigh_step(out, m, all, ranks, rebuilt.position, sizes, opt, owned, per_token_objective);
  }
  if (first.pp > 1) out.checks.push_back(stages_check(ranks, all));
  out.checks.push_back(decision_check(out, all));
  out.checks.push_back(metrics_check(all));
  return out;
}

}  // namespace

AuditResult audit_captures(const std::vector<RankCapture>& captures, const AuditOptions& options) {
  if (captures.empty()) throw UnverifiedError("no captures given");
  std::map<int64_t, std::vector<const RankCapture*>> by_step;
  for (const RankCapture& c : captures) by_step[c.step].push_back(&c);
  AuditResult out;
  const RankCapture& first = captures.front();
  out.header = {captures.size(), first.world_size, first.tp, first.pp, first.cp, first.dp};
  for (const auto& [step, ranks] : by_step) {
    AuditStep s = audit_step(step, ranks, options);
    s.failed = step_failed(s, options.strict_scale);
    s.summary = s.diagnosis.summary();
    // The ratio per micro-batch and CP rank: only where asked (--svg draws the first step), and
    // only for a step whose weights were judged (a layout that holds a sample twice is not).
    if (options.shard_ratios && out.steps.empty() && s.diagnosis.kind != "not-run")
      s.shards = shard_ratios(s.batch, s.measured, s.truth, s.place, s.layout);
    out.failed = out.failed || s.failed;
    out.steps.push_back(std::move(s));
  }
  return out;
}

}  // namespace lossguard::oracle
