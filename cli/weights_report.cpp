// Reports of a weight diagnosis: its JSON (weights and audit) and the weight-ratio grid SVG.
// Weight-ratio grid: one row per (DP rank, micro-batch), one column per CP rank; white is the
// truth, red heavier, blue lighter (log scale, saturating at 4x), purple where masked tokens carry
// weight. Layouts with many micro-batches are drawn as their first 256 rows, said so in the
// caption.
#include "cli/weights_report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace lossguard::cli {

namespace {

std::string colour(const oracle::ShardRatio& r) {
  if (r.masked_weighted > 0) return "#7b1fa2";
  if (r.tokens == 0) return "#eeeeee";
  const double mid = std::sqrt(std::max(r.min_ratio, 1e-300) * std::max(r.max_ratio, 1e-300));
  const double x = std::clamp(std::log2(std::max(mid, 1e-300)) / 2.0, -1.0, 1.0);  // 4x saturates
  const int fade = static_cast<int>(255 * (1.0 - std::fabs(x)));
  return x >= 0 ? fmt::format("#ff{:02x}{:02x}", fade, fade)
                : fmt::format("#{:02x}{:02x}ff", fade, fade);
}

std::string label(const oracle::ShardRatio& r) {
  if (r.masked_weighted > 0) return "masked";
  if (r.tokens == 0) return "";
  if (r.max_ratio - r.min_ratio <= oracle::kWeightRelTol * r.max_ratio)
    return fmt::format("{:.3g}x", r.min_ratio);
  return fmt::format("{:.2g}-{:.2g}x", r.min_ratio, r.max_ratio);
}

std::string escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<')
      o += "&lt;";
    else if (c == '>')
      o += "&gt;";
    else if (c == '&')
      o += "&amp;";
    else
      o += c;
  }
  return o;
}

}  // namespace

nlohmann::ordered_json coord_json(const oracle::TokenCoord& c) {
  auto opt = [](int64_t v) {
    return v < 0 ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(v);
  };
  return {{"sample", c.sample},
          {"response_index", c.response_index},
          {"dp_rank", opt(c.dp_rank)},
          {"microbatch", opt(c.microbatch)},
          {"cp_rank", opt(c.cp_rank)},
          {"got", c.got},
          {"want", c.want},
          {"ratio", c.ratio},
          {"unit_tokens", c.unit_tokens}};
}

namespace {
nlohmann::ordered_json text_or_null(const std::string& s) {
  return s.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(s);
}
}  // namespace

nlohmann::ordered_json diagnosis_json(const oracle::WeightDiagnosis& d) {
  return {{"kind", d.kind},
          {"scale", d.kind == "uniform-scale" || d.kind == "negative-scale"
                        ? nlohmann::ordered_json(d.scale)
                        : nlohmann::ordered_json(nullptr)},
          {"scale_problem", d.scale_problem.empty() ? nlohmann::ordered_json(nullptr)
                                                    : nlohmann::ordered_json(d.scale_problem)},
          {"named",
           d.named.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(d.named)},
          {"layout_dependent", d.layout_dependent},
          {"same_step", text_or_null(d.same_step)},
          {"declared", text_or_null(d.declared)},
          {"factor", text_or_null(d.factor)},
          {"advice", text_or_null(d.advice)},
          {"min_ratio", d.min_ratio},
          {"max_ratio", d.max_ratio},
          {"tokens", d.tokens},
          {"mismatched", d.mismatched},
          {"masked_weighted", d.masked_weighted},
          {"worst", d.kind == "exact" ? nlohmann::ordered_json(nullptr) : coord_json(d.worst)}};
}

std::string weights_svg(const StepLayout& layout, const std::vector<oracle::ShardRatio>& shards,
                        const std::string& summary, const Contract& contract) {
  const int64_t rows = std::min<int64_t>(static_cast<int64_t>(layout.microbatches.size()), 256);
  const int64_t cols = layout.cp;
  // The diagnosis, wrapped at its "; " and ", " breaks into lines of about 90 characters.
  std::vector<std::string> lines;
  {
    const std::string& text = summary;
    std::size_t start = 0;
    while (start < text.size()) {
      std::size_t end = text.size();
      if (end - start > 90) {
        const std::size_t cut = text.rfind("; ", start + 90);
        const std::size_t comma = text.rfind(", ", start + 90);
        end = cut != std::string::npos && cut > start       ? cut + 1
              : comma != std::string::npos && comma > start ? comma + 1
                                                            : start + 90;
      }
      lines.push_back(text.substr(start, end - start));
      start = end;
      while (start < text.size() && text[start] == ' ') ++start;
    }
  }
  const int cell_w = 72, cell_h = 22, left = 150;
  const int top = 56 + 16 * static_cast<int>(lines.size());
  const int64_t width = std::max<int64_t>(left + cols * cell_w + 20, 660);
  const int64_t height = top + rows * cell_h + 60;
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" "
      "font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n",
      width, height);
  s += fmt::format(
      "<text x=\"10\" y=\"20\" font-size=\"14\" font-weight=\"bold\">token weight / objective "
      "weight, "
      "contract {}</text>\n",
      escape(contract.preset.empty() ? contract_components(contract) : contract.preset));
  for (std::size_t k = 0; k < lines.size(); ++k) {
    s += fmt::format("<text x=\"10\" y=\"{}\">{}</text>\n", 38 + 16 * k, escape(lines[k]));
  }
  for (int64_t c = 0; c < cols; ++c) {
    s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">CP rank {}</text>\n",
                     left + c * cell_w + cell_w / 2, top - 8, c);
  }
  for (int64_t k = 0; k < rows; ++k) {
    const MicroBatch& mb = layout.microbatches[k];
    const int64_t y = top + k * cell_h;
    s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">DP {} micro-batch {}</text>\n",
                     left - 8, y + cell_h - 7, mb.dp_rank, mb.index);
    for (int64_t c = 0; c < cols; ++c) {
      const oracle::ShardRatio& r = shards[k * cols + c];
      const int64_t x = left + c * cell_w;
      s += fmt::format(
          "<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\" stroke=\"#999\"/>\n", x,
          y, cell_w, cell_h, colour(r));
      s += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", x + cell_w / 2,
                       y + cell_h - 7, escape(label(r)));
    }
  }
  const int64_t foot = top + rows * cell_h + 22;
  std::string caption =
      "white: as the objective says; red: heavier; blue: lighter (saturates at 4x); grey: no "
      "tokens";
  if (static_cast<int64_t>(layout.microbatches.size()) > rows) {
    caption += fmt::format("; first {} of {} micro-batches", rows, layout.microbatches.size());
  }
  s += fmt::format("<text x=\"10\" y=\"{}\">{}</text>\n</svg>\n", foot, escape(caption));
  return s;
}

}  // namespace lossguard::cli
