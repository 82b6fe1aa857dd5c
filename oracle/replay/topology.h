// Megatron's rank layout (order tp-cp-ep-dp-pp) and process groups (SPEC §7), computed from
// coordinates so that a 131,072-rank topology costs no group tables. Dense layers use the layout
// with EP = 1; expert layers (EP > 1) Megatron's second generator over the same ranks, with CP
// folded into expert data parallelism: sizes (ETP, EP, EDP, PP), EDP = world / (ETP·EP·PP)
// (Megatron-LM megatron/core/parallel_state.py, initialize_model_parallel:
// expert_decoder_rank_generator = RankGenerator(tp=expert_tensor_parallel_size,
// ep=expert_model_parallel_size, dp=expert_data_parallel_size, pp=..., cp=1, order=order)).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/modes.h"

namespace lossguard::oracle {

// kEp: expert-model-parallel group (Megatron get_ranks('ep') of the expert generator); kEdp:
// expert-data-parallel group ('dp', where DDP reduces expert gradients); kEmp: expert
// tensor-model-pipeline group ('tp-ep-pp', where the expert optimizer reduces its grad norm).
enum class GroupKind { kTp, kCp, kDp, kPp, kDpCp, kMp, kWorld, kEp, kEdp, kEmp };
inline constexpr int kNumGroupKinds = 10;
// "tp", "cp", "dp", "pp", "dp_cp", "mp", "world", "ep", "edp", "emp"
}  // namespace lossguard::oracle

namespace lossguard {
template <>
struct ModeNames<oracle::GroupKind> {
  using G = oracle::GroupKind;
  static constexpr std::pair<G, const char*> kTable[] = {
      {G::kTp, "tp"}, {G::kCp, "cp"},       {G::kDp, "dp"}, {G::kPp, "pp"},   {G::kDpCp, "dp_cp"},
      {G::kMp, "mp"}, {G::kWorld, "world"}, {G::kEp, "ep"}, {G::kEdp, "edp"}, {G::kEmp, "emp"}};
};
}  // namespace lossguard

namespace lossguard::oracle {
inline const char* group_kind_name(GroupKind k) { return mode_name(k); }
inline constexpr GroupKind kAllGroupKinds[] = {GroupKind::kTp, GroupKind::kCp,   GroupKind::kDp,
                                               GroupKind::kPp, GroupKind::kDpCp, GroupKind::kMp};
inline constexpr GroupKind kExpertGroupKinds[] = {GroupKind::kEp, GroupKind::kEdp, GroupKind::kEmp};

struct Coord {
  int64_t tp = 0, cp = 0, dp = 0, pp = 0;
};
// A rank's place in the expert layout: global_rank = etp + ETP·(ep + EP·(edp + EDP·pp)).
struct ExpertCoord {
  int64_t etp = 0, ep = 0, edp = 0, pp = 0;
};

// A group of one kind: `id` numbers the groups of that kind; members are ordered by global rank.
struct GroupRef {
  GroupKind kind = GroupKind::kWorld;
  int64_t id = 0;
  bool operator==(const GroupRef& o) const { return kind == o.kind && id == o.id; }
};

class Topology {
 public:
  // Throws InputError for sizes < 1, and when TP·CP·DP is not a multiple of ETP·EP (etp 0: TP).
  Topology(int64_t tp, int64_t pp, int64_t cp, int64_t dp, int64_t ep = 1, int64_t etp = 0);
  int64_t tp() const { return tp_; }
  int64_t ep() const { return ep_; }
  int64_t etp() const { return etp_; }
  int64_t edp() const { return tp_ * cp_ * dp_ / (etp_ * ep_); }
  int64_t pp() const { return pp_; }
  int64_t cp() const { return cp_; }
  int64_t dp() const { return dp_; }
  int64_t world() const { return tp_ * cp_ * dp_ * pp_; }

  Coord coord(int64_t rank) const;
  ExpertCoord expert_coord(int64_t rank) const;
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
  GroupRef group_of(GroupKind kind, const Coord& c) const;        // dense kinds
  GroupRef group_of(GroupKind kind, const ExpertCoord& e) const;  // kEp, kEdp, kEmp
  int64_t tp_, pp_, cp_, dp_, ep_, etp_;
};

// Every dense layout (EP = 1) of `world` ranks: each (TP, PP, CP, DP) whose product is `world`.
std::vector<Topology> dense_layouts(int64_t world);

}  // namespace lossguard::oracle
