// `replay`'s options, each parsed and checked once before any dump is loaded, and its run over one
// step: the simulator, or this process's rank of a real job (Gloo/NCCL under torchrun). Wiring
// only: the outcome and verdict are oracle::ReplayResult's, the ranks' agreement distributed/'s.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/inputs.h"
#include "cli/placement_options.h"
#include "cli/steps.h"
#include "distributed/real_replay.h"
#include "oracle/replay/replay.h"

namespace lossguard::cli {

enum class ReplayBackend { kSim, kGloo, kNccl };

}  // namespace lossguard::cli

namespace lossguard {
template <>
struct ModeNames<cli::ReplayBackend> {
  static constexpr std::pair<cli::ReplayBackend, const char*> kTable[] = {
      {cli::ReplayBackend::kSim, "sim"},
      {cli::ReplayBackend::kGloo, "gloo"},
      {cli::ReplayBackend::kNccl, "nccl"}};
};
}  // namespace lossguard

namespace lossguard::cli {

struct ReplayOptions {
  DumpOptions dumps;
  TopologySizes sizes;
  PlacementOptions placement;
  LayoutOptions layout;
  std::string protocol = "pr285";
  std::string reduce = "per-token";
  std::string policy = "fixed";
  std::string backend = "sim";
  std::string grad_sync = "last-microbatch";
  std::string flag_group = "tp";
  std::string nan_ranks;
  int64_t max_tokens_per_mb = 0;
  double timeout_s = 20.0;
  std::string svg_path;
  int64_t max_lines = 40;
};

struct ReplaySettings {
  oracle::Protocol protocol = oracle::Protocol::kPr285;
  oracle::ReduceMode reduce = oracle::ReduceMode::kPerToken;
  Policy policy = Policy::kFixed;
  ReplayBackend backend = ReplayBackend::kSim;
  oracle::GradSync grad_sync = oracle::GradSync::kLastMicrobatch;
  oracle::GroupKind flag_group = oracle::GroupKind::kTp;
  std::vector<int64_t> nan_ranks;
  oracle::Topology topo{1, 1, 1, 1};
  PlacementOptions placement;  // --dp from the topology
};
// Throws InputError naming the option.
ReplaySettings replay_settings(const ReplayOptions& options);

// One step replayed. `real` is set in real mode.
struct ReplayRun {
  oracle::ReplayInputs in;
  oracle::ReplayResult result;
  std::optional<distributed::RealReplayInput> real;
};
// nullopt on a real-mode rank other than 0: it has taken rank 0's verdict into `report` and reports
// nothing itself.
std::optional<ReplayRun> run_replay_step(const ReplayOptions& options, const ReplaySettings& set,
                                         const StepView& step, Report& report, Context& ctx);

}  // namespace lossguard::cli
