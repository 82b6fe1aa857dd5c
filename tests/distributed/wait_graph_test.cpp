// distributed/'s real-mode fail-fast analysis (wait_graph.h, SPEC §7 "Real mode") on hand-written
// posted states: which waiting ranks can never complete, without processes. The real jobs under
// torchrun are multiproc_replay.py and multiproc_faults.py beside it.
#include "distributed/wait_graph.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <utility>
#include <vector>

#include "oracle/replay/topology.h"

namespace lossguard::distributed {
namespace {

using oracle::GroupKind;
using oracle::GroupRef;
using oracle::kNumGroupKinds;
using oracle::Topology;

// Real mode's fail-fast analysis (distributed/wait_graph.h) on hand-written posted states.
distributed::PostedState waiting(GroupRef g, int seq, std::vector<int> issued) {
  distributed::PostedState s;
  s.status = distributed::PostedState::kWaiting;
  s.group = g;
  s.seq = seq;
  s.issued = std::move(issued);
  s.issued.resize(kNumGroupKinds);
  return s;
}
distributed::PostedState with(distributed::PostedState::Status st) {
  distributed::PostedState s;
  s.status = st;
  s.issued.assign(kNumGroupKinds, 0);
  return s;
}

TEST(ReplayFailFast, StuckRanksAreThoseWaitingOnFailedFinishedOrStuckMembers) {
  using S = distributed::PostedState;
  const auto mp = static_cast<std::size_t>(GroupKind::kMp);
  const auto world = static_cast<std::size_t>(GroupKind::kWorld);
  // TP2 PP2: ranks 0 and 2 errored; 1 and 3 wait in the model-parallel all-reduce [0, 1, 2, 3].
  const Topology t(2, 2, 1, 1);
  std::vector<int> one_mp(kNumGroupKinds, 0);
  one_mp[mp] = 1;
  const GroupRef mp_group{GroupKind::kMp, 0};
  EXPECT_EQ(distributed::stuck_ranks(t, {with(S::kFailed), waiting(mp_group, 1, one_mp),
                                         with(S::kFailed), waiting(mp_group, 1, one_mp)}),
            (std::vector<bool>{false, true, false, true}));
  // A member not heard from yet may still issue it: nobody is stuck.
  EXPECT_EQ(distributed::stuck_ranks(t, {with(S::kRunning), waiting(mp_group, 1, one_mp),
                                         with(S::kFailed), waiting(mp_group, 1, one_mp)}),
            (std::vector<bool>(4, false)));
  // TP2 (world 2): rank 0 waits in the model-parallel all-reduce, rank 1 at the world barrier,
  // each for the other: a cycle.
  const Topology t2(2, 1, 1, 1);
  std::vector<int> barrier_only(kNumGroupKinds, 0);
  barrier_only[world] = 1;
  EXPECT_EQ(distributed::stuck_ranks(t2, {waiting(mp_group, 1, one_mp),
                                          waiting({GroupKind::kWorld, 0}, 1, barrier_only)}),
            (std::vector<bool>{true, true}));
  // Rank 1 already issued the all-reduce: rank 0's wait completes, so rank 1's will too.
  std::vector<int> both = one_mp;
  both[world] = 1;
  EXPECT_EQ(distributed::stuck_ranks(
                t2, {waiting(mp_group, 1, one_mp), waiting({GroupKind::kWorld, 0}, 1, both)}),
            (std::vector<bool>{false, false}));
  // A finished rank never issues again.
  std::vector<int> two_mp(kNumGroupKinds, 0);
  two_mp[mp] = 2;
  EXPECT_EQ(distributed::stuck_ranks(t2, {waiting(mp_group, 2, two_mp), with(S::kDone)}),
            (std::vector<bool>{true, false}));
}

}  // namespace
}  // namespace lossguard::distributed
