// The audit's terms besides main (SPEC §11): each declared or hooked term measured from its own
// records over its own mask, judged relative to main's scale, and matched against the contracts.
#include <fmt/format.h>

#include <algorithm>
#include <map>

#include "core/errors.h"
#include "core/term.h"
#include "oracle/audit/audit_detail.h"

namespace lossguard::oracle::audit_detail {

namespace {

// 5. The terms besides main (SPEC §11), each weighed over its own mask from its own records,
// relative to main's scale: 5a finds what was hooked, 5b flags the undeclared, 5c rebuilds a field
// mask, 5d measures one term, 5e judges it.

// 5a. Every term some loss rank hooked, with the first place it carries non-zero weight ("" when it
// weighs nothing anywhere).
std::map<std::string, std::string> hooked_terms(const LossRanks& ranks) {
  std::map<std::string, std::string> hooked;
  for (const auto& [coord, c] : ranks.by_coord) {
    for (const CapturedMicroBatch& mb : c->microbatches) {
      if (mb.dummy) continue;
      for (const auto& [name, term] : mb.terms) {
        std::string& first = hooked[name];
        if (!first.empty()) continue;
        for (std::size_t j = 0; j < term.token_weight.size(); ++j) {
          if (term.token_weight[j] != 0.0) {
            first = fmt::format("{} micro-batch {} token {} (weight {:.6g})", where(*c), mb.index,
                                j, term.token_weight[j] * c->grad_scale);
            break;
          }
        }
      }
    }
  }
  return hooked;
}

// 5b. A hooked term the captures do not declare: a failure when it carries weight (a loss the
// objective does not name is active), shown otherwise.
void flag_undeclared(AuditStep& out, const std::string& name, const std::string& first_weight) {
  AuditTerm t;
  t.term.name = name;
  t.declared = false;
  t.hooked = true;
  t.diagnosis.kind = "not-run";
  if (!first_weight.empty()) {
    out.checks.push_back(
        {name + ".declared", false,
         fmt::format("term {} carries weight but the captures do not declare it (metadata "
                     "terms): a loss the objective does not name is active; first at {}",
                     name, first_weight)});
    out.findings.push_back({"undeclared_term",
                            fmt::format("step {}: term {} is hooked with non-zero weight but not "
                                        "declared (first at {})",
                                        out.step, name, first_weight),
                            {{"term", name}}});
  } else {
    out.checks.push_back(
        {name + ".declared", std::nullopt,
         fmt::format("term {} is hooked but not declared; its weight is 0 everywhere", name)});
  }
  out.terms.push_back(std::move(t));
}

// 5c. A field mask as the ranks that hooked the term recorded it, [sum R]; ranks must agree and
// every sample must be covered (exit 2 otherwise).
std::vector<uint8_t> recorded_field_mask(const AuditStep& out, const LossRanks& ranks,
                                         const std::string& name, const SamplePositions& position) {
  const Batch& b = out.batch;
  constexpr uint8_t kUnset = 2;
  std::vector<uint8_t> mask(b.loss_mask.size(), kUnset);
  for (const auto& [coord, c] : ranks.by_coord) {
    for (const CapturedMicroBatch& mb : c->microbatches) {
      if (mb.dummy) continue;
      auto it = mb.terms.find(name);
      if (it == mb.terms.end()) continue;
      if (!it->second.mask) {
        throw_input_error(
            "{}: micro-batch {}: term {} is declared with a field mask but records no "
            "mb.{}.term.{}.mask",
            c->file, mb.index, name, mb.index, name);
      }
      int64_t off = 0;
      for (std::size_t p = 0; p < mb.sample_indices.size(); ++p) {
        const int64_t i = position.at(mb.sample_indices[p]);
        for (int64_t r = 0; r < b.response_lengths[i]; ++r) {
          const uint8_t v = (*it->second.mask)[off + r];
          uint8_t& dst = mask[b.response_offsets[i] + r];
          if (dst != kUnset && dst != v) {
            throw_input_error(
                "step {}: term {}: sample {} response index {} has mask {} in {} but {} elsewhere",
                out.step, name, mb.sample_indices[p], r, v, c->file, dst);
          }
          dst = v;
        }
        off += b.response_lengths[i];
      }
    }
  }
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
      if (mask[t] == kUnset) {
        throw_input_error(
            "step {}: term {} has a field mask, but no rank that hooked it recorded the mask of "
            "sample {}",
            out.step, name, b.origins[i].index_in_file);
      }
    }
  }
  return mask;
}

