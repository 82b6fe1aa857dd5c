// Dump options and loading with progress on stderr.
#include "cli/inputs.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>

namespace lossguard::cli {

void add_dump_options(CLI::App& app, DumpOptions& o, bool with_dp_shards) {
  app.add_option("dumps", o.paths,
                 "Dump files or directories (safetensors, .pt, .json); together one global batch")
      ->required()
      ->type_name("DUMP...");
  app.add_option(
         "--field", o.field_maps,
         "Read batch field NAME from the dump's key KEY, e.g. --field loss_mask=mask (NAME: " +
             fmt::format("{}", fmt::join(io::batch_field_names(), ", ")) + ")")
      ->type_name("NAME=KEY");
  if (with_dp_shards) {
    app.add_flag(
        "--dp-shards", o.dp_shards,
        "Each dump is one DP rank's part of the global batch (a trainer's per-rank dumps)");
  }
}

void add_step_option(CLI::App& app, DumpOptions& o) {
  app.add_option("--step", o.step,
                 "Only this optimizer step of a dump that holds several (slime's format-2 train "
                 "dumps); default: every step, reported one by one")
      ->check(CLI::Range(int64_t{0}, kMaxCount));
}

namespace {

class Progress {
 public:
  Progress(Context& ctx, std::size_t total)
      : ctx_(ctx), total_(total), start_(std::chrono::steady_clock::now()) {}
  void at(std::size_t done, const std::string& path) {
    if (!ctx_.err_is_terminal) return;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (elapsed < 0.5) return;
    ctx_.err << fmt::format("\r\x1b[Kloading {}/{}: {} ({:.1f} s)", done + 1, total_, path, elapsed)
             << std::flush;
    shown_ = true;
  }
  ~Progress() {
    if (shown_) ctx_.err << "\r\x1b[K" << std::flush;
  }

 private:
  Context& ctx_;
  std::size_t total_;
  std::chrono::steady_clock::time_point start_;
  bool shown_ = false;
};

}  // namespace

LoadedBatch load_batch(const DumpOptions& o, Report& report, Context& ctx, LoadNeeds needs) {
  io::FieldMap fields;
  for (const auto& spec : o.field_maps) fields.add(spec);
  LoadedBatch out;
  const std::vector<std::string> paths = io::expand_dump_paths(o.paths);
  Progress progress(ctx, paths.size() + 1);
  for (std::size_t k = 0; k < paths.size(); ++k) {
    progress.at(k, paths[k]);
    out.dumps.push_back(io::read_dump(paths[k]));
    report.add_input(paths[k], io::dump_format_name(out.dumps.back().format));
  }
  progress.at(paths.size(), "validating");
  out.batch = io::build_batch(out.dumps, fields, needs);
  return out;
}

}  // namespace lossguard::cli
