// `weights`'s renderers (cli/weights_render.h).
#include "cli/weights_render.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>

#include "cli/weights_report.h"
#include "core/errors.h"

namespace lossguard::cli {

namespace {

int64_t max_microbatches(const StepLayout& layout) {
  int64_t max_m = 0;
  for (int64_t m : layout.microbatches_per_rank()) max_m = std::max(max_m, m);
  return max_m;
}

std::string ratio_text(const oracle::ShardRatio& r) {
  if (r.masked_weighted > 0) return "MASKED";
  if (r.tokens == 0) return "-";
  if (std::fabs(r.max_ratio - r.min_ratio) <= oracle::kWeightRelTol * r.max_ratio) {
    return std::fabs(r.min_ratio - 1.0) <= oracle::kWeightRelTol
               ? "1"
               : fmt::format("{:.4g}", r.min_ratio);
  }
  return fmt::format("{:.3g}-{:.3g}", r.min_ratio, r.max_ratio);
}

nlohmann::ordered_json contract_json(const Contract& contract) {
  return {{"count", mode_name(contract.count)},
          {"clamp", mode_name(contract.clamp)},
          {"norm", norm_text(contract)},
          {"sample", mode_name(contract.sample)},
          {"scale", scale_text(contract.scale)},
          {"grad", contract.grad == GradRule::kMean
                       ? fmt::format("mean:{}", mode_name(contract.grad_group))
                       : std::string(mode_name(contract.grad))},
          {"preset", contract.preset.empty() ? nlohmann::ordered_json(nullptr)
                                             : nlohmann::ordered_json(contract.preset)}};
}

// The weights line, the ratio table, I5 and (with --per-token) every token, of one term.
void print_term(std::ostream& out, const oracle::TermWeights& run, const StepLayout& layout,
                const WeightsView& view) {
  const Batch& b = run.batch();
  const auto& dg = run.dg;
  out << fmt::format("weights: {}\n", run.summary);
  if (!dg.advice.empty()) out << fmt::format("fix: {}\n", dg.advice);
  if (!dg.exact() && run.shards.size() <= 64 * 8) {
    out << fmt::format(
        "\n  ratio w/w* per micro-batch (rows) and CP rank (columns):\n  {:>8} {:>4} |", "DP rank",
        "mb");
    for (int64_t c = 0; c < layout.cp; ++c) out << fmt::format(" {:>11}", fmt::format("cp{}", c));
    out << "\n";
    for (std::size_t k = 0; k < layout.microbatches.size() && k < 32; ++k) {
      out << fmt::format("  {:>8} {:>4} |", layout.microbatches[k].dp_rank,
                         layout.microbatches[k].index);
      for (int64_t c = 0; c < layout.cp; ++c)
        out << fmt::format(" {:>11}", ratio_text(run.shards[k * layout.cp + c]));
      out << "\n";
    }
  }
  int64_t broken = 0, skipped = 0;
  for (const auto& r : run.invariance) {
    broken += !r.ok;
    skipped += !r.skipped.empty();
  }
  const int64_t weighed = static_cast<int64_t>(run.invariance.size()) - skipped;
  const oracle::InvarianceResult* first_break = run.verdict.first_break;
  if (weighed == 0) {
    out << "\nI5 split invariance: not checked (--vary none, or no variation holds the batch)\n";
  } else if (first_break == nullptr) {
    out << fmt::format(
        "\nI5 split invariance: the same weights on all {} variations ({} of 1, 2, 4, 8)\n",
        weighed, fmt::join(view.vary_names, ", "));
  } else {
    out << fmt::format(
        "\nI5 split invariance: BREAKS on {} of {} variations; first: {} (weights differ from this "
        "layout's by up to {:.3g}; sample {} response index {})\n  on {}: {}\n",
        broken, weighed, first_break->label, first_break->max_rel_diff, first_break->worst.sample,
        first_break->worst.response_index, first_break->label, first_break->summary);
  }
  if (skipped > 0) {
    out << fmt::format("  skipped {} variation(s) the trainer cannot produce:", skipped);
    for (const auto& r : run.invariance) {
      if (!r.skipped.empty()) out << fmt::format("\n    {}: {}", r.label, r.skipped);
    }
    out << "\n";
  }
  if (view.per_token) {
    out << fmt::format("\n{:>6} {:>4} {:>4}  weights (w / w*)\n", "sample", "dp", "mb");
    for (int64_t i = 0; i < b.num_samples() && i < 200; ++i) {
      const int32_t k = run.got.place.sample_microbatch[i];
      std::string ws;
      for (int64_t t = b.response_offsets[i];
           t < b.response_offsets[i + 1] && t < b.response_offsets[i] + 8; ++t) {
        ws += fmt::format(" {:.4g}/{:.4g}", run.got.weight[t], run.truth[t]);
      }
      if (b.response_lengths[i] > 8) ws += " ...";
      out << fmt::format("{:>6} {:>4} {:>4} {}\n", i, k < 0 ? -1 : layout.microbatches[k].dp_rank,
                         k < 0 ? -1 : layout.microbatches[k].index, ws);
    }
  }
}

// Every token's weight beside the truth, as JSON text (10 M tokens would be a 10 M-node tree):
// {"index", "weights", "truth"} per sample, numbers in their shortest round-trip form, non-finite
// ones as null (as nlohmann).
fmt::memory_buffer per_token_json(const Batch& b, const std::vector<double>& got,
                                  const std::vector<double>& truth) {
  fmt::memory_buffer text;
  auto number = [&](double x) {
    if (std::isfinite(x))
      fmt::format_to(std::back_inserter(text), "{}", x);
    else
      text.append(std::string_view("null"));
  };
  auto list = [&](const std::vector<double>& v, int64_t begin, int64_t end) {
    text.push_back('[');
    for (int64_t t = begin; t < end; ++t) {
      if (t > begin) text.push_back(',');
      number(v[static_cast<std::size_t>(t)]);
    }
    text.push_back(']');
  };
  text.push_back('[');
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    fmt::format_to(std::back_inserter(text),
                   "{}\n    {{\"index\": {}, \"weights\": ", i > 0 ? "," : "", i);
    list(got, b.response_offsets[i], b.response_offsets[i + 1]);
    text.append(std::string_view(", \"truth\": "));
    list(truth, b.response_offsets[i], b.response_offsets[i + 1]);
    text.push_back('}');
  }
  text.append(std::string_view(b.num_samples() > 0 ? "\n  ]" : "]"));
  return text;
}

// The text report: header, each term, the terms against main, the verdict.
void render_text(const oracle::WeightsResult& result, const Batch& b, const WeightsView& view,
                 std::ostream& out) {
  const std::vector<oracle::TermWeights>& runs = result.terms;
  const oracle::TermWeights& main = runs[0];
  const StepLayout& layout = *view.layout;
  const Contract& contract = main.tc.contract;
  out << fmt::format("lossguard weights: {} samples, {} effective tokens; objective {} (B = {})\n",
                     b.num_samples(), main.effective, mode_name(main.tc.term.reduce),
                     main.sizes.global_batch_size);
  out << fmt::format("contract {}{}\n", contract.preset.empty() ? "" : contract.preset + " = ",
                     contract_components(contract));
  out << fmt::format("layout: DP {} x {} micro-batch(es), CP {} ({}), TP {} (from {})\n\n",
                     layout.dp, max_microbatches(layout), layout.cp, mode_name(layout.cp_layout),
                     layout.tp, view.layout_source);
  for (const auto& p : main.got.problems) out << "  layout problem: " << p << "\n";
  for (const auto& r : runs) {
    if (result.multi()) {
      const Contract& c = r.tc.contract;
      out << fmt::format(
          "term {} ({} tokens){}\n  contract {}{}\n", term_text(r.tc.term), r.effective,
          r.is_main() ? "" : fmt::format(", judged relative to main (×{:.6g})", result.main_scale),
          c.preset.empty() ? "" : c.preset + " = ", contract_components(c));
    }
    print_term(out, r, layout, view);
    if (result.multi()) out << "\n";
  }
  if (result.multi()) {
    out << "terms relative to main:\n";
    for (std::size_t k = 1; k < runs.size(); ++k)
      out << fmt::format("  {:<12} {}\n", runs[k].tc.term.name, runs[k].status);
  }
  out << fmt::format("\nverdict: {}\n", result.verdict_text());
}

// A case for each term on the given layout and on each variation I5 tried.
void add_cases(const oracle::WeightsResult& result, Report& report) {
  for (const auto& r : result.terms) {
    const std::string suffix = result.multi() ? fmt::format(" [{}]", r.tc.term.name) : "";
    report.add_case({"lossguard.weights", "weights on the given layout" + suffix,
                     !r.verdict.here_fails, r.summary, false});
    for (const auto& inv : r.invariance) {
      report.add_case(
          {"lossguard.weights", "I5 " + inv.label + suffix, inv.ok,
           !inv.skipped.empty() ? inv.skipped
           : inv.ok             ? ""
                    : fmt::format("weights differ from the base layout's by up to {:.3g}; {}",
                                  inv.max_rel_diff, inv.summary),
           !inv.skipped.empty()});
    }
  }
}

nlohmann::ordered_json invariance_json(const std::vector<oracle::InvarianceResult>& invariance) {
  nlohmann::ordered_json inv = nlohmann::ordered_json::array();
  for (const auto& r : invariance) {
    const bool weighed = r.skipped.empty();
    inv.push_back({{"layout", r.layout},
                   {"ok", weighed ? nlohmann::ordered_json(r.ok) : nlohmann::ordered_json(nullptr)},
                   {"max_rel_diff", weighed ? nlohmann::ordered_json(r.max_rel_diff)
                                            : nlohmann::ordered_json(nullptr)},
                   {"against_truth", r.against_truth.kind},
                   {"skipped", weighed ? nlohmann::ordered_json(nullptr)
                                       : nlohmann::ordered_json(r.skipped)}});
  }
  return inv;
}

// One term in steps[0].terms (several terms only).
nlohmann::ordered_json term_json(const oracle::WeightsResult& result, const oracle::TermWeights& r,
                                 const WeightsView& view, Report& report, Context& ctx) {
  nlohmann::ordered_json t = {{"name", r.tc.term.name},
                              {"reduce", mode_name(r.tc.term.reduce)},
                              {"coef", r.tc.term.coef},
                              {"mask", r.tc.term.mask.text()},
                              {"contract", contract_json(r.tc.contract)},
                              {"effective_tokens", r.effective},
                              {"relative_to_main", r.is_main() ? 1.0 : result.main_scale},
                              {"ok", !r.verdict.fails},
                              {"diagnosis", diagnosis_json(r.dg)},
                              {"invariance", invariance_json(r.invariance)}};
  if (view.per_token && ctx.want_json)
    t["samples"] = report.raw_value(per_token_json(r.batch(), r.got.weight, r.truth));
  return t;
}

// The JSON results: the main term's contract, the layout, and the step.
void add_results(const oracle::WeightsResult& result, const Batch& b, const WeightsView& view,
                 Report& report, Context& ctx) {
  const oracle::TermWeights& main = result.terms.front();
  const StepLayout& layout = *view.layout;
  auto& res = report.results();
  res["reduce"] = mode_name(main.tc.term.reduce);
  res["contract"] = contract_json(main.tc.contract);
  res["layout"] = {{"dp", layout.dp},
                   {"cp", layout.cp},
                   {"tp", layout.tp},
                   {"microbatches", max_microbatches(layout)},
                   {"split", mode_name(view.split)},
                   {"cp_layout", mode_name(layout.cp_layout)},
                   {"source", layout.source}};
  nlohmann::ordered_json step = {{"step", view.step}, {"diagnosis", diagnosis_json(main.dg)}};
  step["invariance"] = invariance_json(main.invariance);
  step["layout_problems"] = main.got.problems;
  if (view.per_token && ctx.want_json)
    step["samples"] = report.raw_value(per_token_json(b, main.got.weight, main.truth));
  if (result.multi()) {
    nlohmann::ordered_json terms = nlohmann::ordered_json::array();
    for (const auto& r : result.terms) terms.push_back(term_json(result, r, view, report, ctx));
    step["terms"] = std::move(terms);
  }
  res["steps"] = nlohmann::ordered_json::array({step});
}

}  // namespace

void render_weights(const oracle::WeightsResult& result, const Batch& b, const WeightsView& view,
                    Report& report, Context& ctx) {
  render_text(result, b, view, ctx.out);
  report.add_findings(result.findings);
  const oracle::TermWeights& main = result.terms.front();
  if (!view.svg_path.empty()) {
    std::ofstream svg(view.svg_path);
    if (!(svg << weights_svg(*view.layout, main.shards, main.summary, main.tc.contract)))
      throw_input_error("{}: cannot write the SVG", view.svg_path);
  }
  add_cases(result, report);
  add_results(result, b, view, report, ctx);
}

}  // namespace lossguard::cli
