// Megatron's rank layout (order tp-cp-ep-dp-pp, EP = 1) and process groups (SPEC §7), computed from
// coordinates so that a 131,072-rank topology costs no group tables.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace lossguard::oracle {

enum class GroupKind { kTp, kCp, kDp, kPp, kDpCp, kMp, kWorld };
const char* group_kind_name(GroupKind k);  // "tp", "cp", "dp", "pp", "dp_cp", "mp", "world"
inline constexpr GroupKind kAllGroupKinds[] = {GroupKind::kTp, GroupKind::kCp,   GroupKind::kDp,
                                               GroupKind::kPp, GroupKind::kDpCp, GroupKind::kMp};

struct Coord {
  int64_t tp = 0, cp = 0, dp = 0, pp = 0;
};

// A group of one kind: `id` numbers the groups of that kind; members are ordered by global rank.
struct GroupRef {
  GroupKind kind = GroupKind::kWorld;
  int64_t id = 0;
  bool operator==(const GroupRef& o) const { return kind == o.kind && id == o.id; }
};

class Topology {
 public:
  Topology(int64_t tp, int64_t pp, int64_t cp, int64_t dp);  // throws InputError for sizes < 1
  int64_t tp() const { return tp_; }
  int64_t pp() const { return pp_; }
  int64_t cp() const { return cp_; }
  int64_t dp() const { return dp_; }
  int64_t world() const { return tp_ * cp_ * dp_ * pp_; }

  Coord coord(int64_t rank) const;
  int64_t rank(const Coord& c) const { return c.tp + tp_ * (c.cp + cp_ * (c.dp + dp_ * c.pp)); }
  bool is_last_stage(int64_t rank) const { return coord(rank).pp == pp_ - 1; }
  int64_t pipeline_last_rank(int64_t rank) const;

  GroupRef group_of(GroupKind kind, int64_t rank) const;
  int64_t group_size(GroupKind kind) const;
  int64_t num_groups(GroupKind kind) const { return world() / group_size(kind); }
  int64_t member(const GroupRef& g, int64_t index) const;         // index-th member, by global rank
  int64_t index_in_group(const GroupRef& g, int64_t rank) const;  // -1 when not a member
  std::vector<int64_t> members(const GroupRef& g) const;
  std::string describe(const GroupRef& g) const;  // "pipeline group [1, 3]"

 private:
  int64_t tp_, pp_, cp_, dp_;
};

}  // namespace lossguard::oracle
