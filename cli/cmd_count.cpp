// `lossguard count`: per-sample and per-CP-rank effective token counts, global denominators per CP
// size, and invariants I1-I4 under a counting policy (SPEC §2, §3).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <iterator>
#include <string_view>

#include "cli/command.h"
#include "cli/inputs.h"
#include "cli/placement_options.h"
#include "cli/steps.h"
#include "core/errors.h"
#include "oracle/denominators.h"
#include "oracle/findings.h"
#include "oracle/placement.h"

namespace lossguard::cli {

namespace {

struct CountOptions {
  DumpOptions dumps;
  std::vector<int64_t> cp_sizes = {1, 2, 4, 8};
  std::string policy = "fixed";
  LayoutOptions layout;
  CpLayoutOptions cp_layout;
  int64_t tp = 1;
  PlacementOptions placement;
  int64_t max_rows = 40;
};

void count_step(const CountOptions& o, const CLI::App& app, const StepView& v, Policy policy,
                const std::vector<int64_t>& cps, bool cp1_requested, const ShardLayout& layout,
                Report& report, Context& ctx);

void run_count(const CountOptions& o, const CLI::App& app, Report& report, Context& ctx) {
  const Policy policy = policy_from_option(o.policy);
  std::vector<int64_t> cps = o.cp_sizes;
  for (int64_t c : cps) {
    if (c < 1) throw_input_error("--cp sizes must be >= 1, got {}", c);
  }
  std::sort(cps.begin(), cps.end());
  cps.erase(std::unique(cps.begin(), cps.end()), cps.end());
  const bool cp1_requested = cps.front() == 1;
  if (!cp1_requested) cps.insert(cps.begin(), 1);  // I1 compares against the unsharded count
  const ShardLayout layout = o.layout.layout();

  LoadedBatch loaded = load_batch(o.dumps, report, ctx, LoadNeeds{false, false, false});
  run_per_step(loaded.batch, o.dumps.step, report, ctx, [&](const StepView& v) {
    count_step(o, app, v, policy, cps, cp1_requested, layout, report, ctx);
  });
}

void count_step(const CountOptions& o, const CLI::App& app, const StepView& v, Policy policy,
                const std::vector<int64_t>& cps, bool cp1_requested, const ShardLayout& layout,
                Report& report, Context& ctx) {
  const Batch& b = *v.batch;
  // The trainer's own layout where the dump records it, else the flags' split.
  const bool split_given = v.layout != nullptr || o.placement.given(app) || o.dumps.dp_shards;
  oracle::Placement placement;
  std::string placement_text;
  if (v.layout != nullptr) {
    placement = *v.layout;
    std::size_t max_mb = 0;
    for (const auto& r : placement) max_mb = std::max(max_mb, r.size());
    placement_text = fmt::format(
        "{} DP rank(s) x up to {} micro-batch(es), from {}{}", placement.size(), max_mb,
        v.layout_source, o.placement.given(app) ? " (--dp/--microbatches/--split ignored)" : "");
  } else if (split_given) {
    placement = o.placement.placement(b, o.dumps.dp_shards);
    placement_text = fmt::format(
        "{} DP rank(s) x {} micro-batch(es){}", placement.size(), o.placement.microbatches,
        o.dumps.dp_shards ? " (one dump per DP rank)" : ", split " + o.placement.split);
  }
  // Zig-zag owners depend on the sample alone; all-gather and dynamic CP owners on the
  // micro-batch: those are counted token by token on the layout of each CP size.
  oracle::OwnedCounts counts;
  std::vector<std::string> placement_problems;
  if (o.cp_layout.per_token_needed()) {
    const oracle::Placement p =
        split_given ? placement : oracle::place_samples(b.num_samples(), 1, 1, Split::kContiguous);
    std::vector<StepLayout> layouts;
    for (int64_t cp : cps) layouts.push_back(o.cp_layout.step_layout(b, p, cp, o.tp, layout));
    counts = oracle::count_owned_tokens(b, layouts, &placement_problems);
  } else {
    counts = oracle::count_owned_tokens(b, cps, layout);
    if (split_given) placement_problems = oracle::placement_problems(placement, b.num_samples());
  }
  auto invariants =
      oracle::check_invariants(b, counts, policy, layout, split_given ? &placement : nullptr);
  for (auto& inv : invariants) {
    if (inv.name != "I3" || placement_problems.empty()) continue;
    inv.ok = false;
    inv.detail =
        fmt::format("the placement is not a partition: {}", fmt::join(placement_problems, "; "));
  }

  std::ostream& out = ctx.out;
  out << fmt::format("lossguard count: {} samples from {} dump(s), policy {}, CP sizes {}, {}\n\n",
                     b.num_samples(), b.files.size(), policy_name(policy), fmt::join(cps, ", "),
                     o.cp_layout.describe());
  // Per-sample table: T, R, mask sum, the policy's count on each rank of each CP size.
  std::string head =
      fmt::format("{:>6} {:>7} {:>7} {:>6}  {:<5}", "sample", "T", "R", "mask", "kind");
  std::vector<std::size_t> widths;
  for (int64_t cp : cps) {
    const std::size_t w = std::max<std::size_t>(static_cast<std::size_t>(cp) * 4, 6);
    widths.push_back(w);
    head += fmt::format(" | {:<{}}", fmt::format("cp={}", cp), w);
  }
  out << head << " | notes\n";
  // The per-sample JSON rows are written as text (a tree of 100,000 objects costs 10x the count).
  fmt::memory_buffer samples_json;
  if (ctx.want_json) {
    std::size_t per_sample = 140;
    for (int64_t cp : cps) per_sample += 8 + 3 * static_cast<std::size_t>(cp);
    samples_json.reserve(counts.samples.size() * per_sample);
    samples_json.push_back('[');
  }
  std::vector<int64_t> empty, masked, sft, straddling;
  for (std::size_t k = 0; k < counts.samples.size(); ++k) {
    const int64_t i = counts.samples[k];
    const int64_t t = b.total_lengths[i], r = b.response_lengths[i], m = counts.mask_sums[k];
    const oracle::SampleNote note = oracle::classify_sample(b, i, m);
    if (note.cls == oracle::SampleClass::kEmptyResponse) empty.push_back(i);
    if (note.cls == oracle::SampleClass::kFullyMasked) masked.push_back(i);
    if (note.sft) sft.push_back(i);
    std::vector<std::string> notes;
    if (!note.text().empty()) notes.push_back(note.text());
    if (ctx.want_json) {
      fmt::format_to(fmt::appender(samples_json),
                     "{}\n    {{\"index\": {}, \"total_length\": {}, \"response_length\": {}, "
                     "\"mask_sum\": {}, \"kind\": \"{}\", \"per_rank\": {{",
                     k == 0 ? "" : ",", i, t, r, m, sample_kind_name(b.kind(i, m)));
    }
    bool first_cp = true;
    const bool print_row = o.max_rows == 0 || static_cast<int64_t>(k) < o.max_rows;
    std::string row =
        fmt::format("{:>6} {:>7} {:>7} {:>6}  {:<5}", i, t, r, m, sample_kind_name(b.kind(i, m)));
    bool straddles = false;
    for (std::size_t c = 0; c < cps.size(); ++c) {
      std::vector<int64_t> ranks;
      int64_t ranks_with_tokens = 0;
      for (int64_t rank = 0; rank < cps[c]; ++rank) {
        const int64_t owned = counts.count(c, k, rank);
        ranks_with_tokens += owned > 0;
        ranks.push_back(oracle::policy_rank_count(policy, owned, m, cps[c]));
      }
      straddles |= ranks_with_tokens > 1;
      if (ctx.want_json && (cps[c] != 1 || cp1_requested)) {
        fmt::format_to(fmt::appender(samples_json), "{}\"{}\": [{}]", first_cp ? "" : ", ", cps[c],
                       fmt::join(ranks, ", "));
        first_cp = false;
      }
      if (print_row)
        row += fmt::format(" | {:<{}}", fmt::format("{}", fmt::join(ranks, " ")), widths[c]);
    }
    if (straddles) {
      straddling.push_back(i);
      notes.push_back("straddles CP ranks");
    }
    if (print_row) {
      out << row << " | " << fmt::format("{}", fmt::join(notes, ", ")) << "\n";
    } else if (static_cast<int64_t>(k) == o.max_rows) {
      out << fmt::format("{:>6} ... {} more samples (--max-rows 0 shows all)\n", "",
                         counts.samples.size() - k);
    }
    if (ctx.want_json) samples_json.append(std::string_view("}}"));
  }

  out << "\ndenominator N (summed over the DP x CP group):";
  nlohmann::ordered_json totals = nlohmann::ordered_json::object();
  for (std::size_t c = 0; c < cps.size(); ++c) {
    const int64_t n = oracle::global_denominator(policy, counts, c);
    out << fmt::format("  cp={}: {}", cps[c], n);
    if (cps[c] != 1 || cp1_requested) totals[std::to_string(cps[c])] = n;
  }
  out << "\n";
  if (!empty.empty())
    out << fmt::format("empty responses (R = 0): samples {}\n", oracle::format_index_list(empty));
  if (!masked.empty())
    out << fmt::format("fully masked responses: samples {}\n", oracle::format_index_list(masked));
  if (!sft.empty()) out << fmt::format("SFT samples: {}\n", oracle::format_index_list(sft));
  if (!straddling.empty())
    out << fmt::format("samples straddling CP ranks: {}\n", oracle::format_index_list(straddling));
  if (split_given) {
    out << "placement: " << placement_text << "\n";
    if (v.layout != nullptr) {
      for (std::size_t d = 0; d < placement.size(); ++d) {
        std::vector<std::string> mbs;
        for (const auto& mb : placement[d]) mbs.push_back(fmt::format("[{}]", fmt::join(mb, " ")));
        out << fmt::format("  DP rank {}: {}\n", d, fmt::join(mbs, " "));
      }
    }
  }

  out << fmt::format("\ninvariants (policy {}):\n", policy_name(policy));
  nlohmann::ordered_json inv_json = nlohmann::ordered_json::array();
  bool all_ok = true;
  for (const auto& inv : invariants) {
    all_ok &= inv.ok;
    std::string detail = inv.detail;
    for (std::size_t p = 0; (p = detail.find('\n', p)) != std::string::npos; p += 1)
      detail.insert(p + 1, 36, ' ');
    out << fmt::format("  {} {:<24} {}  {}\n", inv.name, inv.title, inv.ok ? "pass" : "FAIL",
                       detail);
    inv_json.push_back({{"name", inv.name},
                        {"title", inv.title},
                        {"ok", inv.ok},
                        {"detail", inv.detail},
                        {"values", inv.data}});
    report.add_case({"lossguard.count",
                     fmt::format("{} {} ({})", inv.name, inv.title, policy_name(policy)), inv.ok,
                     inv.detail, false});
  }
  const auto findings = oracle::batch_findings(b);
  report.add_findings(findings);
  print_findings(out, findings);
  out << fmt::format("\nverdict: {}\n",
                     all_ok ? "pass" : "FAIL (an invariant is broken under this policy)");

  auto& res = report.results();
  res["policy"] = policy_name(policy);
  res["cp_sizes"] = cp1_requested ? cps : std::vector<int64_t>(cps.begin() + 1, cps.end());
  res["layout"] =
      layout.packing == Packing::kBshd
          ? nlohmann::ordered_json{{"packing", "bshd"}, {"max_seq_len", layout.max_seq_len}}
          : nlohmann::ordered_json{{"packing", "thd"},
                                   {"padded_total_length", layout.padded_total_length},
                                   {"pad_multiple", layout.pad_multiple},
                                   {"per_sample_padded_lengths", !b.padded_total_lengths.empty()}};
  res["layout"]["cp_layout"] = o.cp_layout.cp_layout;
  if (o.cp_layout.cp_layout == "allgather")
    res["layout"]["allgather_pad"] = o.cp_layout.allgather_pad;
  res["layout"]["dynamic_cp"] = o.cp_layout.dynamic_cp > 0
                                    ? nlohmann::ordered_json(o.cp_layout.dynamic_cp)
                                    : nlohmann::ordered_json(nullptr);
  if (split_given) {
    res["placement"] = {{"dp", placement.size()},
                        {"microbatches", o.placement.microbatches},
                        {"source", v.layout != nullptr ? "dump" : "flags"}};
    if (v.layout != nullptr) {
      res["placement"]["microbatches"] = nullptr;
      res["placement"]["samples"] = placement;
    }
  }
  if (ctx.want_json) {
    samples_json.append(std::string_view(counts.samples.empty() ? "]" : "\n  ]"));
    report.set_raw_result("samples", std::move(samples_json));
  }
  res["totals"] = totals;
  res["invariants"] = inv_json;
  if (b.num_samples() == 0) throw UnverifiedError("the dumps hold no samples");
  report.verified();
  if (!all_ok) report.fail();
}

}  // namespace

void register_count(CLI::App& root, Commands& commands) {
  auto cmd = std::make_unique<Command>();
  auto opts = std::make_shared<CountOptions>();
  CLI::App* app =
      root.add_subcommand("count",
                          "Per-sample and per-CP-rank token counts, denominators per CP size, "
                          "invariants I1-I4");
  cmd->app = app;
  app->footer(
      "Policies (docs/semantics.md §3): fixed = Relax after PR #285 (the truth); legacy = Relax "
      "before it (CP=1 counts an\n"
      "empty response as 1 token); slime = every CP rank counts full samples, loss multiplied by "
      "cp.\n"
      "Exit 1 when an invariant fails under the chosen policy.\n"
      "Examples:\n  lossguard count batch.safetensors --cp 1,2,4,8\n"
      "  lossguard count batch.safetensors --policy legacy     # shows the CP=1 vs CP>1 "
      "denominator bug\n"
      "  lossguard count rank0.pt rank1.pt --dp-shards --microbatches 4 --json -");
  add_dump_options(*app, opts->dumps, true);
  add_step_option(*app, opts->dumps);
  app->add_option("--cp", opts->cp_sizes, "CP sizes to count for (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--policy", opts->policy, "Counting policy: fixed, legacy or slime")
      ->capture_default_str();
  add_layout_options(*app, opts->layout);
  add_cp_layout_options(*app, opts->cp_layout);
  app->add_option("--tp", opts->tp, "Tensor-parallel size (allgather pads to cp*tp*pad)")
      ->capture_default_str();
  add_placement_options(*app, opts->placement, false);
  app->add_option("--max-rows", opts->max_rows, "Sample rows in the text table (0: all)")
      ->check(CLI::Range(int64_t{0}, kMaxCount))
      ->capture_default_str();
  add_output_options(*app, cmd->output);
  cmd->run = [opts, app](Report& r, Context& c) { run_count(*opts, *app, r, c); };
  commands.push_back(std::move(cmd));
}

}  // namespace lossguard::cli
