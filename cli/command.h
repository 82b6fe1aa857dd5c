// The shape every subcommand shares: an options struct captured by its run function, registered on
// the root CLI11 app by a register_* function (one file per subcommand).
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "cli/report.h"

namespace lossguard::cli {

// The ranges options are validated against (CLI11 rejects a value outside with exit 2 and the
// range). Counts and lengths are token or sample counts a real job can reach; the layout caps keep
// every per-rank or per-micro-batch table a few hundred MB at most (weights models each
// micro-batch of each DP rank as a row).
inline constexpr int64_t kMaxCount = int64_t{1} << 40;
inline constexpr int64_t kMaxDp = int64_t{1} << 20;
inline constexpr int64_t kMaxCp = int64_t{1}
                                  << 14;  // CP owners are int16 (oracle/weights/weights.h)
inline constexpr int64_t kMaxMicrobatches = int64_t{1} << 22;  // DP x micro-batches

struct Context {
  std::ostream& out;  // text report (a null stream when --json - takes stdout)
  std::ostream& err;  // diagnostics, progress
  bool err_is_terminal = false;
  bool want_json =
      false;  // --json given: build the per-sample parts of the document (costly for big batches)
};

struct Command {
  CLI::App* app = nullptr;
  OutputOptions output;
  std::function<void(Report&, Context&)> run;
};
using Commands = std::vector<std::unique_ptr<Command>>;

// A comma-separated list option with its default shown: --cp 1,2,4.
template <typename T>
CLI::Option* add_list_option(CLI::App& app, const std::string& name, std::vector<T>& values,
                             const std::string& help) {
  return app.add_option(name, values, help)->delimiter(',')->capture_default_str();
}
// --global-batch-size B: the B of the sample-mean objectives (check, weights).
inline void add_global_batch_size_option(CLI::App& app, int64_t& value) {
  app.add_option("--global-batch-size", value,
                 "B of the sample-mean objectives (default: the dump's global_batch_size, else "
                 "its samples)")
      ->check(CLI::Range(int64_t{1}, kMaxCount));
}

void register_inspect(CLI::App& root, Commands& commands);
void register_gen(CLI::App& root, Commands& commands);
void register_count(CLI::App& root, Commands& commands);
void register_topo(CLI::App& root, Commands& commands);
void register_replay(CLI::App& root, Commands& commands);
void register_check(CLI::App& root, Commands& commands);
void register_weights(CLI::App& root, Commands& commands);
void register_audit(CLI::App& root, Commands& commands);
void register_postmortem(CLI::App& root, Commands& commands);

// The --version text: tool, LibTorch, CUDA/NCCL compiled in or not, device seen.
std::string version_text();

}  // namespace lossguard::cli
