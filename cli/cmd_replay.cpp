// `lossguard replay`: the skip decision at the end of a step, replayed over a TP x PP x CP x DP
// topology with a protocol (SPEC §7): expected decision, every rank's outcome (grouped), findings,
// verdict.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>
#include <map>

#include "cli/command.h"
#include "cli/inputs.h"
#include "cli/placement_options.h"
#include "cli/replay_svg.h"
#include "cli/steps.h"
#include "core/errors.h"
#include "distributed/real_replay.h"
#include "kernels/device_info.h"
#include "oracle/metrics.h"
#include "oracle/replay.h"

namespace lossguard::cli {

namespace {

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

void print_outcomes(std::ostream& out, const oracle::ReplayResult& r, int64_t max_lines) {
  // Group ranks by what happened to them, in order of first appearance.
  std::vector<std::string> order;
  std::map<std::string, std::vector<int64_t>> members;
  std::map<std::string, const oracle::RankResult*> example;
  for (const auto& rr : r.ranks) {
    const bool wrong = rr.skip && *rr.skip != r.expected_skip;
    std::string key = fmt::format("{}: {}{}", oracle::outcome_name(rr.outcome), rr.summary,
                                  wrong ? " [WRONG DECISION]" : "");
    if (!members.count(key)) {
      order.push_back(key);
      example[key] = &rr;
    }
    members[key].push_back(rr.rank);
  }
  out << "outcomes:\n";
  int64_t lines = 0;
  for (const auto& key : order) {
    if (max_lines > 0 && lines++ >= max_lines) {
      out << fmt::format("  ... {} more kinds of outcome (--max-lines 0 shows all)\n",
                         order.size() - static_cast<std::size_t>(max_lines));
      break;
    }
    const auto& ranks = members[key];
    out << fmt::format("  rank{} {} ({}): {}\n", ranks.size() == 1 ? "" : "s",
                       oracle::format_rank_set(ranks), ranks.size(), key);
    if (!example[key]->detail.empty())
      out << fmt::format("      e.g. rank {}: {}\n", example[key]->rank, example[key]->detail);
  }
}

oracle::GradSync grad_sync_from_option(const std::string& v) {
  for (auto g : {oracle::GradSync::kLastMicrobatch, oracle::GradSync::kEveryMicrobatch,
                 oracle::GradSync::kFinalize}) {
    if (v == oracle::grad_sync_name(g)) return g;
  }
  throw_input_error("--grad-sync must be last-microbatch, every-microbatch or finalize, got '{}'",
                    v);
}

// The options, each parsed and checked once, before any dump is loaded.
struct ReplaySettings {
  oracle::Protocol protocol = oracle::Protocol::kPr285;
  oracle::ReduceMode reduce = oracle::ReduceMode::kPerToken;
  Policy policy = Policy::kFixed;
  oracle::GradSync grad_sync = oracle::GradSync::kLastMicrobatch;
  oracle::GroupKind flag_group = oracle::GroupKind::kTp;
  std::vector<int64_t> nan_ranks;
};

void replay_step(const ReplayOptions& o, const StepView& v, const ReplaySettings& set,
                 const oracle::Topology& topo, const PlacementOptions& placement_options,
                 Report& report, Context& ctx);

void run_replay(const ReplayOptions& o, Report& report, Context& ctx) {
  ReplaySettings set;
  if (!oracle::parse_protocol(o.protocol, &set.protocol)) {
    std::vector<std::string> names;
    for (auto p : oracle::all_protocols()) names.push_back(oracle::protocol_name(p));
    throw_input_error("--protocol must be one of {}, got '{}'", fmt::join(names, ", "), o.protocol);
  }
  if (o.reduce == "per-token")
    set.reduce = oracle::ReduceMode::kPerToken;
  else if (o.reduce == "sample-mean")
    set.reduce = oracle::ReduceMode::kSampleMean;
  else
    throw_input_error("--reduce must be per-token or sample-mean, got '{}'", o.reduce);
  set.policy = policy_from_option(o.policy);
  if (o.backend != "sim" && o.backend != "gloo" && o.backend != "nccl") {
    throw_input_error("--backend must be sim, gloo or nccl, got '{}'", o.backend);
  }
  if (!(o.timeout_s > 0)) throw_input_error("--timeout must be > 0 seconds, got {}", o.timeout_s);
  set.grad_sync = grad_sync_from_option(o.grad_sync);
  if (o.flag_group == "tp" || o.flag_group == "cp" || o.flag_group == "dp") {
    set.flag_group = o.flag_group == "tp"   ? oracle::GroupKind::kTp
                     : o.flag_group == "cp" ? oracle::GroupKind::kCp
                                            : oracle::GroupKind::kDp;
  } else {
    throw_input_error("--flag-group must be tp, cp or dp, got '{}'", o.flag_group);
  }
  if (o.max_tokens_per_mb < 0) {
    throw_input_error("--max-tokens-per-mb must be >= 1 (0: off), got {}", o.max_tokens_per_mb);
  }
  const oracle::Topology topo(o.sizes.tp, o.sizes.pp, o.sizes.cp, o.sizes.dp, o.sizes.ep,
                              o.sizes.etp);
  if (!o.nan_ranks.empty()) set.nan_ranks = oracle::parse_rank_list(o.nan_ranks, topo.world());
  PlacementOptions placement_options = o.placement;
  placement_options.dp = o.sizes.dp;
  if (o.dumps.dp_shards &&
      static_cast<int64_t>(io::expand_dump_paths(o.dumps.paths).size()) != o.sizes.dp) {
    throw_input_error("--dp-shards: {} dump(s) given for DP = {}",
                      io::expand_dump_paths(o.dumps.paths).size(), o.sizes.dp);
  }
  LoadedBatch loaded = load_batch(o.dumps, report, ctx, LoadNeeds{false, false, true});
  if (o.backend != "sim" && loaded.batch.steps.size() > 1 && o.dumps.step < 0) {
    throw_input_error(
        "the dumps hold {} optimizer steps; a real-mode replay runs one: pass --step N (the "
        "simulator replays them all)",
        loaded.batch.steps.size());
  }
  run_per_step(loaded.batch, o.dumps.step, report, ctx, [&](const StepView& v) {
    replay_step(o, v, set, topo, placement_options, report, ctx);
  });
}

void replay_step(const ReplayOptions& o, const StepView& v, const ReplaySettings& set,
                 const oracle::Topology& topo, const PlacementOptions& placement_options,
                 Report& report, Context& ctx) {
  const oracle::Protocol protocol = set.protocol;
  const oracle::ReduceMode reduce = set.reduce;
  const Policy policy = set.policy;
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
    placement = placement_options.placement(b, o.dumps.dp_shards);
  }
  if (o.max_tokens_per_mb > 0) {
    placement = oracle::pack_by_tokens(placement, b.total_lengths, o.max_tokens_per_mb);
  }
  oracle::ReplayInputs in =
      oracle::make_replay_inputs(b, topo, placement, protocol, reduce, policy, o.layout.layout());
  in.grad_sync = set.grad_sync;
  in.flag_group = set.flag_group;
  in.nan_ranks = set.nan_ranks;
  oracle::ReplayResult result;
  distributed::RealReplayInput real;
  if (o.backend == "sim") {
    result = oracle::simulate(in);
  } else {
    real.env = distributed::launch_env_from_environment();
    real.inputs = &in;
    real.timeout_s = o.timeout_s;
    if (real.env.world_size != topo.world()) {
      throw_input_error(
          "the launcher started {} processes ($WORLD_SIZE) but TP{} PP{} CP{} DP{} has {} ranks",
          real.env.world_size, o.sizes.tp, o.sizes.pp, o.sizes.cp, o.sizes.dp, topo.world());
    }
    if (o.backend == "nccl") {
      const kernels::DeviceInfo d = kernels::query_device_info();
      if (!d.nccl_compiled || d.device_count == 0) {
        throw UnverifiedError(fmt::format(
            "--backend nccl needs NCCL and a CUDA device, one per local rank; this process has {}",
            d.nccl_compiled ? "no device (" + d.status + ")" : "a build without NCCL"));
      }
      real.backend = distributed::Backend::kNccl;
    }
    distributed::RealReplayOutput got;
    distributed::dist_api().run(&real, &got);
    if (!got.error.empty()) {
      report.fault();
      throw InputError(fmt::format("rank {}: {}", real.env.rank, got.error));
    }
    if (real.env.rank != 0) {  // rank 0 alone reports; every rank exits with its verdict
      const int code = distributed::dist_api().agree_exit_code(&real, -1);
      report.verified();
      report.suppress_outputs();
      report.force_exit_code(code < 0 ? kExitFault : code);
      if (code != 0) {
        distributed::write_error_file(
            real.env, fmt::format("lossguard replay rank {}: the job's verdict is exit code {}{}",
                                  real.env.rank, code < 0 ? kExitFault : code,
                                  code < 0 ? " (no verdict from rank 0)" : ""));
      }
      if (code < 0)
        ctx.err << fmt::format("lossguard: rank {}: no verdict from rank 0 within the deadline\n",
                               real.env.rank);
      return;
    }
    result = oracle::summarize(in, got.ranks);
  }

