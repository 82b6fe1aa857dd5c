// Skip-decision protocols, the step model and the collective simulator (SPEC §7).
#include "oracle/replay.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <limits>
#include <map>
#include <tuple>

#include "core/errors.h"
#include "oracle/metrics.h"

namespace lossguard::oracle {

const char* protocol_description(Protocol p) {
  switch (p) {
    case Protocol::kPr285:
      return "token count all-reduced over DP+CP, flag broadcast from the pipeline last rank "
             "(Relax "
             "after PR #285; correct)";
    case Protocol::kPr285SrcLocal:
      return "as pr285, broadcast src = PP-1: a stage index used as a global rank";
    case Protocol::kPr285AlwaysBroadcast:
      return "as pr285-src-local, broadcasting even when PP = 1";
    case Protocol::kValues0:
      return "decides on values[0]: a sample count when per-token loss is off";
    case Protocol::kNoSkip:
      return "never skips (Megatron baseline)";
    case Protocol::kMicrobatchSkip:
      return "a micro-batch skips its backward when its count all-reduced over DP+CP is 0 "
             "(correct, unless that backward is the one issuing the gradient all-reduce)";
    case Protocol::kMicrobatchSkipLocal:
      return "a micro-batch skips its backward when this rank's own count is 0 (the DDP gradient "
             "all-reduce is then issued by some ranks only)";
    case Protocol::kMicrobatchesMax:
      return "micro-batch count all-reduced (MAX) over DP, dummy micro-batches counting 0 tokens "
             "pad the lighter ranks (Relax __is_dummy__; correct)";
    case Protocol::kMicrobatchesLocal:
      return "every DP rank runs the micro-batches it has (the lighter rank leaves early)";
    case Protocol::kNanSkip:
      return "skip when the grad norm, all-reduced over the model-parallel group, is not finite "
             "(Megatron; correct)";
    case Protocol::kNanSkipLocal:
      return "skip when this rank's own gradient is not finite, before the norm's all-reduce";
    case Protocol::kNanSkipRank0:
      return "rank 0 checks its own gradient and broadcasts the decision";
    case Protocol::kFlagBroadcast:
      return "as pr285, the flag also broadcast on --flag-group from dist.get_global_rank(group, "
             "0) "
             "(correct)";
    case Protocol::kFlagBroadcastSrcLocal:
      return "as flag-broadcast with src = 0: a group-local index used as a global rank";
  }
  return "?";
}

ProtocolParts protocol_parts(Protocol p) {
  switch (p) {
    case Protocol::kMicrobatchSkip:
      return {Loop::kSkipGlobal, NanCheck::kNone, false};
    case Protocol::kMicrobatchSkipLocal:
      return {Loop::kSkipLocal, NanCheck::kNone, false};
    case Protocol::kMicrobatchesMax:
      return {Loop::kCountMax, NanCheck::kNone, false};
    case Protocol::kMicrobatchesLocal:
      return {Loop::kCountLocal, NanCheck::kNone, false};
    case Protocol::kNanSkip:
      return {Loop::kPlain, NanCheck::kAfterAllReduce, false};
    case Protocol::kNanSkipLocal:
      return {Loop::kPlain, NanCheck::kLocal, false};
    case Protocol::kNanSkipRank0:
      return {Loop::kPlain, NanCheck::kRank0, false};
    case Protocol::kFlagBroadcast:
    case Protocol::kFlagBroadcastSrcLocal:
      return {Loop::kNone, NanCheck::kNone, true};
    default:
      return {};
  }
}

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

std::vector<int64_t> parse_rank_list(const std::string& text, int64_t world) {
  std::vector<int64_t> ranks;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(pos, end - pos);
    long long lo = 0, hi = 0;
    char extra = 0;
    if (std::sscanf(item.c_str(), "%lld-%lld%c", &lo, &hi, &extra) == 2) {
    } else if (std::sscanf(item.c_str(), "%lld%c", &lo, &extra) == 1) {
      hi = lo;
    } else {
      throw_input_error("--nan-ranks: '{}' is not a rank or a range A-B (in '{}')", item, text);
    }
    if (lo < 0 || hi >= world || lo > hi) {
      throw_input_error("--nan-ranks: '{}' is outside the world's ranks 0-{}", item, world - 1);
    }
    for (long long r = lo; r <= hi; ++r) ranks.push_back(r);
    pos = end + 1;
  }
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  return ranks;
}

