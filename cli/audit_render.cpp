// `audit`'s renderers (cli/audit_render.h).
#include "cli/audit_render.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <fstream>

#include "cli/weights_report.h"
#include "core/errors.h"

namespace lossguard::cli {

namespace {

nlohmann::ordered_json check_json(const oracle::AuditCheck& c) {
  return {{"name", c.name},
          {"ok", c.ok ? nlohmann::ordered_json(*c.ok) : nlohmann::ordered_json(nullptr)},
          {"detail", c.detail}};
}

std::string reproduced_by(const std::vector<std::string>& matches) {
  return matches.empty() ? "no preset and no single component change of the truth"
                         : fmt::format("{}", fmt::join(matches, ", "));
}

// One step's text: heading, checks, what reproduces its weights, findings, verdict.
void print_step(const oracle::AuditStep& s, bool explain, std::ostream& out) {
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
  if (!s.diagnosis.advice.empty())
    out << fmt::format("  {:<{}} {}\n", "fix:", name_width + 9, s.diagnosis.advice);
  if (!s.diagnosis.exact()) {
    out << fmt::format("  reproduced by: {}\n", reproduced_by(s.matches));
  } else if (explain && !s.matches.empty()) {  // an exact step: the list only when asked
    out << fmt::format("  matches: {}\n", fmt::join(s.matches, ", "));
  }
  for (const auto& t : s.terms) {
    if (t.diagnosis.kind == "not-run" || t.diagnosis.exact()) continue;
    out << fmt::format("  {} reproduced by: {}\n", t.term.name, reproduced_by(t.matches));
  }
  for (const auto& f : s.findings) out << "  [" << f.kind << "] " << f.message << "\n";
  out << fmt::format("  verdict: {}\n", s.failed ? "FAIL" : "pass");
}

nlohmann::ordered_json ranks_json(const oracle::AuditStep& s) {
  using J = nlohmann::ordered_json;
  J ranks = J::array();
  for (const auto& r : s.ranks) {
    ranks.push_back({{"rank", r.rank},
                     {"dp", r.dp_rank},
                     {"cp", r.cp_rank},
                     {"tp", r.tp_rank},
                     {"pp", r.pp_rank},
                     {"microbatches", r.microbatches},
                     {"owned_tokens", r.owned_tokens},
                     {"grad_scale", r.grad_scale},
                     {"skipped", r.skipped ? J(*r.skipped) : J(nullptr)},
                     {"grad_norm", r.grad_norm ? J(*r.grad_norm) : J(nullptr)},
                     {"file", r.file}});
  }
  return ranks;
}

nlohmann::ordered_json terms_json(const oracle::AuditStep& s) {
  using J = nlohmann::ordered_json;
  J terms = J::array();
  for (const auto& t : s.terms) {
    terms.push_back(
        {{"name", t.term.name},
         {"declared", t.declared},
         {"hooked", t.hooked},
         {"reduce", t.declared ? J(mode_name(t.term.reduce)) : J(nullptr)},
         {"coef", t.declared ? J(t.term.coef) : J(nullptr)},
         {"mask", t.declared ? J(t.term.mask.text()) : J(nullptr)},
         {"tokens", t.tokens},
         {"relative_to_main", t.relative_to},
         {"diagnosis", t.diagnosis.kind == "not-run" ? J(nullptr) : diagnosis_json(t.diagnosis)},
         {"matches", t.matches}});
  }
  return terms;
}

nlohmann::ordered_json step_json(const oracle::AuditStep& s) {
  nlohmann::ordered_json checks = nlohmann::ordered_json::array();
  for (const auto& c : s.checks) checks.push_back(check_json(c));
  nlohmann::ordered_json j = {{"step", s.step},
                              {"reduce", mode_name(s.reduce)},
                              {"global_tokens", s.global_tokens},
                              {"expected", s.expected_skip ? "skip" : "step"},
                              {"ranks", ranks_json(s)},
                              {"checks", checks},
                              {"diagnosis", diagnosis_json(s.diagnosis)},
                              {"matches", s.matches},
                              {"weight_rel_tol", s.weight_rel_tol},
                              {"dtype", std::string(dtype_name(s.dtype))}};
  if (!s.terms.empty()) j["terms"] = terms_json(s);
  return j;
}

void write_svg(const oracle::AuditStep& s, const std::string& path) {
  if (s.shards.empty())
    throw_input_error("--svg {}: step {}'s weights were not judged, nothing to draw ({})", path,
                      s.step, s.summary);
  std::ofstream svg(path);
  Contract measured;
  measured.preset = fmt::format("measured (step {})", s.step);
  if (!(svg << weights_svg(s.layout, s.shards, s.summary, measured)))
    throw_input_error("{}: cannot write the SVG", path);
}

}  // namespace

void render_audit(const oracle::AuditResult& result, bool explain, const std::string& svg_path,
                  Report& report, Context& ctx) {
  std::ostream& out = ctx.out;
  const oracle::AuditHeader& h = result.header;
  out << fmt::format(
      "lossguard audit: {} capture(s), {} step(s); world {} = TP {} x PP {} x CP {} x DP {}\n",
      h.captures, result.steps.size(), h.world_size, h.tp, h.pp, h.cp, h.dp);
  nlohmann::ordered_json steps_json = nlohmann::ordered_json::array();
  for (const auto& s : result.steps) {
    print_step(s, explain, out);
    report.add_findings(s.findings);
    for (const auto& c : s.checks) {
      report.add_case({"lossguard.audit", fmt::format("step {} {}", s.step, c.name), !c.ok || *c.ok,
                       c.detail, !c.ok});
    }
    steps_json.push_back(step_json(s));
  }
  if (!svg_path.empty()) write_svg(result.steps.front(), svg_path);
  out << fmt::format("\nverdict: {}\n",
                     result.failed ? "FAIL: the trainer's numbers differ from the truth"
                                   : "pass: the trainer's numbers are right on every step");
  report.results()["steps"] = steps_json;
}

}  // namespace lossguard::cli
