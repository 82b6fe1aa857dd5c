// The audit's checks (SPEC §10): main's weights measured from each rank's records, and coverage,
// counts, weights, loss, pipeline stages, the skip decision and the metrics judged on them.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "core/contract.h"
#include "core/errors.h"
#include "oracle/audit/audit_detail.h"
#include "oracle/count/metrics.h"

namespace lossguard::oracle::audit_detail {

namespace {

constexpr int64_t kExactMatchTokenLimit = int64_t{1} << 20;

// A float record that is inf or NaN, named by its place.
void check_finite(Problems& p, const RankCapture& c, const std::string& record, double v) {
  if (!std::isfinite(v)) p.add(fmt::format("{}: {} = {}", where(c), record, v));
}

// Long: one rank's records read micro-batch by micro-batch in the order the trainer wrote them
// (weights, counts, loss, terms), each check adding to the same Measurement.
void measure_rank(const RankCapture& c, const AuditStep& out, const SamplePositions& position,
                  bool per_token_objective, double loss_tol, Measurement& m, AuditRank& ar) {
  const Batch& b = out.batch;
  check_finite(m.nonfinite_weights, c, "grad_scale", c.grad_scale);
  for (const CapturedMicroBatch& mb : c.microbatches) {
    if (mb.dummy) continue;
    const std::string mbname = fmt::format("micro-batch {}", mb.index);
    for (std::size_t j = 0; j < mb.token_weight.size(); ++j) {
      check_finite_lazy(m.nonfinite_weights, c, mb.token_weight[j],
                        [&] { return fmt::format("{} token_weight[{}]", mbname, j); });
      if (mb.token_loss) {
        check_finite_lazy(m.nonfinite_loss, c, (*mb.token_loss)[j],
                          [&] { return fmt::format("{} token_loss[{}]", mbname, j); });
      }
    }
    if (mb.sample_denoms) {
      for (std::size_t p = 0; p < mb.sample_denoms->size(); ++p) {
        check_finite_lazy(m.nonfinite_weights, c, (*mb.sample_denoms)[p],
                          [&] { return fmt::format("{} sample_denoms[{}]", mbname, p); });
      }
    }
    int64_t owned_effective = 0;
    double weighted_loss = 0.0, magnitude = 0.0;
    const auto held = static_cast<int64_t>(mb.token_weight.size());
    const int64_t owns = for_owned(c, mb, out, position, [&](int64_t t, int64_t j, std::size_t p) {
      if (j >= held) return;  // reported below, with the count
      const double w = mb.token_weight[j] * c.grad_scale;
      if (b.loss_mask[t]) {
        ++owned_effective;
        m.measured[t] += w;
      } else if (w != 0.0 && m.masked_weighted.empty()) {
        m.masked_weighted = fmt::format(
            "{} {}: sample {} response index {} has mask 0 but weight {:.6g}", where(c), mbname,
            mb.sample_indices[p], t - b.response_offsets[position.at(mb.sample_indices[p])], w);
      }
      ++m.held[t];
      if (mb.token_loss) {
        weighted_loss += mb.token_weight[j] * (*mb.token_loss)[j];
        magnitude += std::fabs(mb.token_weight[j] * (*mb.token_loss)[j]);
      }
    });
    if (static_cast<int64_t>(mb.token_weight.size()) != owns) {
      throw_input_error(
          "{}: {}: token_weight has {} entries but the rank owns {} response tokens of its "
          "samples at CP size {} ({} layout)",
          c.file, mbname, mb.token_weight.size(), owns, mb.cp_size,
          mode_name(out.layout.cp_layout));
    }
    for (const auto& [name, term] : mb.terms) {
      if (static_cast<int64_t>(term.token_weight.size()) != owns ||
          (term.token_loss && term.token_loss->size() != term.token_weight.size())) {
        throw_input_error(
            "{}: {}: term {}: token_weight has {} entries{} but the rank owns {} response tokens "
            "of its samples (a term is hooked over the same owned tokens)",
            c.file, mbname, name, term.token_weight.size(),
            term.token_loss ? fmt::format(" and token_loss {}", term.token_loss->size()) : "",
            owns);
      }
      if (term.mask &&
          static_cast<int64_t>(term.mask->size()) != static_cast<int64_t>(mb.loss_masks.size())) {
        throw_input_error("{}: {}: term {}: mask has {} entries, the micro-batch's loss_masks {}",
                          c.file, mbname, name, term.mask->size(), mb.loss_masks.size());
      }
    }
    // The backpropagated loss is the sum of every term's: each term's sum of weight × loss.
    std::string term_without_loss;
    for (const auto& entry : mb.terms) {
      const std::string& name = entry.first;  // (a structured binding clang cannot capture)
      const CapturedTerm& term = entry.second;
      if (!term.token_loss) {
        if (term_without_loss.empty()) term_without_loss = name;
        continue;
      }
      for (std::size_t j = 0; j < term.token_weight.size(); ++j) {
        check_finite_lazy(m.nonfinite_loss, c, (*term.token_loss)[j], [&] {
          return fmt::format("{} term.{}.token_loss[{}]", mbname, name, j);
        });
        weighted_loss += term.token_weight[j] * (*term.token_loss)[j];
        magnitude += std::fabs(term.token_weight[j] * (*term.token_loss)[j]);
      }
    }
    ar.owned_tokens += owns;
    if (mb.num_tokens) {
      ++m.num_tokens_seen;
      int64_t whole_effective = 0;  // the micro-batch's samples' effective tokens, every CP rank's
      for (const int64_t index : mb.sample_indices) {
        const int64_t i = position.at(index);
        for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t)
          whole_effective += b.loss_mask[t] ? 1 : 0;
      }
      if (per_token_objective && *mb.num_tokens != owned_effective) {
        if (mb.cp_size > 1 && *mb.num_tokens == whole_effective) {
          ++m.whole_sample_counts;
        } else {
          m.counts.add(fmt::format(
              "{} {}: num_tokens {} but the rank owns {} effective tokens{}", where(c), mbname,
              *mb.num_tokens, owned_effective,
              mb.cp_size > 1
                  ? fmt::format(" (its samples hold {} over every CP rank)", whole_effective)
                  : std::string()));
        }
      }
    }
    m.loss_seen |= mb.loss.has_value();
    m.token_loss_seen |= mb.token_loss.has_value();
    if (!mb.loss) continue;
    // A mean over zero tokens: NaN in the trainer's loss value while its gradient is exactly 0.
    // With a NaN gradient too (an unclamped count: every weight NaN), it is no such finding: the
    // non-finite weights fail the weights check.
    const bool zero_gradient = std::all_of(mb.token_weight.begin(), mb.token_weight.end(),
                                           [](double w) { return w == 0.0; });
    if (std::isnan(*mb.loss) && owned_effective == 0 && zero_gradient) {
      if (m.nan_losses++ == 0) m.first_nan = fmt::format("{} {}", where(c), mbname);
      continue;
    }
    check_finite(m.nonfinite_loss, c, mbname + " loss", *mb.loss);
    if (!term_without_loss.empty()) {
      if (m.term_without_loss.empty())
        m.term_without_loss = fmt::format("{} {}: term {}", where(c), mbname, term_without_loss);
      continue;
    }
    if (!mb.token_loss || !std::isfinite(*mb.loss) || !std::isfinite(weighted_loss)) continue;
    if (!(std::fabs(*mb.loss - weighted_loss) <=
          loss_tol * magnitude + 0.1 * loss_tol * std::fabs(*mb.loss) + 1e-12)) {
      m.loss.add(fmt::format("{} {}: loss {:.9g} but sum of token_weight x token_loss is {:.9g}",
                             where(c), mbname, *mb.loss, weighted_loss));
    }
  }
  if (per_token_objective && c.num_tokens_reduced && *c.num_tokens_reduced != out.global_tokens) {
    const bool whole_samples =
        m.whole_sample_counts > 0 && *c.num_tokens_reduced == c.cp * out.global_tokens;
    if (!whole_samples) {
      m.counts.add(fmt::format(
          "{}: num_tokens_reduced {} but the step has N = {} effective tokens{}", where(c),
          *c.num_tokens_reduced, out.global_tokens,
          m.whole_sample_counts > 0
              ? fmt::format(" (cp x N = {} with whole-sample counts)", c.cp * out.global_tokens)
              : std::string()));
    }
  }
}

}  // namespace

