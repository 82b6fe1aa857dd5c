// The candidate: what a CP-sharded trainer computes (SPEC §4, §5), each CP rank on its own shard
// with global denominators, in one of two implementations: `torch` (the dump's dtype, LibTorch ops
// and autograd, in the plugin liblossguard_trainer.so; this header carries only plain types across
// that boundary) or `kernels` (kernels/: counting, fused log-prob/loss/gradient, the skip flag on
// the device).
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "core/array.h"
#include "core/batch.h"
#include "core/candidate_result.h"
#include "core/contract.h"
#include "core/errors.h"
#include "core/layout.h"
#include "core/modes.h"
#include "kernels/device.h"

namespace lossguard::trainer {

enum class Impl { kTorch, kKernels };
}  // namespace lossguard::trainer

namespace lossguard {
template <>
struct ModeNames<trainer::Impl> {
  static constexpr std::pair<trainer::Impl, const char*> kTable[] = {
      {trainer::Impl::kTorch, "torch"}, {trainer::Impl::kKernels, "kernels"}};
};
}  // namespace lossguard

namespace lossguard::trainer {

struct CandidateInput {
  const Batch* batch = nullptr;
  LossSpec spec;
  int64_t cp = 1;
  ShardLayout layout;
  Impl impl = Impl::kTorch;
  kernels::Device device = kernels::Device::kCpu;  // kernels only
  // check --contract: the trainer's normalisation contract over a DP x micro-batch placement; each
  // token's coefficient then comes from the contract (contract_plan.h) instead of the policy, and
  // `denominator` reports the contract's global count.
  const Contract* contract = nullptr;
  const Placement* placement = nullptr;
  int64_t tp = 1;
  int64_t global_batch_size = 0;
  // Tests and benchmarks only (LOSSGUARD_TEST_MUTATION=weight-*): each response row's coefficient
  // times this factor, a planted weight error; null: none.
  const std::vector<double>* weight_scale = nullptr;
  // Receives the gradient block by block (each response row once); without one, the candidate
  // collects it into CandidateOutput::grad (tests, small batches).
  GradSink sink;
};

struct CandidateOutput : CandidateResult {
  std::string error;  // non-empty: the candidate could not run
  ErrorKind error_kind = ErrorKind::kNone;
};

struct TrainerApi {
  int abi_version;
  void (*run)(const CandidateInput* in, CandidateOutput* out);
};
inline constexpr int kTrainerAbiVersion = 8;  // 8: skip_flag is std::optional<bool>

// Runs the candidate: `torch` loads the plugin (LOSSGUARD_TRAINER overrides its path), `kernels`
// runs in process. Throws InputError when it cannot run.
CandidateOutput run_candidate(const CandidateInput& in);

// Loads the LibTorch plugin on a thread of its own from construction on, so that LibTorch's
// start-up (0.4 s here) overlaps the caller's own work (check: reading the dump, the oracle's pass
// over the logits); run_candidate waits for it. A load that fails is reported by run_candidate, as
// without a preload. The destructor waits for the thread.
class TorchPreload {
 public:
  TorchPreload();
  ~TorchPreload();
  TorchPreload(const TorchPreload&) = delete;
  TorchPreload& operator=(const TorchPreload&) = delete;

 private:
  std::thread thread_;
};

// The kernels implementation (candidate_kernels.cpp), in process.
void run_kernels_candidate(const CandidateInput& in, CandidateOutput* out);

// How `impl` computes the nll from logits over `vocab` columns on `device` (for check's derived
// tolerances).
Arithmetic arithmetic_of(Impl impl, int64_t vocab, kernels::Device device);

// Rows per gradient block for rows of `row_bytes`: about 32 MiB (a few rows of a 150k vocabulary,
// thousands of per-token values), at least one.
inline int64_t rows_per_block(std::size_t row_bytes) {
  constexpr std::size_t kBlockBytes = std::size_t{32} << 20;
  return static_cast<int64_t>(
      std::max<std::size_t>(1, kBlockBytes / std::max<std::size_t>(row_bytes, 1)));
}

}  // namespace lossguard::trainer

extern "C" const lossguard::trainer::TrainerApi* lossguard_trainer_api();
