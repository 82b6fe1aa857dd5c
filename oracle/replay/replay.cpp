// The collective simulator, the verdict from per-rank outcomes, the loss metric (SPEC §7, §6).
#include "oracle/replay/replay.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <limits>
#include <map>
#include <tuple>

#include "core/errors.h"
#include "core/format.h"
#include "oracle/count/metrics.h"

namespace lossguard::oracle {

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
ReplayResult simulate(const ReplayInputs& in, const IssueObserver& on_issue) {
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
    if (on_issue) on_issue(r, *call);
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

Judgement replay_judgement(const Batch& batch, const ReplayResult& result,
                           const std::optional<ReplayMetrics>& metrics) {
  if (batch.num_samples() == 0) return samples_judgement(batch);
  return Judgement::verified(result.wrong_decision, result.fault || (metrics && metrics->faults()));
}

}  // namespace lossguard::oracle
