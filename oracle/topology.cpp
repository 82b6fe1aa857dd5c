// Rank coordinates and groups: global_rank = tp + TP·(cp + CP·(dp + DP·pp)) (SPEC §7).
#include "oracle/topology.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/errors.h"

namespace lossguard::oracle {

const char* group_kind_name(GroupKind k) {
  switch (k) {
    case GroupKind::kTp:
      return "tp";
    case GroupKind::kCp:
      return "cp";
    case GroupKind::kDp:
      return "dp";
    case GroupKind::kPp:
      return "pp";
    case GroupKind::kDpCp:
      return "dp_cp";
    case GroupKind::kMp:
      return "mp";
    case GroupKind::kWorld:
      return "world";
  }
  return "?";
}

Topology::Topology(int64_t tp, int64_t pp, int64_t cp, int64_t dp)
    : tp_(tp), pp_(pp), cp_(cp), dp_(dp) {
  if (tp < 1 || pp < 1 || cp < 1 || dp < 1) {
    throw_input_error("--tp, --pp, --cp and --dp must be >= 1, got TP{} PP{} CP{} DP{}", tp, pp, cp,
                      dp);
  }
  if (tp * pp > (int64_t{1} << 24) / std::max<int64_t>(cp * dp, 1)) {
    throw_input_error("world size TP{}·PP{}·CP{}·DP{} exceeds 16,777,216 ranks", tp, pp, cp, dp);
  }
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
  }
  return 0;
}

GroupRef Topology::group_of(GroupKind k, int64_t rank) const {
  const Coord c = coord(rank);
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
    case GroupKind::kWorld:
      return {k, 0};
  }
  return {k, 0};
}

int64_t Topology::member(const GroupRef& g, int64_t i) const {
  Coord c;
  const int64_t id = g.id;
  switch (g.kind) {
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
    case GroupKind::kWorld:
      return i;
  }
  return rank(c);
}

int64_t Topology::index_in_group(const GroupRef& g, int64_t r) const {
  if (r < 0 || r >= world() || !(group_of(g.kind, r) == g)) return -1;
  const Coord c = coord(r);
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
    case GroupKind::kWorld:
      return r;
  }
  return -1;
}

std::vector<int64_t> Topology::members(const GroupRef& g) const {
  std::vector<int64_t> m(static_cast<std::size_t>(group_size(g.kind)));
  for (int64_t i = 0; i < static_cast<int64_t>(m.size()); ++i) m[i] = member(g, i);
  return m;
}

std::string Topology::describe(const GroupRef& g) const {
  static const char* kNames[] = {"tensor-parallel", "context-parallel", "data-parallel", "pipeline",
                                 "DP+CP",           "model-parallel",   "world"};
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

}  // namespace lossguard::oracle
