// Audit of a trainer's captures (SPEC §10). The global batch is rebuilt by sample index from the
// loss-computing ranks (last pipeline stage, TP rank 0), the layout from what each rank says it
// trained, each rank's token_weight mapped to tokens through the ownership rule (§2), and every
// check run on that.
#include "oracle/audit.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "core/contract.h"
#include "core/errors.h"
#include "oracle/metrics.h"

namespace lossguard::oracle {

bool AuditStep::failed(bool strict_scale) const {
  for (const auto& c : checks) {
    if (c.ok.has_value() && !*c.ok) return true;
  }
  return diagnosis.fails(strict_scale);
}

namespace {

struct SampleRecord {
  const RankCapture* rank = nullptr;
  int64_t microbatch = 0, position = 0;  // where it was first seen
  int64_t t = 0, r = 0;
  const int64_t* tokens = nullptr;
  const uint8_t* mask = nullptr;
};

std::string where(const RankCapture& c) {
  return fmt::format("rank {} (DP {} CP {} TP {} PP {}, {})", c.rank, c.dp_rank, c.cp_rank,
                     c.tp_rank, c.pp_rank, c.file);
}

AuditStep audit_step(int64_t step, const std::vector<const RankCapture*>& all,
                     const AuditOptions& opt) {
  AuditStep out;
  out.step = step;
  const RankCapture& first = *all.front();
  for (const RankCapture* c : all) {
    if (c->world_size != first.world_size || c->tp != first.tp || c->pp != first.pp ||
        c->cp != first.cp || c->dp != first.dp) {
      throw_input_error(
          "step {}: {} says world {} (tp {} pp {} cp {} dp {}) but {} says world {} (tp {} pp {} "
          "cp {} dp {})",
          step, where(first), first.world_size, first.tp, first.pp, first.cp, first.dp, where(*c),
          c->world_size, c->tp, c->pp, c->cp, c->dp);
    }
  }
  const int64_t dp = first.dp, cp = first.cp;
  // The loss-computing ranks, one per (DP, CP) coordinate; TP peers are compared with them.
  std::map<std::pair<int64_t, int64_t>, const RankCapture*> loss_rank;
  std::vector<const RankCapture*> tp_peers;
  std::map<int64_t, const RankCapture*> by_rank;
  for (const RankCapture* c : all) {
    if (!by_rank.emplace(c->rank, c).second) {
      throw_input_error("step {}: two captures for rank {}: {} and {}", step, c->rank,
                        by_rank[c->rank]->file, c->file);
    }
    if (c->pp_rank != c->pp - 1) continue;
    if (c->tp_rank == 0) {
      loss_rank[{c->dp_rank, c->cp_rank}] = c;
    } else {
      tp_peers.push_back(c);
    }
  }
  std::vector<std::string> missing;
  for (int64_t d = 0; d < dp; ++d) {
    for (int64_t c = 0; c < cp; ++c) {
      if (!loss_rank.count({d, c})) missing.push_back(fmt::format("DP {} CP {}", d, c));
    }
  }
  if (!missing.empty()) {
    throw_input_error(
        "step {}: no capture from the loss-computing rank (last pipeline stage, TP rank 0) of {}{}",
        step, fmt::format("{}", missing.front()),
        missing.size() > 1 ? fmt::format(" and {} more", missing.size() - 1) : "");
  }
  if (opt.reduce) {
    out.reduce = *opt.reduce;
  } else if (!first.reduce.empty() && !parse_reduction(first.reduce, &out.reduce)) {
    throw_input_error("{}: metadata reduce = '{}' is not {}", first.file, first.reduce,
                      mode_choices<Reduction>());
  }

  // 1. The global batch, by sample index; every rank that holds a sample must hold the same one.
  std::map<int64_t, SampleRecord> samples;
  for (const auto& [coord, c] : loss_rank) {
    for (const CapturedMicroBatch& mb : c->microbatches) {
      if (mb.dummy) continue;
      int64_t tok = 0, msk = 0;
      for (std::size_t p = 0; p < mb.sample_indices.size(); ++p) {
        const int64_t idx = mb.sample_indices[p], t = mb.total_lengths[p],
                      r = mb.response_lengths[p];
        if (idx < 0)
          throw_input_error("{}: micro-batch {} names sample index {}", c->file, mb.index, idx);
        SampleRecord rec{c,
                         mb.index,
                         static_cast<int64_t>(p),
                         t,
                         r,
                         mb.tokens.data() + tok,
                         mb.loss_masks.data() + msk};
        auto [it, fresh] = samples.emplace(idx, rec);
        if (!fresh) {
          const SampleRecord& o = it->second;
          if (o.t != t || o.r != r || !std::equal(o.tokens, o.tokens + t, rec.tokens) ||
              !std::equal(o.mask, o.mask + r, rec.mask)) {
            throw_input_error(
                "step {}: sample {} differs between {} micro-batch {} and {} micro-batch {} "
                "(lengths {}/{} vs {}/{}, or its tokens or mask)",
                step, idx, where(*o.rank), o.microbatch, where(*c), mb.index, o.t, o.r, t, r);
          }
        }
        tok += t;
        msk += r;
      }
    }
  }
  std::map<int64_t, int64_t> position;  // global sample index -> position in the rebuilt batch
  BatchBuilder builder(LoadNeeds{true, false, false});
  builder.begin_file(fmt::format("captures of step {}", step));
  std::vector<HostArray> keep;
  keep.reserve(samples.size() * 2);
  for (const auto& [idx, rec] : samples) {
    position[idx] = static_cast<int64_t>(position.size());
    keep.push_back(HostArray::from_i64(DType::kInt64, {rec.t},
                                       std::vector<int64_t>(rec.tokens, rec.tokens + rec.t)));
    SampleFields f;
    f.tokens = &keep.back();
    f.response_length = rec.r;
    keep.push_back(HostArray::from_i64(DType::kInt64, {rec.r},
                                       std::vector<int64_t>(rec.mask, rec.mask + rec.r)));
    f.loss_mask = &keep.back();
    builder.add_sample(idx, f);
  }
  out.batch = builder.finish();
  const Batch& b = out.batch;

  // 2. The layout each rank trained: its micro-batches, their CP size and sub-groups.
  out.layout.dp = dp;
  out.layout.cp = cp;
  out.layout.tp = first.tp;
  out.layout.cp_layout = first.cp_layout;
  out.layout.source = "dump";
  for (int64_t d = 0; d < dp; ++d) {
    const RankCapture& lead = *loss_rank[{d, 0}];
    for (int64_t c = 1; c < cp; ++c) {
      if (loss_rank[{d, c}]->microbatches.size() != lead.microbatches.size()) {
        throw_input_error(
            "step {}: {} has {} micro-batches but {} has {} (the CP ranks of a DP rank train the "
            "same micro-batches)",
            step, where(lead), lead.microbatches.size(), where(*loss_rank[{d, c}]),
            loss_rank[{d, c}]->microbatches.size());
      }
    }
    for (std::size_t k = 0; k < lead.microbatches.size(); ++k) {
      MicroBatch mb;
      mb.dp_rank = d;
      mb.index = static_cast<int64_t>(k);
      mb.cp_size = lead.microbatches[k].cp_size;
      mb.dummy = lead.microbatches[k].dummy;
      if (mb.cp_size < 1 || cp % mb.cp_size != 0) {
        throw_input_error(
            "{}: micro-batch {} has CP size {}, which does not divide the CP group of {}",
            lead.file, k, mb.cp_size, cp);
      }
      for (int64_t c = 0; c < cp; ++c) {
        const CapturedMicroBatch& m = loss_rank[{d, c}]->microbatches[k];
        if (m.cp_size != mb.cp_size || m.dummy != mb.dummy) {
          throw_input_error(
              "step {}: DP rank {} micro-batch {}: CP rank 0 says CP size {}{} but CP rank {} says "
              "{}{}",
              step, d, k, mb.cp_size, mb.dummy ? " (dummy)" : "", c, m.cp_size,
              m.dummy ? " (dummy)" : "");
        }
        const int64_t g = c / mb.cp_size;
        std::vector<int64_t> pos;
        for (int64_t idx : m.sample_indices) pos.push_back(position.at(idx));
        if (static_cast<int64_t>(mb.groups.size()) <= g) {
          mb.groups.push_back(pos);
        } else if (mb.groups[g] != pos && !mb.dummy) {
          throw_input_error(
              "step {}: DP rank {} micro-batch {}: CP ranks {} and {} of one CP group hold "
              "different samples",
              step, d, k, g * mb.cp_size, c);
        }
      }
      if (mb.dummy) mb.groups.clear();
      out.layout.microbatches.push_back(std::move(mb));
    }
  }

  // 3. The truth, the ownership of every token, and each rank's measured weights placed on it.
  int64_t n = 0;
  for (uint8_t m : b.loss_mask) n += m;
  out.global_tokens = n;
  out.expected_skip = n == 0;
  ObjectiveSizes sizes;
  if (first.global_batch_size) sizes.global_batch_size = *first.global_batch_size;
  sizes = resolve_sizes(b, sizes);
  out.truth = true_weights(b, out.reduce, sizes);
  const ContractWeights owned =
      contract_weights(b, out.layout, preset_contract("truth", out.reduce), sizes);
  out.place = owned.place;
  const int64_t rows = b.num_response_tokens();
  out.measured.assign(static_cast<std::size_t>(rows), 0.0);
  std::vector<int32_t> held(static_cast<std::size_t>(rows), 0);
  std::vector<std::string> count_problems, loss_problems;
  std::string masked_weighted;
  int64_t nan_losses = 0;  // micro-batch means over zero tokens: NaN values, zero gradients
  std::string first_nan;
  int64_t num_tokens_seen = 0;
  bool loss_seen = false;
  double weight_tol = opt.weight_rel_tol > 0            ? opt.weight_rel_tol
                      : first.weight_dtype == "float64" ? 1e-9
                                                        : 1e-5;
  out.weight_rel_tol = weight_tol;
  const bool per_token_objective =
      out.reduce == Reduction::kPerToken || out.reduce == Reduction::kTokenMean;
  for (const auto& [coord, c] : loss_rank) {
    AuditRank ar{c->rank,    c->dp_rank,
                 c->cp_rank, c->tp_rank,
                 c->pp_rank, static_cast<int64_t>(c->microbatches.size()),
                 0,          c->grad_scale,
                 c->skipped, c->grad_norm,
                 c->file};
    for (const CapturedMicroBatch& mb : c->microbatches) {
      if (mb.dummy) {
        for (double w : mb.token_weight) {
          if (w != 0.0) {
            loss_problems.push_back(fmt::format(
                "{} micro-batch {} is a dummy but carries weight {}", where(*c), mb.index, w));
            break;
          }
        }
        continue;
      }
      std::size_t j = 0;
      int64_t owned_effective = 0;
      double weighted_loss = 0.0, magnitude = 0.0;
      for (std::size_t p = 0; p < mb.sample_indices.size(); ++p) {
        const int64_t i = position.at(mb.sample_indices[p]);
        for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
          if (out.place.owner[t] != c->cp_rank) continue;
          if (j >= mb.token_weight.size()) {
            j = mb.token_weight.size() + 1;  // report below
            break;
          }
          const double w = mb.token_weight[j] * c->grad_scale;
          if (b.loss_mask[t]) {
            ++owned_effective;
            out.measured[t] += w;
          } else if (w != 0.0 && masked_weighted.empty()) {
            masked_weighted = fmt::format(
                "{} micro-batch {}: sample {} response index {} has mask 0 but weight {:.6g}",
                where(*c), mb.index, mb.sample_indices[p], t - b.response_offsets[i], w);
          }
          ++held[t];
          if (mb.token_loss) {
            weighted_loss += mb.token_weight[j] * (*mb.token_loss)[j];
            magnitude += std::fabs(mb.token_weight[j] * (*mb.token_loss)[j]);
          }
          ++j;
        }
      }
      if (j != mb.token_weight.size()) {
        int64_t owns = 0;
        for (int64_t idx : mb.sample_indices) {
          const int64_t i = position.at(idx);
          for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t)
            owns += out.place.owner[t] == c->cp_rank;
        }
        throw_input_error(
            "{}: micro-batch {}: token_weight has {} entries but the rank owns {} response tokens "
            "of its samples at CP size {} ({} layout)",
            c->file, mb.index, mb.token_weight.size(), owns, mb.cp_size,
            mode_name(out.layout.cp_layout));
      }
      ar.owned_tokens += static_cast<int64_t>(j);
      if (mb.num_tokens) {
        ++num_tokens_seen;
        if (per_token_objective && *mb.num_tokens != owned_effective && count_problems.size() < 3) {
          count_problems.push_back(
              fmt::format("{} micro-batch {}: num_tokens {} but the rank owns {} effective tokens",
                          where(*c), mb.index, *mb.num_tokens, owned_effective));
        }
      }
      if (mb.loss && mb.token_loss) {
        loss_seen = true;
        if (std::isnan(*mb.loss) && owned_effective == 0) {
          if (nan_losses++ == 0) first_nan = fmt::format("{} micro-batch {}", where(*c), mb.index);
        } else if (!(std::fabs(*mb.loss - weighted_loss) <=
                     1e-5 * magnitude + 1e-6 * std::fabs(*mb.loss) + 1e-12)) {
          if (loss_problems.size() < 3) {
            loss_problems.push_back(fmt::format(
                "{} micro-batch {}: loss {:.9g} but sum of token_weight x token_loss is {:.9g}",
                where(*c), mb.index, *mb.loss, weighted_loss));
          }
        }
      }
    }
    if (per_token_objective && c->num_tokens_reduced && *c->num_tokens_reduced != n &&
        count_problems.size() < 3) {
      count_problems.push_back(
          fmt::format("{}: num_tokens_reduced {} but the step has N = {} effective tokens",
                      where(*c), *c->num_tokens_reduced, n));
    }
    out.ranks.push_back(ar);
  }
  if (nan_losses > 0) {
    out.findings.push_back({"mean_over_zero_tokens",
                            fmt::format("step {}: {} micro-batch loss value(s) are NaN, a mean "
                                        "over zero tokens, while their gradient is 0 "
                                        "(first: {})",
                                        step, nan_losses, first_nan),
                            {{"step", step}, {"microbatches", nan_losses}}});
  }
  // TP peers compute the same loss: their weights must agree exactly with TP rank 0's.
  std::string tp_problem;
  for (const RankCapture* peer : tp_peers) {
    const RankCapture& lead = *loss_rank[{peer->dp_rank, peer->cp_rank}];
    bool same = peer->microbatches.size() == lead.microbatches.size() &&
                peer->grad_scale == lead.grad_scale;
    for (std::size_t k = 0; same && k < lead.microbatches.size(); ++k) {
      same = peer->microbatches[k].token_weight == lead.microbatches[k].token_weight &&
             peer->microbatches[k].sample_indices == lead.microbatches[k].sample_indices;
    }
    if (!same && tp_problem.empty())
      tp_problem = fmt::format("{} disagrees with its TP rank 0 ({})", where(*peer), lead.file);
  }