  std::ostream& out = ctx.out;
  const oracle::ProtocolParts parts = oracle::protocol_parts(protocol);
  out << fmt::format(
      "lossguard replay: protocol {}, backend {}, TP{} PP{} CP{} DP{}{} (world {}), {} samples, {} "
      "micro-batch(es) per DP rank{}, reduce {}{}\n",
      oracle::protocol_name(protocol), o.backend, o.sizes.tp, o.sizes.pp, o.sizes.cp, o.sizes.dp,
      topo.ep() > 1 ? fmt::format(" EP{}", topo.ep()) : "", topo.world(), b.num_samples(),
      in.min_microbatches() == in.microbatches()
          ? fmt::format("{}", in.microbatches())
          : fmt::format("{}-{} (uneven)", in.min_microbatches(), in.microbatches()),
      parts.loop == oracle::Loop::kNone
          ? ""
          : fmt::format(", gradient all-reduce at {}", oracle::grad_sync_name(in.grad_sync)),
      oracle::reduce_mode_name(reduce),
      policy == Policy::kFixed ? "" : fmt::format(", counting policy {}", policy_name(policy)));
  out << fmt::format("  {}: {}\n", oracle::protocol_name(protocol),
                     oracle::protocol_description(protocol));
  out << fmt::format("global effective tokens (fixed): {} -> expected decision: {}\n\n",
                     in.global_tokens,
                     in.global_tokens == 0  ? "skip (a zero-token step: no training signal)"
                     : result.expected_skip ? fmt::format("skip ({})", result.expected_reason)
                                            : std::string("step"));
  print_outcomes(out, result, o.max_lines);

