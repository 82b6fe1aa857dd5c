// The skip-decision protocols of SPEC §7 by name: each a per-rank program built from four parts
// (protocol_parts), with when the DDP gradient all-reduce is issued (GradSync) and what values[0]
// holds (ReduceMode); every name from its table.
#pragma once
#include <cstdint>
#include <utility>

#include "core/modes.h"

namespace lossguard::oracle {

// Every protocol is one rank program (RankProgram) built from four parts, run in this order:
//   1. the micro-batch loop (Loop): forward and backward of each micro-batch, with the
//      collectives they trigger (the MoE token all-to-all on the expert-parallel group when
//      EP > 1, the DDP gradient all-reduce as --grad-sync says), and the per-micro-batch
//      decisions: skip the backward of a micro-batch, how many micro-batches to run;
//   2. the end-of-step zero-token decision (the five original protocols; pr285 for the others);
//   3. the non-finite-gradient decision (NanCheck), with the optimizer's grad-norm all-reduce;
//   4. optimizer.step() and the barrier standing for the next step.
enum class Protocol {
  kPr285,
  kPr285SrcLocal,
  kPr285AlwaysBroadcast,
  kValues0,
  kNoSkip,
  kMicrobatchSkip,        // skip a micro-batch's backward when its DP×CP-reduced count is 0
  kMicrobatchSkipLocal,   // ... when this rank's own count is 0 (Relax#252 as first planned)
  kMicrobatchesMax,       // micro-batch count all-reduced (MAX) over DP, dummies padded (Relax)
  kMicrobatchesLocal,     // every DP rank runs its own micro-batch count
  kNanSkip,               // skip = !isfinite(grad norm) after the norm's all-reduce (Megatron)
  kNanSkipLocal,          // ... decided on this rank's own gradient, before the all-reduce
  kNanSkipRank0,          // ... decided on rank 0's gradient and broadcast from rank 0
  kFlagBroadcast,         // the skip flag broadcast on --flag-group from get_global_rank(group, 0)
  kFlagBroadcastSrcLocal  // ... from src = 0, the group-local index used as a global rank
};
}  // namespace lossguard::oracle

namespace lossguard {
template <>
struct ModeNames<oracle::Protocol> {
  using P = oracle::Protocol;
  static constexpr std::pair<P, const char*> kTable[] = {
      {P::kPr285, "pr285"},
      {P::kPr285SrcLocal, "pr285-src-local"},
      {P::kPr285AlwaysBroadcast, "pr285-always-broadcast"},
      {P::kValues0, "values0"},
      {P::kNoSkip, "no-skip"},
      {P::kMicrobatchSkip, "microbatch-skip"},
      {P::kMicrobatchSkipLocal, "microbatch-skip-local"},
      {P::kMicrobatchesMax, "microbatches-max"},
      {P::kMicrobatchesLocal, "microbatches-local"},
      {P::kNanSkip, "nan-skip"},
      {P::kNanSkipLocal, "nan-skip-local"},
      {P::kNanSkipRank0, "nan-skip-rank0"},
      {P::kFlagBroadcast, "flag-broadcast"},
      {P::kFlagBroadcastSrcLocal, "flag-broadcast-src-local"}};
};
}  // namespace lossguard

namespace lossguard::oracle {

inline const char* protocol_name(Protocol p) { return mode_name(p); }
const char* protocol_description(Protocol p);  // one line, for --help and reports

enum class Loop {
  kNone,        // no micro-batch structure (the five end-of-step protocols)
  kPlain,       // every micro-batch runs forward and backward
  kSkipGlobal,  // backward skipped when the micro-batch's count, all-reduced over DP×CP, is 0
  kSkipLocal,   // backward skipped when this rank's own count of the micro-batch is 0
  kCountMax,    // all_reduce(count, MAX, DP group), then dummy micro-batches up to it
  kCountLocal   // each DP rank runs the micro-batches it has
};
enum class NanCheck { kNone, kAfterAllReduce, kLocal, kRank0 };
struct ProtocolParts {
  Loop loop = Loop::kNone;
  NanCheck nan = NanCheck::kNone;
  bool flag_broadcast = false;  // the flag also goes over the --flag-group group
};
ProtocolParts protocol_parts(Protocol p);

// When the DDP gradient all-reduce (one per DDP bucket; one collective here) is issued:
// kLastMicrobatch: by the backward of the last micro-batch (PyTorch DDP under no_sync, Megatron
//   with overlap_grad_reduce: the bucket's hook fires when its last gradient is ready);
// kEveryMicrobatch: by every backward (no gradient accumulation, or ZeRO-3/FSDP's per-micro-batch
//   reduce-scatter);
// kFinalize: after the loop whatever backward ran (Megatron's finalize_model_grads ->
//   finish_grad_sync without overlap).
enum class GradSync { kLastMicrobatch, kEveryMicrobatch, kFinalize };
// Whether per-token loss is on (what values[0] holds).
enum class ReduceMode { kPerToken, kSampleMean };
}  // namespace lossguard::oracle

namespace lossguard {
template <>
struct ModeNames<oracle::GradSync> {
  static constexpr std::pair<oracle::GradSync, const char*> kTable[] = {
      {oracle::GradSync::kLastMicrobatch, "last-microbatch"},
      {oracle::GradSync::kEveryMicrobatch, "every-microbatch"},
      {oracle::GradSync::kFinalize, "finalize"}};
};
template <>
struct ModeNames<oracle::ReduceMode> {
  static constexpr std::pair<oracle::ReduceMode, const char*> kTable[] = {
      {oracle::ReduceMode::kPerToken, "per-token"},
      {oracle::ReduceMode::kSampleMean, "sample-mean"}};
};
}  // namespace lossguard

namespace lossguard::oracle {
inline const char* grad_sync_name(GradSync g) { return mode_name(g); }
inline const char* reduce_mode_name(ReduceMode m) { return mode_name(m); }

}  // namespace lossguard::oracle
