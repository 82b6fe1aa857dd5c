// What `postmortem` prints (postmortem_report.h), composed once from the analysis under the
// options: each divergence's line, the blamed ranks grouped by their last call, the calls the
// issuers and a cycle's sides wait in, found in their dumps, and the frames shown of each. The
// renderers (cli/postmortem_render.cpp) only read it.
#include "oracle/postmortem/postmortem_report.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <tuple>

#include "core/format.h"
#include "core/printable.h"

namespace lossguard::oracle {

const char* call_state_name(FrState s) {
  switch (s) {
    case FrState::kScheduled:
      return "scheduled";
    case FrState::kStarted:
      return "started";
    case FrState::kCompleted:
      return "completed";
    case FrState::kOther:
      break;
  }
  return "other";
}

namespace {

// The text's pieces: a group, a call's payload, a call, each escaped where it came from a dump.
std::string group_text(const FrJob& job, uint32_t g) {
  const FrGroup& group = job.groups[g];
  std::string desc = group.desc.empty() || group.desc == "undefined" ? "" : group.desc + ", ";
  return fmt::format("group '{}' ({}{} {}{})", printable(group.name), printable(desc),
                     group.members.size(), group.members.size() == 1 ? "rank" : "ranks",
                     group.members.empty() ? "" : ": " + format_rank_set(group.members, 4)) +
         (group.members_inferred ? "*" : "");
}

std::string payload_text(const FrSignature& s) {
  if (s.input_sizes.empty()) return "";
  return printable(fmt::format(" {}{}", fmt::join(s.input_dtypes, ","), s.input_sizes));
}

std::string call_text(const FrJob& job, const FrCall& c) {
  const FrSignature& s = job.signatures[c.signature];
  return fmt::format(
      "{} #{} on {}{}",
      printable(c.is_p2p ? s.profiling_name.substr(s.profiling_name.rfind(':') + 1) : s.op), c.seq,
      group_text(job, c.group), payload_text(s));
}

// A divergence in one line (Divergence::summary).
std::string headline(const FrJob& job, const Divergence& d) {
  const FrSignature& s = job.signatures[d.signature];
  switch (d.kind) {
    case DivergenceKind::kMissingCall:
      if (d.pending) {
        return fmt::format(
            "{} issued {} #{} on {}; it never completed{}", ranks_phrase(d.issued), printable(s.op),
            d.seq, group_text(job, d.group),
            d.no_dump.empty() ? "" : fmt::format(" ({} left no dump)", ranks_phrase(d.no_dump)));
      }
      return fmt::format("{} issued {} #{} on {}; {} never did", ranks_phrase(d.issued),
                         printable(s.op), d.seq, group_text(job, d.group),
                         ranks_phrase(d.not_issued));
    case DivergenceKind::kMismatch: {
      std::vector<std::string> parts;
      for (const auto& [sig, ranks] : d.variants)
        parts.push_back(fmt::format("{} {}{}", ranks_phrase(ranks),
                                    printable(job.signatures[sig].op),
                                    payload_text(job.signatures[sig])));
      return fmt::format("call #{} on {} differs between members ({}): {}", d.seq,
                         group_text(job, d.group), printable(d.detail), fmt::join(parts, " / "));
    }
    case DivergenceKind::kSendWithoutRecv:
      return fmt::format("rank {} sent ({}) on {}; rank {} never posted the receive",
                         d.issued.front(), printable(s.profiling_name), group_text(job, d.group),
                         d.not_issued.front());
    case DivergenceKind::kRecvWithoutSend:
      return fmt::format("rank {} waits to receive ({}) on {}; rank {} never sent",
                         d.issued.front(), printable(s.profiling_name), group_text(job, d.group),
                         d.not_issued.front());
  }
  return "";
}

// The frames of a stack the text shows: the job's own first (the torch.distributed wrappers every
// call passes through say nothing about where the job was), at most `max`.
std::vector<std::size_t> shown_frames(const FrJob& job, uint32_t stack, int64_t max) {
  std::vector<std::size_t> mine, all;
  const std::vector<FrFrame>& frames = job.stacks[stack];
  for (std::size_t k = 0; k < frames.size(); ++k) {
    all.push_back(k);
    if (frames[k].filename.find("/torch/") == std::string::npos) mine.push_back(k);
  }
  std::vector<std::size_t> use = mine.empty() ? std::move(all) : std::move(mine);
  const auto keep = static_cast<std::size_t>(std::max<int64_t>(max, 0));
  if (use.size() > keep) use.resize(keep);
  return use;
}

ShownCall shown(const FrJob& job, const FrCall& c, const PostmortemOptions& o) {
  return ShownCall{c, shown_frames(job, c.stack, o.frames)};
}

const FrRankDump* dump_of(const FrJob& job, int64_t rank) {
  auto it = std::lower_bound(job.ranks.begin(), job.ranks.end(), rank,
                             [](const FrRankDump& d, int64_t r) { return d.rank < r; });
  return it != job.ranks.end() && it->rank == rank ? &*it : nullptr;
}

// `rank`'s collective numbered `seq` on `group`, the first its dump recorded, or nullptr.
const FrCall* collective_of(const FrJob& job, int64_t rank, uint32_t group, int64_t seq) {
  const FrRankDump* d = dump_of(job, rank);
  if (d == nullptr) return nullptr;
  for (const auto& c : d->calls) {
    if (!c.is_p2p && c.group == group && c.seq == seq) return &c;
  }
  return nullptr;
}

// A call's state as the dump says it: its own field, its retirement or pg_status (Gloo's
// entries all read "scheduled").
std::string state_text(const FrRankDump& d, const FrCall& c) {
  if (c.state == FrState::kCompleted) return "completed";
  if (d.finished(c)) return c.retired ? "retired: completed or failed" : "completed (pg_status)";
  // Gloo leaves a call "scheduled" until the recorder retires it, which can come after a dump
  // taken right after the call returned: not retired is not pending.
  return c.state == FrState::kScheduled ? "scheduled, not retired" : call_state_name(c.state);
}

// What a blamed rank last did, as its line reads it: ranks alike share one line, which shows the
// first one's state and frames. Lines in the order of their call's text; ranks without a call last.
struct LastCallKey {
  bool none = false;  // no call recorded, or no dump
  std::string call;   // call_text
  bool unmatched = false;
  uint32_t stack = 0;
  bool completed = false;  // the call's own state
  bool operator<(const LastCallKey& o) const {
    return std::tie(none, call, unmatched, stack, completed) <
           std::tie(o.none, o.call, o.unmatched, o.stack, o.completed);
  }
};

void compose_blamed(PostmortemResult& r, const PostmortemOptions& o) {
  const FrJob& job = r.job;
  const Divergence& d = r.divergences.front();
  std::map<LastCallKey, LastCallGroup> lines;
  for (int64_t rank : d.not_issued) {
    const RankState& s = r.ranks[static_cast<std::size_t>(rank)];
    const FrRankDump* dump = dump_of(job, rank);
    const FrCall* c = dump != nullptr && s.last_call ? &dump->calls[*s.last_call] : nullptr;
    LastCallKey key{true, "", false, 0, false};
    if (c != nullptr)
      key = {false, call_text(job, *c), s.last_call_unmatched, c->stack,
             c->state == FrState::kCompleted};
    auto [it, fresh] = lines.try_emplace(std::move(key));
    LastCallGroup& g = it->second;
    g.ranks.push_back(rank);
    if (!fresh) continue;
    g.dumped = dump != nullptr;
    if (c == nullptr) continue;
    g.last_call = shown(job, *c, o);
    g.state = state_text(*dump, *c);
    g.unmatched = s.last_call_unmatched;
  }
  for (auto& [key, g] : lines) {
    const std::string who = ranks_phrase(g.ranks);
    if (!g.dumped) {
      g.summary = fmt::format("{}: left no dump", who);
    } else if (!g.last_call) {
      g.summary = fmt::format("{}: recorded no call at all", who);
    } else {
      g.summary = fmt::format(
          "{}: last call {} ({}), {}", who, key.call, g.state,
          g.unmatched ? "which some member never issued: it waits there, inside another "
                        "group's collective"
                      : "issued by every member; nothing recorded after it (it died, or hangs "
                        "outside collectives)");
    }
    r.blamed_by_last_call.push_back(std::move(g));
  }
}

// A missing call: where its issuers wait, as the first of them recorded it.
void compose_issuer(PostmortemResult& r, const PostmortemOptions& o) {
  const Divergence& d = r.divergences.front();
  if (d.kind != DivergenceKind::kMissingCall || d.issued.empty()) return;
  const FrCall* c = collective_of(r.job, d.issued.front(), d.group, d.seq);
  if (c == nullptr) return;
  r.issuer_call =
      IssuerCall{shown(r.job, *c, o), fmt::format("{} {} in it{}", ranks_phrase(d.issued),
                                                  d.issued.size() == 1 ? "waits" : "wait",
                                                  c->stack ? ", called from:" : "")};
}

// Each side of a cycle of waits: where it waits, for whom, called from where.
void compose_cycle(PostmortemResult& r, const PostmortemOptions& o) {
  if (!r.root) return;
  const FrJob& job = r.job;
  for (auto& st : r.root->cycle) {
    const Divergence& d = r.divergences[st.divergence];
    st.summary = fmt::format("rank {} waits in {} #{} on {} for {}", st.rank,
                             printable(job.signatures[d.signature].op), d.seq,
                             group_text(job, d.group), ranks_phrase(st.waits_for));
    if (const FrCall* c = collective_of(job, st.rank, d.group, d.seq)) st.call = shown(job, *c, o);
  }
}

// The first 256 culprits, each with its last call.
void compose_culprits(PostmortemResult& r) {
  for (int64_t rank : r.culprits) {
    if (r.culprit_calls.size() >= 256) break;
    const RankState& s = r.ranks[static_cast<std::size_t>(rank)];
    CulpritCall x;
    x.rank = rank;
    x.calls = s.calls;
    const FrRankDump* dump = dump_of(r.job, rank);
    if (dump != nullptr && s.last_call) {
      const FrCall& c = dump->calls[*s.last_call];
      x.last_call = c;
      x.finished = dump->finished(c);
      x.unmatched = s.last_call_unmatched;
    }
    r.culprit_calls.push_back(std::move(x));
  }
}

}  // namespace

void compose_report(PostmortemResult& r, const PostmortemOptions& options) {
  for (auto& d : r.divergences) d.summary = headline(r.job, d);
  const std::size_t others = r.divergences.empty() ? 0 : r.divergences.size() - 1;
  r.listed_divergences =
      std::min(others, static_cast<std::size_t>(std::max<int64_t>(options.listed_divergences, 0)));
  compose_culprits(r);
  if (!r.diverged()) return;
  compose_cycle(r, options);
  compose_blamed(r, options);
  compose_issuer(r, options);
}

}  // namespace lossguard::oracle
