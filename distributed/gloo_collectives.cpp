// Gloo collectives for real-mode replay: one ProcessGroupGloo (from the torch wheel) per topology
// group.
#include <fmt/format.h>

#include <cstdlib>
#include <map>
#include <thread>
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
  GlooCollectives(const LaunchEnv& env, const oracle::ReplayInputs& in,
                  const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout)
      : t_(in.topo), timeout_(timeout) {
    const oracle::Topology& t = in.topo;
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices = {make_device(env)};
    // Every rank builds its groups in the same kind order; groups of one kind are disjoint, so this
    // cannot deadlock.
    for (GroupKind kind : oracle::group_kinds_used(in)) {
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
  CallResult run(const oracle::CollectiveCall& call,
                 const std::function<std::string()>& give_up) override {
    auto& pg = groups_.at(call.group.kind);
    std::vector<at::Tensor> tensors = {at::tensor(call_payload(call), at::kLong)};
    c10::intrusive_ptr<c10d::Work> work;
    if (call.op == oracle::Op::kBroadcast) {
      c10d::BroadcastOptions bo;
      bo.rootRank = t_.index_in_group(call.group, call.src);
      work = pg->broadcast(tensors, bo);
    } else if (call.op == oracle::Op::kBarrier) {
      work = pg->barrier();
    } else {
      c10d::AllreduceOptions ao;
      if (call.op == oracle::Op::kAllReduceMax) ao.reduceOp = c10d::ReduceOp::MAX;
      work = pg->allreduce(tensors, ao);
    }
    // Wait in slices, asking whether a member failed without issuing this call (fail fast).
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    while (!work->isCompleted()) {
      if (std::chrono::steady_clock::now() > deadline)
        throw std::runtime_error("Operation timed out!");
      const std::string reason = give_up();
      if (!reason.empty()) throw std::runtime_error(reason);
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    work->wait(timeout_);  // rethrows a failure of the work
    const at::Tensor r = tensors[0];
    std::vector<int64_t> reduced(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel());
    return read_result(call, reduced, t_.group_size(call.group.kind));
  }

 private:
  const oracle::Topology& t_;
  std::chrono::milliseconds timeout_;
  std::map<GroupKind, c10::intrusive_ptr<c10d::ProcessGroupGloo>> groups_;
};

}  // namespace

std::unique_ptr<Collectives> make_gloo_collectives(const LaunchEnv& env,
                                                   const oracle::ReplayInputs& in,
                                                   const c10::intrusive_ptr<c10d::Store>& store,
                                                   std::chrono::milliseconds timeout) {
  return std::make_unique<GlooCollectives>(env, in, store, timeout);
}

}  // namespace lossguard::distributed