std::string tp_disagreement(const LossRanks& ranks) {
  for (const RankCapture* peer : ranks.tp_peers) {
    const RankCapture& lead = *ranks.by_coord.at({peer->dp_rank, peer->cp_rank});
    bool same = peer->microbatches.size() == lead.microbatches.size() &&
                peer->grad_scale == lead.grad_scale;
    for (std::size_t k = 0; same && k < lead.microbatches.size(); ++k) {
      const auto& a = peer->microbatches[k];
      const auto& b = lead.microbatches[k];
      same = a.token_weight == b.token_weight && a.sample_indices == b.sample_indices &&
             a.terms.size() == b.terms.size();
      for (auto it = a.terms.begin(), jt = b.terms.begin(); same && it != a.terms.end();
           ++it, ++jt) {
        same = it->first == jt->first && it->second.token_weight == jt->second.token_weight;
      }
    }
    if (!same) return fmt::format("{} disagrees with its TP rank 0 ({})", where(*peer), lead.file);
  }
  return "";
}

AuditCheck coverage_check(const AuditStep& out, const Measurement& m,
                          const std::vector<std::string>& placement_problems,
                          const std::vector<std::string>& dummy_problems,
                          const std::string& tp_problem, std::optional<int64_t> recorded_batch) {
  const Batch& b = out.batch;
  std::string problem;
  for (const auto& p : dummy_problems) {
    if (problem.empty()) problem = p;
  }
  for (const auto& p : placement_problems) {
    if (problem.empty()) problem = p;
  }
  if (problem.empty() && recorded_batch && *recorded_batch > b.num_samples()) {
    problem = fmt::format(
        "the captures record global_batch_size = {} but hold {} sample(s): {} sample(s) of the "
        "step were dropped before the loss",
        *recorded_batch, b.num_samples(), *recorded_batch - b.num_samples());
  }
  for (int64_t i = 0; i < b.num_samples() && problem.empty(); ++i) {
    for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
      if (!b.loss_mask[t] || m.held[t] == 1) continue;
      problem = fmt::format(
          "sample {} response index {} is held by {} rank(s){}", b.origins[i].index_in_file,
          t - b.response_offsets[i], m.held[t],
          m.held[t] == 0 ? " (no rank owns its predicting logit)" : " (placed more than once)");
      break;
    }
  }
  if (problem.empty() && !m.masked_weighted.empty())
    problem = "masked tokens carry weight: " + m.masked_weighted;
  if (problem.empty()) problem = tp_problem;
  if (!problem.empty()) return {"coverage", false, problem};
  return {"coverage", true,
          fmt::format("every one of {} effective tokens held exactly once; masked tokens weigh 0",
                      out.global_tokens)};
}

