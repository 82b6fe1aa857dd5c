// `lossguard replay`: the skip decision at the end of a step, replayed over a TP x PP x CP x DP
// topology with a protocol (SPEC §7): expected decision, every rank's outcome (grouped), findings,
// verdict. cli/replay_run.cpp runs a step (simulated or real), oracle::ReplayResult decides,
// cli/replay_render.cpp prints, distributed/ makes the ranks agree on the exit code.
#include <fmt/format.h>

#include <ostream>

#include "cli/command.h"
#include "cli/inputs.h"
#include "cli/placement_options.h"
#include "cli/replay_render.h"
#include "cli/replay_run.h"
#include "cli/steps.h"
#include "core/errors.h"
#include "distributed/real_replay.h"
#include "oracle/replay/replay.h"

namespace lossguard::cli {

namespace {

void replay_step(const ReplayOptions& o, const ReplaySettings& set, const StepView& v,
                 Report& report, Context& ctx) {
  const Batch& b = *v.batch;
  std::optional<ReplayRun> run = run_replay_step(o, set, v, report, ctx);
  if (!run) return;  // a real-mode rank other than 0: rank 0 reports
  if (run->real) run->real->inputs = &run->in;
  const std::optional<oracle::ReplayMetrics> metrics =
      oracle::replay_metrics(b, set.reduce, run->in.global_tokens);
  render_replay(*run, metrics, b, o, report, ctx);
  report.record(oracle::replay_judgement(b, run->result, metrics));
  if (run->real) {
    ctx.out << std::flush;  // a launcher may stop the other ranks once one exits non-zero
    const auto& findings = run->result.findings;
    distributed::publish_job_verdict(*run->real, report.exit_code(),
                                     fmt::format("lossguard replay: verdict {} (exit code {}): {}",
                                                 verdict_name(report.verdict()), report.exit_code(),
                                                 findings.empty() ? "" : findings.back().message));
  }
}

void run_replay(const ReplayOptions& o, Report& report, Context& ctx) {
  const ReplaySettings set = replay_settings(o);
  LoadedBatch loaded = load_batch(o.dumps, report, ctx, LoadNeeds{false, false, true});
  if (set.backend != ReplayBackend::kSim && loaded.batch.steps.size() > 1 && o.dumps.step < 0) {
    throw_input_error(
        "the dumps hold {} optimizer steps; a real-mode replay runs one: pass --step N (the "
        "simulator replays them all)",
        loaded.batch.steps.size());
  }
  run_per_step(loaded.batch, o.dumps.step, report, ctx,
               [&](const StepView& v) { replay_step(o, set, v, report, ctx); });
}

}  // namespace

void register_replay(CLI::App& root, Commands& commands) {
  auto cmd = std::make_unique<Command>();
  auto opts = std::make_shared<ReplayOptions>();
  CLI::App* app = root.add_subcommand(
      "replay", "Replay the zero-token skip decision over a TP x PP x CP x DP topology");
  cmd->app = app;
  std::string protocols;
  for (auto p : all_modes<oracle::Protocol>()) {
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
