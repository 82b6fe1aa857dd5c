// Rank-grid SVG: one row per pipeline stage, one cell per rank of the stage (ordered tp, cp, dp, as
// global ranks are), colour = outcome; a ring marks a rank whose decision differs from the expected
// one.
#include "cli/replay_svg.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

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

// One row per pipeline stage. Runs of consecutive ranks with the same outcome and decision are one
// rectangle (a 131,072-rank grid is a few hundred of them, not 131,072 one-pixel cells), the row
// is at most 1,600 px wide whatever the world size, stage labels are thinned so they never
// overlap, and the x axis is labelled in DP ranks.
// Long: one SVG drawn top to bottom (title, stage rows of outcome runs, axis, legend); each part
// reads its coordinates from the ones drawn before it.
std::string replay_svg(const oracle::ReplayInputs& in, const oracle::ReplayResult& result,
                       const std::string& title) {
  const oracle::Topology& t = in.topo;
  const int64_t cols = t.world() / t.pp(), rows = t.pp();
  const double scale = std::min(1600.0 / static_cast<double>(cols), 28.0);  // px per rank
  const double row_h = std::clamp(560.0 / static_cast<double>(rows), 12.0, 28.0);
  const double left = 80, top = 60, grid_w = scale * static_cast<double>(cols);
  const double width = std::max(left + grid_w + 20, 780.0);
  const double height = top + row_h * static_cast<double>(rows) + 110;
  std::string s = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{:.0f}\" height=\"{:.0f}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"10\" y=\"20\" "
      "font-size=\"14\" font-weight=\"bold\">{}</text>\n"
      "<text x=\"10\" y=\"40\">expected decision: {} ({} effective tokens{}); rows: pipeline "
      "stages; columns: the {} ranks of a stage (tp fastest, then cp, then dp)</text>\n",
      width, height, title, result.expected_skip ? "skip" : "step", result.global_tokens,
      result.expected_reason.empty() || result.global_tokens == 0 ? ""
                                                                  : ", " + result.expected_reason,
      cols);
  const int64_t label_every = static_cast<int64_t>(std::ceil(14.0 / row_h));
  for (int64_t pp = 0; pp < rows; ++pp) {
    if (pp % label_every != 0 && pp != rows - 1) continue;
    s += fmt::format("<text x=\"10\" y=\"{:.1f}\">stage {}</text>\n",
                     top + row_h * (static_cast<double>(pp) + 0.5) + 4, pp);
  }
  const double gap = row_h > 8 ? 1.0 : 0.0;
  auto wrong = [&](const oracle::RankResult& r) {
    return (r.skip.has_value() && *r.skip != result.expected_skip) || r.unsynced_gradients;
  };
  for (int64_t pp = 0; pp < rows; ++pp) {
    int64_t col = 0;
    while (col < cols) {
      const auto& first = result.ranks[static_cast<std::size_t>(pp * cols + col)];
      int64_t end = col + 1;
      while (end < cols) {
        const auto& r = result.ranks[static_cast<std::size_t>(pp * cols + end)];
        if (r.outcome != first.outcome || wrong(r) != wrong(first)) break;
        ++end;
      }
      const double x = left + scale * static_cast<double>(col);
      const double w =
          std::max(scale * static_cast<double>(end - col) - (scale > 4 ? 1.0 : 0.0), 0.5);
      const std::string who =
          end - col == 1 ? fmt::format("rank {}", first.rank)
                         : fmt::format("ranks {}-{}", first.rank, first.rank + (end - col) - 1);
      s += fmt::format(
          "<rect x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" "
          "fill=\"{}\"{}><title>{}: {}{}</title></rect>\n",
          x, top + row_h * static_cast<double>(pp), w, row_h - gap, colour(first.outcome),
          wrong(first) ? " stroke=\"black\" stroke-width=\"2\"" : "", who,
          oracle::outcome_name(first.outcome), wrong(first) ? " (wrong decision)" : "");
      col = end;
    }
  }
  // x axis: DP ranks, ticks at least 70 px apart.
  const int64_t per_dp = t.tp() * t.cp();
  const double dp_px = scale * static_cast<double>(per_dp);
  const int64_t tick = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(70.0 / dp_px)));
  const double axis_y = top + row_h * static_cast<double>(rows) + 16;
  for (int64_t d = 0; d < t.dp(); d += tick) {
    const double x = left + dp_px * static_cast<double>(d);
    s += fmt::format(
        "<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#555\"/><text "
        "x=\"{:.1f}\" y=\"{:.1f}\" font-size=\"11\">dp {}</text>\n",
        x, axis_y - 12, x, axis_y - 6, x + 2, axis_y + 4, d);
  }
  double lx = 10;
  const double ly = axis_y + 24;
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