std::string format_rank_set(const std::vector<int64_t>& r, std::size_t max_runs) {
  std::vector<std::string> runs;
  std::size_t i = 0, shown = 0;
  while (i < r.size()) {
    std::size_t j = i + 1;
    if (j < r.size()) {
      const int64_t step = r[j] - r[i];
      while (j + 1 < r.size() && r[j + 1] - r[j] == step) ++j;
      if (j - i + 1 >= 3) {
        if (shown < max_runs) {
          runs.push_back(step == 1 ? fmt::format("{}-{}", r[i], r[j])
                                   : fmt::format("{}-{} step {}", r[i], r[j], step));
        }
        ++shown;
        i = j + 1;
        continue;
      }
    }
    if (shown < max_runs) runs.push_back(std::to_string(r[i]));
    ++shown;
    ++i;
  }
  std::string s = fmt::format("{}", fmt::join(runs, ", "));
  if (shown > max_runs) s += ", ...";
  return s;
}

ReplayResult summarize(const ReplayInputs& in, std::vector<RankResult> ranks) {
  ReplayResult out;
  out.expected_skip = in.expected_skip();
  out.global_tokens = in.global_tokens;
  out.expected_reason = in.global_tokens == 0   ? "no effective tokens"
                        : !in.nan_ranks.empty() ? fmt::format("a non-finite gradient on rank(s) {}",
                                                              format_rank_set(in.nan_ranks))
                                                : "";
  std::vector<int64_t> drift, lost, faulted, unsynced;
  for (const auto& r : ranks) {
    if (r.unsynced_gradients) unsynced.push_back(r.rank);
    if (r.outcome == Outcome::kError || r.outcome == Outcome::kBlocked ||
        r.outcome == Outcome::kMismatch) {
      out.fault = true;
      faulted.push_back(r.rank);
    }
    if (r.skip && *r.skip != out.expected_skip) {
      out.wrong_decision = true;
      (*r.skip ? lost : drift).push_back(r.rank);
    }
  }
  if (!drift.empty() && in.global_tokens != 0) {  // expected to skip for a non-finite gradient
    out.findings.push_back(
        {"nonfinite_step",
         fmt::format(
             "{} rank(s) ({}) decided to run optimizer.step() although the global grad norm is not "
             "finite ({}): NaN or Inf reaches the weights and the Adam moments",
             drift.size(), format_rank_set(drift), out.expected_reason),
         {{"ranks", drift.size()}, {"rank_set", format_rank_set(drift, 64)}}});
  } else if (!drift.empty()) {
    out.findings.push_back(
        {"parameter_drift",
         fmt::format("{} rank(s) ({}) decided to run optimizer.step() on a zero-token batch: Adam "
                     "moments and weight "
                     "decay move the weights and the LR scheduler advances with no training signal",
                     drift.size(), format_rank_set(drift)),
         {{"ranks", drift.size()}, {"rank_set", format_rank_set(drift, 64)}}});
  }
  if (!lost.empty()) {
    out.findings.push_back(
        {"lost_step",
         fmt::format("{} rank(s) ({}) skipped a step that had {} effective tokens", lost.size(),
                     format_rank_set(lost), in.global_tokens),
         {{"ranks", lost.size()}, {"rank_set", format_rank_set(lost, 64)}}});
  }
  if (!unsynced.empty()) {
    out.wrong_decision = true;
    out.findings.push_back(
        {"unsynced_gradients",
         fmt::format("{} rank(s) ({}) stepped with gradients of a backward that no DDP all-reduce "
                     "followed (the last micro-batch's backward was skipped, and it is the one "
                     "that issues the all-reduce): DP replicas diverge silently",
                     unsynced.size(), format_rank_set(unsynced)),
         {{"ranks", unsynced.size()}, {"rank_set", format_rank_set(unsynced, 64)}}});
  }
  if (!faulted.empty()) {
    out.findings.push_back(
        {"distributed_fault",
         fmt::format(
             "{} rank(s) ({}) errored, blocked or mismatched: a real job would crash or hang",
             faulted.size(), format_rank_set(faulted)),
         {{"ranks", faulted.size()}, {"rank_set", format_rank_set(faulted, 64)}}});
  }
  out.ranks = std::move(ranks);
  return out;
}