// 5d. One declared term's records placed on its tokens: measured weights, and the problems found
// on the way (weight outside the mask, a rank owning term tokens that hooked nothing, counts).
struct TermMeasurement {
  std::vector<double> measured;  // [sum R]
  Problems coverage, counts, nonfinite;
  int64_t num_tokens_seen = 0;
};

TermMeasurement measure_term(const AuditStep& out, const LossRanks& ranks, const Term& decl,
                             const Batch& tb, const SamplePositions& position) {
  const Batch& b = out.batch;
  const std::string& name = decl.name;
  const bool per_token =
      decl.reduce == Reduction::kPerToken || decl.reduce == Reduction::kTokenMean;
  TermMeasurement m;
  m.measured.assign(tb.loss_mask.size(), 0.0);
  for (const auto& entry : ranks.by_coord) {
    const RankCapture* c = entry.second;  // (a structured binding clang cannot capture)
    for (const CapturedMicroBatch& mb : c->microbatches) {
      if (mb.dummy) continue;
      auto it = mb.terms.find(name);
      const CapturedTerm* ct = it == mb.terms.end() ? nullptr : &it->second;
      int64_t owned_in_mask = 0;
      for_owned(*c, mb, out, position, [&](int64_t t, int64_t j, std::size_t p) {
        owned_in_mask += tb.loss_mask[t];
        if (ct == nullptr) return;
        const double w = ct->token_weight[j] * c->grad_scale;
        check_finite_lazy(m.nonfinite, *c, ct->token_weight[j], [&] {
          return fmt::format("micro-batch {} term.{}.token_weight[{}]", mb.index, name, j);
        });
        if (tb.loss_mask[t]) {
          m.measured[t] += w;
        } else if (w != 0.0) {
          m.coverage.add(fmt::format(
              "{} micro-batch {}: sample {} response index {} is outside term {}'s mask ({}) but "
              "weighs {:.6g}",
              where(*c), mb.index, mb.sample_indices[p],
              t - b.response_offsets[position.at(mb.sample_indices[p])], name, decl.mask.text(),
              w));
        }
      });
      if (ct == nullptr) {
        if (owned_in_mask > 0) {
          m.coverage.add(fmt::format(
              "{} micro-batch {} owns {} token(s) of term {} but hooked no {} loss: their "
              "gradient is dropped",
              where(*c), mb.index, owned_in_mask, name, name));
        }
        continue;
      }
      if (!ct->num_tokens) continue;
      ++m.num_tokens_seen;
      if (per_token && *ct->num_tokens != owned_in_mask) {
        m.counts.add(fmt::format(
            "{} micro-batch {}: term.{}.num_tokens {} but the rank owns {} token(s) under the "
            "term's mask ({})",
            where(*c), mb.index, name, *ct->num_tokens, owned_in_mask, decl.mask.text()));
      }
    }
  }
  return m;
}

