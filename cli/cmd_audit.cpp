// `lossguard audit`: a trainer's own numbers, recorded on every rank by lossguard-capture (or any
// writer of the SPEC §10 format), judged per step: coverage, counts, measured effective weights
// with their diagnosis and the contract that reproduces them, loss, skip decision, metrics.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <fstream>

#include "cli/command.h"
#include "cli/weights_report.h"
#include "core/errors.h"
#include "io/capture.h"
#include "oracle/audit.h"

namespace lossguard::cli {

namespace {

struct AuditOptions {
  std::vector<std::string> paths;
  std::string reduce;
  double rtol = 0.0;
  bool strict_scale = false;
  std::string svg_path;
};

nlohmann::ordered_json check_json(const oracle::AuditCheck& c) {
  return {{"name", c.name},
          {"ok", c.ok ? nlohmann::ordered_json(*c.ok) : nlohmann::ordered_json(nullptr)},
          {"detail", c.detail}};
}

void run_audit(const AuditOptions& o, Report& report, Context& ctx) {
  oracle::AuditOptions opt;
  if (!o.reduce.empty()) {
    Reduction r;
    if (!parse_reduction(o.reduce, &r)) {
      throw_input_error("--reduce must be {}, got '{}'", mode_choices<Reduction>(), o.reduce);
    }
    opt.reduce = r;
  }
  opt.weight_rel_tol = o.rtol;
  opt.strict_scale = o.strict_scale;
  const std::vector<RankCapture> captures = io::read_captures(o.paths);
  for (const auto& c : captures) report.add_input(c.file, "audit capture");
  const std::vector<oracle::AuditStep> steps = oracle::audit_captures(captures, opt);

  std::ostream& out = ctx.out;
  const RankCapture& first = captures.front();
  out << fmt::format(
      "lossguard audit: {} capture(s), {} step(s); world {} = TP {} x PP {} x CP {} x DP {}\n",
      captures.size(), steps.size(), first.world_size, first.tp, first.pp, first.cp, first.dp);
  bool any_failed = false;
  nlohmann::ordered_json steps_json = nlohmann::ordered_json::array();
  for (const auto& s : steps) {
    const bool failed = s.failed(o.strict_scale);
    any_failed |= failed;
    int64_t mbs = 0;
    for (const auto& mb : s.layout.microbatches) mbs += !mb.dummy;
    out << fmt::format(
        "\nstep {}: {} samples, N = {} effective tokens, {} micro-batch(es) on {} loss rank(s); "
        "objective {}\n",
        s.step, s.batch.num_samples(), s.global_tokens, mbs, s.ranks.size(), mode_name(s.reduce));
    std::size_t name_width = 9;  // "coverage", "decision"; wider for terms ("mtp.coverage")
    for (const auto& c : s.checks) name_width = std::max(name_width, c.name.size());
    for (const auto& c : s.checks) {
      const char* mark = !c.ok ? "not run" : *c.ok ? "ok" : "FAIL";
      out << fmt::format("  {:<{}} {:<8} {}\n", c.name, name_width, mark, c.detail);
    }
    if (!s.diagnosis.exact()) {
      out << fmt::format("  reproduced by: {}\n",
                         s.matches.empty() ? "no preset and no single component change of the truth"
                                           : fmt::format("{}", fmt::join(s.matches, ", ")));
    } else if (!s.matches.empty()) {
      out << fmt::format("  matches: {}\n", fmt::join(s.matches, ", "));
    }
    for (const auto& t : s.terms) {
      if (t.diagnosis.kind == "not-run" || t.diagnosis.exact()) continue;
      out << fmt::format("  {} reproduced by: {}\n", t.term.name,
                         t.matches.empty() ? "no preset and no single component change of the truth"
                                           : fmt::format("{}", fmt::join(t.matches, ", ")));
    }
    for (const auto& f : s.findings) out << "  [" << f.kind << "] " << f.message << "\n";
    out << fmt::format("  verdict: {}\n", failed ? "FAIL" : "pass");
    report.add_findings(s.findings);
    for (const auto& c : s.checks) {
      report.add_case({"lossguard.audit", fmt::format("step {} {}", s.step, c.name), !c.ok || *c.ok,
                       c.detail, !c.ok});
    }
    nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
    for (const auto& r : s.ranks) {
      ranks.push_back({{"rank", r.rank},
                       {"dp", r.dp_rank},
                       {"cp", r.cp_rank},
                       {"tp", r.tp_rank},
                       {"pp", r.pp_rank},
                       {"microbatches", r.microbatches},
                       {"owned_tokens", r.owned_tokens},
                       {"grad_scale", r.grad_scale},
                       {"skipped", r.skipped ? nlohmann::ordered_json(*r.skipped)
                                             : nlohmann::ordered_json(nullptr)},
                       {"grad_norm", r.grad_norm ? nlohmann::ordered_json(*r.grad_norm)
                                                 : nlohmann::ordered_json(nullptr)},
                       {"file", r.file}});
    }
    nlohmann::ordered_json checks = nlohmann::ordered_json::array();
    for (const auto& c : s.checks) checks.push_back(check_json(c));
    steps_json.push_back({{"step", s.step},
                          {"reduce", mode_name(s.reduce)},
                          {"global_tokens", s.global_tokens},
                          {"expected", s.expected_skip ? "skip" : "step"},
                          {"ranks", ranks},
                          {"checks", checks},
                          {"diagnosis", diagnosis_json(s.diagnosis)},
                          {"matches", s.matches},
                          {"weight_rel_tol", s.weight_rel_tol},
                          {"dtype", std::string(dtype_name(s.dtype))}});
    if (!s.terms.empty()) {
      nlohmann::ordered_json terms = nlohmann::ordered_json::array();
      for (const auto& t : s.terms) {
        terms.push_back(
            {{"name", t.term.name},
             {"declared", t.declared},
             {"hooked", t.hooked},
             {"reduce", t.declared ? nlohmann::ordered_json(mode_name(t.term.reduce))
                                   : nlohmann::ordered_json(nullptr)},
             {"coef",
              t.declared ? nlohmann::ordered_json(t.term.coef) : nlohmann::ordered_json(nullptr)},
             {"mask", t.declared ? nlohmann::ordered_json(t.term.mask.text())
                                 : nlohmann::ordered_json(nullptr)},
             {"tokens", t.tokens},
             {"relative_to_main", t.relative_to},
             {"diagnosis", t.diagnosis.kind == "not-run" ? nlohmann::ordered_json(nullptr)
                                                         : diagnosis_json(t.diagnosis)},
             {"matches", t.matches}});
      }
      steps_json.back()["terms"] = std::move(terms);
    }
  }
  if (!o.svg_path.empty()) {
    const auto& s = steps.front();
    std::ofstream svg(o.svg_path);
    const auto shards = oracle::shard_ratios(s.batch, s.measured, s.truth, s.place, s.layout);
    Contract measured;
    measured.preset = fmt::format("measured (step {})", s.step);
    if (!(svg << weights_svg(s.layout, shards, s.diagnosis, measured))) {
      throw_input_error("{}: cannot write the SVG", o.svg_path);
    }
  }
  out << fmt::format("\nverdict: {}\n",
                     any_failed ? "FAIL: the trainer's numbers differ from the truth"
                                : "pass: the trainer's numbers are right on every step");
  report.results()["steps"] = steps_json;
  report.verified();
  if (any_failed) report.fail();
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
      "Exit 1 when a check fails (a uniform weight scale only with --strict-scale; a non-finite "
      "record always),\n"
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
  app->add_flag("--strict-scale", opts->strict_scale, "A uniform weight scale fails too");
  app->add_option("--svg", opts->svg_path,
                  "Draw the measured ratio per micro-batch and CP rank (first step)");
  add_output_options(*app, cmd->output);
  cmd->run = [opts](Report& r, Context& c) { run_audit(*opts, r, c); };
  commands.push_back(std::move(cmd));
}

}  // namespace lossguard::cli
