// The candidate: what a CP-sharded trainer computes (SPEC §4, §5), in the dump's dtype with LibTorch ops
// and autograd, each CP rank on its own shard with global denominators. Implemented in the plugin
// liblossguard_trainer.so; this header carries only plain types across that boundary.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "oracle/array.h"
#include "oracle/batch.h"
#include "oracle/cp_shard.h"
#include "oracle/loss.h"

namespace lossguard::trainer {

struct CandidateInput {
  const oracle::Batch* batch = nullptr;
  oracle::LossSpec spec;
  int64_t cp = 1;
  oracle::ShardLayout layout;
};

struct CandidateOutput {
  int64_t denominator = 0;          // the denominator the trainer used (per-token: N summed over CP ranks)
  double loss = 0.0;                // SUM over CP ranks of each rank's partial loss
  HostArray grad;                   // reassembled gradient w.r.t. the loss input, in its dtype
  std::vector<int32_t> row_rank;    // per response row: the CP rank that owns it (-1: none)
  std::vector<int8_t> row_chunk;    // per response row: which of the owner's two chunks (0, 1; -1: none)
  std::string dtype;                // working dtype
  std::string error;                // non-empty: the candidate could not run
};

struct TrainerApi {
  int abi_version;
  void (*run)(const CandidateInput* in, CandidateOutput* out);
};
inline constexpr int kTrainerAbiVersion = 1;

// Loads the plugin (LOSSGUARD_TRAINER overrides its path) and runs the candidate; throws InputError.
CandidateOutput run_candidate(const CandidateInput& in);

}  // namespace lossguard::trainer

extern "C" const lossguard::trainer::TrainerApi* lossguard_trainer_api();
