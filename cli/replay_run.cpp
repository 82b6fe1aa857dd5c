// `replay`'s settings and its run over one step (cli/replay_run.h).
#include "cli/replay_run.h"

#include <fmt/format.h>

#include "cli/mode_option.h"
#include "core/errors.h"
#include "kernels/device_info.h"

namespace lossguard::cli {

ReplaySettings replay_settings(const ReplayOptions& o) {
  ReplaySettings set;
  set.protocol = mode_from_option<oracle::Protocol>("--protocol", o.protocol);
  set.reduce = mode_from_option<oracle::ReduceMode>("--reduce", o.reduce);
  set.policy = policy_from_option(o.policy);
  set.backend = mode_from_option<ReplayBackend>("--backend", o.backend);
  if (!(o.timeout_s > 0)) throw_input_error("--timeout must be > 0 seconds, got {}", o.timeout_s);
  set.grad_sync = mode_from_option<oracle::GradSync>("--grad-sync", o.grad_sync);
  // A flag is broadcast on one of the model's groups: tp, cp or dp.
  set.flag_group = mode_from_option<oracle::GroupKind>("--flag-group", o.flag_group);
  if (set.flag_group != oracle::GroupKind::kTp && set.flag_group != oracle::GroupKind::kCp &&
      set.flag_group != oracle::GroupKind::kDp) {
    throw_input_error("--flag-group must be tp, cp or dp, got '{}'", o.flag_group);
  }
  if (o.max_tokens_per_mb < 0) {
    throw_input_error("--max-tokens-per-mb must be >= 1 (0: off), got {}", o.max_tokens_per_mb);
  }
  set.topo =
      oracle::Topology(o.sizes.tp, o.sizes.pp, o.sizes.cp, o.sizes.dp, o.sizes.ep, o.sizes.etp);
  if (!o.nan_ranks.empty()) set.nan_ranks = oracle::parse_rank_list(o.nan_ranks, set.topo.world());
  set.placement = o.placement;
  set.placement.dp = o.sizes.dp;
  if (o.dumps.dp_shards &&
      static_cast<int64_t>(io::expand_dump_paths(o.dumps.paths).size()) != o.sizes.dp) {
    throw_input_error("--dp-shards: {} dump(s) given for DP = {}",
                      io::expand_dump_paths(o.dumps.paths).size(), o.sizes.dp);
  }
  return set;
}

namespace {

// The step's DP x micro-batch placement: the trainer's own where the dump records it.
oracle::Placement step_placement(const ReplayOptions& o, const ReplaySettings& set,
                                 const StepView& v, Context& ctx) {
  const Batch& b = *v.batch;
  oracle::Placement placement;
  if (v.layout != nullptr) {
    placement = *v.layout;
    if (static_cast<int64_t>(placement.size()) != o.sizes.dp) {
      throw_input_error("step {}: {} has {} DP rank(s) but --dp {}", v.step, v.layout_source,
                        placement.size(), o.sizes.dp);
    }
    ctx.out << fmt::format("placement: {} (--microbatches and --split ignored)\n", v.layout_source);
  } else {
    placement = set.placement.placement(b, o.dumps.dp_shards);
  }
  if (o.max_tokens_per_mb > 0)
    placement = oracle::pack_by_tokens(placement, b.total_lengths, o.max_tokens_per_mb);
  return placement;
}

// This process's rank of the real job, its outcomes gathered on rank 0.
distributed::RealReplayOutput run_real(const ReplayOptions& o, const ReplaySettings& set,
                                       distributed::RealReplayInput& real) {
  real.env = distributed::launch_env_from_environment();
  real.timeout_s = o.timeout_s;
  if (real.env.world_size != set.topo.world()) {
    throw_input_error(
        "the launcher started {} processes ($WORLD_SIZE) but TP{} PP{} CP{} DP{} has {} ranks",
        real.env.world_size, o.sizes.tp, o.sizes.pp, o.sizes.cp, o.sizes.dp, set.topo.world());
  }
  if (set.backend == ReplayBackend::kNccl) {
    const kernels::DeviceInfo d = kernels::query_device_info();
    if (!d.nccl_compiled || d.nccl_library.empty() || d.device_count == 0) {
      throw UnverifiedError(fmt::format(
          "--backend nccl needs NCCL and a CUDA device, one per local rank; this process has {}",
          !d.nccl_compiled         ? "a build without NCCL"
          : d.nccl_library.empty() ? d.nccl_status
                                   : "no device (" + d.status + ")"));
    }
    real.backend = distributed::Backend::kNccl;
  }
  distributed::RealReplayOutput got;
  distributed::dist_api().run(&real, &got);
  if (!got.error.empty()) throw JobFaultError(fmt::format("rank {}: {}", real.env.rank, got.error));
  return got;
}

}  // namespace

std::optional<ReplayRun> run_replay_step(const ReplayOptions& o, const ReplaySettings& set,
                                         const StepView& v, Report& report, Context& ctx) {
  ReplayRun run;
  run.in = oracle::make_replay_inputs(*v.batch, set.topo, step_placement(o, set, v, ctx),
                                      set.protocol, set.reduce, set.policy, o.layout.layout());
  run.in.grad_sync = set.grad_sync;
  run.in.flag_group = set.flag_group;
  run.in.nan_ranks = set.nan_ranks;
  if (set.backend == ReplayBackend::kSim) {
    run.result = oracle::simulate(run.in);
    return run;
  }
  run.real.emplace();
  run.real->inputs = &run.in;
  distributed::RealReplayOutput got = run_real(o, set, *run.real);
  if (run.real->env.rank != 0) {  // rank 0 alone reports; every rank exits with its verdict
    const distributed::JobVerdict verdict = distributed::follow_job_verdict(*run.real);
    report.record(Judgement::verified());  // rank 0's verdict is forced below
    report.suppress_outputs();
    report.force_exit_code(verdict.exit_code);
    if (!verdict.heard_from_rank0)
      ctx.err << fmt::format("lossguard: rank {}: no verdict from rank 0 within the deadline\n",
                             run.real->env.rank);
    return std::nullopt;
  }
  run.result = oracle::summarize(run.in, std::move(got.ranks));
  return run;
}

}  // namespace lossguard::cli