namespace {

AuditCheck counts_check(const AuditStep& out, const Measurement& m, bool recorded_reduced,
                        bool per_token_objective) {
  if (m.num_tokens_seen == 0 && !recorded_reduced) return {"counts", std::nullopt, "not recorded"};
  if (!per_token_objective) {
    return {"counts", std::nullopt,
            fmt::format("shown, not judged under {} (N = {})", mode_name(out.reduce),
                        out.global_tokens)};
  }
  if (!m.counts.empty()) return {"counts", false, m.counts.text()};
  // Whole-sample counts are consistent only with the loss x cp that compensates them: then the
  // weights are exact; without it every weight is 1/cp of the truth (a scale Adam would hide).
  if (m.whole_sample_counts > 0 && out.global_tokens > 0 && !out.diagnosis.exact()) {
    return {"counts", false,
            fmt::format(
                "every CP rank counts its micro-batch's whole samples (num_tokens_reduced = cp x "
                "N = {} x {}) but the weights are not those of the loss x cp that compensates "
                "it: {}",
                out.layout.cp, out.global_tokens, out.diagnosis.summary())};
  }
  if (m.whole_sample_counts > 0) {
    return {
        "counts", true,
        fmt::format("every CP rank counts its micro-batch's whole samples (slime's convention, the "
                    "loss x cp); {}N = {}",
                    recorded_reduced ? "num_tokens_reduced is cp x " : "", out.global_tokens)};
  }
  return {"counts", true,
          fmt::format("{}{}N = {}",
                      m.num_tokens_seen > 0 ? "every num_tokens is the rank's owned count; " : "",
                      recorded_reduced ? "num_tokens_reduced is " : "", out.global_tokens)};
}

AuditCheck loss_check(const Measurement& m) {
  if (!m.nonfinite_loss.empty()) return {"loss", false, "not finite: " + m.nonfinite_loss.text()};
  if (!m.loss_seen || !m.token_loss_seen) {
    return {
        "loss", std::nullopt,
        fmt::format("not recorded ({})", !m.loss_seen && !m.token_loss_seen ? "loss and token_loss"
                                         : !m.loss_seen                     ? "loss"
                                                                            : "token_loss")};
  }
  if (!m.loss.empty()) return {"loss", false, m.loss.text()};
  if (!m.term_without_loss.empty()) {
    return {"loss", std::nullopt,
            fmt::format("not checked: {} recorded no token_loss (the loss is the sum over every "
                        "term)",
                        m.term_without_loss)};
  }
  return {"loss", true, "every loss is the sum of token_weight x token_loss"};
}

}  // namespace

