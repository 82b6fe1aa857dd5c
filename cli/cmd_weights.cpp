// `lossguard weights`: the effective weight of every token's loss in the applied gradient under a
// trainer's normalisation contract on a layout, against the objective's (SPEC §9); the diagnosis of
// their ratio and split invariance (I5).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <iterator>
#include <optional>

#include "cli/command.h"
#include "cli/inputs.h"
#include "cli/placement_options.h"
#include "cli/steps.h"
#include "cli/weights_report.h"
#include "core/contract.h"
#include "core/errors.h"
#include "core/term.h"
#include "oracle/findings.h"
#include "oracle/weights.h"

namespace lossguard::cli {

namespace {

struct WeightsOptions {
  DumpOptions dumps;
  std::string reduce = "per-token";
  std::vector<std::string> contracts;  // the main term's, and NAME=C per declared term
  std::vector<std::string> terms;      // NAME:REDUCE[:COEF][:MASK]
  int64_t cp = 1, tp = 1;
  CpLayoutOptions cp_layout;
  LayoutOptions layout;
  PlacementOptions placement;
  int64_t global_batch_size = 0;
  double l_norm = 0.0;
  bool per_token = false;
  bool strict_scale = false;
  std::string svg_path;
  std::vector<std::string> vary = {"dp", "microbatches", "cp"};
};

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

// A term as `weights` weighs it: its declaration and the contract its trainer applies to it.
struct TermContract {
  Term term;
  Contract contract;
};

void weights_step(const WeightsOptions& o, const StepView& v,
                  const std::vector<TermContract>& terms, Report& report, Context& ctx);

// The main term from --reduce and the unqualified --contract; one more per --term, with its own
// `--contract NAME=C` or else the main term's contract.
std::vector<TermContract> parse_terms(const WeightsOptions& o) {
  Term main_term;
  if (!parse_reduction(o.reduce, &main_term.reduce)) {
    throw_input_error("--reduce must be {}, got '{}'", mode_choices<Reduction>(), o.reduce);
  }
  std::vector<TermContract> out{{main_term, {}}};
  for (const auto& text : o.terms) {
    Term t = parse_term(text);
    if (t.name == kMainTerm) {
      throw_input_error("--term {}: 'main' is the term of --reduce and --contract; name the others",
                        text);
    }
    if (t.mask.kind == TermMaskKind::kField) {
      throw_input_error(
          "--term {}: a field mask is recorded by a trainer (audit); weights derives masks from "
          "the dump: loss, all or shift:J",
          t.name);
    }
    for (const auto& have : out) {
      if (have.term.name == t.name) throw_input_error("--term {} is given twice", t.name);
    }
    out.push_back({t, {}});
  }
  std::vector<std::optional<std::string>> given(out.size());
  for (const auto& text : o.contracts) {
    std::size_t k = 0;
    std::string body = text;
    const std::size_t eq = text.find('=');
    if (eq != std::string::npos && valid_term_name(text.substr(0, eq))) {
      const std::string name = text.substr(0, eq);
      body = text.substr(eq + 1);
      for (k = 0; k < out.size() && out[k].term.name != name; ++k) {
      }
      if (k == out.size()) {
        throw_input_error("--contract {}: no term '{}' (declare it with --term {}:REDUCE)", text,
                          name, name);
      }
    }
    if (given[k]) {
      throw_input_error("--contract: two contracts for term {}: '{}' and '{}'", out[k].term.name,
                        *given[k], body);
    }
    given[k] = body;
  }
  if (!given[0]) {
    throw_input_error(
        "--contract: no contract for the main term (give a preset or key=value "
        "without a NAME= prefix)");
  }
  for (std::size_t k = 0; k < out.size(); ++k) {
    out[k].contract = parse_contract(given[k] ? *given[k] : *given[0], out[k].term.reduce);
  }
  return out;
}

void run_weights(const WeightsOptions& o, Report& report, Context& ctx) {
  const std::vector<TermContract> terms = parse_terms(o);
  if (o.cp < 1 || o.tp < 1) throw_input_error("--cp and --tp must be >= 1");
  Split split;
  if (!parse_mode(o.placement.split, &split)) {
    throw_input_error("--split must be {}, got '{}'", mode_choices<Split>(), o.placement.split);
  }
  LoadedBatch loaded = load_batch(o.dumps, report, ctx, LoadNeeds{false, false, false});
  if (loaded.batch.num_samples() == 0) throw UnverifiedError("the dumps hold no samples");
  run_per_step(loaded.batch, o.dumps.step, report, ctx,
               [&](const StepView& v) { weights_step(o, v, terms, report, ctx); });
}

// One term weighed on the layout: its own batch (its mask), truth, contract weights, diagnosis and
// I5. Terms other than main are judged relative to main: their truth carries main's uniform scale
// (a policy term off by ×2 under Adam is harmless; a KL term that is not off with it is not).
struct TermRun {
  TermContract tc;
  std::optional<Batch> own;           // the term's batch when its mask is not the loss mask
  const Batch* step_batch = nullptr;  // else the step's
  const Batch& batch() const { return own ? *own : *step_batch; }
  std::vector<double> truth_per_sample;  // w*_t = m_t · this[i]
  std::vector<double> truth;             // per token: with --per-token only
  oracle::ContractWeights got;           // weight and place: with --per-token only
  int64_t effective = 0;
  oracle::WeightDiagnosis dg;
  std::vector<oracle::InvarianceResult> invariance;
  std::vector<oracle::ShardRatio> shards;
  oracle::WeightsVerdict verdict;
  oracle::ObjectiveSizes sizes;
  bool strict_scale = false;
  bool is_main() const { return tc.term.name == kMainTerm; }
};

TermRun weigh_term(const TermContract& tc, const Batch& step_batch, const StepLayout& layout,
                   const oracle::ObjectiveSizes& sizes, double relative_to, bool strict_scale,
                   bool per_token, const oracle::PlacedTokens* placed = nullptr) {
  TermRun run;
  run.tc = tc;
  if (tc.term.mask.kind != TermMaskKind::kLoss) {
    run.own = with_mask(step_batch, term_mask(step_batch, tc.term.mask));
  }
  run.step_batch = &step_batch;
  const Batch& b = run.batch();
  run.truth_per_sample = oracle::true_sample_weights(b, tc.term.reduce, sizes);
  if (relative_to != 1.0) {
    for (double& w : run.truth_per_sample) w *= relative_to;
  }
  for (uint8_t m : b.loss_mask) run.effective += m;
  run.sizes = sizes;
  run.strict_scale = strict_scale;
  if (!per_token) {  // the summary from each sample's owner runs: no per-token vector
    oracle::WeightsSummary sum = oracle::summarize_weights(b, layout, tc.contract, sizes,
                                                           run.truth_per_sample, run.effective);
    run.dg = std::move(sum.diagnosis);
    run.shards = std::move(sum.shards);
    run.got.global_count = sum.global_count;
    run.got.problems = std::move(sum.problems);
    return run;  // I5 and the verdict: weigh_invariance, for every term at once
  }
  run.truth = oracle::per_token_weights(b, run.truth_per_sample);
  run.got = oracle::contract_weights(b, layout, tc.contract, sizes, placed);
  run.dg = oracle::diagnose_weights(b, run.got.weight, run.truth, run.got.place, layout,
                                    run.effective, run.got.global_count);
  run.shards = oracle::shard_ratios(b, run.got.weight, run.truth, run.got.place, layout);
  return run;
}

// I5 of every term at once (each variation placed once), then each term's verdict.
void weigh_invariance(std::vector<TermRun>& runs, const StepLayout& layout, Split split,
                      oracle::Variations vary) {
  std::vector<oracle::TermInvariance> inputs;
  for (const TermRun& r : runs)
    // main's JSON diagnoses every variation that breaks (as before terms); a term, its first
    inputs.push_back({&r.batch(), &r.tc.contract, r.sizes, r.truth.empty() ? nullptr : &r.truth,
                      r.got.weight.empty() ? nullptr : &r.got, &r.dg, &r.truth_per_sample,
                      r.is_main()});
  auto invariance = oracle::check_split_invariance_terms(inputs, layout, split, vary);
  for (std::size_t k = 0; k < runs.size(); ++k) {
    runs[k].invariance = std::move(invariance[k]);
    runs[k].verdict =
        oracle::weights_verdict(runs[k].dg, runs[k].got, runs[k].invariance, runs[k].strict_scale);
  }
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
void print_term(std::ostream& out, const TermRun& run, const StepLayout& layout,
                const WeightsOptions& o) {
  const Batch& b = run.batch();
  const auto& dg = run.dg;
  out << fmt::format("weights: {}\n", dg.summary());
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
  int64_t broken = 0;
  for (const auto& r : run.invariance) broken += !r.ok;
  const oracle::InvarianceResult* first_break = run.verdict.first_break;
  if (run.invariance.empty()) {
    out << "\nI5 split invariance: not checked (--vary none, or no variation holds the batch)\n";
  } else if (first_break == nullptr) {
    out << fmt::format(
        "\nI5 split invariance: the same weights on all {} variations ({} of 1, 2, 4, 8)\n",
        run.invariance.size(), fmt::join(o.vary, ", "));
  } else {
    out << fmt::format(
        "\nI5 split invariance: BREAKS on {} of {} variations; first: {} (weights differ from this "
        "layout's by up to {:.3g}; sample {} response index {})\n  on {}: {}\n",
        broken, run.invariance.size(), first_break->label, first_break->max_rel_diff,
        first_break->worst.sample, first_break->worst.response_index, first_break->label,
        first_break->against_truth.summary());
  }
  if (o.per_token) {
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

void weights_step(const WeightsOptions& o, const StepView& v,
                  const std::vector<TermContract>& terms, Report& report, Context& ctx) {
  const Batch& b = *v.batch;
  Split split = Split::kContiguous;
  parse_mode(o.placement.split, &split);  // validated by run_weights
  // The trainer's own layout where the dump records it, else the flags'.
  const std::string layout_source =
      v.layout != nullptr ? v.layout_source
                          : (o.dumps.dp_shards ? "the dumps: one per DP rank" : "flags");
  StepLayout layout = o.cp_layout.step_layout(
      b, v.layout != nullptr ? *v.layout : o.placement.placement(b, o.dumps.dp_shards), o.cp, o.tp,
      o.layout.layout());
  layout.source = v.layout != nullptr || o.dumps.dp_shards ? "dump" : "flags";
  const oracle::ObjectiveSizes sizes =
      oracle::resolve_sizes(b, {global_batch_size_of(o.global_batch_size, b), o.l_norm});
  oracle::Variations vary{false, false, false};
  for (const auto& x : o.vary) {
    if (x == "dp")
      vary.dp = true;
    else if (x == "microbatches")
      vary.microbatches = true;
    else if (x == "cp")
      vary.cp = true;
    else if (x != "none")
      throw_input_error("--vary takes dp, microbatches, cp or none, got '{}'", x);
  }

  // Main first: the other terms are judged relative to its scale.
  std::vector<TermRun> runs;
  runs.push_back(weigh_term(terms[0], b, layout, sizes, 1.0, o.strict_scale, o.per_token));
  const double main_scale = runs[0].dg.kind == "uniform-scale" ? runs[0].dg.scale : 1.0;
  oracle::ObjectiveSizes term_sizes = sizes;
  term_sizes.main_mask = &b.loss_mask;  // count-of=main
  // Every term's samples sit where main's do: one placement for all.
  const oracle::PlacedTokens placed{runs[0].got.place, runs[0].got.problems};
  for (std::size_t k = 1; k < terms.size(); ++k) {
    runs.push_back(weigh_term(terms[k], b, layout, term_sizes, main_scale, true, o.per_token,
                              o.per_token ? &placed : nullptr));
  }
  weigh_invariance(runs, layout, split, vary);
  const bool multi = runs.size() > 1;
  bool fails = false;
  for (const auto& r : runs) fails |= r.verdict.fails;

  std::ostream& out = ctx.out;
  const TermRun& main = runs[0];
  const Contract& contract = main.tc.contract;
  out << fmt::format("lossguard weights: {} samples, {} effective tokens; objective {} (B = {})\n",
                     b.num_samples(), main.effective, mode_name(main.tc.term.reduce),
                     sizes.global_batch_size);
  out << fmt::format("contract {}{}\n", contract.preset.empty() ? "" : contract.preset + " = ",
                     contract_components(contract));
  int64_t max_m = 0;
  for (int64_t m : layout.microbatches_per_rank()) max_m = std::max(max_m, m);
  out << fmt::format("layout: DP {} x {} micro-batch(es), CP {} ({}), TP {} (from {})\n\n",
                     layout.dp, max_m, layout.cp, mode_name(layout.cp_layout), layout.tp,
                     layout_source);
  for (const auto& p : main.got.problems) out << "  layout problem: " << p << "\n";
  std::vector<oracle::Finding> findings;
  for (const auto& r : runs) {
    if (multi) {
      const Contract& c = r.tc.contract;
      out << fmt::format(
          "term {} ({} tokens){}\n  contract {}{}\n", term_text(r.tc.term), r.effective,
          r.is_main() ? "" : fmt::format(", judged relative to main (×{:.6g})", main_scale),
          c.preset.empty() ? "" : c.preset + " = ", contract_components(c));
    }
    print_term(out, r, layout, o);
    if (multi) out << "\n";
    if (multi && !r.is_main() && r.verdict.here_fails && r.dg.kind != "exact") {
      findings.push_back(
          {"term_normalisation",
           fmt::format("term {}: {} relative to main", r.tc.term.name, r.dg.summary()),
           {{"term", r.tc.term.name},
            {"diagnosis", r.dg.kind},
            {"scale", r.dg.kind == "uniform-scale" ? r.dg.scale : 1.0},
            {"named", r.dg.named}}});
    }
  }
  if (multi) {
    out << "terms relative to main:\n";
    for (std::size_t k = 1; k < runs.size(); ++k) {
      const TermRun& r = runs[k];
      out << fmt::format(
          "  {:<12} {}\n", r.tc.term.name,
          r.verdict.fails
              ? (r.verdict.here_fails ? r.dg.summary()
                                      : fmt::format("changes with the layout (first on {})",
                                                    r.verdict.first_break->label))
              : "as declared");
    }
  }
  std::string verdict;
  if (!fails) {
    verdict = main.dg.kind == "uniform-scale"
                  ? "pass (a uniform scale; --strict-scale makes it fail)"
                  : "pass: every token weighted as the objective says, on every layout tried";
  } else {
    std::vector<std::string> failing;
    for (const auto& r : runs) {
      if (r.verdict.fails) failing.push_back(r.tc.term.name);
    }
    const TermRun& first =
        *std::find_if(runs.begin(), runs.end(), [](const TermRun& r) { return r.verdict.fails; });
    verdict = first.verdict.here_fails
                  ? "FAIL: the contract does not weight tokens as the objective says"
                  : fmt::format("FAIL: the weights change with the layout (first on {})",
                                first.verdict.first_break->label);
    if (multi)
      verdict +=
          fmt::format(" (term{} {})", failing.size() > 1 ? "s" : "", fmt::join(failing, ", "));
  }
  out << fmt::format("\nverdict: {}\n", verdict);
  report.add_findings(findings);

  if (!o.svg_path.empty()) {
    std::ofstream svg(o.svg_path);
    if (!(svg << weights_svg(layout, main.shards, main.dg, contract)))
      throw_input_error("{}: cannot write the SVG", o.svg_path);
  }

  for (const auto& r : runs) {
    const std::string suffix = multi ? fmt::format(" [{}]", r.tc.term.name) : "";
    report.add_case({"lossguard.weights", "weights on the given layout" + suffix,
                     !r.verdict.here_fails, r.dg.summary(), false});
    for (const auto& inv : r.invariance) {
      report.add_case(
          {"lossguard.weights", "I5 " + inv.label + suffix, inv.ok,
           inv.ok ? ""
                  : fmt::format("weights differ from the base layout's by up to {:.3g}; {}",
                                inv.max_rel_diff, inv.against_truth.summary()),
           false});
    }
  }
  auto invariance_json = [](const std::vector<oracle::InvarianceResult>& invariance) {
    nlohmann::ordered_json inv = nlohmann::ordered_json::array();
    for (const auto& r : invariance) {
      inv.push_back({{"layout", r.layout},
                     {"ok", r.ok},
                     {"max_rel_diff", r.max_rel_diff},
                     {"against_truth", r.against_truth.kind}});
    }
    return inv;
  };
  auto& res = report.results();
  res["reduce"] = mode_name(main.tc.term.reduce);
  res["contract"] = contract_json(contract);
  res["layout"] = {{"dp", layout.dp},           {"cp", layout.cp},
                   {"tp", layout.tp},           {"microbatches", max_m},
                   {"split", mode_name(split)}, {"cp_layout", mode_name(layout.cp_layout)},
                   {"source", layout.source}};
  const int64_t step_number =
      !v.layout_source.empty() ? v.step
      : b.metadata.contains("step") && b.metadata["step"].is_number_integer()
          ? b.metadata["step"].get<int64_t>()
          : 0;
  nlohmann::ordered_json step = {{"step", step_number}, {"diagnosis", diagnosis_json(main.dg)}};
  step["invariance"] = invariance_json(main.invariance);
  step["layout_problems"] = main.got.problems;
  if (o.per_token && ctx.want_json) {
    step["samples"] = report.raw_value(per_token_json(b, main.got.weight, main.truth));
  }
  if (multi) {
    nlohmann::ordered_json terms_json = nlohmann::ordered_json::array();
    for (const auto& r : runs) {
      nlohmann::ordered_json t = {{"name", r.tc.term.name},
                                  {"reduce", mode_name(r.tc.term.reduce)},
                                  {"coef", r.tc.term.coef},
                                  {"mask", r.tc.term.mask.text()},
                                  {"contract", contract_json(r.tc.contract)},
                                  {"effective_tokens", r.effective},
                                  {"relative_to_main", r.is_main() ? 1.0 : main_scale},
                                  {"ok", !r.verdict.fails},
                                  {"diagnosis", diagnosis_json(r.dg)},
                                  {"invariance", invariance_json(r.invariance)}};
      if (o.per_token && ctx.want_json) {
        t["samples"] = report.raw_value(per_token_json(r.batch(), r.got.weight, r.truth));
      }
      terms_json.push_back(std::move(t));
    }
    step["terms"] = std::move(terms_json);
  }
  res["steps"] = nlohmann::ordered_json::array({step});
  report.verified();
  if (fails) report.fail();
}

}  // namespace

void register_weights(CLI::App& root, Commands& commands) {
  auto cmd = std::make_unique<Command>();
  auto opts = std::make_shared<WeightsOptions>();
  CLI::App* app = root.add_subcommand(
      "weights",
      "The effective weight of each token's loss in the applied gradient under a trainer's "
      "normalisation contract and layout, against the objective's; names the bug from the shape of "
      "the "
      "difference and checks that the weights do not depend on the layout (I5)");
  cmd->app = app;
  std::string presets;
  for (const auto& p : contract_presets())
    presets += fmt::format("  {:<28} {}{}\n", p.name, p.term_only ? "[a --term] " : "", p.models);
  app->footer(
      "A contract is a preset or key=value components (defaults in brackets):\n"
      "  count  [cp-local] | full-sample | samples      what a rank counts for a micro-batch\n"
      "  clamp  [none] | per-sample | at-cp1            each sample's count taken as max(count, "
      "1)\n"
      "  norm   [none] | microbatch | rank | global:G   the denominator D: 1, the micro-batch's "
      "count,\n"
      "                                                 the rank's count over its micro-batches, "
      "or that\n"
      "                                                 all-reduced over G = dp-cp | dp | cp | "
      "world\n"
      "  sample [none] | mean                           divide each sample's sum by its mask sum "
      "first\n"
      "  scale  [1] | products of cp, dp, tp, M, B, Bnz, L, numbers and 1/x   compensation "
      "factors\n"
      "  grad   [sum] | mean:G                          gradients summed over DP x CP, then / |G|\n"
      "  count-of [term] | main                         a --term counted under its own mask or "
      "main's\n"
      "  w_t = m_t * scale / max(D, 1) * (1/max(m_i, 1) if sample=mean) / (|G| if grad=mean:G)\n"
      "Presets (--reduce picks the per-token or sample-mean form where the trainer has both):\n" +
      presets +
      "Diagnosis of r = w / w*: exact, uniform-scale (named as a product of cp, dp, tp, M), "
      "masked-weight,\n"
      "per-rank, per-microbatch, per-cp-shard, per-sample or mixed, with the worst token.\n"
      "Exit 1 when the weights differ from the objective's on the layout or on a variation of it "
      "(a\n"
      "uniform scale only with --strict-scale).\n"
      "Terms (docs/semantics.md §11): each --term is weighed over its own mask as its own "
      "objective, under its\n"
      "own contract, and judged relative to the main term's scale: a term off by any factor "
      "relative to main fails\n"
      "(a KL averaged per micro-batch while the policy term uses the global count: ×M).\n"
      "Examples:\n"
      "  lossguard weights batch.safetensors --contract hf-ga --dp 2 --microbatches 4\n"
      "  lossguard weights batch.safetensors --contract megatron-per-token --term kl:per-token:0.1 "
      "--contract kl=norm=microbatch --microbatches 4\n"
      "  lossguard weights batch.safetensors --contract megatron-per-token,norm=global:dp --cp 2 "
      "--dp 2\n"
      "  lossguard weights batch.safetensors --reduce sample-mean --contract slime --dp 4 --cp 2 "
      "--svg w.svg");
  add_dump_options(*app, opts->dumps, true);
  add_step_option(*app, opts->dumps);
  app->add_option("--reduce", opts->reduce, "The objective: " + mode_choices<Reduction>())
      ->capture_default_str();
  app->add_option("--contract", opts->contracts,
                  "The trainer's contract: a preset or key=value,... (see below); with --term, "
                  "NAME=C gives term NAME its own (default: the main term's)")
      ->required()
      ->allow_extra_args(false);
  app->add_option("--term", opts->terms,
                  "A loss term besides the main one (repeatable): NAME:REDUCE[:COEF][:MASK], MASK "
                  "= loss (default), all (every response token), shift:J (m_t·m_t+J: depth J of a "
                  "multi-token "
                  "prediction loss) or roll:J (m_t+J: Megatron-core's MTP mask)")
      ->allow_extra_args(false);
  app->add_option("--cp", opts->cp, "Context-parallel size")
      ->check(CLI::Range(int64_t{1}, kMaxCp))
      ->capture_default_str();
  app->add_option("--tp", opts->tp,
                  "Tensor-parallel size (counts summed over the world group include it)")
      ->check(CLI::Range(int64_t{1}, kMaxCp))
      ->capture_default_str();
  add_cp_layout_options(*app, opts->cp_layout);
  add_layout_options(*app, opts->layout);
  add_placement_options(*app, opts->placement, false);
  add_global_batch_size_option(*app, opts->global_batch_size);
  app->add_option("--l-norm", opts->l_norm,
                  "L_norm of seq-mean-token-sum-norm, in tokens (default: the longest response)")
      ->check(CLI::Range(1.0, static_cast<double>(kMaxCount)));
  app->add_flag("--per-token", opts->per_token,
                "Show (and put in --json) every token's weight beside the truth");
  app->add_flag("--strict-scale", opts->strict_scale,
                "A uniform scale fails too (clipping and weight decay see it)");
  app->add_option("--svg", opts->svg_path, "Draw the ratio per micro-batch and CP rank");
  app->add_option("--vary", opts->vary,
                  "Which layout sizes I5 varies (1, 2, 4, 8 each): dp, microbatches, cp, or none "
                  "(a trainer without context parallelism: --vary dp,microbatches)")
      ->delimiter(',')
      ->capture_default_str();
  add_output_options(*app, cmd->output);
  cmd->run = [opts](Report& r, Context& c) { run_weights(*opts, r, c); };
  commands.push_back(std::move(cmd));
}

}  // namespace lossguard::cli
