// Megatron rank layout and groups (SPEC §7): the worked topologies, and every topology up to world
// 64 against a port of Megatron's own generator (generate_masked_orthogonal_rank_groups).
#include "oracle/replay/topology.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "core/errors.h"

namespace lossguard::oracle {
namespace {

using Groups = std::vector<std::vector<int64_t>>;

Groups all_groups(const Topology& t, GroupKind k) {
  Groups g;
  for (int64_t id = 0; id < t.num_groups(k); ++id) g.push_back(t.members({k, id}));
  std::sort(g.begin(), g.end());
  return g;
}

TEST(Topology, WorkedTopologiesOfSpecSection7) {
  const Topology a(2, 2, 1, 1);  // TP2 PP2
  EXPECT_EQ(all_groups(a, GroupKind::kPp), (Groups{{0, 2}, {1, 3}}));
  EXPECT_EQ(a.pipeline_last_rank(0), 2);
  EXPECT_EQ(a.pipeline_last_rank(1), 3);
  const Topology b(1, 2, 2, 2);  // TP1 CP2 DP2 PP2
  EXPECT_EQ(all_groups(b, GroupKind::kCp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(all_groups(b, GroupKind::kDpCp), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(all_groups(b, GroupKind::kPp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  const Topology c(2, 2, 2, 2);  // TP2 CP2 DP2 PP2
  EXPECT_EQ(all_groups(c, GroupKind::kDpCp),
            (Groups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
  for (int64_t r = 0; r < 8; ++r)
    EXPECT_EQ(c.members(c.group_of(GroupKind::kPp, r)), (std::vector<int64_t>{r, r + 8}));
  EXPECT_THROW(Topology(0, 1, 1, 1), InputError);
}

// Megatron-LM megatron/core/parallel_state.py, generate_masked_orthogonal_rank_groups, ported
// literally.
std::vector<int64_t> prefix_product(const std::vector<int64_t>& a) {
  std::vector<int64_t> r = {1};
  for (int64_t v : a) r.push_back(r.back() * v);
  return r;
}
std::vector<int64_t> decompose(int64_t index, const std::vector<int64_t>& shape) {
  const auto stride = prefix_product(shape);
  std::vector<int64_t> idx;
  for (std::size_t k = 0; k < shape.size(); ++k) idx.push_back((index / stride[k]) % shape[k]);
  return idx;
}
Groups megatron_groups(int64_t world, const std::vector<int64_t>& parallel_size,
                       const std::vector<bool>& mask) {
  std::vector<int64_t> masked_shape, unmasked_shape, masked_stride, unmasked_stride;
  const auto global_stride = prefix_product(parallel_size);
  for (std::size_t k = 0; k < parallel_size.size(); ++k) {
    (mask[k] ? masked_shape : unmasked_shape).push_back(parallel_size[k]);
    (mask[k] ? masked_stride : unmasked_stride).push_back(global_stride[k]);
  }
  const int64_t group_size = prefix_product(masked_shape).back();
  Groups out;
  for (int64_t g = 0; g < world / group_size; ++g) {
    const auto gi = decompose(g, unmasked_shape);
    std::vector<int64_t> ranks;
    for (int64_t r = 0; r < group_size; ++r) {
      const auto ri = decompose(r, masked_shape);
      int64_t rank = 0;
      for (std::size_t k = 0; k < ri.size(); ++k) rank += ri[k] * masked_stride[k];
      for (std::size_t k = 0; k < gi.size(); ++k) rank += gi[k] * unmasked_stride[k];
      ranks.push_back(rank);
    }
    out.push_back(ranks);
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(Topology, EveryTopologyUpToWorld64MatchesMegatronsGenerator) {
  // order "tp-cp-ep-dp-pp" with ep = 1; token -> mask over (tp, cp, ep, dp, pp).
  const std::map<GroupKind, std::vector<bool>> masks = {
      {GroupKind::kTp, {true, false, false, false, false}},
      {GroupKind::kCp, {false, true, false, false, false}},
      {GroupKind::kDp, {false, false, false, true, false}},
      {GroupKind::kPp, {false, false, false, false, true}},
      {GroupKind::kDpCp, {false, true, false, true, false}},
      {GroupKind::kMp, {true, false, false, false, true}}};
  int checked = 0;
  for (int64_t tp = 1; tp <= 64; ++tp) {
    for (int64_t pp = 1; tp * pp <= 64; ++pp) {
      for (int64_t cp = 1; tp * pp * cp <= 64; ++cp) {
        for (int64_t dp = 1; tp * pp * cp * dp <= 64; ++dp) {
          const Topology t(tp, pp, cp, dp);
          for (const auto& [kind, mask] : masks) {
            ASSERT_EQ(all_groups(t, kind), megatron_groups(t.world(), {tp, cp, 1, dp, pp}, mask))
                << "TP" << tp << " PP" << pp << " CP" << cp << " DP" << dp << " "
                << group_kind_name(kind);
          }
          for (int64_t r = 0; r < t.world(); ++r) {
            ASSERT_EQ(t.rank(t.coord(r)), r);
            const auto pipe = t.members(t.group_of(GroupKind::kPp, r));
            ASSERT_EQ(t.pipeline_last_rank(r), pipe.back());
            for (GroupKind k : kAllGroupKinds) {
              const GroupRef g = t.group_of(k, r);
              ASSERT_EQ(t.member(g, t.index_in_group(g, r)), r);
            }
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 500);
}

// Expert layers: Megatron's expert generator, RankGenerator(tp=ETP, ep=EP, dp=EDP, pp=PP, cp=1,
// order="tp-cp-ep-dp-pp") with EDP = world / (ETP·EP·PP), tokens 'ep', 'dp' and 'tp-ep-pp'.
TEST(Topology, ExpertGroupsUpToWorld64MatchMegatronsExpertGenerator) {
  const std::map<GroupKind, std::vector<bool>> masks = {
      {GroupKind::kEp, {false, false, true, false, false}},
      {GroupKind::kEdp, {false, false, false, true, false}},
      {GroupKind::kEmp, {true, false, true, false, true}}};
  int checked = 0;
  for (int64_t tp = 1; tp <= 64; ++tp) {
    for (int64_t pp = 1; tp * pp <= 64; ++pp) {
      for (int64_t cp = 1; tp * pp * cp <= 64; ++cp) {
        for (int64_t dp = 1; tp * pp * cp * dp <= 64; ++dp) {
          const int64_t stage = tp * cp * dp;
          for (int64_t etp = 1; etp <= stage; ++etp) {
            for (int64_t ep = 1; etp * ep <= stage; ++ep) {
              if (stage % (etp * ep) != 0) {
                EXPECT_THROW(Topology(tp, pp, cp, dp, ep, etp), InputError);
                continue;
              }
              const Topology t(tp, pp, cp, dp, ep, etp);
              const int64_t edp = stage / (etp * ep);
              ASSERT_EQ(t.edp(), edp);
              for (const auto& [kind, mask] : masks) {
                ASSERT_EQ(all_groups(t, kind),
                          megatron_groups(t.world(), {etp, 1, ep, edp, pp}, mask))
                    << "TP" << tp << " PP" << pp << " CP" << cp << " DP" << dp << " EP" << ep
                    << " ETP" << etp << " " << group_kind_name(kind);
              }
              for (int64_t r = 0; r < t.world(); ++r) {
                for (GroupKind k : kExpertGroupKinds) {
                  const GroupRef g = t.group_of(k, r);
                  ASSERT_EQ(t.member(g, t.index_in_group(g, r)), r);
                }
              }
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 2000);
  // Worked example: TP1 CP1 DP4 PP2 EP2 (world 8): EP groups [0,1] [2,3] [4,5] [6,7], expert-DP
  // groups [0,2] [1,3] [4,6] [5,7].
  const Topology w(1, 2, 1, 4, 2);
  EXPECT_EQ(all_groups(w, GroupKind::kEp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(all_groups(w, GroupKind::kEdp), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
}

}  // namespace
}  // namespace lossguard::oracle