  // 4. The checks.
  std::string coverage;
  for (int64_t i = 0; i < b.num_samples() && coverage.empty(); ++i) {
    for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
      if (!b.loss_mask[t]) continue;
      if (held[t] != 1) {
        coverage = fmt::format(
            "sample {} response index {} is held by {} rank(s){}", b.origins[i].index_in_file,
            t - b.response_offsets[i], held[t],
            held[t] == 0 ? " (no rank owns its predicting logit)" : " (placed more than once)");
        break;
      }
    }
  }
  for (const auto& p : owned.problems) {
    if (coverage.empty()) coverage = p;
  }
  if (coverage.empty() && !masked_weighted.empty())
    coverage = "masked tokens carry weight: " + masked_weighted;
  if (coverage.empty() && !tp_problem.empty()) coverage = tp_problem;
  out.checks.push_back(
      {"coverage", coverage.empty(),
       coverage.empty()
           ? fmt::format(
                 "every one of {} effective tokens held exactly once; masked tokens weigh 0", n)
           : coverage});
  if (num_tokens_seen == 0 && !first.num_tokens_reduced) {
    out.checks.push_back({"counts", std::nullopt, "not recorded"});
  } else if (!per_token_objective) {
    out.checks.push_back(
        {"counts", std::nullopt,
         fmt::format("shown, not judged under {} (N = {})", mode_name(out.reduce), n)});
  } else {
    out.checks.push_back({"counts", count_problems.empty(),
                          count_problems.empty()
                              ? fmt::format("every num_tokens is the rank's owned count; N = {}", n)
                              : fmt::format("{}", fmt::join(count_problems, "; "))});
  }
  int64_t contract_count = 0;  // not known for a measured run: N/N' is named from the counts if any
  for (const RankCapture* c : all) {
    if (c->num_tokens_reduced && per_token_objective) contract_count = *c->num_tokens_reduced;
  }
  out.diagnosis = diagnose_weights(b, out.measured, out.truth, out.place, out.layout, n,
                                   contract_count, weight_tol);
  out.checks.push_back(
      {"weights", !out.diagnosis.fails(opt.strict_scale), out.diagnosis.summary()});
  if (n > 0)
    out.matches = matching_presets(b, out.layout, out.measured, out.reduce, sizes, weight_tol);
  out.checks.push_back(
      {"loss", loss_seen ? std::optional<bool>(loss_problems.empty()) : std::nullopt,
       !loss_seen              ? "not recorded (loss and token_loss)"
       : loss_problems.empty() ? "every loss is the sum of token_weight x token_loss"
                               : fmt::format("{}", fmt::join(loss_problems, "; "))});
  // The skip decision: expected from the global fixed count, identical on every rank.
  std::vector<std::string> decision_problems;
  int64_t recorded = 0;
  for (const RankCapture* c : all) {
    if (!c->skipped) continue;
    ++recorded;
    if (*c->skipped != out.expected_skip && decision_problems.size() < 4) {
      decision_problems.push_back(fmt::format("rank {} {} (expected {}: N = {})", c->rank,
                                              *c->skipped ? "skipped" : "stepped",
                                              out.expected_skip ? "skip" : "step", n));
    }
    if (*c->skipped && c->grad_norm && *c->grad_norm != 0.0 && decision_problems.size() < 4) {
      decision_problems.push_back(
          fmt::format("rank {} skipped but reports grad_norm {}", c->rank, *c->grad_norm));
    }
  }
  out.checks.push_back(
      {"decision", recorded ? std::optional<bool>(decision_problems.empty()) : std::nullopt,
       !recorded                   ? "not recorded (skipped)"
       : decision_problems.empty() ? fmt::format("all {} recording rank(s) {} (N = {})", recorded,
                                                 out.expected_skip ? "skipped" : "stepped", n)
                                   : fmt::format("{}", fmt::join(decision_problems, "; "))});
  std::vector<std::string> metric_problems;
  int64_t metric_ranks = 0;
  for (const RankCapture* c : all) {
    if (!c->metrics_values) continue;
    ++metric_ranks;
    try {
      normalize_metrics(*c->metrics_values, c->metrics_keys);
    } catch (const MetricsError& e) {
      if (metric_problems.size() < 3)
        metric_problems.push_back(fmt::format("rank {}: {}", c->rank, e.what()));
    }
  }
  out.checks.push_back(
      {"metrics", metric_ranks ? std::optional<bool>(metric_problems.empty()) : std::nullopt,
       !metric_ranks             ? "not recorded"
       : metric_problems.empty() ? fmt::format("{} rank(s) normalise", metric_ranks)
                                 : fmt::format("{}", fmt::join(metric_problems, "; "))});
  return out;
}

}  // namespace

std::vector<AuditStep> audit_captures(const std::vector<RankCapture>& captures,
                                      const AuditOptions& options) {
  if (captures.empty()) throw UnverifiedError("no captures given");
  std::map<int64_t, std::vector<const RankCapture*>> by_step;
  for (const RankCapture& c : captures) by_step[c.step].push_back(&c);
  std::vector<AuditStep> out;
  for (const auto& [step, ranks] : by_step) out.push_back(audit_step(step, ranks, options));
  return out;
}

}  // namespace lossguard::oracle
