// `lossguard inspect`: what is in a dump: fields, shapes, dtypes, per-sample lengths and mask sums,
// empty, fully masked and SFT samples, and findings (NaN/Inf with coordinates, T = 0, SFT masks).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <filesystem>

#include "cli/command.h"
#include "cli/inputs.h"
#include "core/errors.h"
#include "oracle/denominators.h"
#include "oracle/findings.h"

namespace lossguard::cli {

namespace {

struct InspectOptions {
  DumpOptions dumps;
  int64_t max_rows = 40;
};

void run_inspect(const InspectOptions& o, Report& report, Context& ctx) {
  LoadedBatch loaded = load_batch(o.dumps, report, ctx);
  const Batch& b = loaded.batch;
  std::ostream& out = ctx.out;

  nlohmann::ordered_json dumps_json = nlohmann::ordered_json::array();
  for (const auto& d : loaded.dumps) {
    nlohmann::ordered_json fields = nlohmann::ordered_json::array();
    out << fmt::format("{} ({})\n", d.path, io::dump_format_name(d.format));
    std::size_t w = 5;
    for (const auto& f : d.fields) w = std::max(w, f.name.size());
    out << fmt::format("  {:<{}}  {:<14} {}\n", "field", w, "dtype", "shape");
    for (const auto& f : d.fields) {
      out << fmt::format("  {:<{}}  {:<14} {}\n", f.name, w, f.dtype, f.shape);
      fields.push_back({{"name", f.name}, {"dtype", f.dtype}, {"shape", f.shape}});
    }
    dumps_json.push_back(
        {{"path", d.path}, {"format", io::dump_format_name(d.format)}, {"fields", fields}});
  }
  if (!b.metadata.empty()) {
    out << "metadata:";
    for (auto it = b.metadata.begin(); it != b.metadata.end(); ++it) {
      out << " " << it.key() << "="
          << (it.value().is_string() ? it.value().get<std::string>() : it.value().dump());
    }
    out << "\n";
  }

  std::vector<int64_t> empty_r, fully_masked, sft, t_zero;
  int64_t effective = 0, kinds[3] = {0, 0, 0};
  nlohmann::ordered_json samples = nlohmann::ordered_json::array();
  out << fmt::format("\n{:>6}  {:<24} {:>7} {:>7} {:>7} {:>7}  {:<5}  {}\n", "sample", "source",
                     "T", "R", "P", "mask", "kind", "notes");
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    const int64_t m = b.mask_sum(i), r = b.response_lengths[i], t = b.total_lengths[i];
    const SampleKind kind = b.kind(i, m);
    kinds[static_cast<int>(kind)]++;
    effective += m;
    const oracle::SampleNote note = oracle::classify_sample(b, i, m);
    if (note.cls == oracle::SampleClass::kTZero) t_zero.push_back(i);
    if (note.cls == oracle::SampleClass::kEmptyResponse) empty_r.push_back(i);
    if (note.cls == oracle::SampleClass::kFullyMasked) fully_masked.push_back(i);
    if (note.sft) sft.push_back(i);
    const std::string notes = note.text();
    if (o.max_rows == 0 || i < o.max_rows) {
      const auto& origin = b.origins[i];
      std::string src = fmt::format(
          "{}:{}", std::filesystem::path(b.files[origin.file_index]).filename().string(),
          origin.index_in_file);
      if (src.size() > 24) src = "..." + src.substr(src.size() - 21);
      out << fmt::format("{:>6}  {:<24} {:>7} {:>7} {:>7} {:>7}  {:<5}  {}\n", i, src, t, r, t - r,
                         m, sample_kind_name(kind), notes);
    } else if (i == o.max_rows) {
      out << fmt::format("{:>6}  ... {} more samples (--max-rows 0 shows all)\n", "",
                         b.num_samples() - o.max_rows);
    }
    if (ctx.want_json)
      samples.push_back({{"index", i},
                         {"file", b.files[b.origins[i].file_index]},
                         {"index_in_file", b.origins[i].index_in_file},
                         {"total_length", t},
                         {"response_length", r},
                         {"prompt_length", t - r},
                         {"mask_sum", m},
                         {"kind", sample_kind_name(kind)},
                         {"fully_masked", r > 0 && m == 0}});
  }
  out << fmt::format(
      "\n{} samples: {} rl, {} sft, {} empty; {} tokens, {} response tokens, {} effective (mask = "
      "1)\n",
      b.num_samples(), kinds[0], kinds[1], kinds[2], b.tokens.size(), b.num_response_tokens(),
      effective);
  if (b.logits)
    out << fmt::format("logits: [{}, {}] {}\n", b.logits->shape[0], b.logits->shape[1],
                       dtype_name(b.logits->dtype));
  if (!b.loss_mask_given) out << "no loss mask in the dump: every response token counts\n";
  if (!empty_r.empty())
    out << fmt::format("empty responses (R = 0): samples {}\n", oracle::format_index_list(empty_r));
  if (!fully_masked.empty())
    out << fmt::format("fully masked responses: samples {}\n",
                       oracle::format_index_list(fully_masked));
  if (!sft.empty())
    out << fmt::format("SFT samples (R = T): samples {}\n", oracle::format_index_list(sft));
  if (effective == 0 && b.num_samples() > 0) {
    out << "the batch has ZERO effective tokens: a trainer must skip optimizer.step() for it "
           "(docs/semantics.md §7)\n";
  }
  // The optimizer steps and the trainer's layout a dump records (slime's format 2).
  nlohmann::ordered_json steps_json = nlohmann::ordered_json::array();
  if (!b.steps.empty()) {
    out << fmt::format(
        "{} optimizer step(s), with the trainer's DP / micro-batch layout from {}:\n",
        b.steps.size(), b.steps.front().source);
    for (const BatchStep& st : b.steps) {
      int64_t m = 0;
      for (int64_t i : st.samples) m += b.mask_sum(i);
      std::vector<std::string> ranks;
      for (const auto& rank : st.placement) {
        std::vector<std::string> mbs;
        for (const auto& mb : rank) mbs.push_back(fmt::format("[{}]", fmt::join(mb, " ")));
        ranks.push_back(fmt::format("{}", fmt::join(mbs, " ")));
      }
      out << fmt::format("  step {}: samples {}; {} effective tokens{}; DP ranks: {}\n", st.step,
                         oracle::format_index_list(st.samples), m,
                         m == 0 ? " (a zero-token step: must be skipped)" : "",
                         fmt::join(ranks, " | "));
      steps_json.push_back({{"step", st.step},
                            {"samples", st.samples},
                            {"effective_tokens", m},
                            {"global_batch_size", st.global_batch_size},
                            {"placement", st.placement}});
    }
  }
  const auto findings = oracle::batch_findings(b);
  report.add_findings(findings);
  print_findings(out, findings);

