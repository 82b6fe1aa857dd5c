// The zero-token skip decision at the end of a step (SPEC §7): each protocol as a per-rank program
// of collectives, shared by the simulator (here) and the real Gloo/NCCL backends (distributed/),
// and the step model after the decision. The simulator has torch.distributed semantics: `src` is a
// global rank, a rank whose group lacks `src` errors at that call, collectives on a group match in
// issue order.
#pragma once
#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/batch.h"
#include "oracle/cp_shard.h"
#include "oracle/denominators.h"
#include "oracle/findings.h"
#include "oracle/placement.h"
#include "oracle/topology.h"

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

enum class Op { kAllReduceSum, kAllReduceMax, kBroadcast, kAllToAll, kBarrier };
const char* op_name(Op op);

// What a collective carries (its dtype and shape in a real job): calls that match in order on a
// group must carry the same.
enum class Payload : uint8_t { kNone, kCount, kFlag, kNorm, kGradients, kExpertGradients, kTokens };
const char* payload_name(Payload p);

struct CollectiveCall {
  Op op = Op::kBarrier;
  GroupRef group;
  int64_t src = -1;        // global rank, broadcast only
  int64_t value = 0;       // this rank's contribution (int64 scalar tensor)
  bool nonfinite = false;  // the contribution holds a NaN or Inf (gradients, norms)
  Payload payload = Payload::kNone;
  int32_t microbatch = -1;  // the micro-batch that issued it, -1 outside the loop
  const char* purpose = "";
};

// Everything a rank's program needs: the topology, the protocol, and per-(dp, cp) local quantities.
struct ReplayInputs {
  Topology topo{1, 1, 1, 1};
  Protocol protocol = Protocol::kPr285;
  ReduceMode reduce = ReduceMode::kPerToken;
  Policy policy = Policy::kFixed;
  GradSync grad_sync = GradSync::kLastMicrobatch;
  GroupKind flag_group = GroupKind::kTp;  // kFlagBroadcast*: tp, cp or dp
  // [dp * CP + cp][m]: the CP-local token count of micro-batch m under `policy`; its sum is what
  // the end-of-step count all-reduces, its length how many micro-batches that DP rank has.
  std::vector<std::vector<int64_t>> microbatch_tokens;
  std::vector<int64_t>
      local_samples;  // [dp * CP + cp]: samples over micro-batches (values[0], per-token loss off)
  std::vector<int64_t> nan_ranks;  // sorted: ranks whose own gradient is non-finite (--nan-ranks)
  int64_t global_tokens = 0;       // the truth: global `fixed` count
  int64_t num_samples = 0;
  int64_t local_tokens(std::size_t dp_cp) const;  // over its micro-batches
  int64_t microbatches() const;                   // the most micro-batches any DP rank has
  int64_t min_microbatches() const;               // the fewest
  bool nan_rank(int64_t rank) const;
  // The truth: skip iff the step has no effective token or some gradient is non-finite (the
  // global grad norm is then NaN or Inf).
  bool expected_skip() const { return global_tokens == 0 || !nan_ranks.empty(); }
};

ReplayInputs make_replay_inputs(const Batch& batch, const Topology& topo,
                                const Placement& placement, Protocol protocol, ReduceMode reduce,
                                Policy policy, const ShardLayout& layout);

enum class Outcome { kSkip, kStep, kError, kBlocked, kMismatch };
const char* outcome_name(Outcome o);

struct RankResult {
  int64_t rank = 0;
  std::optional<bool> skip;  // the decision, when the rank reached one
  Outcome outcome = Outcome::kBlocked;
  bool optimizer_stepped = false;
  bool scheduler_stepped = false;
  std::optional<double>
      grad_norm;  // 0.0 when skipped for no tokens, null for a non-finite norm or no decision
  bool update_successful = false;
  // It stepped with gradients from a backward that no DDP all-reduce followed (the last
  // micro-batch's backward skipped under --grad-sync last-microbatch): DP replicas diverge.
  bool unsynced_gradients = false;
  std::string summary;  // rank-independent text, used to group ranks in reports
  std::string detail;   // this rank's specifics
};

// One rank's program as a state machine: next() yields the collective to issue (or nothing when
// finished); the executor calls complete() with its result, or fail() when it cannot complete.
class RankProgram {
 public:
  RankProgram(const ReplayInputs* in, int64_t rank);
  std::optional<CollectiveCall> next();
  void complete(int64_t result, bool nonfinite = false);
  void fail(Outcome outcome, const std::string& summary, const std::string& detail);
  // How every executor (the simulator, the real Gloo/NCCL backends) fails a call, worded once:
  // reject() fails the program when torch.distributed would reject `call` on this rank (src not in
  // group) and says whether it did; block() when the call cannot complete (`seq`: the call's number
  // on its group, from 1; `detail`: what the executor waited for); mismatch() when the members of
  // its group issued different collectives (`detail`: what they issued).
  bool reject(const Topology& topo, const CollectiveCall& call);
  void block(const CollectiveCall& call, int seq, const std::string& detail);
  void mismatch(const CollectiveCall& call, int seq, const std::string& detail);
  bool finished() const { return phase_ == Phase::kDone || phase_ == Phase::kFailed; }
  RankResult result() const;