// Long: the simulator's event loop: issue every rank's next call, match calls per group, complete,
// block or mismatch them, until every rank finished or none can move.
ReplayResult simulate(const ReplayInputs& in) {
  const Topology& t = in.topo;
  const int64_t world = t.world();
  std::vector<RankProgram> progs;
  progs.reserve(static_cast<std::size_t>(world));
  for (int64_t r = 0; r < world; ++r) progs.emplace_back(&in, r);

  struct Slot {
    int64_t arrived = 0;
    std::vector<CollectiveCall> calls;
    std::vector<uint8_t> present;
  };
  constexpr int kKinds = kNumGroupKinds;
  // slots[kind][group id][seq]: the seq-th collective issued on that group.
  std::array<std::vector<std::vector<Slot>>, kKinds> slots_of;
  for (int k = 0; k < kKinds; ++k) {
    slots_of[k].resize(static_cast<std::size_t>(t.num_groups(static_cast<GroupKind>(k))));
  }
  auto slots_for = [&](const GroupRef& g) -> std::vector<Slot>& {
    return slots_of[static_cast<int>(g.kind)][static_cast<std::size_t>(g.id)];
  };
  std::vector<std::array<uint32_t, kKinds>> issued(static_cast<std::size_t>(world),
                                                   std::array<uint32_t, kKinds>{});
  struct Wait {
    GroupRef group;
    uint32_t seq = 0;
  };
  std::vector<Wait> waiting(static_cast<std::size_t>(world));

  std::vector<int64_t> work(static_cast<std::size_t>(world));
  for (int64_t r = 0; r < world; ++r) work[r] = world - 1 - r;
  while (!work.empty()) {
    const int64_t r = work.back();
    work.pop_back();
    RankProgram& prog = progs[r];
    std::optional<CollectiveCall> call = prog.next();
    if (!call) continue;
    if (prog.reject(t, *call)) continue;
    const int kind = static_cast<int>(call->group.kind);
    const uint32_t seq = issued[r][kind]++;
    auto& slots = slots_for(call->group);
    if (slots.size() <= seq) slots.resize(seq + 1u);
    Slot& s = slots[seq];
    const int64_t size = t.group_size(call->group.kind);
    if (s.calls.empty()) {
      s.calls.resize(static_cast<std::size_t>(size));
      s.present.assign(static_cast<std::size_t>(size), 0);
    }
    const int64_t idx = t.index_in_group(call->group, r);
    s.calls[idx] = *call;
    s.present[idx] = 1;
    waiting[r] = {call->group, seq};
    if (++s.arrived < size) continue;
    // Every member issued its seq-th collective on this group: match them.
    const CollectiveCall& first = s.calls[0];
    bool match = true;
    for (const auto& c : s.calls) {
      match &= c.op == first.op && c.src == first.src && c.payload == first.payload;
    }
    if (!match) {
      std::vector<std::string> seen;
      for (int64_t m = 0; m < size; ++m) {
        const auto& c = s.calls[m];
        std::string what = c.op == Op::kBroadcast ? fmt::format("broadcast(src={})", c.src)
                                                  : std::string(op_name(c.op));
        if (c.payload != Payload::kNone) what += fmt::format(" of {}", payload_name(c.payload));
        if (std::find(seen.begin(), seen.end(), what) == seen.end()) seen.push_back(what);
      }
      const std::string detail = fmt::format("collective #{} on {}: members issued {}", seq + 1,
                                             t.describe(call->group), fmt::join(seen, " / "));
      for (int64_t m = 0; m < size; ++m) {
        progs[t.member(call->group, m)].mismatch(s.calls[m], static_cast<int>(seq + 1), detail);
      }
    } else {
      int64_t result = 0;
      bool nonfinite = false;
      if (first.op == Op::kAllReduceSum || first.op == Op::kAllToAll) {
        for (const auto& c : s.calls) {
          result += c.value;
          nonfinite = nonfinite || c.nonfinite;
        }
      } else if (first.op == Op::kAllReduceMax) {
        result = first.value;
        for (const auto& c : s.calls) {
          result = std::max(result, c.value);
          nonfinite = nonfinite || c.nonfinite;
        }
      } else if (first.op == Op::kBroadcast) {
        const auto& root = s.calls[t.index_in_group(call->group, first.src)];
        result = root.value;
        nonfinite = root.nonfinite;
      }
      for (int64_t m = 0; m < size; ++m) {
        const int64_t member = t.member(call->group, m);
        progs[member].complete(result, nonfinite);
        work.push_back(member);
      }
    }
    s.calls = {};
    s.present = {};
  }

  std::vector<RankResult> results;
  results.reserve(static_cast<std::size_t>(world));
  std::map<std::tuple<int, int64_t, uint32_t>, std::string> blocked_text;
  for (int64_t r = 0; r < world; ++r) {
    if (!progs[r].finished()) {
      const Wait& w = waiting[r];
      Slot& s = slots_for(w.group)[w.seq];
      // Every waiter of a slot shares its text: computed once per slot, not once per waiter (a
      // world barrier has 131,072 members).
      auto [it, fresh] =
          blocked_text.try_emplace({static_cast<int>(w.group.kind), w.group.id, w.seq});
      if (fresh) {
        std::vector<int64_t> missing;
        for (int64_t m = 0; m < static_cast<int64_t>(s.present.size()); ++m) {
          if (!s.present[m]) missing.push_back(t.member(w.group, m));
        }
        it->second = fmt::format("waiting in {} for rank(s) {} that never issue it",
                                 t.describe(w.group), format_rank_set(missing, 4));
      }
      const CollectiveCall& mine = s.calls[t.index_in_group(w.group, r)];
      progs[r].block(mine, static_cast<int>(w.seq + 1), it->second);
    }
    results.push_back(progs[r].result());
  }
  return summarize(in, std::move(results));
}

}  // namespace lossguard::oracle

