// Skip-decision protocols, the step model and the collective simulator (SPEC §7).
#include "oracle/replay.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <map>
#include <unordered_map>

#include "core/errors.h"

namespace lossguard::oracle {

const char* protocol_name(Protocol p) {
  switch (p) {
    case Protocol::kPr285:
      return "pr285";
    case Protocol::kPr285SrcLocal:
      return "pr285-src-local";
    case Protocol::kPr285AlwaysBroadcast:
      return "pr285-always-broadcast";
    case Protocol::kValues0:
      return "values0";
    case Protocol::kNoSkip:
      return "no-skip";
  }
  return "?";
}

const std::vector<Protocol>& all_protocols() {
  static const std::vector<Protocol> kAll = {Protocol::kPr285, Protocol::kPr285SrcLocal,
                                             Protocol::kPr285AlwaysBroadcast, Protocol::kValues0,
                                             Protocol::kNoSkip};
  return kAll;
}

bool parse_protocol(const std::string& s, Protocol* out) {
  for (Protocol p : all_protocols()) {
    if (s == protocol_name(p)) {
      *out = p;
      return true;
    }
  }
  return false;
}

const char* reduce_mode_name(ReduceMode m) {
  return m == ReduceMode::kPerToken ? "per-token" : "sample-mean";
}

const char* op_name(Op op) {
  switch (op) {
    case Op::kAllReduceSum:
      return "all_reduce";
    case Op::kBroadcast:
      return "broadcast";
    case Op::kBarrier:
      return "barrier";
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
  in.microbatches = placement.empty() ? 1 : static_cast<int64_t>(placement[0].size());
  const int64_t cp = topo.cp();
  const OwnedCounts counts = count_owned_tokens(batch, {cp}, layout);
  in.global_tokens = global_denominator(Policy::kFixed, counts, 0);
  in.local_tokens.assign(static_cast<std::size_t>(topo.dp() * cp), 0);
  in.local_samples.assign(static_cast<std::size_t>(topo.dp() * cp), 0);
  for (int64_t d = 0; d < topo.dp(); ++d) {
    for (const auto& micro : placement[d]) {
      for (int64_t i : micro) {
        for (int64_t r = 0; r < cp; ++r) {
          const auto k = static_cast<std::size_t>(i);
          in.local_tokens[d * cp + r] +=
              policy_rank_count(policy, counts.count(0, k, r), counts.mask_sums[k], cp);
          in.local_samples[d * cp + r] += 1;
        }
      }
    }
  }
  return in;
}

RankProgram::RankProgram(const ReplayInputs* in, int64_t rank) : in_(in), rank_(rank) {}

std::optional<CollectiveCall> RankProgram::next() {
  const Topology& t = in_->topo;
  while (true) {
    switch (phase_) {
      case Phase::kStart: {
        if (in_->protocol == Protocol::kNoSkip) {  // Megatron baseline: no decision is ever made
          phase_ = Phase::kDecide;
          continue;
        }
        const Coord c = t.coord(rank_);
        if (c.pp != t.pp() - 1) {  // only the last stage computes loss and counts tokens
          phase_ = Phase::kBroadcast;
          continue;
        }
        const auto idx = static_cast<std::size_t>(c.dp * t.cp() + c.cp);
        const bool sample_count =
            in_->protocol == Protocol::kValues0 && in_->reduce == ReduceMode::kSampleMean;
        phase_ = Phase::kAfterCount;
        return CollectiveCall{
            Op::kAllReduceSum, t.group_of(GroupKind::kDpCp, rank_), -1,
            sample_count ? in_->local_samples[idx] : in_->local_tokens[idx],
            in_->protocol == Protocol::kValues0 ? "sum of values[0]" : "effective token count"};
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
        return CollectiveCall{Op::kBroadcast, t.group_of(GroupKind::kPp, rank_), bcast_src_, flag_,
                              "skip flag"};
      }
      case Phase::kDecide:
        skip_ = in_->protocol != Protocol::kNoSkip && flag_ != 0;
        phase_ = *skip_ ? Phase::kBarrier : Phase::kOptimizer;
        continue;
      case Phase::kOptimizer:  // optimizer.step(): the grad-norm all-reduce over the model-parallel
                               // group
        phase_ = Phase::kAfterOptimizer;
        return CollectiveCall{Op::kAllReduceSum, t.group_of(GroupKind::kMp, rank_), -1, 0,
                              "grad_norm"};
      case Phase::kBarrier:  // every rank enters the next step
        phase_ = Phase::kAfterBarrier;
        return CollectiveCall{Op::kBarrier, GroupRef{GroupKind::kWorld, 0}, -1, 0, "next step"};
      case Phase::kDone:
      case Phase::kFailed:
        return std::nullopt;
      default:
        LG_CHECK(false, "rank {}: next() while waiting for a collective", rank_);
    }
  }
}

void RankProgram::complete(int64_t result) {
  switch (phase_) {
    case Phase::kAfterCount:
      own_flag_ = flag_ = result == 0 ? 1 : 0;
      phase_ = Phase::kBroadcast;
      break;
    case Phase::kAfterBroadcast:
      flag_ = result;
      phase_ = Phase::kDecide;
      break;
    case Phase::kAfterOptimizer:
      optimizer_ = true;
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

void RankProgram::block(const CollectiveCall& call, int seq, const std::string& detail) {
  fail(Outcome::kBlocked,
       fmt::format("in {} ({}) on the {} group, collective #{} there", op_name(call.op),
                   call.purpose, group_kind_name(call.group.kind), seq),
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
  if (skip_ && *skip_) r.grad_norm = 0.0;
  std::string flag_note;
  if (own_flag_ >= 0 && bcast_src_ >= 0 && flag_ != own_flag_) {
    flag_note = fmt::format(
        "received skip flag {} from rank {} (pipeline stage {}), but its own token count said {}",
        flag_, bcast_src_, in_->topo.coord(bcast_src_).pp, own_flag_ ? "skip" : "step");
  }
  if (phase_ == Phase::kFailed) {
    r.outcome = failed_outcome_;
    r.summary =
        summary_ + (skip_ ? fmt::format(" (after deciding to {})", *skip_ ? "skip" : "step") : "");
    r.detail = detail_;
  } else {
    LG_CHECK(phase_ == Phase::kDone && skip_, "rank {}: result() before the program finished",
             rank_);
    r.outcome = *skip_ ? Outcome::kSkip : Outcome::kStep;
    r.summary =
        *skip_ ? "optimizer and LR scheduler not called" : "optimizer and LR scheduler stepped";
  }
  if (!flag_note.empty()) {
    r.summary += " (wrong flag received)";
    r.detail = r.detail.empty() ? flag_note : r.detail + "; " + flag_note;
  }
  return r;
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
  std::vector<int64_t> drift, lost, faulted;
  for (const auto& r : ranks) {
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
  if (!drift.empty()) {
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
  constexpr int kKinds = 7;
  std::unordered_map<uint64_t, std::vector<Slot>> groups;
  std::vector<std::array<uint16_t, kKinds>> issued(static_cast<std::size_t>(world),
                                                   std::array<uint16_t, kKinds>{});
  struct Wait {
    GroupRef group;
    uint16_t seq = 0;
  };
  std::vector<Wait> waiting(static_cast<std::size_t>(world));
  auto key_of = [](const GroupRef& g) {
    return (static_cast<uint64_t>(g.kind) << 48) | static_cast<uint64_t>(g.id);
  };

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
    const uint16_t seq = issued[r][kind]++;
    auto& slots = groups[key_of(call->group)];
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
    for (const auto& c : s.calls) match &= c.op == first.op && c.src == first.src;
    if (!match) {
      std::vector<std::string> seen;
      for (int64_t m = 0; m < size; ++m) {
        const auto& c = s.calls[m];
        const std::string what =
            c.op == Op::kBroadcast ? fmt::format("broadcast(src={})", c.src) : op_name(c.op);
        if (std::find(seen.begin(), seen.end(), what) == seen.end()) seen.push_back(what);
      }
      const std::string detail = fmt::format("collective #{} on {}: members issued {}", seq + 1,
                                             t.describe(call->group), fmt::join(seen, " / "));
      for (int64_t m = 0; m < size; ++m) {
        progs[t.member(call->group, m)].fail(
            Outcome::kMismatch,
            fmt::format("collective #{} on the {} group does not match", seq + 1,
                        group_kind_name(call->group.kind)),
            detail);
      }
    } else {
      int64_t result = 0;
      if (first.op == Op::kAllReduceSum) {
        for (const auto& c : s.calls) result += c.value;
      } else if (first.op == Op::kBroadcast) {
        result = s.calls[t.index_in_group(call->group, first.src)].value;
      }
      for (int64_t m = 0; m < size; ++m) {
        const int64_t member = t.member(call->group, m);
        progs[member].complete(result);
        work.push_back(member);
      }
    }
    s.calls = {};
    s.present = {};
  }

  std::vector<RankResult> results;
  results.reserve(static_cast<std::size_t>(world));
  for (int64_t r = 0; r < world; ++r) {
    if (!progs[r].finished()) {
      const Wait& w = waiting[r];
      Slot& s = groups[key_of(w.group)][w.seq];
      std::vector<int64_t> missing;
      for (int64_t m = 0; m < static_cast<int64_t>(s.present.size()); ++m) {
        if (!s.present[m]) missing.push_back(t.member(w.group, m));
      }
      const CollectiveCall& mine = s.calls[t.index_in_group(w.group, r)];
      progs[r].block(mine, w.seq + 1,
                     fmt::format("waiting in {} for rank(s) {} that never issue it",
                                 t.describe(w.group), format_rank_set(missing, 4)));
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

}  // namespace lossguard::oracle
