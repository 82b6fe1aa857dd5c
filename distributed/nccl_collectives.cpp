// NCCL collectives for real-mode replay: one communicator per topology group (unique ids exchanged
// through the store), one GPU per local rank, non-blocking communicators polled against the
// deadline and aborted when it passes, so a hang becomes a `blocked` outcome.
#include <fmt/format.h>

#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>

#include "distributed/collectives.h"
#include "lossguard/build_config.h"

#if LOSSGUARD_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include "core/nccl_library.h"
#endif

namespace lossguard::distributed {

#if LOSSGUARD_HAVE_NCCL

namespace {

using Clock = std::chrono::steady_clock;

// NCCL's entry points, from the library found at run time (core/nccl_library.h): nothing here links
// against libnccl.so.2, so the plugin loads (for --backend gloo too) on a machine without it.
struct NcclApi {
  decltype(&ncclGetUniqueId) GetUniqueId;
  decltype(&ncclCommInitRankConfig) CommInitRankConfig;
  decltype(&ncclGetErrorString) GetErrorString;
  decltype(&ncclBroadcast) Broadcast;
  decltype(&ncclAllReduce) AllReduce;
  decltype(&ncclCommGetAsyncError) CommGetAsyncError;
  decltype(&ncclCommAbort) CommAbort;
};

const NcclApi& nccl() {
  static const NcclApi api = [] {
    const NcclLibrary& lib = nccl_library("replay --backend nccl");
    auto get = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(nccl_symbol(lib, name));
    };
    NcclApi a{};
    get(a.GetUniqueId, "ncclGetUniqueId");
    get(a.CommInitRankConfig, "ncclCommInitRankConfig");
    get(a.GetErrorString, "ncclGetErrorString");
    get(a.Broadcast, "ncclBroadcast");
    get(a.AllReduce, "ncclAllReduce");
    get(a.CommGetAsyncError, "ncclCommGetAsyncError");
    get(a.CommAbort, "ncclCommAbort");
    return a;
  }();
  return api;
}

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

class NcclCollectives : public Collectives {
 public:
  NcclCollectives(const LaunchEnv& env, const oracle::ReplayInputs& in,
                  const c10::intrusive_ptr<c10d::Store>& store, std::chrono::milliseconds timeout)
      : t_(in.topo), timeout_(timeout) {
    const oracle::Topology& t = in.topo;
    int devices = 0;
    check_cuda(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
    if (devices == 0) throw std::runtime_error("no CUDA device");
    check_cuda(cudaSetDevice(static_cast<int>(env.local_rank % devices)), "cudaSetDevice");
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cuda(cudaMalloc(&buffer_, kWords * sizeof(int64_t)), "cudaMalloc");
    const auto deadline = Clock::now() + timeout;
    for (oracle::GroupKind kind : oracle::group_kinds_used(in)) {
      const oracle::GroupRef g = t.group_of(kind, env.rank);
      const int index = static_cast<int>(t.index_in_group(g, env.rank));
      const std::string key = fmt::format("nccl/{}/{}", oracle::group_kind_name(kind), g.id);
      ncclUniqueId id;
      if (index == 0) {
        if (nccl().GetUniqueId(&id) != ncclSuccess)
          throw std::runtime_error("ncclGetUniqueId failed");
        store->set(key, std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                             reinterpret_cast<uint8_t*>(&id) + sizeof(id)));
      } else {
        store->wait({key}, timeout);
        const std::vector<uint8_t> bytes = store->get(key);
        if (bytes.size() != sizeof(id))
          throw std::runtime_error("malformed NCCL unique id in the store");
        std::memcpy(&id, bytes.data(), sizeof(id));
      }
      ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
      config.blocking = 0;
      ncclComm_t comm = nullptr;
      ncclResult_t r = nccl().CommInitRankConfig(&comm, static_cast<int>(t.group_size(kind)), id,
                                                 index, &config);
      if (r != ncclSuccess && r != ncclInProgress)
        throw std::runtime_error(fmt::format("ncclCommInitRank: {}", nccl().GetErrorString(r)));
      wait_comm(comm, deadline, "ncclCommInitRank");
      comms_[kind] = comm;
    }
  }