  // The last stage's loss metrics, normalised as SPEC §6 says.
  nlohmann::ordered_json metrics = nullptr;
  if (auto values = oracle::loss_metric_values(b, reduce, in.global_tokens)) {
    metrics = {{"keys", {"loss"}},
               {"values", *values},
               {"denominator",
                reduce == oracle::ReduceMode::kPerToken ? "global tokens" : "global batch size"}};
    try {
      const auto m = oracle::normalize_metrics(*values, {"loss"});
      metrics["normalized"] = {{"loss", m.values[0].second}};
      metrics["no_signal"] = m.no_signal;
      out << fmt::format("\nlast-stage metrics ({}): loss = {:.6g}{}\n",
                         oracle::reduce_mode_name(reduce), m.values[0].second,
                         m.no_signal ? " (no-signal step: reported as 0.0)" : "");
    } catch (const oracle::MetricsError& e) {
      metrics["error"] = e.what();
      report.add_findings({{"metrics_fail_fast", e.what(), nlohmann::json::object()}});
      out << fmt::format("\nlast-stage metrics: FAIL FAST: {}\n", e.what());
      report.fault();
    }
  }
  report.add_findings(result.findings);
  print_findings(out, result.findings);

  const bool pass = !result.fault && !result.wrong_decision;
  out << fmt::format("\nverdict: {}\n", pass ? "pass: every rank reached the expected decision"
                                        : result.fault
                                            ? "FAULT: a real job would crash or hang (exit 3)"
                                            : "FAIL: wrong decision (exit 1)");
  if (!o.svg_path.empty()) {
    std::ofstream svg(o.svg_path, std::ios::trunc);
    svg << replay_svg(
        in, result,
        fmt::format("lossguard replay: {} on TP{} PP{} CP{} DP{}", oracle::protocol_name(protocol),
                    o.sizes.tp, o.sizes.pp, o.sizes.cp, o.sizes.dp));
    if (!svg) throw_input_error("{}: cannot write the SVG", o.svg_path);
    out << fmt::format("rank grid: {}\n", o.svg_path);
  }

