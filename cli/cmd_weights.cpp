// `lossguard weights`: the effective weight of every token's loss in the applied gradient under a
// trainer's normalisation contract on a layout, against the objective's (SPEC §9); the diagnosis of
// their ratio and split invariance (I5). oracle::evaluate_weights decides; cli/weights_render.cpp
// prints.
#include <fmt/format.h>

#include "cli/command.h"
#include "cli/inputs.h"
#include "cli/mode_option.h"
#include "cli/placement_options.h"
#include "cli/steps.h"
#include "cli/weights_render.h"
#include "core/contract.h"
#include "core/errors.h"
#include "core/term.h"
#include "oracle/weights/weights_result.h"

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

// One step on the trainer's own layout where the dump records it, else the flags'.
void weights_step(const WeightsOptions& o, const StepView& v, oracle::WeightsRequest request,
                  Report& report, Context& ctx) {
  const Batch& b = *v.batch;
  request.layout = o.cp_layout.step_layout(
      b, v.layout != nullptr ? *v.layout : o.placement.placement(b, o.dumps.dp_shards), o.cp, o.tp,
      o.layout.layout());
  request.layout.source = v.layout != nullptr || o.dumps.dp_shards ? "dump" : "flags";
  request.sizes =
      oracle::resolve_sizes(b, {global_batch_size_of(o.global_batch_size, b), o.l_norm});
  const oracle::WeightsResult result = oracle::evaluate_weights(b, request);
  WeightsView view;
  view.layout = &request.layout;
  view.layout_source = v.layout != nullptr ? v.layout_source
                       : o.dumps.dp_shards ? "the dumps: one per DP rank"
                                           : "flags";
  view.split = request.split;
  view.vary_names = o.vary;
  view.per_token = o.per_token;
  view.step = !v.layout_source.empty() ? v.step
              : b.metadata.contains("step") && b.metadata["step"].is_number_integer()
                  ? b.metadata["step"].get<int64_t>()
                  : 0;
  view.svg_path = o.svg_path;
  render_weights(result, b, view, report, ctx);
  report.record(result.judgement());
}

void run_weights(const WeightsOptions& o, Report& report, Context& ctx) {
  oracle::WeightsRequest request;
  request.terms = parse_term_contracts(o.reduce, o.contracts, o.terms);
  require_sizes_at_least_1("--cp", {o.cp});
  require_sizes_at_least_1("--tp", {o.tp});
  request.split = mode_from_option<Split>("--split", o.placement.split);
  request.strict_scale = o.strict_scale;
  request.per_token = o.per_token;
  LoadedBatch loaded = load_batch(o.dumps, report, ctx, LoadNeeds{false, false, false});
  oracle::require_samples(loaded.batch);
  request.vary = oracle::parse_variations(o.vary);
  run_per_step(loaded.batch, o.dumps.step, report, ctx,
               [&](const StepView& v) { weights_step(o, v, request, report, ctx); });
}

}  // namespace

constexpr const char* kFooter =
    R"(A contract is a preset or key=value components (defaults in brackets):
  count  [cp-local] | full-sample | samples      what a rank counts for a micro-batch
  clamp  [none] | per-sample | at-cp1            each sample's count taken as max(count, 1)
  norm   [none] | microbatch | rank | global:G   the denominator D: 1, the micro-batch's count,
                                                 the rank's count over its micro-batches, or that
                                                 all-reduced over G = dp-cp | dp | cp | world
  sample [none] | mean                           divide each sample's sum by its mask sum first
  scale  [1] | products of cp, dp, tp, M, B, Bnz, L, numbers and 1/x   compensation factors
  grad   [sum] | mean:G                          gradients summed over DP x CP, then / |G|
  count-of [term] | main                         a --term counted under its own mask or main's
  w_t = m_t * scale / max(D, 1) * (1/max(m_i, 1) if sample=mean) / (|G| if grad=mean:G)
Presets (--reduce picks the per-token or sample-mean form where the trainer has both):
{}Diagnosis of r = w / w*: exact, uniform-scale (a product of cp, dp, tp, pp, M, B), masked-weight, per-rank,
per-microbatch ("1/n: divided by its own 24 tokens, then by N"), per-cp-shard, per-sample or mixed.
Exit 1 when the weights differ from the objective's on the layout or a variation: a uniform scale the
layout sets (1/cp, dp, 1/M) always, unless the contract's own number equals it (scale=0.5); a constant
one with --strict-scale or where Adam cannot hide it (s < 2^-10, s > 2^64; docs/semantics.md §9). I5 varies only layouts the
trainer can build: none that leaves a micro-batch empty, none uneven for TRL (listed as skipped).
Terms (docs/semantics.md §11): each --term is weighed over its own mask as its own objective, under
its own contract, and judged relative to the main term's scale: a term off by any factor relative
to main fails (a KL averaged per micro-batch while the policy term uses the global count: ×M).
Examples:
  lossguard weights batch.safetensors --contract hf-ga --dp 2 --microbatches 4
  lossguard weights batch.safetensors --contract megatron-per-token --term kl:per-token:0.1 \
      --contract kl=norm=microbatch --microbatches 4
  lossguard weights batch.safetensors --contract megatron-per-token,norm=global:dp --cp 2 --dp 2
  lossguard weights batch.safetensors --reduce sample-mean --contract slime --dp 4 --cp 2 \
      --svg w.svg)";

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
  app->footer(fmt::format(kFooter, presets));
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
                "A constant uniform scale fails too (one the layout sets always fails)");
  app->add_option("--svg", opts->svg_path, "Draw the ratio per micro-batch and CP rank");
  add_list_option(*app, "--vary", opts->vary,
                  "Which layout sizes I5 varies (1, 2, 4, 8 each): dp, microbatches, cp, or none "
                  "(a trainer without context parallelism: --vary dp,microbatches)");
  add_output_options(*app, cmd->output);
  cmd->run = [opts](Report& r, Context& c) { run_weights(*opts, r, c); };
  commands.push_back(std::move(cmd));
}

}  // namespace lossguard::cli
