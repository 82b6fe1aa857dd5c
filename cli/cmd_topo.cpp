// `lossguard topo`: ranks, coordinates and process groups of a TP x PP x CP x DP topology (SPEC
// §7).
#include "cli/command.h"
#include "cli/placement_options.h"
#include "cli/topo_render.h"
#include "oracle/replay/topology.h"

namespace lossguard::cli {

namespace {

struct TopoOptions : TopologySizes {
  int64_t max_rows = 64;
};

void run_topo(const TopoOptions& o, Report& report, Context& ctx) {
  const oracle::Topology t(o.tp, o.pp, o.cp, o.dp, o.ep, o.etp);
  render_topo(t, o.max_rows, report, ctx);
  report.record(Judgement::verified());  // a layout is computed, never judged
}

}  // namespace

void register_topo(CLI::App& root, Commands& commands) {
  auto cmd = std::make_unique<Command>();
  auto opts = std::make_shared<TopoOptions>();
  CLI::App* app = root.add_subcommand(
      "topo", "Ranks, coordinates and process groups of a TP x PP x CP x DP topology");
  cmd->app = app;
  app->footer(
      "Groups: tp, cp, dp, pp (pipeline), dp_cp (DP+CP: fixed tp and pp), mp (model-parallel: all "
      "tp and pp for fixed cp, dp).\n"
      "With --ep > 1, the expert layers' groups of Megatron's expert rank generator: ep "
      "(expert-parallel), edp (expert\n"
      "data-parallel, where DDP reduces expert gradients), emp (expert tp-ep-pp, where the "
      "expert optimizer reduces its norm).\n"
      "Examples:\n  lossguard topo --tp 2 --pp 2 --cp 2 --dp 2 --json -\n"
      "  lossguard topo --tp 1 --pp 2 --dp 4 --ep 2");
  add_topology_options(*app, *opts);
  app->add_option("--max-rows", opts->max_rows, "Rank rows in the text table (0: all)")
      ->check(CLI::Range(int64_t{0}, kMaxCount))
      ->capture_default_str();
  add_output_options(*app, cmd->output);
  cmd->run = [opts](Report& r, Context& c) { run_topo(*opts, r, c); };
  commands.push_back(std::move(cmd));
}

}  // namespace lossguard::cli
