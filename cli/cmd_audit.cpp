// `lossguard audit`: a trainer's own numbers, recorded on every rank by lossguard-capture (or any
// writer of the SPEC §10 format), judged per step: coverage, counts, measured effective weights
// with their diagnosis and the contract that reproduces them, loss, skip decision, metrics.
// oracle::audit_captures decides; cli/audit_render.cpp prints.
#include <fmt/format.h>

#include <optional>

#include "cli/audit_render.h"
#include "cli/command.h"
#include "cli/mode_option.h"
#include "core/errors.h"
#include "io/capture.h"
#include "oracle/audit/audit.h"

namespace lossguard::cli {

namespace {

struct AuditOptions {
  std::vector<std::string> paths;
  std::string reduce;
  std::optional<double> rtol;  // none: from the trainer's recorded dtype
  bool strict_scale = false;
  bool strict = false;
  bool explain = false;
  std::string svg_path;
};

void run_audit(const AuditOptions& o, Report& report, Context& ctx) {
  oracle::AuditOptions opt;
  if (!o.reduce.empty()) opt.reduce = mode_from_option<Reduction>("--reduce", o.reduce);
  opt.weight_rel_tol = o.rtol;
  opt.strict_scale = o.strict_scale;
  opt.every_trainer_preset = o.explain;
  opt.strict_records = o.strict;
  opt.shard_ratios = !o.svg_path.empty();
  const std::vector<RankCapture> captures = io::read_captures(o.paths);
  for (const auto& c : captures) report.add_input(c.file, "audit capture");
  const oracle::AuditResult result = oracle::audit_captures(captures, opt);
  render_audit(result, o.explain, o.svg_path, report, ctx);
  report.record(result.judgement());
}

}  // namespace

void register_audit(CLI::App& root, Commands& commands) {
  auto cmd = std::make_unique<Command>();
  auto opts = std::make_shared<AuditOptions>();
  CLI::App* app = root.add_subcommand(
      "audit",
      "A trainer's own numbers, recorded on every rank by lossguard-capture: every effective token "
      "held "
      "once, the counts, each token's measured weight in the applied gradient (diagnosed, and the "
      "contract that reproduces it named), the loss, the skip decision on every rank, the metrics");
  cmd->app = app;
  app->footer(
      "Record (pip install ./python; python/README.md). A Hugging Face Trainer, three lines:\n"
      "  import lossguard_capture.hf\n"
      "  lossguard_capture.hf.attach(trainer, \"captures\")   # step 0; fails fast on every rank\n"
      "  trainer.train()\n"
      "then:  lossguard audit captures/step000000\n"
      "Any other trainer, in its loss path on every loss-computing rank:\n"
      "  cap = lossguard_capture.Capture(\"captures\", reduce=\"per-token\", cp=...)\n"
      "  with cap.step(n) as s:\n"
      "      mb = s.microbatch(sample_indices=..., tokens=..., total_lengths=..., "
      "response_lengths=..., loss_masks=..., cp_size=...)\n"
      "      mb.hook(per_token_loss); ...; s.finish(grad_scale=..., num_tokens_reduced=N)\n"
      "Exit 1 when a check fails (a uniform weight scale the layout sets, 1/cp, dp, 1/M, always: "
      "another layout\n"
      "applies another update; a constant one only with --strict-scale, or when no optimizer "
      "hides it: a negative\n"
      "scale is gradient ascent, below 2^-10 Adam's eps/s takes over, above 2^64 the trainer's "
      "floats overflow;\n"
      "a non-finite record always),\n"
      "2 when the captures do not fit together (a missing rank, ranks that disagree on the "
      "objective, a sample that\n"
      "differs between ranks, token_weight lengths that do not match the layout), 4 when they hold "
      "no sample.\n"
      "Tolerances follow the trainer's recorded dtype (fp32 1e-5; bf16 4u weights, 8u loss; "
      "docs/semantics.md §10).\n"
      "Checks whose records are absent are shown as not run, never as passed.");
  app->add_option("captures", opts->paths, "Capture files or directories of them")->required();
  app->add_option(
      "--reduce", opts->reduce,
      "The objective, instead of the one the captures claim: " + mode_choices<Reduction>());
  app->add_option("--rtol", opts->rtol,
                  "Relative tolerance of measured weights (default: from the trainer's dtype: "
                  "float32 1e-5, float64 1e-9, bf16 7.8e-3, fp16 2e-3)")
      ->check(CLI::PositiveNumber);
  app->add_flag("--strict-scale", opts->strict_scale,
                "A constant uniform weight scale fails too (one the layout sets always fails)");
  app->add_flag("--strict", opts->strict,
                "A record the capture format does not name (a misspelled 'skiped') is an error "
                "(exit 2), not a warning");
  app->add_flag("--explain", opts->explain,
                "On an exact step also list every preset its weights match (JSON always has "
                "them), and offer every trainer's presets: a Megatron, slime or Relax run is "
                "otherwise explained by its own family's presets only");
  app->add_option("--svg", opts->svg_path,
                  "Draw the measured ratio per micro-batch and CP rank (first step)");
  add_output_options(*app, cmd->output);
  cmd->run = [opts](Report& r, Context& c) { run_audit(*opts, r, c); };
  commands.push_back(std::move(cmd));
}

}  // namespace lossguard::cli
