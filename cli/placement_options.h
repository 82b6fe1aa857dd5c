// Options shared by count and replay: CP layout and DP / micro-batch placement.
#pragma once
#include <CLI/CLI.hpp>
#include <string>

#include "core/batch.h"
#include "oracle/count/cp_shard.h"
#include "oracle/count/denominators.h"
#include "oracle/count/placement.h"

namespace lossguard::cli {

// --policy fixed|legacy|slime; throws InputError naming the bad value.
Policy policy_from_option(const std::string& value);

struct TopologySizes {
  int64_t tp = 1, pp = 1, cp = 1, dp = 1;
  int64_t ep = 1, etp = 0;  // expert parallelism; etp 0: the same as tp
};
void add_topology_options(CLI::App& app, TopologySizes& sizes);

struct LayoutOptions {
  int64_t padded_total_length = 0;
  int64_t max_seq_len = 0;
  int64_t pad_multiple = 0;
  ShardLayout layout() const;
};
void add_layout_options(CLI::App& app, LayoutOptions& o);

// How a micro-batch is cut over its CP group (SPEC §2): zig-zag or all-gather, static or dynamic
// CP size.
struct CpLayoutOptions {
  std::string cp_layout = "zigzag";
  int64_t allgather_pad = 128;
  int64_t dynamic_cp = 0;  // > 0: Relax's dynamic CP with this many tokens per GPU
  bool per_token_needed() const { return cp_layout != "zigzag" || dynamic_cp > 0; }
  // The step layout of `placement` on a CP group of `cp` (and `tp`), with these options.
  StepLayout step_layout(const Batch& batch, const Placement& placement, int64_t cp, int64_t tp,
                         const ShardLayout& shard) const;
  std::string describe() const;  // "zigzag", "allgather (pad 128)", "zigzag, dynamic CP (4096 ...)"
};
void add_cp_layout_options(CLI::App& app, CpLayoutOptions& o);

struct PlacementOptions {
  int64_t dp = 1;
  int64_t microbatches = 1;
  std::string split = "contiguous";
  bool given(const CLI::App& app) const {
    return app.count("--dp") + app.count("--microbatches") + app.count("--split") > 0;
  }
  // With --dp-shards, each dump is one DP rank (and --dp, when given, must match the number of
  // dumps).
  oracle::Placement placement(const Batch& batch, bool dp_shards) const;
};
void add_placement_options(CLI::App& app, PlacementOptions& o, bool dp_required);

}  // namespace lossguard::cli
