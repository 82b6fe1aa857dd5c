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
  const oracle::Topology t(o.tp, o.pp, o.cp, o.dp, o.ep, o.etp);
  std::ostream& out = ctx.out;
  out << fmt::format(
      "TP{} PP{} CP{} DP{}{}: world {} (Megatron order tp-cp-ep-dp-pp; dense layers EP = 1)\n",
      o.tp, o.pp, o.cp, o.dp, t.ep() > 1 ? fmt::format(" EP{}", t.ep()) : "", t.world());
  out << "global_rank = tp + TP*(cp + CP*(dp + DP*pp))\n";
  if (t.ep() > 1) {
    out << fmt::format(
        "expert layers: ETP{} EP{} EDP{} PP{} (CP folded into expert data parallelism)\n"
        "global_rank = etp + ETP*(ep + EP*(edp + EDP*pp))\n",
        t.etp(), t.ep(), t.edp(), t.pp());
  }
  out << "\n";
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
  std::vector<oracle::GroupKind> kinds(std::begin(oracle::kAllGroupKinds),
                                       std::end(oracle::kAllGroupKinds));
  if (t.ep() > 1) {
    kinds.insert(kinds.end(), std::begin(oracle::kExpertGroupKinds),
                 std::end(oracle::kExpertGroupKinds));
  }
  for (oracle::GroupKind k : kinds) {
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
  res["ep"] = t.ep();
  res["etp"] = t.etp();
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
