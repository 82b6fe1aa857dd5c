// Where a step's samples were computed (SPEC §1 "Steps and layout", §2, §7): which DP rank, which
// micro-batch, which CP size and CP sub-group. Built from flags (oracle/count/placement.h) or read
// from a dump or a capture that recorded the trainer's real layout.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/modes.h"

namespace lossguard {

// placement[dp][mb] = the global sample indices of micro-batch mb on DP rank dp, in order.
using Placement = std::vector<std::vector<std::vector<int64_t>>>;

// One micro-batch of one DP rank. Its CP group of `cp` ranks (the static CP size) trains it as
// cp / cp_size sub-groups of cp_size ranks each (dynamic CP; one group when cp_size == cp):
// sub-group g is CP ranks [g·cp_size, (g+1)·cp_size) and trains the samples groups[g].
struct MicroBatch {
  int64_t dp_rank = 0;
  int64_t index = 0;    // within its DP rank
  int64_t cp_size = 1;  // cp_k
  std::vector<std::vector<int64_t>> groups;
  bool dummy = false;  // a padding micro-batch that carries no loss
};

struct StepLayout {
  int64_t dp = 1, cp = 1, tp = 1;
  std::vector<MicroBatch> microbatches;  // by DP rank, then index
  CpLayout cp_layout = CpLayout::kZigzag;
  ShardLayout shard;
  int64_t allgather_pad =
      128;  // all-gather layout: the stream is padded to a multiple of cp·tp·this
  std::string source = "flags";  // "flags" or "dump"
  bool dynamic_cp = false;

  // Micro-batches of DP rank d (M of SPEC §9 for that rank). A scan: for every rank at once (a
  // loop over ranks calling this is quadratic in DP), use microbatches_per_rank().
  int64_t num_microbatches(int64_t d) const {
    int64_t m = 0;
    for (const auto& mb : microbatches) m += mb.dp_rank == d;
    return m;
  }
  // [dp] the micro-batches of every DP rank, in one pass.
  std::vector<int64_t> microbatches_per_rank() const {
    std::vector<int64_t> m(static_cast<std::size_t>(dp > 0 ? dp : 0), 0);
    for (const auto& mb : microbatches) {
      if (mb.dp_rank >= 0 && mb.dp_rank < dp) ++m[static_cast<std::size_t>(mb.dp_rank)];
    }
    return m;
  }
};

// Every micro-batch trained by the whole static CP group as one group.
inline StepLayout static_layout(const Placement& placement, int64_t cp, int64_t tp,
                                const ShardLayout& shard) {
  StepLayout l;
  l.dp = static_cast<int64_t>(placement.size());
  l.cp = cp;
  l.tp = tp;
  l.shard = shard;
  for (std::size_t d = 0; d < placement.size(); ++d) {
    for (std::size_t k = 0; k < placement[d].size(); ++k) {
      l.microbatches.push_back(
          {static_cast<int64_t>(d), static_cast<int64_t>(k), cp, {placement[d][k]}, false});
    }
  }
  return l;
}

}  // namespace lossguard