AuditCheck stages_check(const LossRanks& ranks, const std::vector<const RankCapture*>& all) {
  Problems problems;
  int64_t compared = 0;
  for (const RankCapture* c : all) {
    if (c->pp_rank == c->pp - 1) continue;
    if (!c->microbatches.empty()) {
      problems.add(
          fmt::format("{} is pipeline stage {} of {} but records {} micro-batch(es): only "
                      "the last stage computes the loss",
                      where(*c), c->pp_rank, c->pp, c->microbatches.size()));
    }
    const auto it = ranks.by_coord.find({c->dp_rank, c->cp_rank});
    if (it == ranks.by_coord.end()) continue;  // reported as missing (exit 2) before this
    const RankCapture& last = *it->second;
    ++compared;
    const double a = c->grad_scale, b = last.grad_scale;
    if (!(std::fabs(a - b) <= 1e-12 * std::max(std::fabs(a), std::fabs(b)))) {
      problems.add(
          fmt::format("{} scaled its gradients by {:.9g} where the last stage ({}) scaled "
                      "by {:.9g}: the stages train with different normalisations",
                      where(*c), a, last.file, b));
    }
    if (c->num_tokens_reduced && last.num_tokens_reduced &&
        *c->num_tokens_reduced != *last.num_tokens_reduced) {
      problems.add(
          fmt::format("{} holds num_tokens_reduced {} where the last stage ({}) reduced {}: "
                      "the count did not reach it",
                      where(*c), *c->num_tokens_reduced, last.file, *last.num_tokens_reduced));
    }
  }
  if (!problems.empty()) return {"stages", false, problems.text()};
  return {"stages", true,
          fmt::format("{} rank(s) of the earlier stage(s) applied the last stage's gradient scale "
                      "and hold its count",
                      compared)};
}

