// Rank-grid SVG: one row per pipeline stage, one cell per rank of the stage (ordered tp, cp, dp, as
// global ranks are), colour = outcome; a ring marks a rank whose decision differs from the expected
// one.
#include "cli/replay_svg.h"

#include <fmt/format.h>

#include <algorithm>

namespace lossguard::cli {

namespace {
const char* colour(oracle::Outcome o) {
  switch (o) {
    case oracle::Outcome::kSkip:
      return "#2e7d32";
    case oracle::Outcome::kStep:
      return "#1565c0";
    case oracle::Outcome::kError:
      return "#c62828";
    case oracle::Outcome::kBlocked:
      return "#ef6c00";
    case oracle::Outcome::kMismatch:
      return "#6a1b9a";
  }
  return "#000";
}
}  // namespace

std::string replay_svg(const oracle::ReplayInputs& in, const oracle::ReplayResult& result,
                       const std::string& title) {
  const oracle::Topology& t = in.topo;
  const int64_t cols = t.world() / t.pp(), rows = t.pp();
  const double cell = std::clamp(1600.0 / static_cast<double>(cols), 1.0, 28.0);
  const double left = 70, top = 60, width = left + cell * static_cast<double>(cols) + 20;
  const double height = top + cell * static_cast<double>(rows) + 90;
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"10\" y=\"20\" "
      "font-size=\"14\" font-weight=\"bold\">{}</text>\n"
      "<text x=\"10\" y=\"40\">expected decision: {} ({} effective tokens); columns: ranks of a "
      "stage (tp, cp, dp); rows: "
      "pipeline stages</text>\n",
      std::max(width, 780.0), height, title, result.expected_skip ? "skip" : "step",
      result.global_tokens);
  for (int64_t pp = 0; pp < rows; ++pp) {
    s += fmt::format("<text x=\"10\" y=\"{:.1f}\">stage {}</text>\n",
                     top + cell * (static_cast<double>(pp) + 0.5) + 4, pp);
  }
  for (const auto& r : result.ranks) {
    const int64_t pp = r.rank / cols, col = r.rank % cols;
    const double x = left + cell * static_cast<double>(col),
                 y = top + cell * static_cast<double>(pp);
    const bool wrong = r.skip && *r.skip != result.expected_skip;
    s += fmt::format(
        "<rect x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" "
        "fill=\"{}\"{}><title>rank {}: {}{}</title></rect>\n",
        x, y, std::max(cell - (cell > 4 ? 1.0 : 0.0), 0.5),
        std::max(cell - (cell > 4 ? 1.0 : 0.0), 0.5), colour(r.outcome),
        wrong ? " stroke=\"black\" stroke-width=\"2\"" : "", r.rank,
        oracle::outcome_name(r.outcome), wrong ? " (wrong decision)" : "");
  }
  double lx = 10;
  const double ly = top + cell * static_cast<double>(rows) + 30;
  for (auto o : {oracle::Outcome::kSkip, oracle::Outcome::kStep, oracle::Outcome::kError,
                 oracle::Outcome::kBlocked, oracle::Outcome::kMismatch}) {
    s += fmt::format(
        "<rect x=\"{:.0f}\" y=\"{:.0f}\" width=\"14\" height=\"14\" fill=\"{}\"/><text "
        "x=\"{:.0f}\" y=\"{:.0f}\">{}</text>\n",
        lx, ly, colour(o), lx + 18, ly + 12, oracle::outcome_name(o));
    lx += 100;
  }
  s += fmt::format(
      "<rect x=\"{:.0f}\" y=\"{:.0f}\" width=\"14\" height=\"14\" fill=\"white\" stroke=\"black\" "
      "stroke-width=\"2\"/>"
      "<text x=\"{:.0f}\" y=\"{:.0f}\">wrong decision</text>\n</svg>\n",
      lx, ly, lx + 18, ly + 12);
  return s;
}

}  // namespace lossguard::cli