namespace lossguard::oracle {

std::optional<std::vector<double>> loss_metric_values(const Batch& b, ReduceMode reduce,
                                                      int64_t global_tokens) {
  const HostArray* loss = nullptr;
  double sign = 1.0;
  if (auto it = b.per_token.find("token_loss"); it != b.per_token.end()) {
    loss = &it->second;
  } else if (auto lp = b.per_token.find("log_probs"); lp != b.per_token.end()) {
    loss = &lp->second;
    sign = -1.0;
  }
  if (loss == nullptr) return std::nullopt;
  double numerator = 0.0;
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    double sample = 0.0;
    int64_t m = 0;
    for (int64_t j = b.response_offsets[i]; j < b.response_offsets[i + 1]; ++j) {
      if (b.loss_mask[j]) {
        sample += sign * loss->get_f64(j);
        ++m;
      }
    }
    numerator += reduce == ReduceMode::kPerToken
                     ? sample
                     : sample / static_cast<double>(std::max<int64_t>(m, 1));
  }
  const double denominator = reduce == ReduceMode::kPerToken ? static_cast<double>(global_tokens)
                                                             : static_cast<double>(b.num_samples());
  return std::vector<double>{denominator, numerator};
}

std::string ReplayResult::wrong_decision_message() const {
  if (!wrong_decision) return "";
  std::string out;
  for (const auto& f : findings) {
    if (f.kind == "parameter_drift" || f.kind == "lost_step" || f.kind == "nonfinite_step" ||
        f.kind == "unsynced_gradients")
      out += (out.empty() ? "" : "; ") + f.message;
  }
  return out;
}

std::string ReplayResult::fault_message() const {
  if (!fault) return "";
  std::string out;
  for (const auto& f : findings) {
    if (f.kind == "distributed_fault") out = f.message;
  }
  return out;
}

std::vector<Finding> ReplayMetrics::findings() const {
  if (!faults()) return {};
  return {{"metrics_fail_fast", error, nlohmann::json::object()}};
}

std::optional<ReplayMetrics> replay_metrics(const Batch& b, ReduceMode reduce,
                                            int64_t global_tokens) {
  auto values = loss_metric_values(b, reduce, global_tokens);
  if (!values) return std::nullopt;
  ReplayMetrics m;
  m.values = std::move(*values);
  try {
    const NormalizedMetrics n = normalize_metrics(m.values, {"loss"});
    m.loss = n.values[0].second;
    m.no_signal = n.no_signal;
  } catch (const MetricsError& e) {
    m.error = e.what();
  }
  return m;
}

}  // namespace lossguard::oracle