AuditCheck decision_check(const AuditStep& out, const std::vector<const RankCapture*>& all) {
  Problems problems;
  int64_t recorded = 0;
  for (const RankCapture* c : all) {
    if (c->grad_norm && !std::isfinite(*c->grad_norm)) {
      problems.add(fmt::format("rank {} ({}) reports grad_norm {}{}", c->rank, c->file,
                               *c->grad_norm,
                               c->skipped && !*c->skipped ? " and stepped on it" : ""));
    }
    // The LR scheduler advances exactly when the optimizer steps (SPEC §7: a skipped step
    // advances neither); without `skipped`, against the expected decision.
    if (c->scheduler_stepped) {
      const bool optimizer_stepped = c->skipped ? !*c->skipped : !out.expected_skip;
      if (*c->scheduler_stepped != optimizer_stepped) {
        problems.add(fmt::format("rank {} {} the LR scheduler while its optimizer {}", c->rank,
                                 *c->scheduler_stepped ? "advanced" : "did not advance",
                                 c->skipped ? (*c->skipped ? "skipped" : "stepped")
                                            : (out.expected_skip ? "should skip" : "should step")));
      }
      if (!c->skipped) ++recorded;
    }
    if (!c->skipped) continue;
    ++recorded;
    if (*c->skipped != out.expected_skip) {
      problems.add(fmt::format(
          "rank {}{} {} (expected {}: N = {})", c->rank,
          c->pp > 1 ? fmt::format(" (pipeline stage {} of {})", c->pp_rank, c->pp) : std::string(),
          *c->skipped ? "skipped" : "stepped", out.expected_skip ? "skip" : "step",
          out.global_tokens));
    }
    if (*c->skipped && c->grad_norm && *c->grad_norm != 0.0 && std::isfinite(*c->grad_norm))
      problems.add(fmt::format("rank {} skipped but reports grad_norm {}", c->rank, *c->grad_norm));
  }
  if (!problems.empty()) return {"decision", false, problems.text()};
  if (!recorded) return {"decision", std::nullopt, "not recorded (skipped)"};
  return {"decision", true,
          fmt::format("all {} recording rank(s) {} (N = {})", recorded,
                      out.expected_skip ? "skipped" : "stepped", out.global_tokens)};
}

AuditCheck metrics_check(const std::vector<const RankCapture*>& all) {
  Problems problems;
  int64_t metric_ranks = 0;
  for (const RankCapture* c : all) {
    if (!c->metrics_values) continue;
    ++metric_ranks;
    for (std::size_t j = 0; j < c->metrics_values->size(); ++j)
      check_finite_lazy(problems, *c, (*c->metrics_values)[j],
                        [&] { return fmt::format("metrics.values[{}]", j); });
    try {
      normalize_metrics(*c->metrics_values, c->metrics_keys);
    } catch (const MetricsError& e) {
      problems.add(fmt::format("rank {}: {}", c->rank, e.what()));
    }
  }
  if (!problems.empty()) return {"metrics", false, problems.text()};
  if (!metric_ranks) return {"metrics", std::nullopt, "not recorded"};
  return {"metrics", true, fmt::format("{} rank(s) normalise", metric_ranks)};
}

ScaleContext scale_context(const RankCapture& first, const ObjectiveSizes& sizes, Reduction reduce,
                           bool main) {
  ScaleContext ctx;
  ctx.pp = first.pp;
  ctx.global_batch = sizes.global_batch_size;
  ctx.reduce = reduce;
  ctx.reduce_known = true;
  if (main) ctx.declared = first.declared_scales;
  ctx.loss_site = first.loss_site;
  return ctx;
}

void order_for_trainer(std::vector<std::string>& matches, const std::string& trainer,
                       bool every_trainer) {
  if (trainer.empty() || matches.empty()) return;
  const std::vector<std::string> families =
      trainer == "trl"        ? std::vector<std::string>{"trl-", "hf-"}
      : trainer == "megatron" ? std::vector<std::string>{"megatron-", "slime", "relax"}
      : trainer == "slime"    ? std::vector<std::string>{"slime", "megatron-"}
      : trainer == "relax"    ? std::vector<std::string>{"relax", "megatron-"}
                              : std::vector<std::string>{trainer + "-", trainer};
  auto rank = [&](const std::string& name) -> std::size_t {
    if (name == "truth") return 0;  // an exact step's first entry stays first
    for (std::size_t k = 0; k < families.size(); ++k) {
      if (name.rfind(families[k], 0) == 0) return k + 1;
    }
    return families.size() + 1;
  };
  std::stable_sort(matches.begin(), matches.end(),
                   [&](const std::string& a, const std::string& b) { return rank(a) < rank(b); });
  const bool megatron_family = trainer == "megatron" || trainer == "slime" || trainer == "relax";
  if (!megatron_family || every_trainer) return;
  const std::vector<ContractPreset>& presets = contract_presets();
  auto foreign = [&](const std::string& match) {  // "hf-ga" or "hf-ga with scale=cp"
    const std::string name = match.substr(0, match.find(" with "));
    const bool preset = std::any_of(presets.begin(), presets.end(),
                                    [&](const ContractPreset& p) { return name == p.name; });
    return preset && rank(name) > families.size();
  };
  matches.erase(std::remove_if(matches.begin(), matches.end(), foreign), matches.end());
}

