// `lossguard topo`: ranks, coordinates and process groups of a TP x PP x CP x DP topology (SPEC
// §7).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/command.h"
#include "cli/placement_options.h"
#include "oracle/topology.h"

namespace lossguard::cli {

namespace {

struct TopoOptions : TopologySizes {
  int64_t max_rows = 64;
};

void run_topo(const TopoOptions& o, Report& report, Context& ctx) {
  const oracle::Topology t(o.tp, o.pp, o.cp, o.dp);
  std::ostream& out = ctx.out;
  out << fmt::format("TP{} PP{} CP{} DP{}: world {} (Megatron order tp-cp-ep-dp-pp, EP = 1)\n",
                     o.tp, o.pp, o.cp, o.dp, t.world());
  out << "global_rank = tp + TP*(cp + CP*(dp + DP*pp))\n\n";
  out << fmt::format("{:>7} {:>5} {:>5} {:>5} {:>5}  {}\n", "rank", "tp", "cp", "dp", "pp",
                     "pipeline last rank");
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  for (int64_t r = 0; r < t.world(); ++r) {
    const oracle::Coord c = t.coord(r);
    if (o.max_rows == 0 || r < o.max_rows) {
      out << fmt::format("{:>7} {:>5} {:>5} {:>5} {:>5}  {}\n", r, c.tp, c.cp, c.dp, c.pp,
                         t.pipeline_last_rank(r));
    } else if (r == o.max_rows) {
      out << fmt::format("{:>7} ... {} more ranks (--max-rows 0 shows all)\n", "", t.world() - r);
    }
    if (ctx.want_json) {
      ranks.push_back({{"rank", r},
                       {"tp", c.tp},
                       {"cp", c.cp},
                       {"dp", c.dp},
                       {"pp", c.pp},
                       {"pipeline_last_rank", t.pipeline_last_rank(r)}});
    }
  }
  out << "\ngroups (members ordered by global rank):\n";
  nlohmann::ordered_json groups = nlohmann::ordered_json::object();
  for (oracle::GroupKind k : oracle::kAllGroupKinds) {
    const int64_t n = t.num_groups(k);
    std::vector<std::string> shown;
    nlohmann::ordered_json list = nlohmann::ordered_json::array();
    for (int64_t g = 0; g < n; ++g) {
      const auto members = t.members({k, g});
      if (g < 8) shown.push_back(fmt::format("[{}]", fmt::join(members, ",")));
      if (ctx.want_json) list.push_back(members);
    }
    out << fmt::format("  {:<6} {} group(s) of {}: {}{}\n", oracle::group_kind_name(k), n,
                       t.group_size(k), fmt::join(shown, " "), n > 8 ? " ..." : "");
    groups[oracle::group_kind_name(k)] = list;
  }
  auto& res = report.results();
  res["tp"] = o.tp;
  res["pp"] = o.pp;
  res["cp"] = o.cp;
  res["dp"] = o.dp;
  res["world"] = t.world();
  res["ranks"] = ranks;
  res["groups"] = groups;
  report.add_case({"lossguard.topo", "layout", true, "", false});
  report.verified();
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
      "tp and pp "
      "for fixed cp, dp).\nExample: lossguard topo --tp 2 --pp 2 --cp 2 --dp 2 --json -");
  add_topology_options(*app, *opts);
  app->add_option("--max-rows", opts->max_rows, "Rank rows in the text table (0: all)")
      ->capture_default_str();
  add_output_options(*app, cmd->output);
  cmd->run = [opts](Report& r, Context& c) { run_topo(*opts, r, c); };
  commands.push_back(std::move(cmd));
}

}  // namespace lossguard::cli
