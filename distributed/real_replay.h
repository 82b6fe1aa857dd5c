// Real-mode replay (SPEC §7 "Real mode"): every process of a torchrun-launched job runs its own
// rank's protocol program over real collectives (Gloo process groups built for exactly the
// topology's groups, rendezvous through c10d::TCPStore), every wait bounded by a deadline; outcomes
// go through the store to rank 0. Implemented in the plugin liblossguard_distributed.so; this
// header carries only plain types.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "oracle/replay/replay.h"

namespace lossguard::distributed {

// What the launcher's environment says (torchrun, or any launcher setting these variables).
struct LaunchEnv {
  int64_t rank = 0, world_size = 1, local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int port = 29500;
  bool agent_store = false;  // TORCHELASTIC_USE_AGENT_STORE=True: the launcher serves the store
  std::string run_id = "lossguard";
  std::string error_file;  // TORCHELASTIC_ERROR_FILE
};
// Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*; throws InputError
// naming what is missing or malformed.
LaunchEnv launch_env_from_environment();

enum class Backend { kGloo, kNccl };

struct RealReplayInput {
  const oracle::ReplayInputs* inputs = nullptr;
  LaunchEnv env;
  Backend backend = Backend::kGloo;
  double timeout_s = 20.0;
};

struct RealReplayOutput {
  std::vector<oracle::RankResult> ranks;  // rank 0: every rank's outcome in rank order (an error
                                          // for a rank that never posted one); others: empty
  std::string error;                      // could not take part at all (rendezvous failed, bad env)
};

struct DistApi {
  int abi_version;
  void (*run)(const RealReplayInput* in, RealReplayOutput* out);
  // After rank 0 decided: publish (rank 0) or wait for (others) the job's exit code; -1 on timeout.
  int (*agree_exit_code)(const RealReplayInput* in, int exit_code_from_rank0);
};
inline constexpr int kDistAbiVersion = 1;

// Loads the plugin (LOSSGUARD_DIST overrides its path). Throws InputError.
const DistApi& dist_api();

// Writes the error JSON torchrun reads from $TORCHELASTIC_ERROR_FILE (nothing when it is unset).
void write_error_file(const LaunchEnv& env, const std::string& message);

// The one exit code every rank of a real-mode replay exits with: rank 0's (SPEC §7 "Real mode";
// torchrun's own exit code is 1 for any failure). Rank 0 publishes `exit_code` and, when it is not
// 0, writes `reason` to $TORCHELASTIC_ERROR_FILE. Any other rank waits for rank 0's code (ignoring
// its own view), writes the error file when that code is not 0, and exits with it; kExitFault when
// no code came within the deadline (heard_from_rank0 false).
struct JobVerdict {
  int exit_code = 0;
  bool heard_from_rank0 = true;
};
JobVerdict publish_job_verdict(const RealReplayInput& in, int exit_code, const std::string& reason);
JobVerdict follow_job_verdict(const RealReplayInput& in);

// Serialisation of one rank's outcome through the store.
std::string rank_result_to_json(const oracle::RankResult& r);
oracle::RankResult rank_result_from_json(const std::string& text);

}  // namespace lossguard::distributed

extern "C" const lossguard::distributed::DistApi* lossguard_dist_api();
