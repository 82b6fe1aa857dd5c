// `lossguard weights`: the effective weight of every token's loss in the applied gradient under a
// trainer's normalisation contract on a layout, against the objective's (SPEC §9); the diagnosis of
// their ratio and split invariance (I5).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <iterator>
#include <fstream>

#include "cli/command.h"
#include "cli/inputs.h"
#include "cli/placement_options.h"
#include "cli/steps.h"
#include "cli/weights_report.h"
#include "core/contract.h"
#include "core/errors.h"
#include "oracle/findings.h"
#include "oracle/weights.h"

namespace lossguard::cli {

namespace {

struct WeightsOptions {
  DumpOptions dumps;
  std::string reduce = "per-token";
  std::string contract;
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

void weights_step(const WeightsOptions& o, const StepView& v, Reduction reduce,
                  const Contract& contract, Report& report, Context& ctx);

void run_weights(const WeightsOptions& o, Report& report, Context& ctx) {
  Reduction reduce;
  if (!parse_reduction(o.reduce, &reduce)) {
    throw_input_error("--reduce must be {}, got '{}'", mode_choices<Reduction>(), o.reduce);
  }
  const Contract contract = parse_contract(o.contract, reduce);
  if (o.cp < 1 || o.tp < 1) throw_input_error("--cp and --tp must be >= 1");
  Split split;
  if (!parse_mode(o.placement.split, &split)) {
    throw_input_error("--split must be {}, got '{}'", mode_choices<Split>(), o.placement.split);
  }
  LoadedBatch loaded = load_batch(o.dumps, report, ctx, LoadNeeds{false, false, false});
  if (loaded.batch.num_samples() == 0) throw UnverifiedError("the dumps hold no samples");
  run_per_step(loaded.batch, o.dumps.step, report, ctx,
               [&](const StepView& v) { weights_step(o, v, reduce, contract, report, ctx); });
}

void weights_step(const WeightsOptions& o, const StepView& v, Reduction reduce,
                  const Contract& contract, Report& report, Context& ctx) {
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
  oracle::ObjectiveSizes sizes{o.global_batch_size, o.l_norm};
  if (sizes.global_batch_size == 0 && b.metadata.contains("global_batch_size") &&
      b.metadata["global_batch_size"].is_number_integer()) {
    sizes.global_batch_size = b.metadata["global_batch_size"].get<int64_t>();
  }
  sizes = oracle::resolve_sizes(b, sizes);

  const std::vector<double> truth = oracle::true_weights(b, reduce, sizes);
  const oracle::ContractWeights got = oracle::contract_weights(b, layout, contract, sizes);
  int64_t effective = 0;
  for (uint8_t m : b.loss_mask) effective += m;
  const oracle::WeightDiagnosis dg = oracle::diagnose_weights(b, got.weight, truth, got.place,
                                                              layout, effective, got.global_count);
  oracle::Variations vary{false, false, false};
  for (const auto& v : o.vary) {
    if (v == "dp")
      vary.dp = true;
    else if (v == "microbatches")
      vary.microbatches = true;
    else if (v == "cp")
      vary.cp = true;
    else if (v != "none")
      throw_input_error("--vary takes dp, microbatches, cp or none, got '{}'", v);
  }
  const auto invariance =
      oracle::check_split_invariance(b, layout, contract, sizes, split, truth, vary, &got);
  const auto shards = oracle::shard_ratios(b, got.weight, truth, got.place, layout);

  const oracle::WeightsVerdict verdict_of =
      oracle::weights_verdict(dg, got, invariance, o.strict_scale);
  const bool here_fails = verdict_of.here_fails, fails = verdict_of.fails;
  const oracle::InvarianceResult* first_break = verdict_of.first_break;

  std::ostream& out = ctx.out;
  out << fmt::format("lossguard weights: {} samples, {} effective tokens; objective {} (B = {})\n",
                     b.num_samples(), effective, mode_name(reduce), sizes.global_batch_size);
  out << fmt::format("contract {}{}\n", contract.preset.empty() ? "" : contract.preset + " = ",
                     contract_components(contract));
  int64_t max_m = 0;
  for (int64_t m : layout.microbatches_per_rank()) max_m = std::max(max_m, m);
  out << fmt::format("layout: DP {} x {} micro-batch(es), CP {} ({}), TP {} (from {})\n\n",
                     layout.dp, max_m, layout.cp, mode_name(layout.cp_layout), layout.tp,
                     layout_source);
  for (const auto& p : got.problems) out << "  layout problem: " << p << "\n";
  out << fmt::format("weights: {}\n", dg.summary());
  if (!dg.exact() && shards.size() <= 64 * 8) {
    out << fmt::format(
        "\n  ratio w/w* per micro-batch (rows) and CP rank (columns):\n  {:>8} {:>4} |", "DP rank",
        "mb");
    for (int64_t c = 0; c < layout.cp; ++c) out << fmt::format(" {:>11}", fmt::format("cp{}", c));
    out << "\n";
    for (std::size_t k = 0; k < layout.microbatches.size() && k < 32; ++k) {
      out << fmt::format("  {:>8} {:>4} |", layout.microbatches[k].dp_rank,
                         layout.microbatches[k].index);
      for (int64_t c = 0; c < layout.cp; ++c)
        out << fmt::format(" {:>11}", ratio_text(shards[k * layout.cp + c]));
      out << "\n";
    }
  }
  int64_t broken = 0;
  for (const auto& r : invariance) broken += !r.ok;
  if (first_break == nullptr) {
    out << fmt::format(
        "\nI5 split invariance: the same weights on all {} variations ({} of 1, 2, 4, 8)\n",
        invariance.size(), fmt::join(o.vary, ", "));
  } else {
    out << fmt::format(
        "\nI5 split invariance: BREAKS on {} of {} variations; first: {} (weights differ from this "
        "layout's by up to {:.3g}; sample {} response index {})\n  on {}: {}\n",
        broken, invariance.size(), first_break->label, first_break->max_rel_diff,
        first_break->worst.sample, first_break->worst.response_index, first_break->label,
        first_break->against_truth.summary());
  }
  if (o.per_token) {
    out << fmt::format("\n{:>6} {:>4} {:>4}  weights (w / w*)\n", "sample", "dp", "mb");
    for (int64_t i = 0; i < b.num_samples() && i < 200; ++i) {
      const int32_t k = got.place.sample_microbatch[i];
      std::string ws;
      for (int64_t t = b.response_offsets[i];
           t < b.response_offsets[i + 1] && t < b.response_offsets[i] + 8; ++t) {
        ws += fmt::format(" {:.4g}/{:.4g}", got.weight[t], truth[t]);
      }
      if (b.response_lengths[i] > 8) ws += " ...";
      out << fmt::format("{:>6} {:>4} {:>4} {}\n", i, k < 0 ? -1 : layout.microbatches[k].dp_rank,
                         k < 0 ? -1 : layout.microbatches[k].index, ws);
    }
  }
  const std::string verdict =
      fails ? (here_fails ? "FAIL: the contract does not weight tokens as the objective says"
                          : fmt::format("FAIL: the weights change with the layout (first on {})",
                                        first_break->label))
      : dg.kind == "uniform-scale"
          ? "pass (a uniform scale; --strict-scale makes it fail)"
          : "pass: every token weighted as the objective says, on every layout tried";
  out << fmt::format("\nverdict: {}\n", verdict);

  if (!o.svg_path.empty()) {
    std::ofstream svg(o.svg_path);
    if (!(svg << weights_svg(layout, shards, dg, contract)))
      throw_input_error("{}: cannot write the SVG", o.svg_path);
  }

  report.add_case({"lossguard.weights", "weights on the given layout", !dg.fails(o.strict_scale),
                   dg.summary(), false});
  for (const auto& r : invariance) {
    report.add_case({"lossguard.weights", "I5 " + r.label, r.ok,
                     r.ok ? ""
                          : fmt::format("weights differ from the base layout's by up to {:.3g}; {}",
                                        r.max_rel_diff, r.against_truth.summary()),
                     false});
  }
  auto& res = report.results();
  res["reduce"] = mode_name(reduce);
  res["contract"] = {{"count", mode_name(contract.count)},
                     {"clamp", mode_name(contract.clamp)},
                     {"norm", norm_text(contract)},
                     {"sample", mode_name(contract.sample)},
                     {"scale", scale_text(contract.scale)},
                     {"grad", contract.grad == GradRule::kMean
                                  ? fmt::format("mean:{}", mode_name(contract.grad_group))
                                  : std::string(mode_name(contract.grad))},
                     {"preset", contract.preset.empty() ? nlohmann::ordered_json(nullptr)
                                                        : nlohmann::ordered_json(contract.preset)}};
  res["layout"] = {{"dp", layout.dp},           {"cp", layout.cp},
                   {"tp", layout.tp},           {"microbatches", max_m},
                   {"split", mode_name(split)}, {"cp_layout", mode_name(layout.cp_layout)},
                   {"source", layout.source}};
  const int64_t step_number = !v.layout_source.empty() ? v.step
                             : b.metadata.contains("step") && b.metadata["step"].is_number_integer()
                                  ? b.metadata["step"].get<int64_t>()
                                  : 0;
  nlohmann::ordered_json step = {{"step", step_number}, {"diagnosis", diagnosis_json(dg)}};
  nlohmann::ordered_json inv = nlohmann::ordered_json::array();
  for (const auto& r : invariance) {
    inv.push_back({{"layout", r.layout},
                   {"ok", r.ok},
                   {"max_rel_diff", r.max_rel_diff},
                   {"against_truth", r.against_truth.kind}});
  }
  step["invariance"] = inv;
  step["layout_problems"] = got.problems;
  if (o.per_token && ctx.want_json) {
    // Written as text (10 M tokens would be a 10 M-node tree): {"index", "weights", "truth"} per
    // sample, numbers in their shortest round-trip form, non-finite ones as null (as nlohmann).
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
      fmt::format_to(std::back_inserter(text), "{}\n    {{\"index\": {}, \"weights\": ",
                     i > 0 ? "," : "", i);
      list(got.weight, b.response_offsets[i], b.response_offsets[i + 1]);
      text.append(std::string_view(", \"truth\": "));
      list(truth, b.response_offsets[i], b.response_offsets[i + 1]);
      text.push_back('}');
    }
    text.append(std::string_view(b.num_samples() > 0 ? "\n  ]" : "]"));
    step["samples"] = report.raw_value(std::move(text));
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
    presets += fmt::format("  {:<28} {}\n", p.name, p.models);
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
      "  w_t = m_t * scale / max(D, 1) * (1/max(m_i, 1) if sample=mean) / (|G| if grad=mean:G)\n"
      "Presets (--reduce picks the per-token or sample-mean form where the trainer has both):\n" +
      presets +
      "Diagnosis of r = w / w*: exact, uniform-scale (named as a product of cp, dp, tp, M), "
      "masked-weight,\n"
      "per-rank, per-microbatch, per-cp-shard, per-sample or mixed, with the worst token.\n"
      "Exit 1 when the weights differ from the objective's on the layout or on a variation of it "
      "(a\n"
      "uniform scale only with --strict-scale).\n"
      "Examples:\n"
      "  lossguard weights batch.safetensors --contract hf-ga --dp 2 --microbatches 4\n"
      "  lossguard weights batch.safetensors --contract megatron-per-token,norm=global:dp --cp 2 "
      "--dp 2\n"
      "  lossguard weights batch.safetensors --reduce sample-mean --contract slime --dp 4 --cp 2 "
      "--svg w.svg");
  add_dump_options(*app, opts->dumps, true);
  add_step_option(*app, opts->dumps);
  app->add_option("--reduce", opts->reduce, "The objective: " + mode_choices<Reduction>())
      ->capture_default_str();
  app->add_option("--contract", opts->contract,
                  "The trainer's contract: a preset or key=value,... (see below)")
      ->required();
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
  app->add_option(
      "--global-batch-size", opts->global_batch_size,
      "B of the sample-mean objectives (default: the dump's global_batch_size, else its samples)")
      ->check(CLI::Range(int64_t{1}, kMaxCount));
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
