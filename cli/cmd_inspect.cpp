// `lossguard inspect`: what is in a dump: fields, shapes, dtypes, per-sample lengths and mask sums,
// empty, fully masked and SFT samples, and findings (NaN/Inf with coordinates, T = 0, SFT masks).
#include "cli/command.h"
#include "cli/inputs.h"
#include "cli/inspect_render.h"
#include "core/errors.h"
#include "oracle/count/findings.h"

namespace lossguard::cli {

namespace {

struct InspectOptions {
  DumpOptions dumps;
  int64_t max_rows = 40;
};

void run_inspect(const InspectOptions& o, Report& report, Context& ctx) {
  LoadedBatch loaded = load_batch(o.dumps, report, ctx);
  const oracle::BatchSummary summary = oracle::summarize_batch(loaded.batch);
  render_inspect(loaded, summary, o.max_rows, report, ctx);
  report.record(oracle::samples_judgement(loaded.batch));
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
