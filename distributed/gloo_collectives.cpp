// Gloo collectives for real-mode replay: one ProcessGroupGloo (from the torch wheel) per topology
// group.
#include <fmt/format.h>

#include <cstdlib>
#include <map>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include "distributed/collectives.h"

namespace lossguard::distributed {

namespace {

using oracle::GroupKind;

std::shared_ptr<::gloo::transport::Device> make_device(const LaunchEnv& env) {
  if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      ifname != nullptr && *ifname != '\0') {
    return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
  }
  if (env.master_addr == "127.0.0.1" || env.master_addr == "localhost") {
    return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
  }
  return c10d::ProcessGroupGloo::createDefaultDevice();
}

class GlooCollectives : public Collectives {
 public:
  GlooCollectives(const LaunchEnv& env, const oracle::Topology& t,
                  const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout)
      : t_(t), timeout_(timeout) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices = {make_device(env)};
    // Every rank builds its groups in the same kind order; groups of one kind are disjoint, so this
    // cannot deadlock.
    for (GroupKind kind : kRealGroupKinds) {
      const oracle::GroupRef g = t.group_of(kind, env.rank);
      auto prefixed = c10::make_intrusive<c10d::PrefixStore>(
          fmt::format("pg/{}/{}", oracle::group_kind_name(kind), g.id), store);
      groups_[kind] = c10::make_intrusive<c10d::ProcessGroupGloo>(
          prefixed, static_cast<int>(t.index_in_group(g, env.rank)),
          static_cast<int>(t.group_size(kind)), options);
    }
  }
  ~GlooCollectives() override {
    for (auto& [kind, pg] : groups_) pg.release();  // never destroyed: peers may hang
  }
  int64_t run(const oracle::CollectiveCall& call) override {
    auto& pg = groups_.at(call.group.kind);
    std::vector<at::Tensor> tensors = {at::tensor({call.value}, at::kLong)};
    c10::intrusive_ptr<c10d::Work> work;
    if (call.op == oracle::Op::kAllReduceSum) {
      work = pg->allreduce(tensors);
    } else if (call.op == oracle::Op::kBroadcast) {
      c10d::BroadcastOptions bo;
      bo.rootRank = t_.index_in_group(call.group, call.src);
      work = pg->broadcast(tensors, bo);
    } else {
      work = pg->barrier();
    }
    work->wait(timeout_);
    return call.op == oracle::Op::kBarrier ? 0 : tensors[0].item<int64_t>();
  }

 private:
  const oracle::Topology& t_;
  std::chrono::milliseconds timeout_;
  std::map<GroupKind, c10::intrusive_ptr<c10d::ProcessGroupGloo>> groups_;
};

}  // namespace

std::unique_ptr<Collectives> make_gloo_collectives(const LaunchEnv& env, const oracle::Topology& t,
                                                   const c10::intrusive_ptr<c10d::Store>& store,
                                                   std::chrono::milliseconds timeout) {
  return std::make_unique<GlooCollectives>(env, t, store, timeout);
}

}  // namespace lossguard::distributed