  auto& res = report.results();
  if (!b.steps.empty()) res["steps"] = steps_json;
  res["format"] = loaded.dumps.empty() ? "" : io::dump_format_name(loaded.dumps.front().format);
  res["fields"] =
      dumps_json.empty() ? nlohmann::ordered_json::array() : dumps_json.front()["fields"];
  res["dumps"] = dumps_json;
  res["metadata"] = b.metadata;
  res["num_samples"] = b.num_samples();
  res["num_tokens"] = b.tokens.size();
  res["num_response_tokens"] = b.num_response_tokens();
  res["num_effective_tokens"] = effective;
  res["logits"] = b.logits ? nlohmann::ordered_json{{"dtype", dtype_name(b.logits->dtype)},
                                                    {"shape", b.logits->shape}}
                           : nlohmann::ordered_json(nullptr);
  res["samples"] = samples;
  report.add_case({"lossguard.inspect", "load", true, "", false});
  if (b.num_samples() == 0) throw UnverifiedError("the dumps hold no samples");
  report.verified();
}

}  // namespace

void register_inspect(CLI::App& root, Commands& commands) {
  auto cmd = std::make_unique<Command>();
  auto opts = std::make_shared<InspectOptions>();
  cmd->app =
      root.add_subcommand("inspect",
                          "Show what is in a dump: fields, shapes, dtypes, per-sample lengths, "
                          "empty / fully masked / SFT samples, NaN/Inf");
  cmd->app->footer("Example: lossguard inspect fixtures/data/cp-examples.safetensors --json -");
  add_dump_options(*cmd->app, opts->dumps, false);
  cmd->app->add_option("--max-rows", opts->max_rows, "Sample rows in the text table (0: all)")
      ->check(CLI::Range(int64_t{0}, kMaxCount))
      ->capture_default_str();
  add_output_options(*cmd->app, cmd->output);
  cmd->run = [opts](Report& r, Context& c) { run_inspect(*opts, r, c); };
  commands.push_back(std::move(cmd));
}

}  // namespace lossguard::cli
