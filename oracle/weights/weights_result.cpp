// `weights`'s result (oracle/weights/weights_result.h).
#include "oracle/weights/weights_result.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "core/errors.h"

namespace lossguard::oracle {

namespace {

// What the diagnosis names a ratio by: B, the objective, and the contract's own number as the
// trainer's declared constant (`scale=0.5` is a coefficient, `scale=1/cp` a layout factor).
ScaleContext scale_context(const TermContract& tc, const ObjectiveSizes& sizes) {
  ScaleContext ctx;
  ctx.global_batch = sizes.global_batch_size;
  ctx.reduce = tc.term.reduce;
  ctx.reduce_known = true;
  if (tc.contract.scale.number != 1.0) ctx.declared.push_back({"scale", tc.contract.scale.number});
  return ctx;
}

TermWeights weigh_term(const TermContract& tc, const Batch& step_batch, const StepLayout& layout,
                       const ObjectiveSizes& sizes, double relative_to, bool strict_scale,
                       bool per_token, const PlacedTokens* placed = nullptr) {
  TermWeights run;
  run.tc = tc;
  if (tc.term.mask.kind != TermMaskKind::kLoss) {
    run.own = with_mask(step_batch, term_mask(step_batch, tc.term.mask));
  }
  run.step_batch = &step_batch;
  const Batch& b = run.batch();
  run.truth_per_sample = true_sample_weights(b, tc.term.reduce, sizes);
  if (relative_to != 1.0) {
    for (double& w : run.truth_per_sample) w *= relative_to;
  }
  for (uint8_t m : b.loss_mask) run.effective += m;
  run.sizes = sizes;
  run.strict_scale = strict_scale;
  if (!per_token) {  // the summary from each sample's owner runs: no per-token vector
    WeightsSummary sum = summarize_weights(b, layout, tc.contract, sizes, run.truth_per_sample,
                                           run.effective, scale_context(tc, sizes));
    run.dg = std::move(sum.diagnosis);
    run.shards = std::move(sum.shards);
    run.got.global_count = sum.global_count;
    run.got.problems = std::move(sum.problems);
    return run;  // I5 and the verdict: weigh_invariance, for every term at once
  }
  run.truth = per_token_weights(b, run.truth_per_sample);
  run.got = contract_weights(b, layout, tc.contract, sizes, placed);
  run.dg = diagnose_weights(b, run.got.weight, run.truth, run.got.place, layout, run.effective,
                            run.got.global_count, kWeightRelTol, scale_context(tc, sizes));
  run.shards = shard_ratios(b, run.got.weight, run.truth, run.got.place, layout);
  return run;
}

std::string term_status(const TermWeights& t) {
  if (!t.verdict.fails) return "as declared";
  return t.verdict.here_fails
             ? t.summary
             : fmt::format("changes with the layout (first on {})", t.verdict.first_break->label);
}

// I5 of every term at once (each variation placed once), then each term's verdict.
void weigh_invariance(std::vector<TermWeights>& runs, const StepLayout& layout, Split split,
                      Variations vary) {
  std::vector<TermInvariance> inputs;
  for (const TermWeights& r : runs)
    // main's JSON diagnoses every variation that breaks (as before terms); a term, its first
    inputs.push_back({&r.batch(), &r.tc.contract, r.sizes, r.truth.empty() ? nullptr : &r.truth,
                      r.got.weight.empty() ? nullptr : &r.got, &r.dg, &r.truth_per_sample,
                      r.is_main()});
  auto invariance = check_split_invariance_terms(inputs, layout, split, vary);
  for (std::size_t k = 0; k < runs.size(); ++k) {
    runs[k].invariance = std::move(invariance[k]);
    runs[k].verdict =
        weights_verdict(runs[k].dg, runs[k].got, runs[k].invariance, runs[k].strict_scale);
    runs[k].summary = runs[k].dg.summary();
    runs[k].status = term_status(runs[k]);
  }
}

}  // namespace

bool WeightsResult::fails() const {
  return std::any_of(terms.begin(), terms.end(),
                     [](const TermWeights& t) { return t.verdict.fails; });
}

std::string WeightsResult::verdict_text() const {
  const TermWeights& main = terms.front();
  if (!fails()) {
    return main.dg.kind == "uniform-scale"
               ? "pass (a uniform scale; --strict-scale makes it fail)"
               : "pass: every token weighted as the objective says, on every layout tried";
  }
  std::vector<std::string> failing;
  for (const auto& r : terms) {
    if (r.verdict.fails) failing.push_back(r.tc.term.name);
  }
  const TermWeights& first = *std::find_if(terms.begin(), terms.end(),
                                           [](const TermWeights& r) { return r.verdict.fails; });
  std::string verdict = first.verdict.here_fails
                            ? "FAIL: the contract does not weight tokens as the objective says"
                            : fmt::format("FAIL: the weights change with the layout (first on {})",
                                          first.verdict.first_break->label);
  if (multi())
    verdict += fmt::format(" (term{} {})", failing.size() > 1 ? "s" : "", fmt::join(failing, ", "));
  return verdict;
}

Variations parse_variations(const std::vector<std::string>& names) {
  Variations vary{false, false, false};
  for (const auto& x : names) {
    if (x == "dp")
      vary.dp = true;
    else if (x == "microbatches")
      vary.microbatches = true;
    else if (x == "cp")
      vary.cp = true;
    else if (x != "none")
      throw_input_error("--vary takes dp, microbatches, cp or none, got '{}'", x);
  }
  return vary;
}

WeightsResult evaluate_weights(const Batch& b, const WeightsRequest& q) {
  // Each term holds its own per-micro-batch tables at once: the terms together get the budget of
  // one term at the largest layout the options allow (2^22 micro-batches), so that memory follows
  // the input, not the count of --term flags (1,000 terms at DP 2^20 held ~33 GB).
  const auto rows =
      static_cast<double>(q.terms.size()) * static_cast<double>(q.layout.microbatches.size());
  if (q.terms.size() > 1 && rows > kMaxTermRows) {
    throw_input_error(
        "{} terms x {} micro-batches = {:.0f} rows to weigh; at most {:.0f} are modelled at once "
        "(give fewer terms or a smaller layout)",
        q.terms.size(), q.layout.microbatches.size(), rows, kMaxTermRows);
  }
  WeightsResult result;
  std::vector<TermWeights>& runs = result.terms;
  // Main first: the other terms are judged relative to its scale.
  runs.push_back(weigh_term(q.terms[0], b, q.layout, q.sizes, 1.0, q.strict_scale, q.per_token));
  result.main_scale = runs[0].dg.kind == "uniform-scale" ? runs[0].dg.scale : 1.0;
  ObjectiveSizes term_sizes = q.sizes;
  term_sizes.main_mask = &b.loss_mask;  // count-of=main
  // Every term's samples sit where main's do: one placement for all.
  const PlacedTokens placed{runs[0].got.place, runs[0].got.problems};
  for (std::size_t k = 1; k < q.terms.size(); ++k) {
    runs.push_back(weigh_term(q.terms[k], b, q.layout, term_sizes, result.main_scale, true,
                              q.per_token, q.per_token ? &placed : nullptr));
  }
  weigh_invariance(runs, q.layout, q.split, q.vary);
  for (const auto& r : runs) {
    if (!result.multi() || r.is_main() || !r.verdict.here_fails || r.dg.kind == "exact") continue;
    result.findings.push_back(
        {"term_normalisation",
         fmt::format("term {}: {} relative to main", r.tc.term.name, r.dg.summary()),
         {{"term", r.tc.term.name},
          {"diagnosis", r.dg.kind},
          {"scale", r.dg.kind == "uniform-scale" ? r.dg.scale : 1.0},
          {"named", r.dg.named}}});
  }
  return result;
}

}  // namespace lossguard::oracle
