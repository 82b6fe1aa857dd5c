// Options and loading shared by every command that reads dumps.
#pragma once
#include <string>
#include <vector>

#include "cli/command.h"
#include "io/dump.h"

namespace lossguard::cli {

struct DumpOptions {
  std::vector<std::string> paths;
  std::vector<std::string> field_maps;  // --field NAME=KEY
  bool dp_shards = false;
  int64_t step = -1;  // --step N: only that step of a multi-step dump
};
void add_dump_options(CLI::App& app, DumpOptions& options, bool with_dp_shards);
// --step N, for the commands that decide per step.
void add_step_option(CLI::App& app, DumpOptions& options);

struct LoadedBatch {
  std::vector<io::Dump> dumps;
  Batch batch;
};
// Reads, validates and concatenates the dumps; records them as the report's inputs. Shows progress
// on a terminal when loading takes more than a moment.
LoadedBatch load_batch(const DumpOptions& options, Report& report, Context& ctx,
                       LoadNeeds needs = {});

}  // namespace lossguard::cli
