// One rank's program of collectives for a protocol (SPEC §7): what every rank's program needs
// (ReplayInputs), the collectives it issues, its outcome, and the state machine shared by the
// simulator (oracle/replay/replay.h) and the real Gloo/NCCL backends (distributed/).
// torch.distributed semantics: `src` is a global rank, a rank whose group lacks `src` errors at
// that call, collectives on a group match in issue order.
#pragma once
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/batch.h"
#include "oracle/count/placement.h"
#include "oracle/replay/replay_protocol.h"
#include "oracle/replay/topology.h"

namespace lossguard::oracle {

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

}  // namespace lossguard::oracle
