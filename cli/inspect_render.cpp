// `inspect`'s renderers (cli/inspect_render.h).
#include "cli/inspect_render.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>

#include "core/format.h"
#include "oracle/count/denominators.h"

namespace lossguard::cli {

namespace {

// Each dump's fields, and the batch's metadata.
nlohmann::ordered_json render_dumps(const LoadedBatch& loaded, std::ostream& out) {
  const Batch& b = loaded.batch;
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

  return dumps_json;
}

// The per-sample table (the first max_rows rows) and, for --json, every sample.
nlohmann::ordered_json render_samples(const Batch& b, const oracle::BatchSummary& sum,
                                      int64_t max_rows, bool want_json, std::ostream& out) {
  nlohmann::ordered_json samples = nlohmann::ordered_json::array();
  out << fmt::format("\n{:>6}  {:<24} {:>7} {:>7} {:>7} {:>7}  {:<5}  {}\n", "sample", "source",
                     "T", "R", "P", "mask", "kind", "notes");
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    const int64_t m = sum.mask_sums[i], r = b.response_lengths[i], t = b.total_lengths[i];
    const SampleClass& c = sum.classes[i];
    if (max_rows == 0 || i < max_rows) {
      const auto& origin = b.origins[i];
      std::string src = fmt::format(
          "{}:{}", std::filesystem::path(b.files[origin.file_index]).filename().string(),
          origin.index_in_file);
      if (src.size() > 24) src = "..." + src.substr(src.size() - 21);
      out << fmt::format("{:>6}  {:<24} {:>7} {:>7} {:>7} {:>7}  {:<5}  {}\n", i, src, t, r, t - r,
                         m, sample_kind_name(c.kind), c.notes());
    } else if (i == max_rows) {
      out << fmt::format("{:>6}  ... {} more samples (--max-rows 0 shows all)\n", "",
                         b.num_samples() - max_rows);
    }
    if (want_json)
      samples.push_back({{"index", i},
                         {"file", b.files[b.origins[i].file_index]},
                         {"index_in_file", b.origins[i].index_in_file},
                         {"total_length", t},
                         {"response_length", r},
                         {"prompt_length", t - r},
                         {"mask_sum", m},
                         {"kind", sample_kind_name(c.kind)},
                         {"fully_masked", c.why_empty == NoTokenReason::kFullyMasked}});
  }
  return samples;
}

// Totals, the listed samples, and each optimizer step the dump records.
nlohmann::ordered_json render_summary(const Batch& b, const oracle::BatchSummary& sum,
                                      std::ostream& out) {
  out << fmt::format(
      "\n{} samples: {} rl, {} sft, {} empty; {} tokens, {} response tokens, {} effective (mask = "
      "1)\n",
      b.num_samples(), sum.kinds[0], sum.kinds[1], sum.kinds[2], b.tokens.size(),
      b.num_response_tokens(), sum.effective_tokens);
  if (b.logits)
    out << fmt::format("logits: [{}, {}] {}\n", b.logits->shape[0], b.logits->shape[1],
                       dtype_name(b.logits->dtype));
  if (!b.loss_mask_given) out << "no loss mask in the dump: every response token counts\n";
  const std::pair<const char*, const std::vector<int64_t>*> lists[] = {
      {"empty responses (R = 0): samples {}\n", &sum.empty_responses},
      {"fully masked responses: samples {}\n", &sum.fully_masked},
      {"SFT samples (R = T): samples {}\n", &sum.sft}};
  for (const auto& [text, list] : lists) {
    if (!list->empty()) out << fmt::format(fmt::runtime(text), format_index_list(*list));
  }
  if (sum.must_skip()) {
    out << "the batch has ZERO effective tokens: a trainer must skip optimizer.step() for it "
           "(docs/semantics.md §7)\n";
  }
  // The optimizer steps and the trainer's layout a dump records (slime's format 2).
  nlohmann::ordered_json steps_json = nlohmann::ordered_json::array();
  if (!b.steps.empty()) {
    out << fmt::format(
        "{} optimizer step(s), with the trainer's DP / micro-batch layout from {}:\n",
        b.steps.size(), b.steps.front().source);
    for (std::size_t k = 0; k < b.steps.size(); ++k) {
      const BatchStep& st = b.steps[k];
      const int64_t m = sum.step_effective_tokens[k];
      std::vector<std::string> ranks;
      for (const auto& rank : st.placement) {
        std::vector<std::string> mbs;
        for (const auto& mb : rank) mbs.push_back(fmt::format("[{}]", fmt::join(mb, " ")));
        ranks.push_back(fmt::format("{}", fmt::join(mbs, " ")));
      }
      out << fmt::format("  step {}: samples {}; {} effective tokens{}; DP ranks: {}\n", st.step,
                         format_index_list(st.samples), m,
                         m == 0 ? " (a zero-token step: must be skipped)" : "",
                         fmt::join(ranks, " | "));
      steps_json.push_back({{"step", st.step},
                            {"samples", st.samples},
                            {"effective_tokens", m},
                            {"global_batch_size", st.global_batch_size},
                            {"placement", st.placement}});
    }
  }
  return steps_json;
}

}  // namespace

void render_inspect(const LoadedBatch& loaded, const oracle::BatchSummary& sum, int64_t max_rows,
                    Report& report, Context& ctx) {
  const Batch& b = loaded.batch;
  std::ostream& out = ctx.out;
  const nlohmann::ordered_json dumps_json = render_dumps(loaded, out);
  const nlohmann::ordered_json samples = render_samples(b, sum, max_rows, ctx.want_json, out);
  const nlohmann::ordered_json steps_json = render_summary(b, sum, out);
  report.add_findings(sum.findings);
  print_findings(out, sum.findings);

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
  res["num_effective_tokens"] = sum.effective_tokens;
  res["logits"] = b.logits ? nlohmann::ordered_json{{"dtype", dtype_name(b.logits->dtype)},
                                                    {"shape", b.logits->shape}}
                           : nlohmann::ordered_json(nullptr);
  res["samples"] = samples;
  report.add_case({"lossguard.inspect", "load", true, "", false});
}

}  // namespace lossguard::cli
