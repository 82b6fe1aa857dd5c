// One real backend's collectives on the topology groups a rank belongs to (inside
// liblossguard_distributed.so).
#pragma once
#include <chrono>
#include <functional>
#include <memory>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <vector>

#include "distributed/real_replay.h"
#include "oracle/replay/replay.h"

namespace lossguard::distributed {

// The groups a replay's protocol uses (oracle::group_kinds_used); every rank builds its own group
// of each kind, in that order (groups of one kind are disjoint, so this cannot deadlock).

// Every real collective carries [value, nonfinite, tag, check] as int64: the tag stands for the
// call's op and payload (a real job's dtype and shape), so members that issued different
// collectives in the same place find out, as the simulator's matching does: an all-reduce sums
// check = tag² (all tags equal iff (Σtag)² = n·Σtag²), an all-reduce(MAX) takes check = -tag
// (equal iff max tag = min tag), a broadcast's receivers compare the root's tag with their own.
// An all-to-all runs as an all-reduce of its tag: who takes part is what the replay needs.
int64_t call_tag(const oracle::CollectiveCall& call);

struct CallResult {
  int64_t value = 0;       // the sum, the maximum, the root's value; 0 for a barrier
  bool nonfinite = false;  // some contribution (the root's, for a broadcast) was non-finite
  bool mismatch = false;   // the members issued different collectives (the tag check failed)
};

class Collectives {
 public:
  virtual ~Collectives() = default;
  // Runs `call` on its group with the construction-time deadline; `give_up` is asked a few times a
  // second while it waits and ends the wait when it returns a reason (a member failed without
  // issuing the call). Throws std::exception on a timeout, a failed peer or giving up.
  virtual CallResult run(const oracle::CollectiveCall& call,
                         const std::function<std::string()>& give_up) = 0;
};

// What a rank contributes, and how it reads the reduced tensor back.
std::vector<int64_t> call_payload(const oracle::CollectiveCall& call);
CallResult read_result(const oracle::CollectiveCall& call, const std::vector<int64_t>& reduced,
                       int64_t group_size);

std::unique_ptr<Collectives> make_gloo_collectives(const LaunchEnv& env,
                                                   const oracle::ReplayInputs& in,
                                                   const c10::intrusive_ptr<c10d::Store>& store,
                                                   std::chrono::milliseconds timeout);
// Throws when this build has no NCCL or the process sees no CUDA device.
std::unique_ptr<Collectives> make_nccl_collectives(const LaunchEnv& env,
                                                   const oracle::ReplayInputs& in,
                                                   const c10::intrusive_ptr<c10d::Store>& store,
                                                   std::chrono::milliseconds timeout);

}  // namespace lossguard::distributed
