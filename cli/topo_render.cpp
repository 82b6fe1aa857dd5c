// `topo`'s renderer: text and JSON of a topology's ranks and groups.
#include "cli/topo_render.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <iterator>
#include <string>
#include <vector>

namespace lossguard::cli {

void render_topo(const oracle::Topology& t, int64_t max_rows, Report& report, Context& ctx) {
  std::ostream& out = ctx.out;
  out << fmt::format(
      "TP{} PP{} CP{} DP{}{}: world {} (Megatron order tp-cp-ep-dp-pp; dense layers EP = 1)\n",
      t.tp(), t.pp(), t.cp(), t.dp(), t.ep() > 1 ? fmt::format(" EP{}", t.ep()) : "", t.world());
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
    if (max_rows == 0 || r < max_rows) {
      out << fmt::format("{:>7} {:>5} {:>5} {:>5} {:>5}  {}\n", r, c.tp, c.cp, c.dp, c.pp,
                         t.pipeline_last_rank(r));
    } else if (r == max_rows) {
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
  res["tp"] = t.tp();
  res["pp"] = t.pp();
  res["cp"] = t.cp();
  res["dp"] = t.dp();
  res["ep"] = t.ep();
  res["etp"] = t.etp();
  res["world"] = t.world();
  res["ranks"] = ranks;
  res["groups"] = groups;
  report.add_case({"lossguard.topo", "layout", true, "", false});
}

}  // namespace lossguard::cli
