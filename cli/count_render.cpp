// `count`'s renderers (cli/count_render.h).
#include "cli/count_render.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <charconv>
#include <cstring>
#include <iterator>
#include <optional>
#include <string_view>

#include "core/format.h"

namespace lossguard::cli {

namespace {

// count's per-sample rows as JSON text, written by hand (a tree of 100,000 objects costs 10x the
// count; a format string parsed per field, half of --json's time): the pieces gather in a small
// staging area, appended to the buffer a few KB at a time.
class SampleRowsJson {
 public:
  SampleRowsJson(std::size_t samples, const std::vector<int64_t>& cps) {
    std::size_t per_sample = 140;
    for (int64_t cp : cps) per_sample += 8 + 3 * static_cast<std::size_t>(cp);
    json_.reserve(samples * per_sample);
    json_.push_back('[');
  }
  void begin_sample(bool first, int64_t i, int64_t t, int64_t len, int64_t m, const char* kind) {
    put(first ? "\n    {\"index\": " : ",\n    {\"index\": ");
    put_int(i);
    put(", \"total_length\": ");
    put_int(t);
    put(", \"response_length\": ");
    put_int(len);
    put(", \"mask_sum\": ");
    put_int(m);
    put(", \"kind\": \"");
    put(kind);
    put("\", \"per_rank\": {");
  }
  void ranks(bool first_cp, int64_t cp, const std::vector<int64_t>& counts) {
    put(first_cp ? "\"" : ", \"");
    put_int(cp);
    put("\": [");
    for (std::size_t q = 0; q < counts.size(); ++q) {
      if (q > 0) put(", ");
      put_int(counts[q]);
    }
    put("]");
  }
  void end_sample() { put("}}"); }
  fmt::memory_buffer finish(bool empty) {
    flush();
    json_.append(std::string_view(empty ? "]" : "\n  ]"));
    return std::move(json_);
  }

