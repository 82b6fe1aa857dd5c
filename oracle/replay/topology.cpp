// Rank coordinates and groups: global_rank = tp + TP·(cp + CP·(dp + DP·pp)) (SPEC §7).
#include "oracle/replay/topology.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/errors.h"

namespace lossguard::oracle {

Topology::Topology(int64_t tp, int64_t pp, int64_t cp, int64_t dp, int64_t ep, int64_t etp)
    : tp_(tp), pp_(pp), cp_(cp), dp_(dp), ep_(ep), etp_(etp == 0 ? tp : etp) {
  if (tp < 1 || pp < 1 || cp < 1 || dp < 1) {
    throw_input_error("--tp, --pp, --cp and --dp must be >= 1, got TP{} PP{} CP{} DP{}", tp, pp, cp,
                      dp);
  }
  if (tp * pp > (int64_t{1} << 24) / std::max<int64_t>(cp * dp, 1)) {
    throw_input_error("world size TP{}·PP{}·CP{}·DP{} exceeds 16,777,216 ranks", tp, pp, cp, dp);
  }
  if (ep_ < 1 || etp_ < 1) throw_input_error("--ep and --etp must be >= 1, got {} and {}", ep, etp);
  if ((tp * cp * dp) % (etp_ * ep_) != 0) {
    throw_input_error(
        "--ep {} with expert TP {} (--etp) does not divide the {} ranks of a pipeline stage "
        "(TP{}·CP{}·DP{}): Megatron needs world % (ETP·EP·PP) == 0",
        ep_, etp_, tp * cp * dp, tp, cp, dp);
  }
}

ExpertCoord Topology::expert_coord(int64_t rank) const {
  const int64_t stage = tp_ * cp_ * dp_;
  const int64_t local = rank % stage;
  return {local % etp_, (local / etp_) % ep_, local / (etp_ * ep_), rank / stage};
}

Coord Topology::coord(int64_t rank) const {
  Coord c;
  c.tp = rank % tp_;
  rank /= tp_;
  c.cp = rank % cp_;
  rank /= cp_;
  c.dp = rank % dp_;
  c.pp = rank / dp_;
  return c;
}

int64_t Topology::pipeline_last_rank(int64_t rank) const {
  Coord c = coord(rank);
  c.pp = pp_ - 1;
  return this->rank(c);
}

int64_t Topology::group_size(GroupKind k) const {
  switch (k) {
    case GroupKind::kTp:
      return tp_;
    case GroupKind::kCp:
      return cp_;
    case GroupKind::kDp:
      return dp_;
    case GroupKind::kPp:
      return pp_;
    case GroupKind::kDpCp:
      return dp_ * cp_;
    case GroupKind::kMp:
      return tp_ * pp_;
    case GroupKind::kWorld:
      return world();
    case GroupKind::kEp:
      return ep_;
    case GroupKind::kEdp:
      return edp();
    case GroupKind::kEmp:
      return etp_ * ep_ * pp_;
  }
  return 0;
}

namespace {
bool is_expert(GroupKind k) {
  return k == GroupKind::kEp || k == GroupKind::kEdp || k == GroupKind::kEmp;
}
}  // namespace

GroupRef Topology::group_of(GroupKind k, int64_t rank) const {
  return is_expert(k) ? group_of(k, expert_coord(rank)) : group_of(k, coord(rank));
}

GroupRef Topology::group_of(GroupKind k, const ExpertCoord& e) const {
  if (k == GroupKind::kEp) return {k, e.etp + etp_ * (e.edp + edp() * e.pp)};
  if (k == GroupKind::kEdp) return {k, e.etp + etp_ * (e.ep + ep_ * e.pp)};
  return {k, e.edp};
}

GroupRef Topology::group_of(GroupKind k, const Coord& c) const {
  switch (k) {
    case GroupKind::kTp:
      return {k, c.cp + cp_ * (c.dp + dp_ * c.pp)};
    case GroupKind::kCp:
      return {k, c.tp + tp_ * (c.dp + dp_ * c.pp)};
    case GroupKind::kDp:
      return {k, c.tp + tp_ * (c.cp + cp_ * c.pp)};
    case GroupKind::kPp:
      return {k, c.tp + tp_ * (c.cp + cp_ * c.dp)};
    case GroupKind::kDpCp:
      return {k, c.tp + tp_ * c.pp};
    case GroupKind::kMp:
      return {k, c.cp + cp_ * c.dp};
    default:
      return {k, 0};
  }
}

int64_t Topology::member(const GroupRef& g, int64_t i) const {
  Coord c;
  const int64_t id = g.id;
  const int64_t stage = tp_ * cp_ * dp_, edp_size = edp();
  switch (g.kind) {
    case GroupKind::kEp:  // id = etp + ETP·(edp + EDP·pp)
      return id % etp_ + etp_ * (i + ep_ * ((id / etp_) % edp_size)) +
             stage * (id / (etp_ * edp_size));
    case GroupKind::kEdp:  // id = etp + ETP·(ep + EP·pp)
      return id % etp_ + etp_ * ((id / etp_) % ep_ + ep_ * i) + stage * (id / (etp_ * ep_));
    case GroupKind::kEmp:  // id = edp; i = etp + ETP·(ep + EP·pp)
      return i % (etp_ * ep_) + etp_ * ep_ * id + stage * (i / (etp_ * ep_));
    case GroupKind::kTp:
      c = {i, id % cp_, (id / cp_) % dp_, id / (cp_ * dp_)};
      break;
    case GroupKind::kCp:
      c = {id % tp_, i, (id / tp_) % dp_, id / (tp_ * dp_)};
      break;
    case GroupKind::kDp:
      c = {id % tp_, (id / tp_) % cp_, i, id / (tp_ * cp_)};
      break;
    case GroupKind::kPp:
      c = {id % tp_, (id / tp_) % cp_, id / (tp_ * cp_), i};
      break;
    case GroupKind::kDpCp:
      c = {id % tp_, i % cp_, i / cp_, id / tp_};
      break;
    case GroupKind::kMp:
      c = {i % tp_, id % cp_, id / cp_, i / tp_};
      break;
    default:
      return i;
  }
  return rank(c);
}

int64_t Topology::index_in_group(const GroupRef& g, int64_t r) const {
  if (r < 0 || r >= world()) return -1;
  if (is_expert(g.kind)) {
    const ExpertCoord e = expert_coord(r);
    if (!(group_of(g.kind, e) == g)) return -1;
    if (g.kind == GroupKind::kEp) return e.ep;
    if (g.kind == GroupKind::kEdp) return e.edp;
    return e.etp + etp_ * (e.ep + ep_ * e.pp);
  }
  const Coord c = coord(r);
  if (!(group_of(g.kind, c) == g)) return -1;
  switch (g.kind) {
    case GroupKind::kTp:
      return c.tp;
    case GroupKind::kCp:
      return c.cp;
    case GroupKind::kDp:
      return c.dp;
    case GroupKind::kPp:
      return c.pp;
    case GroupKind::kDpCp:
      return c.cp + cp_ * c.dp;
    case GroupKind::kMp:
      return c.tp + tp_ * c.pp;
    default:
      return r;
  }
}

std::vector<int64_t> Topology::members(const GroupRef& g) const {
  std::vector<int64_t> m(static_cast<std::size_t>(group_size(g.kind)));
  for (int64_t i = 0; i < static_cast<int64_t>(m.size()); ++i) m[i] = member(g, i);
  return m;
}

std::string Topology::describe(const GroupRef& g) const {
  static const char* kNames[] = {"tensor-parallel",
                                 "context-parallel",
                                 "data-parallel",
                                 "pipeline",
                                 "DP+CP",
                                 "model-parallel",
                                 "world",
                                 "expert-parallel",
                                 "expert-data-parallel",
                                 "expert model-parallel"};
  const int64_t size = group_size(g.kind);
  std::string list;
  if (size <= 8) {
    list = fmt::format("[{}]", fmt::join(members(g), ", "));
  } else {
    list = fmt::format("[{}, {}, ..., {}] ({} ranks)", member(g, 0), member(g, 1),
                       member(g, size - 1), size);
  }
  return fmt::format("{} group {}", kNames[static_cast<int>(g.kind)], list);
}

std::vector<Topology> dense_layouts(int64_t world) {
  std::vector<Topology> out;
  for (int64_t tp = 1; tp <= world; ++tp) {
    if (world % tp) continue;
    for (int64_t cp = 1; cp <= world / tp; ++cp) {
      if ((world / tp) % cp) continue;
      for (int64_t dp = 1; dp <= world / (tp * cp); ++dp) {
        if ((world / (tp * cp)) % dp == 0) out.emplace_back(tp, world / (tp * cp * dp), cp, dp);
      }
    }
  }
  return out;
}

}  // namespace lossguard::oracle