  auto& res = report.results();
  res["protocol"] = oracle::protocol_name(protocol);
  res["backend"] = o.backend;
  res["tp"] = o.sizes.tp;
  res["pp"] = o.sizes.pp;
  res["cp"] = o.sizes.cp;
  res["dp"] = o.sizes.dp;
  res["world"] = topo.world();
  res["ep"] = topo.ep();
  res["microbatches"] = in.microbatches();
  res["min_microbatches"] = in.min_microbatches();
  res["grad_sync"] = oracle::grad_sync_name(in.grad_sync);
  res["nan_ranks"] = in.nan_ranks;
  res["expected_reason"] = result.expected_reason;
  res["reduce"] = oracle::reduce_mode_name(reduce);
  res["policy"] = policy_name(policy);
  res["global_tokens"] = in.global_tokens;
  res["expected"] = result.expected_skip ? "skip" : "step";
  res["metrics"] = metrics;
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  if (ctx.want_json) {
    for (const auto& r : result.ranks) {
      ranks.push_back({{"rank", r.rank},
                       {"decision", r.skip ? nlohmann::ordered_json(*r.skip ? "skip" : "step")
                                           : nlohmann::ordered_json(nullptr)},
                       {"outcome", oracle::outcome_name(r.outcome)},
                       {"optimizer_stepped", r.optimizer_stepped},
                       {"scheduler_stepped", r.scheduler_stepped},
                       {"grad_norm", r.grad_norm ? nlohmann::ordered_json(*r.grad_norm)
                                                 : nlohmann::ordered_json(nullptr)},
                       {"update_successful", r.update_successful},
                       {"unsynced_gradients", r.unsynced_gradients},
                       {"detail", r.detail.empty() ? r.summary : r.summary + ": " + r.detail}});
    }
  }
  res["ranks"] = ranks;
  const std::string name = fmt::format("{} TP{} PP{} CP{} DP{}", oracle::protocol_name(protocol),
                                       o.sizes.tp, o.sizes.pp, o.sizes.cp, o.sizes.dp);
  // JUnit failure messages name the ranks (the findings' rank sets: "0-3, 8-11", arithmetic runs).
  std::string wrong_ranks, fault_ranks;
  for (const auto& f : result.findings) {
    if (f.kind == "parameter_drift" || f.kind == "lost_step" || f.kind == "nonfinite_step" ||
        f.kind == "unsynced_gradients")
      wrong_ranks += (wrong_ranks.empty() ? "" : "; ") + f.message;
    if (f.kind == "distributed_fault") fault_ranks = f.message;
  }
  report.add_case({"lossguard.replay", name + ": expected decision on every rank",
                   !result.wrong_decision, result.wrong_decision ? wrong_ranks : "", false});
  report.add_case({"lossguard.replay", name + ": no error, deadlock or mismatch", !result.fault,
                   result.fault ? fault_ranks : "", false});
  if (b.num_samples() == 0) throw UnverifiedError("the dumps hold no samples");
  report.verified();
  if (result.fault) report.fault();
  if (result.wrong_decision) report.fail();
  if (o.backend != "sim") {
    ctx.out << std::flush;  // a launcher may stop the other ranks once one exits non-zero
    distributed::dist_api().agree_exit_code(&real, report.exit_code());
    if (report.exit_code() != 0) {
      distributed::write_error_file(
          real.env, fmt::format("lossguard replay: verdict {} (exit code {}): {}",
                                verdict_name(report.verdict()), report.exit_code(),
                                result.findings.empty() ? "" : result.findings.back().message));
    }
  }
}

}  // namespace