  CallResult run(const oracle::CollectiveCall& call,
                 const std::function<std::string()>& give_up) override {
    ncclComm_t comm = comms_.at(call.group.kind);
    const std::vector<int64_t> payload = call_payload(call);
    check_cuda(cudaMemcpyAsync(buffer_, payload.data(), kWords * sizeof(int64_t),
                               cudaMemcpyHostToDevice, stream_),
               "cudaMemcpy");
    ncclResult_t r;
    if (call.op == oracle::Op::kBroadcast) {
      r = nccl().Broadcast(buffer_, buffer_, kWords, ncclInt64,
                           static_cast<int>(t_.index_in_group(call.group, call.src)), comm,
                           stream_);
    } else {  // all_reduce; a barrier is an all_reduce of the tagged payload
      r = nccl().AllReduce(buffer_, buffer_, kWords, ncclInt64,
                           call.op == oracle::Op::kAllReduceMax ? ncclMax : ncclSum, comm, stream_);
    }
    if (r != ncclSuccess && r != ncclInProgress)
      throw std::runtime_error(fmt::format("NCCL: {}", nccl().GetErrorString(r)));
    const auto deadline = Clock::now() + timeout_;
    auto next_ask = Clock::now();
    while (true) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady)
        throw std::runtime_error(fmt::format("CUDA: {}", cudaGetErrorString(q)));
      ncclResult_t async = ncclSuccess;
      nccl().CommGetAsyncError(comm, &async);
      if (async != ncclSuccess && async != ncclInProgress)
        throw std::runtime_error(fmt::format("NCCL: {}", nccl().GetErrorString(async)));
      if (Clock::now() > deadline) {
        nccl().CommAbort(
            comm);  // frees the stream's pending work so the process can report and exit
        throw std::runtime_error("Operation timed out!");
      }
      if (Clock::now() > next_ask) {
        next_ask = Clock::now() + std::chrono::milliseconds(20);
        const std::string reason = give_up();
        if (!reason.empty()) {
          nccl().CommAbort(comm);
          throw std::runtime_error(reason);
        }
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    std::vector<int64_t> reduced(kWords);
    check_cuda(
        cudaMemcpy(reduced.data(), buffer_, kWords * sizeof(int64_t), cudaMemcpyDeviceToHost),
        "cudaMemcpy");
    return read_result(call, reduced, t_.group_size(call.group.kind));
  }

 private:
  static void wait_comm(ncclComm_t comm, Clock::time_point deadline, const char* what) {
    while (true) {
      ncclResult_t state = ncclInProgress;
      nccl().CommGetAsyncError(comm, &state);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress)
        throw std::runtime_error(fmt::format("{}: {}", what, nccl().GetErrorString(state)));
      if (Clock::now() > deadline) {
        nccl().CommAbort(comm);
        throw std::runtime_error(fmt::format("{}: timed out", what));
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  static constexpr std::size_t kWords = 4;  // collectives.h: [value, nonfinite, tag, check]
  const oracle::Topology& t_;
  std::chrono::milliseconds timeout_;
  cudaStream_t stream_ = nullptr;
  void* buffer_ = nullptr;
  std::map<oracle::GroupKind, ncclComm_t> comms_;
};

}  // namespace

std::unique_ptr<Collectives> make_nccl_collectives(const LaunchEnv& env,
                                                   const oracle::ReplayInputs& in,
                                                   const c10::intrusive_ptr<c10d::Store>& store,
                                                   std::chrono::milliseconds timeout) {
  return std::make_unique<NcclCollectives>(env, in, store, timeout);
}

#else

std::unique_ptr<Collectives> make_nccl_collectives(const LaunchEnv&, const oracle::ReplayInputs&,
                                                   const c10::intrusive_ptr<c10d::Store>&,
                                                   std::chrono::milliseconds) {
  throw std::runtime_error("this build has no NCCL (configure with a CUDA toolkit that has NCCL)");
}

#endif

}  // namespace lossguard::distributed
