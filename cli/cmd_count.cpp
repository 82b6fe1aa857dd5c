// `lossguard count`: per-sample and per-CP-rank effective token counts, global denominators per CP
// size, and invariants I1-I4 under a counting policy (SPEC §2, §3). The result is
// oracle::evaluate_count's; cli/count_render.cpp prints it.
#include <fmt/format.h>

#include <algorithm>

#include "cli/command.h"
#include "cli/count_render.h"
#include "cli/inputs.h"
#include "cli/placement_options.h"
#include "cli/steps.h"
#include "core/errors.h"
#include "oracle/count/count_result.h"
#include "oracle/count/placement.h"

namespace lossguard::cli {

namespace {

struct CountOptions {
  DumpOptions dumps;
  std::vector<int64_t> cp_sizes = {1, 2, 4, 8};
  std::string policy = "fixed";
  LayoutOptions layout;
  CpLayoutOptions cp_layout;
  int64_t tp = 1;
  PlacementOptions placement;
  int64_t max_rows = 40;
};

// The step's placement (the trainer's own where the dump records it, else the flags') and the
// per-token layouts where owners depend on the micro-batch; then the result and its rendering.
void count_step(const CountOptions& o, const CLI::App& app, const StepView& v,
                const oracle::CountRequest& base, Report& report, Context& ctx) {
  const Batch& b = *v.batch;
  oracle::CountRequest request = base;
  CountView view;
  view.layout = &request.layout;
  view.cp_layout = &o.cp_layout;
  view.microbatches = o.placement.microbatches;
  view.max_rows = o.max_rows;
  const bool split_given = v.layout != nullptr || o.placement.given(app) || o.dumps.dp_shards;
  oracle::Placement placement;
  if (v.layout != nullptr) {
    placement = *v.layout;
    std::size_t max_mb = 0;
    for (const auto& r : placement) max_mb = std::max(max_mb, r.size());
    view.placement_from_dump = true;
    view.placement_text = fmt::format(
        "{} DP rank(s) x up to {} micro-batch(es), from {}{}", placement.size(), max_mb,
        v.layout_source, o.placement.given(app) ? " (--dp/--microbatches/--split ignored)" : "");
  } else if (split_given) {
    placement = o.placement.placement(b, o.dumps.dp_shards);
    view.placement_text = fmt::format(
        "{} DP rank(s) x {} micro-batch(es){}", placement.size(), o.placement.microbatches,
        o.dumps.dp_shards ? " (one dump per DP rank)" : ", split " + o.placement.split);
  }
  if (split_given) {
    request.placement = &placement;
    view.placement = &placement;
  }
  if (o.cp_layout.per_token_needed()) {
    const oracle::Placement p =
        split_given ? placement : oracle::place_samples(b.num_samples(), 1, 1, Split::kContiguous);
    for (int64_t cp : request.sizes.cp_sizes)
      request.step_layouts.push_back(o.cp_layout.step_layout(b, p, cp, o.tp, request.layout));
  }
  const oracle::CountResult result = oracle::evaluate_count(b, request);
  render_count(result, b, view, report, ctx);
  report.record(result.judgement());
}

void run_count(const CountOptions& o, const CLI::App& app, Report& report, Context& ctx) {
  oracle::CountRequest request;
  request.policy = policy_from_option(o.policy);
  request.sizes = oracle::count_sizes(o.cp_sizes);
  request.layout = o.layout.layout();
  LoadedBatch loaded = load_batch(o.dumps, report, ctx, LoadNeeds{false, false, false});
  run_per_step(loaded.batch, o.dumps.step, report, ctx,
               [&](const StepView& v) { count_step(o, app, v, request, report, ctx); });
}

}  // namespace

void register_count(CLI::App& root, Commands& commands) {
  auto cmd = std::make_unique<Command>();
  auto opts = std::make_shared<CountOptions>();
  CLI::App* app =
      root.add_subcommand("count",
                          "Per-sample and per-CP-rank token counts, denominators per CP size, "
                          "invariants I1-I4");
  cmd->app = app;
  app->footer(
      "Policies (docs/semantics.md §3): fixed = Relax after PR #285 (the truth); legacy = Relax "
      "before it (CP=1 counts an\n"
      "empty response as 1 token); slime = every CP rank counts full samples, loss multiplied by "
      "cp.\n"
      "Exit 1 when an invariant fails under the chosen policy.\n"
      "Examples:\n  lossguard count batch.safetensors --cp 1,2,4,8\n"
      "  lossguard count batch.safetensors --policy legacy     # shows the CP=1 vs CP>1 "
      "denominator bug\n"
      "  lossguard count rank0.pt rank1.pt --dp-shards --microbatches 4 --json -");
  add_dump_options(*app, opts->dumps, true);
  add_step_option(*app, opts->dumps);
  app->add_option("--cp", opts->cp_sizes, "CP sizes to count for (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--policy", opts->policy, "Counting policy: fixed, legacy or slime")
      ->capture_default_str();
  add_layout_options(*app, opts->layout);
  add_cp_layout_options(*app, opts->cp_layout);
  app->add_option("--tp", opts->tp, "Tensor-parallel size (allgather pads to cp*tp*pad)")
      ->capture_default_str();
  add_placement_options(*app, opts->placement, false);
  app->add_option("--max-rows", opts->max_rows, "Sample rows in the text table (0: all)")
      ->check(CLI::Range(int64_t{0}, kMaxCount))
      ->capture_default_str();
  add_output_options(*app, cmd->output);
  cmd->run = [opts, app](Report& r, Context& c) { run_count(*opts, *app, r, c); };
  commands.push_back(std::move(cmd));
}

}  // namespace lossguard::cli