 private:
  void flush() {
    json_.append(std::string_view(stage_, staged_));
    staged_ = 0;
  }
  void put(std::string_view text) {
    if (staged_ + text.size() > sizeof stage_) flush();
    if (text.size() > sizeof stage_) return json_.append(text);
    std::memcpy(stage_ + staged_, text.data(), text.size());
    staged_ += text.size();
  }
  void put_int(int64_t v) {
    if (staged_ + 24 > sizeof stage_) flush();
    staged_ = static_cast<std::size_t>(
        std::to_chars(stage_ + staged_, stage_ + sizeof stage_, v).ptr - stage_);
  }
  fmt::memory_buffer json_;
  char stage_[4096];
  std::size_t staged_ = 0;
};

// The per-sample table (the first max_rows rows) and, for --json, the per-sample rows as JSON.
void render_samples(const oracle::CountResult& r, const Batch& b, const CountView& view,
                    Report& report, Context& ctx) {
  std::ostream& out = ctx.out;
  const std::vector<int64_t>& cps = r.sizes.cp_sizes;
  std::string head =
      fmt::format("{:>6} {:>7} {:>7} {:>6}  {:<5}", "sample", "T", "R", "mask", "kind");
  std::vector<std::size_t> widths;
  for (int64_t cp : cps) {
    const std::size_t w = std::max<std::size_t>(static_cast<std::size_t>(cp) * 4, 6);
    widths.push_back(w);
    head += fmt::format(" | {:<{}}", fmt::format("cp={}", cp), w);
  }
  out << head << " | notes\n";
  std::optional<SampleRowsJson> json;
  if (ctx.want_json) json.emplace(r.counts.samples.size(), cps);
  std::vector<int64_t> ranks;
  for (std::size_t k = 0; k < r.counts.samples.size(); ++k) {
    const int64_t i = r.counts.samples[k];
    const int64_t t = b.total_lengths[i], len = b.response_lengths[i], m = r.counts.mask_sums[k];
    const char* kind = sample_kind_name(r.classes[k].kind);
    const bool print_row = view.max_rows == 0 || static_cast<int64_t>(k) < view.max_rows;
    if (json) json->begin_sample(k == 0, i, t, len, m, kind);
    std::string row = fmt::format("{:>6} {:>7} {:>7} {:>6}  {:<5}", i, t, len, m, kind);
    bool first_cp = true;
    for (std::size_t c = 0; c < cps.size(); ++c) {
      if (!print_row && !json) break;
      ranks.clear();
      for (int64_t rank = 0; rank < cps[c]; ++rank) ranks.push_back(r.rank_count(c, k, rank));
      if (json && r.reported(c)) {
        json->ranks(first_cp, cps[c], ranks);
        first_cp = false;
      }
      if (print_row)
        row += fmt::format(" | {:<{}}", fmt::format("{}", fmt::join(ranks, " ")), widths[c]);
    }
    if (print_row) {
      std::vector<std::string> notes;
      if (!r.classes[k].notes().empty()) notes.push_back(r.classes[k].notes());
      if (r.straddles[k]) notes.push_back("straddles CP ranks");
      out << row << " | " << fmt::format("{}", fmt::join(notes, ", ")) << "\n";
    } else if (static_cast<int64_t>(k) == view.max_rows) {
      out << fmt::format("{:>6} ... {} more samples (--max-rows 0 shows all)\n", "",
                         r.counts.samples.size() - k);
    }
    if (json) json->end_sample();
  }
  if (json) report.set_raw_result("samples", json->finish(r.counts.samples.empty()));
}

void render_summary(const oracle::CountResult& r, const CountView& view, std::ostream& out) {
  out << "\ndenominator N (summed over the DP x CP group):";
  for (std::size_t c = 0; c < r.sizes.cp_sizes.size(); ++c)
    out << fmt::format("  cp={}: {}", r.sizes.cp_sizes[c], r.denominators[c]);
  out << "\n";
  const std::pair<const char*, const std::vector<int64_t>*> lists[] = {
      {"empty responses (R = 0): samples {}\n", &r.empty},
      {"fully masked responses: samples {}\n", &r.fully_masked},
      {"SFT samples: {}\n", &r.sft},
      {"samples straddling CP ranks: {}\n", &r.straddling}};
  for (const auto& [text, list] : lists) {
    if (!list->empty()) out << fmt::format(fmt::runtime(text), format_index_list(*list));
  }
  if (view.placement == nullptr) return;
  out << "placement: " << view.placement_text << "\n";
  if (!view.placement_from_dump) return;
  for (std::size_t d = 0; d < view.placement->size(); ++d) {
    std::vector<std::string> mbs;
    for (const auto& mb : (*view.placement)[d])
      mbs.push_back(fmt::format("[{}]", fmt::join(mb, " ")));
    out << fmt::format("  DP rank {}: {}\n", d, fmt::join(mbs, " "));
  }
}

nlohmann::ordered_json layout_json(const CountView& view, const Batch& b) {
  const ShardLayout& layout = *view.layout;
  nlohmann::ordered_json j =
      layout.packing == Packing::kBshd
          ? nlohmann::ordered_json{{"packing", "bshd"}, {"max_seq_len", layout.max_seq_len}}
          : nlohmann::ordered_json{{"packing", "thd"},
                                   {"padded_total_length", layout.padded_total_length},
                                   {"pad_multiple", layout.pad_multiple},
                                   {"per_sample_padded_lengths", !b.padded_total_lengths.empty()}};
  const CpLayoutOptions& cp = *view.cp_layout;
  j["cp_layout"] = cp.cp_layout;
  if (cp.cp_layout == "allgather") j["allgather_pad"] = cp.allgather_pad;
  j["dynamic_cp"] =
      cp.dynamic_cp > 0 ? nlohmann::ordered_json(cp.dynamic_cp) : nlohmann::ordered_json(nullptr);
  return j;
}

}  // namespace

void render_count(const oracle::CountResult& r, const Batch& b, const CountView& view,
                  Report& report, Context& ctx) {
  std::ostream& out = ctx.out;
  const char* policy = policy_name(r.policy);
  out << fmt::format("lossguard count: {} samples from {} dump(s), policy {}, CP sizes {}, {}\n\n",
                     b.num_samples(), b.files.size(), policy, fmt::join(r.sizes.cp_sizes, ", "),
                     view.cp_layout->describe());
  render_samples(r, b, view, report, ctx);
  render_summary(r, view, out);

  out << fmt::format("\ninvariants (policy {}):\n", policy);
  nlohmann::ordered_json inv_json = nlohmann::ordered_json::array();
  for (const auto& inv : r.invariants) {
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
    report.add_case({"lossguard.count", fmt::format("{} {} ({})", inv.name, inv.title, policy),
                     inv.ok, inv.detail, false});
  }
  report.add_findings(r.findings);
  print_findings(out, r.findings);
  out << fmt::format("\nverdict: {}\n",
                     r.ok() ? "pass" : "FAIL (an invariant is broken under this policy)");

  auto& res = report.results();
  res["policy"] = policy;
  const auto& cps = r.sizes.cp_sizes;
  res["cp_sizes"] = r.sizes.cp1_requested ? cps : std::vector<int64_t>(cps.begin() + 1, cps.end());
  res["layout"] = layout_json(view, b);
  if (view.placement != nullptr) {
    res["placement"] = {{"dp", view.placement->size()},
                        {"microbatches", view.microbatches},
                        {"source", view.placement_from_dump ? "dump" : "flags"}};
    if (view.placement_from_dump) {
      res["placement"]["microbatches"] = nullptr;
      res["placement"]["samples"] = *view.placement;
    }
  }
  nlohmann::ordered_json totals = nlohmann::ordered_json::object();
  for (std::size_t c = 0; c < cps.size(); ++c) {
    if (r.reported(c)) totals[std::to_string(cps[c])] = r.denominators[c];
  }
  res["totals"] = totals;
  res["invariants"] = inv_json;
}

}  // namespace lossguard::cli
