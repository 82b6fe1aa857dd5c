// `replay`'s renderers (cli/replay_render.h).
#include "cli/replay_render.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <fstream>
#include <map>

#include "cli/replay_svg.h"
#include "core/errors.h"
#include "core/format.h"

namespace lossguard::cli {

namespace {

void print_outcomes(std::ostream& out, const oracle::ReplayResult& r, int64_t max_lines) {
  // Group ranks by what happened to them, in order of first appearance.
  std::vector<std::string> order;
  std::map<std::string, std::vector<int64_t>> members;
  std::map<std::string, const oracle::RankResult*> example;
  for (const auto& rr : r.ranks) {
    const bool wrong = r.decided_wrong(rr);
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
                       format_rank_set(ranks), ranks.size(), key);
    if (!example[key]->detail.empty())
      out << fmt::format("      e.g. rank {}: {}\n", example[key]->rank, example[key]->detail);
  }
}

// The heading: protocol, backend, topology, micro-batches, and the expected decision.
void print_heading(const ReplayRun& run, const Batch& b, const ReplayOptions& o,
                   std::ostream& out) {
  const oracle::ReplayInputs& in = run.in;
  const oracle::ReplayResult& result = run.result;
  const oracle::ProtocolParts parts = oracle::protocol_parts(in.protocol);
  out << fmt::format(
      "lossguard replay: protocol {}, backend {}, TP{} PP{} CP{} DP{}{} (world {}), {} samples, {} "
      "micro-batch(es) per DP rank{}, reduce {}{}\n",
      oracle::protocol_name(in.protocol), o.backend, o.sizes.tp, o.sizes.pp, o.sizes.cp, o.sizes.dp,
      in.topo.ep() > 1 ? fmt::format(" EP{}", in.topo.ep()) : "", in.topo.world(), b.num_samples(),
      in.min_microbatches() == in.microbatches()
          ? fmt::format("{}", in.microbatches())
          : fmt::format("{}-{} (uneven)", in.min_microbatches(), in.microbatches()),
      parts.loop == oracle::Loop::kNone
          ? ""
          : fmt::format(", gradient all-reduce at {}", oracle::grad_sync_name(in.grad_sync)),
      oracle::reduce_mode_name(in.reduce),
      in.policy == Policy::kFixed ? ""
                                  : fmt::format(", counting policy {}", policy_name(in.policy)));
  out << fmt::format("  {}: {}\n", oracle::protocol_name(in.protocol),
                     oracle::protocol_description(in.protocol));
  out << fmt::format("global effective tokens (fixed): {} -> expected decision: {}\n\n",
                     in.global_tokens,
                     in.global_tokens == 0  ? "skip (a zero-token step: no training signal)"
                     : result.expected_skip ? fmt::format("skip ({})", result.expected_reason)
                                            : std::string("step"));
}

// The last stage's loss metrics, normalised as SPEC §6 says: their line and JSON.
nlohmann::ordered_json render_metrics(const std::optional<oracle::ReplayMetrics>& m,
                                      oracle::ReduceMode reduce, std::ostream& out) {
  if (!m) return nullptr;
  nlohmann::ordered_json j = {
      {"keys", {"loss"}},
      {"values", m->values},
      {"denominator",
       reduce == oracle::ReduceMode::kPerToken ? "global tokens" : "global batch size"}};
  if (m->faults()) {
    j["error"] = m->error;
    out << fmt::format("\nlast-stage metrics: FAIL FAST: {}\n", m->error);
    return j;
  }
  j["normalized"] = {{"loss", m->loss}};
  j["no_signal"] = m->no_signal;
  out << fmt::format("\nlast-stage metrics ({}): loss = {:.6g}{}\n",
                     oracle::reduce_mode_name(reduce), m->loss,
                     m->no_signal ? " (no-signal step: reported as 0.0)" : "");
  return j;
}

nlohmann::ordered_json ranks_json(const oracle::ReplayResult& result) {
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
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
  return ranks;
}

void add_results(const ReplayRun& run, nlohmann::ordered_json metrics, const ReplayOptions& o,
                 Report& report, Context& ctx) {
  const oracle::ReplayInputs& in = run.in;
  const oracle::ReplayResult& result = run.result;
  auto& res = report.results();
  res["protocol"] = oracle::protocol_name(in.protocol);
  res["backend"] = o.backend;
  res["tp"] = o.sizes.tp;
  res["pp"] = o.sizes.pp;
  res["cp"] = o.sizes.cp;
  res["dp"] = o.sizes.dp;
  res["world"] = in.topo.world();
  res["ep"] = in.topo.ep();
  res["microbatches"] = in.microbatches();
  res["min_microbatches"] = in.min_microbatches();
  res["grad_sync"] = oracle::grad_sync_name(in.grad_sync);
  res["nan_ranks"] = in.nan_ranks;
  res["expected_reason"] = result.expected_reason;
  res["reduce"] = oracle::reduce_mode_name(in.reduce);
  res["policy"] = policy_name(in.policy);
  res["global_tokens"] = in.global_tokens;
  res["expected"] = result.expected_skip ? "skip" : "step";
  res["metrics"] = std::move(metrics);
  res["ranks"] = ctx.want_json ? ranks_json(result) : nlohmann::ordered_json::array();
  const std::string name = fmt::format("{} TP{} PP{} CP{} DP{}", oracle::protocol_name(in.protocol),
                                       o.sizes.tp, o.sizes.pp, o.sizes.cp, o.sizes.dp);
  report.add_case({"lossguard.replay", name + ": expected decision on every rank",
                   !result.wrong_decision, result.wrong_decision_message(), false});
  report.add_case({"lossguard.replay", name + ": no error, deadlock or mismatch", !result.fault,
                   result.fault_message(), false});
}

}  // namespace

void render_replay(const ReplayRun& run, const std::optional<oracle::ReplayMetrics>& metrics,
                   const Batch& b, const ReplayOptions& o, Report& report, Context& ctx) {
  std::ostream& out = ctx.out;
  const oracle::ReplayResult& result = run.result;
  print_heading(run, b, o, out);
  print_outcomes(out, result, o.max_lines);
  nlohmann::ordered_json metrics_json = render_metrics(metrics, run.in.reduce, out);
  if (metrics) report.add_findings(metrics->findings());
  report.add_findings(result.findings);
  print_findings(out, result.findings);
  out << fmt::format("\nverdict: {}\n",
                     result.ok()    ? "pass: every rank reached the expected decision"
                     : result.fault ? "FAULT: a real job would crash or hang (exit 3)"
                                    : "FAIL: wrong decision (exit 1)");
  if (!o.svg_path.empty()) {
    std::ofstream svg(o.svg_path, std::ios::trunc);
    svg << replay_svg(run.in, result,
                      fmt::format("lossguard replay: {} on TP{} PP{} CP{} DP{}",
                                  oracle::protocol_name(run.in.protocol), o.sizes.tp, o.sizes.pp,
                                  o.sizes.cp, o.sizes.dp));
    if (!svg) throw_input_error("{}: cannot write the SVG", o.svg_path);
    out << fmt::format("rank grid: {}\n", o.svg_path);
  }
  add_results(run, std::move(metrics_json), o, report, ctx);
}

}  // namespace lossguard::cli