void register_replay(CLI::App& root, Commands& commands) {
  auto cmd = std::make_unique<Command>();
  auto opts = std::make_shared<ReplayOptions>();
  CLI::App* app = root.add_subcommand(
      "replay", "Replay the zero-token skip decision over a TP x PP x CP x DP topology");
  cmd->app = app;
  std::string protocols;
  for (auto p : oracle::all_protocols()) {
    protocols +=
        fmt::format("  {:<25} {}\n", oracle::protocol_name(p), oracle::protocol_description(p));
  }
  app->footer(
      "Protocols: the zero-token skip at the end of a step, and the data-dependent participation\n"
      "around it (per-micro-batch backward skips, uneven micro-batch counts, non-finite-gradient\n"
      "skips, a flag broadcast on a TP/CP/DP group). Each correct form and its buggy forms:\n" +
      protocols +
      "The expected decision is skip iff the step has no effective token or a gradient is "
      "non-finite\n"
      "(--nan-ranks). Exit codes: 0 every rank reached the expected decision; 1 a wrong decision\n"
      "(parameter drift, a lost step, a step with a non-finite gradient or with gradients no\n"
      "all-reduce followed); 3 an error, deadlock or mismatch. Under torchrun, whose own exit code "
      "is 1\n"
      "for any failure, read rank 0's --json report (verdict, exit_code).\n"
      "Examples:\n  lossguard replay zero.pt --tp 2 --pp 2 --protocol pr285-src-local\n"
      "  lossguard replay batch.safetensors --dp 4 --max-tokens-per-mb 4096 --protocol "
      "microbatches-local --ep 2\n"
      "  lossguard replay batch.safetensors --tp 2 --pp 2 --dp 2 --protocol nan-skip-local "
      "--nan-ranks 3\n"
      "  lossguard replay batch.safetensors --tp 8 --pp 16 --cp 8 --dp 128 --svg grid.svg\n"
      "  torchrun --nproc-per-node 4 --no-python lossguard replay batch.safetensors --tp 2 --pp 2 "
      "--backend gloo --json report.json");
  add_dump_options(*app, opts->dumps, true);
  add_step_option(*app, opts->dumps);
  add_topology_options(*app, opts->sizes);
  app->add_option("--microbatches", opts->placement.microbatches, "Micro-batches per DP rank")
      ->capture_default_str();
  app->add_option("--split", opts->placement.split,
                  "How samples go to DP ranks: contiguous or round-robin")
      ->capture_default_str();
  app->add_option("--protocol", opts->protocol, "The protocol every rank runs (list below)")
      ->capture_default_str();
  app->add_option("--grad-sync", opts->grad_sync,
                  "When a backward issues the DDP gradient all-reduce: last-microbatch (PyTorch "
                  "DDP no_sync, Megatron overlap_grad_reduce), every-microbatch (ZeRO-3/FSDP), "
                  "finalize (Megatron finalize_model_grads, whatever backward ran)")
      ->capture_default_str();
  app->add_option("--flag-group", opts->flag_group,
                  "flag-broadcast protocols: the group the flag is broadcast on (tp, cp or dp)")
      ->capture_default_str();
  app->add_option("--nan-ranks", opts->nan_ranks,
                  "Ranks whose own gradient is NaN (\"3\", \"0,4-7\"): the step must then be "
                  "skipped everywhere")
      ->type_name("LIST");
  app->add_option("--max-tokens-per-mb", opts->max_tokens_per_mb,
                  "Dynamic batch size: cut each DP rank's samples, in order, into micro-batches of "
                  "at most N tokens (DP ranks may get different counts; 0: --microbatches)")
      ->capture_default_str();
  app->add_option("--reduce", opts->reduce,
                  "per-token (per-token loss on) or sample-mean (off): what values[0] holds")
      ->capture_default_str();
  app->add_option("--policy", opts->policy,
                  "Token counting policy on each rank: fixed, legacy or slime")
      ->capture_default_str();
  app->add_option("--backend", opts->backend,
                  "sim (simulated collectives), gloo (real, CPU; launch under torchrun) or nccl "
                  "(real, one GPU per rank)")
      ->capture_default_str();
  app->add_option("--timeout", opts->timeout_s,
                  "Seconds any real collective may wait (real backends)")
      ->capture_default_str();
  app->add_option("--svg", opts->svg_path, "Draw the rank grid, coloured by outcome, to FILE")
      ->type_name("FILE");
  app->add_option("--max-lines", opts->max_lines, "Outcome groups shown in text (0: all)")
      ->capture_default_str();
  add_layout_options(*app, opts->layout);
  add_output_options(*app, cmd->output);
  cmd->run = [opts](Report& r, Context& c) { run_replay(*opts, r, c); };
  commands.push_back(std::move(cmd));
}

}  // namespace lossguard::cli