// 5e. One declared term's checks (coverage, counts, weights), its diagnosis and finding.
void judge_term(AuditStep& out, AuditTerm& at, const TermMeasurement& m) {
  const Term& decl = at.term;
  const std::string& name = decl.name;
  out.checks.push_back(
      m.coverage.empty()
          ? AuditCheck{name + ".coverage", true,
                       fmt::format("every rank that owns its {} token(s) hooked it; tokens outside "
                                   "its mask ({}) weigh 0",
                                   at.tokens, decl.mask.text())}
          : AuditCheck{name + ".coverage", false, m.coverage.text()});
  const bool per_token =
      decl.reduce == Reduction::kPerToken || decl.reduce == Reduction::kTokenMean;
  if (m.num_tokens_seen == 0) {
    out.checks.push_back({name + ".counts", std::nullopt, "not recorded"});
  } else if (!per_token) {
    out.checks.push_back(
        {name + ".counts", std::nullopt,
         fmt::format("shown, not judged under {} (N = {})", mode_name(decl.reduce), at.tokens)});
  } else {
    out.checks.push_back(
        m.counts.empty()
            ? AuditCheck{name + ".counts", true,
                         fmt::format("every term.{}.num_tokens is the rank's owned count; N = {}",
                                     name, at.tokens)}
            : AuditCheck{name + ".counts", false, m.counts.text()});
  }
  if (!m.nonfinite.empty()) {
    out.checks.push_back({name + ".weights", false, "not finite: " + m.nonfinite.text()});
    return;
  }
  // A term's scale is part of the objective (its coefficient relative to main): any difference
  // fails, a uniform one too.
  const bool ok = !at.diagnosis.fails(true);
  out.checks.push_back({name + ".weights", ok,
                        ok ? at.diagnosis.summary()
                           : fmt::format("{} (relative to main, coefficient {})",
                                         at.diagnosis.summary(), decl.coef)});
  if (ok) return;
  out.findings.push_back(
      {"term_normalisation",
       fmt::format("step {}: term {}: {} relative to main", out.step, name, at.diagnosis.summary()),
       {{"term", name},
        {"diagnosis", at.diagnosis.kind},
        {"scale", at.diagnosis.kind == "uniform-scale" ? at.diagnosis.scale : 1.0},
        {"named", at.diagnosis.named}}});
}

}  // namespace

void audit_terms(AuditStep& out, const LossRanks& ranks, const std::vector<Term>& declared,
                 const SamplePositions& position, const ObjectiveSizes& main_sizes,
                 const AuditOptions& opt, double relative_to, const PlacedTokens& placed) {
  const Batch& b = out.batch;
  ObjectiveSizes sizes = main_sizes;
  sizes.main_mask = &b.loss_mask;  // a term's contract may count under main's mask
  const std::map<std::string, std::string> hooked = hooked_terms(ranks);
  for (const auto& [name, first_weight] : hooked) {
    const bool is_declared = std::any_of(declared.begin(), declared.end(),
                                         [&n = name](const Term& t) { return t.name == n; });
    if (!is_declared) flag_undeclared(out, name, first_weight);
  }
  for (const Term& decl : declared) {
    AuditTerm at;
    at.term = decl;
    at.hooked = hooked.count(decl.name) > 0;
    at.relative_to = relative_to;
    at.diagnosis.kind = "not-run";
    if (!at.hooked) {
      out.checks.push_back({decl.name + ".weights", std::nullopt,
                            fmt::format("not run: term {} is declared ({}) but no rank hooked it",
                                        decl.name, term_text(decl))});
      out.terms.push_back(std::move(at));
      continue;
    }
    const Batch tb = with_mask(b,
                               decl.mask.kind == TermMaskKind::kField
                                   ? recorded_field_mask(out, ranks, decl.name, position)
                                   : term_mask(b, decl.mask),
                               decl.mask.kind == TermMaskKind::kLoss);
    for (uint8_t v : tb.loss_mask) at.tokens += v;
    at.truth = true_weights(tb, decl.reduce, sizes);
    for (double& w : at.truth) w *= decl.coef * relative_to;
    TermMeasurement m = measure_term(out, ranks, decl, tb, position);
    at.measured = std::move(m.measured);
    at.diagnosis = diagnose_weights(
        tb, at.measured, at.truth, out.place, out.layout, at.tokens, 0, out.term_weight_rel_tol,
        scale_context(*ranks.by_coord.begin()->second, sizes, decl.reduce, false));
    judge_term(out, at, m);
    if (opt.match_presets && at.tokens > 0 && !at.diagnosis.exact() &&
        at.diagnosis.kind != "non-finite" && decl.coef != 0.0) {
      std::vector<double> plain = at.measured;
      for (double& w : plain) w /= decl.coef * relative_to;
      at.matches = matching_presets(tb, out.layout, plain, decl.reduce, sizes,
                                    out.term_weight_rel_tol, &placed);
      order_for_trainer(at.matches, ranks.by_coord.begin()->second->trainer,
                        opt.every_trainer_preset);
    }
    out.terms.push_back(std::move(at));
  }
}

}  // namespace lossguard::oracle::audit_detail