void measure_ranks(AuditStep& out, const LossRanks& ranks, const SamplePositions& position,
                   bool per_token_objective, double loss_tol, Measurement& m) {
  const int64_t step = out.step;
  for (const auto& [coord, c] : ranks.by_coord) {
    AuditRank ar{c->rank,    c->dp_rank,
                 c->cp_rank, c->tp_rank,
                 c->pp_rank, static_cast<int64_t>(c->microbatches.size()),
                 0,          c->grad_scale,
                 c->skipped, c->grad_norm,
                 c->file};
    measure_rank(*c, out, position, per_token_objective, loss_tol, m, ar);
    out.ranks.push_back(ar);
  }
  if (m.nan_losses > 0) {
    out.findings.push_back({"mean_over_zero_tokens",
                            fmt::format("step {}: {} micro-batch loss value(s) are NaN, a mean "
                                        "over zero tokens, while their gradient is 0 "
                                        "(first: {})",
                                        step, m.nan_losses, m.first_nan),
                            {{"step", step}, {"microbatches", m.nan_losses}}});
  }
}

void weigh_step(AuditStep& out, const Measurement& m, const std::vector<const RankCapture*>& all,
                const LossRanks& ranks, const SamplePositions& position,
                const ObjectiveSizes& sizes, const AuditOptions& opt, const ContractWeights& owned,
                bool per_token_objective) {
  const Batch& b = out.batch;
  const RankCapture& first = *all.front();
  bool recorded_reduced = false;
  int64_t contract_count = 0;  // a measured run's N' (names N/N'), from its recorded counts
  for (const RankCapture* c : all) {
    recorded_reduced |= c->num_tokens_reduced.has_value();
    if (c->num_tokens_reduced && per_token_objective) contract_count = *c->num_tokens_reduced;
  }
  out.diagnosis = diagnose_weights(b, out.measured, out.truth, out.place, out.layout,
                                   out.global_tokens, contract_count, out.weight_rel_tol,
                                   scale_context(first, sizes, out.reduce, true));
  out.checks.push_back(counts_check(out, m, recorded_reduced, per_token_objective));
  if (!m.nonfinite_weights.empty()) {
    out.checks.push_back({"weights", false, "not finite: " + m.nonfinite_weights.text()});
  } else {
    out.checks.push_back(
        {"weights", !out.diagnosis.fails(opt.strict_scale), out.diagnosis.summary()});
  }
  const PlacedTokens placed{out.place, owned.problems};  // every candidate contract's placement
  // Naming the presets an exact step matches is a pass per preset over the tokens: shown for
  // steps up to 2^20 response tokens; a step that fails is always matched.
  const bool worth_matching =
      !out.diagnosis.exact() || b.num_response_tokens() <= kExactMatchTokenLimit;
  if (opt.match_presets && worth_matching && out.global_tokens > 0 &&
      out.diagnosis.kind != "non-finite") {
    out.matches = matching_presets(b, out.layout, out.measured, out.reduce, sizes,
                                   out.weight_rel_tol, &placed);
    order_for_trainer(out.matches, all.front()->trainer, opt.every_trainer_preset);
  }
  out.checks.push_back(loss_check(m));
  audit_terms(out, ranks, first.terms, position, sizes, opt,
              out.diagnosis.kind == "uniform-scale" ? out.diagnosis.scale : 1.0, placed);
}

}  // namespace lossguard::oracle::audit_detail
