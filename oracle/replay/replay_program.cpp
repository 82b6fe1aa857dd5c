// The rank program, its inputs and outcomes (oracle/replay/replay_program.h).
#include "oracle/replay/replay_program.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <limits>
#include <map>
#include <tuple>

#include "core/errors.h"
#include "oracle/count/cp_shard.h"
#include "oracle/count/denominators.h"
#include "oracle/replay/rank_set.h"

namespace lossguard::oracle {

const char* op_name(Op op) {
  switch (op) {
    case Op::kAllReduceSum:
      return "all_reduce";
    case Op::kAllReduceMax:
      return "all_reduce(MAX)";
    case Op::kBroadcast:
      return "broadcast";
    case Op::kAllToAll:
      return "all_to_all";
    case Op::kBarrier:
      return "barrier";
  }
  return "?";
}

const char* payload_name(Payload p) {
  switch (p) {
    case Payload::kNone:
      return "nothing";
    case Payload::kCount:
      return "an int64 count";
    case Payload::kFlag:
      return "an int64 flag";
    case Payload::kNorm:
      return "a float grad norm";
    case Payload::kGradients:
      return "a gradient bucket";
    case Payload::kExpertGradients:
      return "an expert gradient bucket";
    case Payload::kTokens:
      return "MoE tokens";
  }
  return "?";
}

const char* outcome_name(Outcome o) {
  switch (o) {
    case Outcome::kSkip:
      return "skip";
    case Outcome::kStep:
      return "step";
    case Outcome::kError:
      return "error";
    case Outcome::kBlocked:
      return "blocked";
    case Outcome::kMismatch:
      return "mismatch";
  }
  return "?";
}

bool ReplayInputs::nan_rank(int64_t rank) const {
  return std::binary_search(nan_ranks.begin(), nan_ranks.end(), rank);
}

int64_t ReplayInputs::local_tokens(std::size_t dp_cp) const {
  int64_t n = 0;
  for (int64_t t : microbatch_tokens[dp_cp]) n += t;
  return n;
}

int64_t ReplayInputs::microbatches() const {
  std::size_t m = 0;
  for (const auto& mbs : microbatch_tokens) m = std::max(m, mbs.size());
  return static_cast<int64_t>(m);
}

int64_t ReplayInputs::min_microbatches() const {
  if (microbatch_tokens.empty()) return 0;
  std::size_t m = microbatch_tokens[0].size();
  for (const auto& mbs : microbatch_tokens) m = std::min(m, mbs.size());
  return static_cast<int64_t>(m);
}

ReplayInputs make_replay_inputs(const Batch& batch, const Topology& topo,
                                const Placement& placement, Protocol protocol, ReduceMode reduce,
                                Policy policy, const ShardLayout& layout) {
  if (static_cast<int64_t>(placement.size()) != topo.dp()) {
    throw_input_error("the batch is placed on {} DP rank(s) but the topology has DP = {}",
                      placement.size(), topo.dp());
  }
  ReplayInputs in;
  in.topo = topo;
  in.protocol = protocol;
  in.reduce = reduce;
  in.policy = policy;
  in.num_samples = batch.num_samples();
  const int64_t cp = topo.cp();
  const OwnedCounts counts = count_owned_tokens(batch, {cp}, layout);
  in.global_tokens = global_denominator(Policy::kFixed, counts, 0);
  in.local_samples.assign(static_cast<std::size_t>(topo.dp() * cp), 0);
  in.microbatch_tokens.assign(static_cast<std::size_t>(topo.dp() * cp), {});
  for (int64_t d = 0; d < topo.dp(); ++d) {
    for (int64_t r = 0; r < cp; ++r)
      in.microbatch_tokens[d * cp + r].assign(placement[d].size(), 0);
    for (std::size_t m = 0; m < placement[d].size(); ++m) {
      for (int64_t i : placement[d][m]) {
        for (int64_t r = 0; r < cp; ++r) {
          const auto k = static_cast<std::size_t>(i);
          in.microbatch_tokens[d * cp + r][m] +=
              policy_rank_count(policy, counts.count(0, k, r), counts.mask_sums[k], cp);
          in.local_samples[d * cp + r] += 1;
        }
      }
    }
  }
  return in;
}

RankProgram::RankProgram(const ReplayInputs* in, int64_t rank)
    : in_(in), parts_(protocol_parts(in->protocol)), rank_(rank) {
  const Topology& t = in->topo;
  const Coord c = t.coord(rank);
  last_stage_ = c.pp == t.pp() - 1;
  idx_ = static_cast<std::size_t>(c.dp * t.cp() + c.cp);
  for (int k = 0; k < kNumGroupKinds; ++k) {
    const auto kind = static_cast<GroupKind>(k);
    const bool expert =
        kind == GroupKind::kEp || kind == GroupKind::kEdp || kind == GroupKind::kEmp;
    if (!expert || t.ep() > 1) groups_[static_cast<std::size_t>(k)] = t.group_of(kind, rank);
  }
  LG_CHECK(idx_ < in->microbatch_tokens.size(), "rank {}: no micro-batch counts for DP+CP index {}",
           rank, idx_);
  local_mb_ = static_cast<int64_t>(in->microbatch_tokens[idx_].size());
  dense_nonfinite_ = expert_nonfinite_ = in->nan_rank(rank);
}

// The DDP gradient all-reduce: dense buckets over DP+CP, expert buckets (EP > 1) over the
// expert-data-parallel group (Megatron DistributedDataParallel: dense buffers on
// intra_dp_cp_group, expert buffers on intra_expt_dp_group), each carrying its own NaN.
CollectiveCall RankProgram::grad_sync_call(Payload buckets) const {
  const bool expert = buckets == Payload::kExpertGradients;
  return CollectiveCall{
      Op::kAllReduceSum,
      groups_[static_cast<std::size_t>(expert ? GroupKind::kEdp : GroupKind::kDpCp)],
      -1,
      0,
      expert ? expert_nonfinite_ : dense_nonfinite_,
      buckets,
      static_cast<int32_t>(after_sync_ == Phase::kMicrobatch ? mb_ - 1 : -1),
      expert ? "DDP expert-gradient all-reduce" : "DDP gradient all-reduce"};
}

// Long: the rank program's transition function, one case per phase of a training step, in the
// order a step runs them.
std::optional<CollectiveCall> RankProgram::next() {
  const Topology& t = in_->topo;
  auto group = [&](GroupKind k) { return groups_[static_cast<std::size_t>(k)]; };
  while (true) {
    const auto mb = static_cast<int32_t>(mb_);
    switch (phase_) {
      case Phase::kStart:
        if (parts_.loop == Loop::kNone) {
          phase_ = Phase::kCount;
          continue;
        }
        mb_total_ = local_mb_;
        if (parts_.loop == Loop::kCountMax) {  // Relax get_data_iterator: MAX over the DP group
          phase_ = Phase::kAfterCountMax;
          return CollectiveCall{
              Op::kAllReduceMax,  group(GroupKind::kDp), -1, local_mb_, false, Payload::kCount, -1,
              "micro-batch count"};
        }
        phase_ = Phase::kMicrobatch;
        continue;
      case Phase::kMicrobatch: {
        if (mb_ >= mb_total_) {
          phase_ = Phase::kLoopEnd;
          continue;
        }
        mb_flag_ = 0;
        const bool decides = parts_.loop == Loop::kSkipGlobal || parts_.loop == Loop::kSkipLocal;
        if (!decides) {
          phase_ = Phase::kForward;
          continue;
        }
        phase_ = Phase::kMbFlag;
        if (!last_stage_) continue;  // earlier stages learn the decision from the last one
        const int64_t count = mb_ < local_mb_
                                  ? in_->microbatch_tokens[idx_][static_cast<std::size_t>(mb_)]
                                  : 0;  // a dummy micro-batch counts 0 tokens
        if (parts_.loop == Loop::kSkipLocal) {
          mb_flag_ = count == 0 ? 1 : 0;
          continue;
        }
        phase_ = Phase::kMbAfterCount;
        return CollectiveCall{Op::kAllReduceSum,
                              group(GroupKind::kDpCp),
                              -1,
                              count,
                              false,
                              Payload::kCount,
                              mb,
                              "micro-batch token count"};
      }
      case Phase::kMbFlag:
        if (t.pp() == 1) {
          phase_ = Phase::kForward;
          continue;
        }
        phase_ = Phase::kMbAfterFlag;
        return CollectiveCall{Op::kBroadcast,
                              group(GroupKind::kPp),
                              t.pipeline_last_rank(rank_),
                              mb_flag_,
                              false,
                              Payload::kFlag,
                              mb,
                              "backward-skip flag"};
      case Phase::kForward:
        if (t.ep() > 1) {  // MoE token dispatch in every forward
          phase_ = Phase::kAfterForward;
          return CollectiveCall{
              Op::kAllToAll, group(GroupKind::kEp), -1, 0,
              false,         Payload::kTokens,      mb, "MoE token dispatch (forward)"};
        }
        phase_ = Phase::kBackward;
        continue;
      case Phase::kBackward:
        if (mb_flag_ != 0) {
          ++backward_skipped_;
          ++mb_;
          phase_ = Phase::kMicrobatch;
          continue;
        }
        if (t.ep() > 1) {
          phase_ = Phase::kAfterBackwardA2a;
          return CollectiveCall{
              Op::kAllToAll, group(GroupKind::kEp), -1, 0,
              false,         Payload::kTokens,      mb, "MoE token dispatch (backward)"};
        }
        phase_ = Phase::kBackwardDone;
        continue;
      case Phase::kBackwardDone: {
        ++mb_;
        unsynced_ = true;
        const bool sync = in_->grad_sync == GradSync::kEveryMicrobatch ||
                          (in_->grad_sync == GradSync::kLastMicrobatch && mb_ == mb_total_);
        phase_ = Phase::kMicrobatch;
        if (!sync) continue;
        after_sync_ = Phase::kMicrobatch;
        phase_ = Phase::kAfterGradSync;
        return grad_sync_call(Payload::kGradients);
      }
      case Phase::kLoopEnd:
        phase_ = Phase::kCount;
        if (in_->grad_sync != GradSync::kFinalize) continue;
        after_sync_ = Phase::kCount;
        phase_ = Phase::kAfterGradSync;
        return grad_sync_call(Payload::kGradients);
      case Phase::kExpertGradSync:
        phase_ = Phase::kAfterExpertGradSync;
        return grad_sync_call(Payload::kExpertGradients);
      case Phase::kCount: {
        if (in_->protocol == Protocol::kNoSkip) {  // Megatron baseline: no decision is ever made
          phase_ = Phase::kDecide;
          continue;
        }
        if (!last_stage_) {  // only the last stage computes loss and counts tokens
          phase_ = Phase::kBroadcast;
          continue;
        }
        const bool sample_count =
            in_->protocol == Protocol::kValues0 && in_->reduce == ReduceMode::kSampleMean;
        phase_ = Phase::kAfterCount;
        return CollectiveCall{
            Op::kAllReduceSum,
            group(GroupKind::kDpCp),
            -1,
            sample_count ? in_->local_samples[idx_] : in_->local_tokens(idx_),
            false,
            Payload::kCount,
            -1,
            in_->protocol == Protocol::kValues0 ? "sum of values[0]" : "effective token count"};
      }
      case Phase::kGroupFlag: {
        const GroupRef g = group(in_->flag_group);
        const int64_t src = in_->protocol == Protocol::kFlagBroadcastSrcLocal ? 0 : t.member(g, 0);
        phase_ = Phase::kAfterGroupFlag;
        return CollectiveCall{Op::kBroadcast, g,  src,        flag_, false,
                              Payload::kFlag, -1, "skip flag"};
      }
      case Phase::kBroadcast: {
        const bool needed = in_->protocol == Protocol::kPr285AlwaysBroadcast || t.pp() > 1;
        if (!needed) {
          phase_ = Phase::kDecide;
          continue;
        }
        const bool stage_index_as_rank = in_->protocol == Protocol::kPr285SrcLocal ||
                                         in_->protocol == Protocol::kPr285AlwaysBroadcast;
        bcast_src_ = stage_index_as_rank ? t.pp() - 1 : t.pipeline_last_rank(rank_);
        phase_ = Phase::kAfterBroadcast;
        return CollectiveCall{Op::kBroadcast, group(GroupKind::kPp), bcast_src_, flag_,
                              false,          Payload::kFlag,        -1,         "skip flag"};
      }
      case Phase::kDecide:
        skip_ = in_->protocol != Protocol::kNoSkip && flag_ != 0;
        if (*skip_) {
          phase_ = Phase::kBarrier;
          continue;
        }
        if (parts_.nan == NanCheck::kLocal &&
            (dense_nonfinite_ || expert_nonfinite_)) {  // decided on its own gradient
          skip_ = nan_skip_ = true;
          phase_ = Phase::kBarrier;
          continue;
        }
        phase_ = parts_.nan == NanCheck::kRank0 ? Phase::kNanRank0 : Phase::kOptimizer;
        continue;
      case Phase::kNanRank0:
        phase_ = Phase::kAfterNanRank0;
        return CollectiveCall{Op::kBroadcast,
                              GroupRef{GroupKind::kWorld, 0},
                              0,
                              rank_ == 0 && (dense_nonfinite_ || expert_nonfinite_) ? 1 : 0,
                              false,
                              Payload::kFlag,
                              -1,
                              "non-finite-gradient flag"};
      case Phase::kOptimizer:  // optimizer.step(): the grad norm's all-reduce over the
                               // model-parallel group (Megatron clip_grads:
                               // grad_stats_parallel_group)
        phase_ = Phase::kAfterOptimizer;
        return CollectiveCall{Op::kAllReduceSum, group(GroupKind::kMp), -1, 0,
                              dense_nonfinite_,  Payload::kNorm,        -1, "grad_norm"};
      case Phase::kExpertNorm:  // the expert optimizer's norm over tp-ep-pp (ChainedOptimizer)
        phase_ = Phase::kAfterExpertNorm;
        return CollectiveCall{Op::kAllReduceSum, group(GroupKind::kEmp), -1, 0,
                              expert_nonfinite_, Payload::kNorm,         -1, "expert grad_norm"};
      case Phase::kBarrier:  // every rank enters the next step
        phase_ = Phase::kAfterBarrier;
        return CollectiveCall{
            Op::kBarrier, GroupRef{GroupKind::kWorld, 0}, -1, 0, false, Payload::kNone, -1,
            "next step"};
      case Phase::kDone:
      case Phase::kFailed:
        return std::nullopt;
      default:
        LG_CHECK(false, "rank {}: next() while waiting for a collective", rank_);
    }
  }
}

void RankProgram::complete(int64_t result, bool nonfinite) {
  const Topology& t = in_->topo;
  switch (phase_) {
    case Phase::kAfterCountMax:
      mb_total_ = result;
      phase_ = Phase::kMicrobatch;
      break;
    case Phase::kMbAfterCount:
      mb_flag_ = result == 0 ? 1 : 0;
      phase_ = Phase::kMbFlag;
      break;
    case Phase::kMbAfterFlag:
      mb_flag_ = result;
      phase_ = Phase::kForward;
      break;
    case Phase::kAfterForward:
      phase_ = Phase::kBackward;
      break;
    case Phase::kAfterBackwardA2a:
      phase_ = Phase::kBackwardDone;
      break;
    case Phase::kAfterGradSync:
      dense_nonfinite_ = dense_nonfinite_ || nonfinite;
      unsynced_ = false;
      phase_ = t.ep() > 1 ? Phase::kExpertGradSync : after_sync_;
      break;
    case Phase::kAfterExpertGradSync:
      expert_nonfinite_ = expert_nonfinite_ || nonfinite;
      phase_ = after_sync_;
      break;
    case Phase::kAfterCount:
      own_flag_ = flag_ = result == 0 ? 1 : 0;
      phase_ = parts_.flag_broadcast ? Phase::kGroupFlag : Phase::kBroadcast;
      break;
    case Phase::kAfterGroupFlag:
      flag_ = result;
      phase_ = Phase::kBroadcast;
      break;
    case Phase::kAfterBroadcast:
      flag_ = result;
      phase_ = Phase::kDecide;
      break;
    case Phase::kAfterNanRank0:
      if (result != 0) skip_ = nan_skip_ = true;
      phase_ = result != 0 ? Phase::kBarrier : Phase::kOptimizer;
      break;
    case Phase::kAfterOptimizer:
    case Phase::kAfterExpertNorm:
      norm_nonfinite_ = norm_nonfinite_ || nonfinite;
      if (t.ep() > 1 && phase_ == Phase::kAfterOptimizer) {
        phase_ = Phase::kExpertNorm;
        break;
      }
      if (parts_.nan == NanCheck::kAfterAllReduce && norm_nonfinite_) {
        skip_ = nan_skip_ = true;  // Megatron: found_inf -> return False, None, None
      } else {
        optimizer_ = true;
      }
      phase_ = Phase::kBarrier;
      break;
    case Phase::kAfterBarrier:
      phase_ = Phase::kDone;
      break;
    default:
      LG_CHECK(false, "rank {}: complete() without a collective in flight", rank_);
  }
}

void RankProgram::fail(Outcome outcome, const std::string& summary, const std::string& detail) {
  failed_outcome_ = outcome;
  summary_ = summary;
  detail_ = detail;
  phase_ = Phase::kFailed;
}

bool RankProgram::reject(const Topology& topo, const CollectiveCall& call) {
  const std::optional<std::string> err = check_call(topo, rank_, call);
  if (!err) return false;
  fail(Outcome::kError,
       fmt::format("{} on the {} group: src not in group", op_name(call.op),
                   group_kind_name(call.group.kind)),
       *err);
  return true;
}

namespace {
std::string call_title(const CollectiveCall& call) {
  return call.microbatch >= 0 ? fmt::format("{} ({}, micro-batch {})", op_name(call.op),
                                            call.purpose, call.microbatch)
                              : fmt::format("{} ({})", op_name(call.op), call.purpose);
}
}  // namespace

void RankProgram::block(const CollectiveCall& call, int seq, const std::string& detail) {
  fail(Outcome::kBlocked,
       fmt::format("in {} on the {} group, collective #{} there", call_title(call),
                   group_kind_name(call.group.kind), seq),
       detail);
}

void RankProgram::mismatch(const CollectiveCall& call, int seq, const std::string& detail) {
  fail(Outcome::kMismatch,
       fmt::format("collective #{} on the {} group does not match (this rank: {})", seq,
                   group_kind_name(call.group.kind), call_title(call)),
       detail);
}

RankResult RankProgram::result() const {
  RankResult r;
  r.rank = rank_;
  r.skip = skip_;
  r.optimizer_stepped = optimizer_;
  r.scheduler_stepped =
      optimizer_;  // the LR scheduler steps right after a successful optimizer step
  r.update_successful = optimizer_;
  r.unsynced_gradients = optimizer_ && unsynced_ && in_->topo.group_size(GroupKind::kDpCp) > 1;
  if (skip_ && *skip_ && !nan_skip_) r.grad_norm = 0.0;
  std::vector<std::string> notes;
  if (own_flag_ >= 0 && bcast_src_ >= 0 && flag_ != own_flag_) {
    notes.push_back(fmt::format(
        "received skip flag {} from rank {} (pipeline stage {}), but its own token count said {}",
        flag_, bcast_src_, in_->topo.coord(bcast_src_).pp, own_flag_ ? "skip" : "step"));
  }
  if (backward_skipped_ > 0) {
    notes.push_back(fmt::format("skipped the backward of {} of its {} micro-batch(es)",
                                backward_skipped_, mb_total_));
  }
  if (parts_.loop == Loop::kCountMax && mb_total_ > local_mb_) {
    notes.push_back(
        fmt::format("ran {} dummy micro-batch(es) after its {}", mb_total_ - local_mb_, local_mb_));
  }
  if (in_->nan_rank(rank_)) notes.push_back("its own gradient is non-finite (--nan-ranks)");
  if (phase_ == Phase::kFailed) {
    r.outcome = failed_outcome_;
    r.summary =
        summary_ + (skip_ ? fmt::format(" (after deciding to {})", *skip_ ? "skip" : "step") : "");
    r.detail = detail_;
  } else {
    LG_CHECK(phase_ == Phase::kDone && skip_, "rank {}: result() before the program finished",
             rank_);
    r.outcome = *skip_ ? Outcome::kSkip : Outcome::kStep;
    r.summary = !*skip_     ? "optimizer and LR scheduler stepped"
                : nan_skip_ ? "optimizer and LR scheduler not called (non-finite gradient)"
                            : "optimizer and LR scheduler not called";
    if (!*skip_ && (dense_nonfinite_ || expert_nonfinite_ || norm_nonfinite_)) {
      r.summary += " with a non-finite gradient";
    }
    if (r.unsynced_gradients) {
      r.summary += " with gradients no DDP all-reduce followed (DP replicas diverge)";
    }
  }
  if (!notes.empty() && notes.front().rfind("received", 0) == 0)
    r.summary += " (wrong flag received)";
  for (const auto& n : notes) r.detail = r.detail.empty() ? n : r.detail + "; " + n;
  return r;
}

std::vector<GroupKind> group_kinds_used(const ReplayInputs& in) {
  std::vector<GroupKind> kinds = {GroupKind::kWorld, GroupKind::kDpCp, GroupKind::kPp,
                                  GroupKind::kMp};
  const ProtocolParts parts = protocol_parts(in.protocol);
  if (parts.loop == Loop::kCountMax) kinds.push_back(GroupKind::kDp);
  if (parts.flag_broadcast && std::find(kinds.begin(), kinds.end(), in.flag_group) == kinds.end()) {
    kinds.push_back(in.flag_group);
  }
  if (in.topo.ep() > 1) {
    kinds.insert(kinds.end(), {GroupKind::kEp, GroupKind::kEdp, GroupKind::kEmp});
  }
  return kinds;
}

std::optional<std::string> check_call(const Topology& t, int64_t /*rank*/,
                                      const CollectiveCall& call) {
  if (call.op != Op::kBroadcast) return std::nullopt;
  if (t.index_in_group(call.group, call.src) < 0) {
    return fmt::format("broadcast src = {} is not in its {} (torch.distributed: src not in group)",
                       call.src, t.describe(call.group));
  }
  return std::nullopt;
}

}  // namespace lossguard::oracle
