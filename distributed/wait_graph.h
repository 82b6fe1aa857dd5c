// Real mode's fail-fast analysis (SPEC §7 "Real mode"): from every rank's last posted state
// (waiting on a collective, failed, done, or nothing posted yet: running), which waiting ranks can
// never complete. A waiting rank is stuck when a member of its group has not issued the call and
// that member is failed, done or itself stuck: the greatest such set, found by removing ranks that
// some running or unstuck member may still release. Pure, so the executor's decision is tested
// without processes.
#pragma once
#include <cstdint>
#include <vector>

#include "oracle/replay/topology.h"

namespace lossguard::distributed {

struct PostedState {
  enum Status : uint8_t { kRunning, kWaiting, kFailed, kDone } status = kRunning;
  oracle::GroupRef group;   // kWaiting: the group it waits on
  int seq = 0;              // kWaiting: the call's number on its group kind, from 1
  std::vector<int> issued;  // calls issued per group kind (oracle::GroupKind order)
};

// stuck[r]: rank r waits for a call that can never complete.
inline std::vector<bool> stuck_ranks(const oracle::Topology& t,
                                     const std::vector<PostedState>& states) {
  const auto n = states.size();
  auto issued = [&](std::size_t m, oracle::GroupKind k) {
    const auto& v = states[m].issued;
    const auto i = static_cast<std::size_t>(k);
    return i < v.size() ? v[i] : 0;
  };
  // lacking[r]: the members of r's group that have not issued r's call.
  std::vector<std::vector<int64_t>> lacking(n);
  std::vector<bool> stuck(n, false);
  for (std::size_t r = 0; r < n; ++r) {
    if (states[r].status != PostedState::kWaiting) continue;
    const oracle::GroupRef g = states[r].group;
    for (int64_t i = 0; i < t.group_size(g.kind); ++i) {
      const int64_t m = t.member(g, i);
      if (issued(static_cast<std::size_t>(m), g.kind) < states[r].seq) lacking[r].push_back(m);
    }
    stuck[r] = !lacking[r].empty();
  }
  for (bool changed = true; changed;) {
    changed = false;
    for (std::size_t r = 0; r < n; ++r) {
      if (!stuck[r]) continue;
      for (int64_t m : lacking[r]) {
        const auto s = states[static_cast<std::size_t>(m)].status;
        const bool never = s == PostedState::kFailed || s == PostedState::kDone ||
                           (s == PostedState::kWaiting && stuck[static_cast<std::size_t>(m)]);
        if (!never) {  // m may still issue it
          stuck[r] = false;
          changed = true;
          break;
        }
      }
    }
  }
  return stuck;
}

}  // namespace lossguard::distributed
