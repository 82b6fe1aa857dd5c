// One real backend's collectives on the topology groups a rank belongs to (inside
// liblossguard_distributed.so).
#pragma once
#include <chrono>
#include <memory>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "distributed/real_replay.h"
#include "oracle/replay.h"

namespace lossguard::distributed {

// The groups the protocols use; every rank builds its own group of each kind, in this order.
inline constexpr oracle::GroupKind kRealGroupKinds[] = {
    oracle::GroupKind::kWorld, oracle::GroupKind::kDpCp, oracle::GroupKind::kPp,
    oracle::GroupKind::kMp};

class Collectives {
 public:
  virtual ~Collectives() = default;
  // Runs `call` on its group with the construction-time deadline; returns the result (the sum, the
  // source's value, 0 for a barrier); throws std::exception on a timeout or a failed peer.
  virtual int64_t run(const oracle::CollectiveCall& call) = 0;
};

std::unique_ptr<Collectives> make_gloo_collectives(const LaunchEnv& env, const oracle::Topology& t,
                                                   const c10::intrusive_ptr<c10d::Store>& store,
                                                   std::chrono::milliseconds timeout);
// Throws when this build has no NCCL or the process sees no CUDA device.
std::unique_ptr<Collectives> make_nccl_collectives(const LaunchEnv& env, const oracle::Topology& t,
                                                   const c10::intrusive_ptr<c10d::Store>& store,
                                                   std::chrono::milliseconds timeout);

}  // namespace lossguard::distributed