 private:
  enum class Phase : uint8_t {
    kStart,
    kAfterCountMax,
    kMicrobatch,
    kMbAfterCount,
    kMbFlag,
    kMbAfterFlag,
    kForward,
    kAfterForward,
    kBackward,
    kAfterBackwardA2a,
    kBackwardDone,
    kAfterGradSync,
    kExpertGradSync,
    kAfterExpertGradSync,
    kLoopEnd,
    kCount,
    kAfterCount,
    kGroupFlag,
    kAfterGroupFlag,
    kBroadcast,
    kAfterBroadcast,
    kDecide,
    kNanRank0,
    kAfterNanRank0,
    kOptimizer,
    kAfterOptimizer,
    kExpertNorm,
    kAfterExpertNorm,
    kBarrier,
    kAfterBarrier,
    kDone,
    kFailed
  };
  // The DDP gradient all-reduce of its dense (kGradients) or expert (kExpertGradients) buckets;
  // the sync returns to after_sync_.
  CollectiveCall grad_sync_call(Payload buckets) const;
  const ReplayInputs* in_;
  ProtocolParts parts_;
  int64_t rank_;
  bool last_stage_ = false;
  std::size_t idx_ = 0;                            // dp * CP + cp: where its local counts are
  std::array<GroupRef, kNumGroupKinds> groups_{};  // its group of each kind
  Phase phase_ = Phase::kStart;
  Phase after_sync_ = Phase::kMicrobatch;  // where a gradient sync returns to
  int64_t flag_ = 0;                       // 1: skip
  int64_t own_flag_ = -1;  // the flag this rank computed itself (last stage), -1 when none
  int64_t bcast_src_ = -1;
  int64_t local_mb_ = 0;  // micro-batches this rank has
  int64_t mb_total_ = 0;  // micro-batches it runs (with dummies)
  int64_t mb_ = 0;        // the current one
  int64_t mb_flag_ = 0;   // 1: skip this micro-batch's backward
  int64_t backward_skipped_ = 0;
  // Its dense and its expert gradients (after the syncs it took part in) hold NaN or Inf: each
  // travels only through its own all-reduce (DP+CP, expert-DP) and its own norm (mp, emp).
  bool dense_nonfinite_ = false;
  bool expert_nonfinite_ = false;
  bool nan_skip_ = false;        // skipped for a non-finite gradient
  bool norm_nonfinite_ = false;  // the all-reduced grad norm is non-finite
  bool unsynced_ = false;        // a backward ran after the last DDP gradient all-reduce
  std::optional<bool> skip_;
  bool optimizer_ = false;
  Outcome failed_outcome_ = Outcome::kError;
  std::string summary_, detail_;
};

// The group kinds a replay's programs issue collectives on (what a real backend must build).
std::vector<GroupKind> group_kinds_used(const ReplayInputs& in);

// The torch.distributed check at call time: the error message when `call` is invalid on `rank`.
std::optional<std::string> check_call(const Topology& topo, int64_t rank,
                                      const CollectiveCall& call);

struct ReplayResult {
  std::vector<RankResult> ranks;
  bool expected_skip = false;
  std::string expected_reason;  // "no effective tokens", "non-finite gradient on rank(s) 3", ""
  int64_t global_tokens = 0;
  bool fault = false;           // an error, block or mismatch
  bool wrong_decision = false;  // some rank decided differently from the expected decision
  std::vector<Finding> findings;
  bool ok() const { return !fault && !wrong_decision; }
  // A rank that reached a decision other than the expected one.
  bool decided_wrong(const RankResult& r) const { return r.skip && *r.skip != expected_skip; }
  // What a failing case names: the ranks with a wrong outcome (drift, a lost step, a non-finite or
  // unsynced step: the findings' rank sets, "; "-joined), and the ranks that faulted.
  std::string wrong_decision_message() const;
  std::string fault_message() const;
};

ReplayResult simulate(const ReplayInputs& in);
// Verdict and findings from per-rank results (shared by the simulator and real backends).
ReplayResult summarize(const ReplayInputs& in, std::vector<RankResult> ranks);

// --nan-ranks: "3,5-7" -> {3, 5, 6, 7}; throws InputError naming a rank outside [0, world).
std::vector<int64_t> parse_rank_list(const std::string& text, int64_t world);

// "0-3, 8-11" / "0-4094 step 2": rank lists compressed into arithmetic runs.
std::string format_rank_set(const std::vector<int64_t>& sorted_ranks, std::size_t max_runs = 8);

}  // namespace lossguard::oracle

namespace lossguard::oracle {

// The last stage's reported loss metric, values = [denominator, loss numerator] (SPEC §6): the
// global token count under per-token, the global batch size under sample-mean; the numerator from
// the batch's `token_loss` (or -log_probs). nullopt when the batch has neither field.
std::optional<std::vector<double>> loss_metric_values(const Batch& batch, ReduceMode reduce,
                                                      int64_t global_tokens);

// The last stage's loss metric as the trainer reports it (SPEC §6): its values, the normalised
// loss, or the fail-fast error that makes the step a distributed fault (a non-zero numerator over a
// zero denominator).
struct ReplayMetrics {
  std::vector<double> values;
  double loss = 0.0;  // normalised
  bool no_signal = false;
  std::string error;  // non-empty: the trainer fails fast
  bool faults() const { return !error.empty(); }
  std::vector<Finding> findings() const;  // metrics_fail_fast when it faults
};
// nullopt when the batch has neither token_loss nor log_probs.
std::optional<ReplayMetrics> replay_metrics(const Batch& batch, ReduceMode reduce,
                                            int64_t global_tokens);

}  // namespace lossguard::oracle
