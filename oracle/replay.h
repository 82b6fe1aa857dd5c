// The zero-token skip decision at the end of a step (SPEC §7): each protocol as a per-rank program
// of collectives, shared by the simulator (here) and the real Gloo/NCCL backends (distributed/),
// and the step model after the decision. The simulator has torch.distributed semantics: `src` is a
// global rank, a rank whose group lacks `src` errors at that call, collectives on a group match in
// issue order.
#pragma once
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

enum class Protocol { kPr285, kPr285SrcLocal, kPr285AlwaysBroadcast, kValues0, kNoSkip };
const char* protocol_name(Protocol p);
bool parse_protocol(const std::string& s, Protocol* out);
const std::vector<Protocol>& all_protocols();

enum class ReduceMode {
  kPerToken,
  kSampleMean
};  // whether per-token loss is on (what values[0] holds)
const char* reduce_mode_name(ReduceMode m);

enum class Op { kAllReduceSum, kBroadcast, kBarrier };
const char* op_name(Op op);

struct CollectiveCall {
  Op op = Op::kBarrier;
  GroupRef group;
  int64_t src = -1;   // global rank, broadcast only
  int64_t value = 0;  // this rank's contribution (int64 scalar tensor)
  const char* purpose = "";
};

// Everything a rank's program needs: the topology, the protocol, and per-(dp, cp) local quantities.
struct ReplayInputs {
  Topology topo{1, 1, 1, 1};
  Protocol protocol = Protocol::kPr285;
  ReduceMode reduce = ReduceMode::kPerToken;
  Policy policy = Policy::kFixed;
  std::vector<int64_t>
      local_tokens;  // [dp * CP + cp]: CP-local token count over micro-batches, under `policy`
  std::vector<int64_t>
      local_samples;  // [dp * CP + cp]: samples over micro-batches (values[0], per-token loss off)
  int64_t global_tokens = 0;  // the truth: global `fixed` count
  int64_t num_samples = 0;
  int64_t microbatches = 1;
  bool expected_skip() const { return global_tokens == 0; }
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
      grad_norm;  // 0.0 when skipped; the simulator computes no gradients otherwise
  bool update_successful = false;
  std::string summary;  // rank-independent text, used to group ranks in reports
  std::string detail;   // this rank's specifics
};

// One rank's end-of-step protocol as a state machine: next() yields the collective to issue (or
// nothing when finished); the executor calls complete() with its result, or fail() when it cannot
// complete.
class RankProgram {
 public:
  RankProgram(const ReplayInputs* in, int64_t rank);
  std::optional<CollectiveCall> next();
  void complete(int64_t result);
  void fail(Outcome outcome, const std::string& summary, const std::string& detail);
  // How every executor (the simulator, the real Gloo/NCCL backends) fails a call, worded once:
  // reject() fails the program when torch.distributed would reject `call` on this rank (src not in
  // group) and says whether it did; block() when the call cannot complete (`seq`: the call's number
  // on its group, from 1; `detail`: what the executor waited for).
  bool reject(const Topology& topo, const CollectiveCall& call);
  void block(const CollectiveCall& call, int seq, const std::string& detail);
  bool finished() const { return phase_ == Phase::kDone || phase_ == Phase::kFailed; }
  RankResult result() const;

 private:
  enum class Phase : uint8_t {
    kStart,
    kAfterCount,
    kBroadcast,
    kAfterBroadcast,
    kDecide,
    kOptimizer,
    kAfterOptimizer,
    kBarrier,
    kAfterBarrier,
    kDone,
    kFailed
  };
  const ReplayInputs* in_;
  int64_t rank_;
  Phase phase_ = Phase::kStart;
  int64_t flag_ = 0;       // 1: skip
  int64_t own_flag_ = -1;  // the flag this rank computed itself (last stage), -1 when none
  int64_t bcast_src_ = -1;
  std::optional<bool> skip_;
  bool optimizer_ = false;
  Outcome failed_outcome_ = Outcome::kError;
  std::string summary_, detail_;
};

// The torch.distributed check at call time: the error message when `call` is invalid on `rank`.
std::optional<std::string> check_call(const Topology& topo, int64_t rank,
                                      const CollectiveCall& call);

struct ReplayResult {
  std::vector<RankResult> ranks;
  bool expected_skip = false;
  int64_t global_tokens = 0;
  bool fault = false;           // an error, block or mismatch
  bool wrong_decision = false;  // some rank decided differently from the expected decision
  std::vector<Finding> findings;
};

ReplayResult simulate(const ReplayInputs& in);
// Verdict and findings from per-rank results (shared by the simulator and real backends).
ReplayResult summarize(const ReplayInputs& in, std::vector<RankResult> ranks);

// "0-3, 8-11" / "0-4094 step 2": rank lists compressed into arithmetic runs.
std::string format_rank_set(const std::vector<int64_t>& sorted_ranks, std::size_t max_runs = 8);

}  // namespace lossguard::oracle

namespace lossguard::oracle {

// The last stage's reported loss metric, values = [denominator, loss numerator] (SPEC §6): the
// global token count under per-token, the global batch size under sample-mean; the numerator from
// the batch's `token_loss` (or -log_probs). nullopt when the batch has neither field.
std::optional<std::vector<double>> loss_metric_values(const Batch& batch, ReduceMode reduce,
                                                      int64_t global_tokens);

}  // namespace lossguard::oracle
