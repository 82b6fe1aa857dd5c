// What a candidate (trainer/: LibTorch or the kernels) computed for one check case, as plain data
// the oracle judges (SPEC §5). The trainer fills it; the oracle never sees how.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/array.h"

namespace lossguard {

struct CandidateResult {
  int64_t denominator = 0;  // the denominator the trainer used (per-token: N summed over CP ranks)
  double loss = 0.0;        // SUM over CP ranks of each rank's partial loss
  HostArray grad;           // reassembled gradient w.r.t. the loss input, in its dtype
  std::vector<int32_t> row_rank;  // per response row: the CP rank that owns it (-1: none)
  std::vector<int8_t>
      row_chunk;      // per response row: which of the owner's two chunks (0, 1; -1: none)
  std::string dtype;  // working dtype
  int64_t skip_flag =
      -1;  // kernels: the zero-token flag as reduced on the device (1 skip); -1: not computed
};

}  // namespace lossguard
