// The alignment of recorded calls per process group, the divergences and each rank's part in them
// (SPEC §12). One pass over every rank's calls, sorted by group, at 4 bytes a call beyond the calls
// themselves.
#include "oracle/postmortem/postmortem.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <queue>
#include <set>
#include <tuple>

#include "core/errors.h"
#include "core/format.h"
#include "oracle/postmortem/postmortem_report.h"

namespace lossguard::oracle {

const char* divergence_kind_name(DivergenceKind k) {
  switch (k) {
    case DivergenceKind::kMissingCall:
      return "missing_call";
    case DivergenceKind::kMismatch:
      return "mismatch";
    case DivergenceKind::kSendWithoutRecv:
      return "send_without_recv";
    case DivergenceKind::kRecvWithoutSend:
      return "recv_without_send";
  }
  return "?";
}

const char* rank_role_name(RankRole r) {
  switch (r) {
    case RankRole::kComplete:
      return "complete";
    case RankRole::kWaiting:
      return "waiting";
    case RankRole::kCulprit:
      return "culprit";
    case RankRole::kMissing:
      return "missing";
  }
  return "?";
}

namespace {

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}
int64_t total_numel(const std::vector<std::vector<int64_t>>& shapes) {
  int64_t n = 0;
  for (const auto& s : shapes) n += numel(s);
  return n;
}

}  // namespace

std::optional<std::string> signature_difference(const FrSignature& a, const FrSignature& b) {
  if (a.op != b.op) return fmt::format("operation {} vs {}", a.op, b.op);
  // Collectives whose members may send different amounts (fr_trace's _UNEVEN_COLLECTIVES, and
  // the rooted gather/scatter whose non-roots hold no buffer).
  const bool uneven = a.op == "all_to_all" || a.op == "gather" || a.op == "scatter" ||
                      a.op == "barrier" || a.op == "coalesced";
  if (!uneven && a.op != "reduce_scatter" && a.input_sizes != b.input_sizes &&
      total_numel(a.input_sizes) != total_numel(b.input_sizes)) {
    return fmt::format("input sizes {} vs {}", a.input_sizes, b.input_sizes);
  }
  if (a.op == "reduce_scatter" && total_numel(a.output_sizes) != total_numel(b.output_sizes)) {
    return fmt::format("output sizes {} vs {}", a.output_sizes, b.output_sizes);
  }
  auto dtypes = [](const FrSignature& s) {
    std::vector<std::string> d = s.input_dtypes;
    std::sort(d.begin(), d.end());
    d.erase(std::unique(d.begin(), d.end()), d.end());
    return d;
  };
  if (a.op != "barrier" && !a.input_sizes.empty() && !b.input_sizes.empty() &&
      total_numel(a.input_sizes) > 0 && total_numel(b.input_sizes) > 0 && dtypes(a) != dtypes(b)) {
    return fmt::format("dtypes {} vs {}", dtypes(a), dtypes(b));
  }
  return std::nullopt;
}

namespace {

// Every rank's calls regrouped by process group (collectives and p2p apart), and each group's
// members with what they issued on it.
class Alignment {
 public:
  explicit Alignment(const FrJob& job) : job_(job) {
    LG_CHECK(job.world >= 0 && job.world < (int64_t{1} << 31), "world {} out of range", job.world);
    dump_of_.assign(static_cast<std::size_t>(job.world), -1);
    for (std::size_t k = 0; k < job.ranks.size(); ++k) {
      const int64_t r = job.ranks[k].rank;
      if (r >= 0 && r < job.world) dump_of_[static_cast<std::size_t>(r)] = static_cast<int64_t>(k);
    }
    order_.resize(job.ranks.size());
    ranges_.resize(job.ranks.size());
    for (std::size_t k = 0; k < job.ranks.size(); ++k) {
      const auto& calls = job.ranks[k].calls;
      auto& ord = order_[k];
      ord.resize(calls.size());
      std::iota(ord.begin(), ord.end(), 0u);
      std::stable_sort(ord.begin(), ord.end(), [&](uint32_t a, uint32_t b) {
        if (calls[a].group != calls[b].group) return calls[a].group < calls[b].group;
        return calls[a].is_p2p < calls[b].is_p2p;
      });
      for (uint32_t i = 0; i < ord.size();) {
        const FrCall& c = calls[ord[i]];
        uint32_t j = i;
        while (j < ord.size() && calls[ord[j]].group == c.group && calls[ord[j]].is_p2p == c.is_p2p)
          ++j;
        ranges_[k].push_back({c.group, c.is_p2p, i, j});
        i = j;
      }
    }
  }

  const FrJob& job() const { return job_; }
  // The dump of `rank`, or nullptr.
  const FrRankDump* dump(int64_t rank) const {
    if (rank < 0 || rank >= job_.world) return nullptr;
    const int64_t k = dump_of_[static_cast<std::size_t>(rank)];
    return k < 0 ? nullptr : &job_.ranks[static_cast<std::size_t>(k)];
  }
  // The calls `rank` issued on `group` (collectives or p2p), as indices into its calls, in order.
  std::pair<const uint32_t*, const uint32_t*> calls_on(int64_t rank, uint32_t group,
                                                       bool p2p) const {
    const int64_t k =
        rank >= 0 && rank < job_.world ? dump_of_[static_cast<std::size_t>(rank)] : -1;
    if (k < 0) return {nullptr, nullptr};
    for (const auto& r : ranges_[static_cast<std::size_t>(k)]) {
      if (r.group == group && r.p2p == p2p) {
        const uint32_t* base = order_[static_cast<std::size_t>(k)].data();
        return {base + r.begin, base + r.end};
      }
    }
    return {nullptr, nullptr};
  }

 private:
  struct Range {
    uint32_t group;
    bool p2p;
    uint32_t begin, end;
  };
  const FrJob& job_;
  std::vector<int64_t> dump_of_;
  std::vector<std::vector<uint32_t>> order_;
  std::vector<std::vector<Range>> ranges_;
};

// What each member did on one group's collectives: its first and last call numbers.
struct MemberSeqs {
  int64_t rank = 0;
  const FrRankDump* dump = nullptr;
  const uint32_t* begin = nullptr;
  const uint32_t* end = nullptr;
  int64_t first = 0, last = 0;  // 0, 0: no call
  bool unknown = false;         // no call kept, and its buffer wrapped: cannot tell
  const FrCall& call(const uint32_t* it) const { return dump->calls[*it]; }
  // Its first call numbered `seq` or later.
  const uint32_t* from(int64_t seq) const {
    return std::lower_bound(begin, end, seq,
                            [&](uint32_t i, int64_t s) { return dump->calls[i].seq < s; });
  }
  // Its call numbered `seq`, or nullptr.
  const FrCall* at(int64_t seq) const {
    const uint32_t* it = from(seq);
    return it != end && dump->calls[*it].seq == seq ? &dump->calls[*it] : nullptr;
  }
};

struct GroupView {
  std::vector<MemberSeqs> members;  // with a dump
  std::vector<int64_t> no_dump;
  int64_t min_last = 0;  // over members that can be judged
};

GroupView view_of(const Alignment& a, uint32_t g) {
  GroupView v;
  const FrGroup& group = a.job().groups[g];
  bool any = false;
  for (int64_t r : group.members) {
    const FrRankDump* d = a.dump(r);
    if (d == nullptr) {
      v.no_dump.push_back(r);
      continue;
    }
    MemberSeqs m;
    m.rank = r;
    m.dump = d;
    std::tie(m.begin, m.end) = a.calls_on(r, g, false);
    if (m.begin != m.end) {
      m.first = d->calls[*m.begin].seq;
      m.last = d->calls[*(m.end - 1)].seq;
    } else {
      m.unknown = d->wrapped;
    }
    if (!m.unknown) {
      v.min_last = any ? std::min(v.min_last, m.last) : m.last;
      any = true;
    }
    v.members.push_back(m);
  }
  return v;
}

// A pending call every member with a dump issued, on a group with members outside the dumps
// (no dump, or members unknown): the rank blocks there, and only those members can be why.
std::optional<Divergence> pending_call(const GroupView& v, uint32_t g, bool members_unknown) {
  if (v.no_dump.empty() && !members_unknown) return std::nullopt;
  Divergence d;
  d.kind = DivergenceKind::kMissingCall;
  d.group = g;
  d.pending = true;
  d.members_unknown = members_unknown;
  d.no_dump = v.no_dump;
  bool found = false;
  for (const auto& m : v.members) {
    if (m.unknown || m.begin == m.end) continue;
    const FrCall& c = m.call(m.end - 1);
    // It blocks there: its last call of all, started and never finished. Only a backend that
    // records "started" (NCCL) says so: Gloo's entries read "scheduled" until the recorder
    // retires them, which can come after a dump taken right after the call returned, so an
    // unretired Gloo call proves nothing.
    if (&c != &m.dump->calls.back() || m.dump->finished(c) || c.state != FrState::kStarted)
      continue;
    if (!found || c.time_created_ns < d.time_ns) {
      d.time_ns = c.time_created_ns;
      d.signature = c.signature;
      d.seq = c.seq;
    }
    found = true;
  }
  if (!found) return std::nullopt;
  for (const auto& m : v.members) {
    if (m.unknown || m.last < d.seq) continue;
    // A member that went on past the call (a blocking backend's later call; NCCL's states say
    // "started" where a call hangs while later ones are enqueued) saw it complete.
    // A member that finished it saw it complete (the recorder may not have retired it yet on
    // another rank when that one dumped).
    const FrCall* c = m.at(d.seq);
    if (c != nullptr &&
        (m.dump->finished(*c) || (c != &m.dump->calls.back() && c->state != FrState::kStarted)))
      return std::nullopt;
    d.issued.push_back(m.rank);
  }
  return d;
}

std::optional<Divergence> missing_call(const GroupView& v, uint32_t g, bool members_unknown) {
  int64_t max_last = 0;
  for (const auto& m : v.members) {
    if (!m.unknown) max_last = std::max(max_last, m.last);
  }
  if (v.min_last >= max_last) return pending_call(v, g, members_unknown);
  const int64_t s = v.min_last + 1;
  Divergence d;
  d.kind = DivergenceKind::kMissingCall;
  d.group = g;
  d.seq = s;
  d.no_dump = v.no_dump;
  d.members_unknown = members_unknown;
  bool found = false;
  for (const auto& m : v.members) {
    if (m.unknown) continue;
    if (m.last >= s) {
      d.issued.push_back(m.rank);
      if (const FrCall* c = m.at(s)) {
        if (!found || c->time_created_ns < d.time_ns) {
          d.time_ns = c->time_created_ns;
          d.signature = c->signature;
        }
        found = true;
      }
    } else {
      d.not_issued.push_back(m.rank);
    }
  }
  if (!found) {  // every issuer's buffer dropped it: date it by their first call kept after it
    for (const auto& m : v.members) {
      if (m.unknown || m.last < s) continue;
      const uint32_t* it = m.from(s);
      if (it != m.end && (!found || m.call(it).time_created_ns < d.time_ns)) {
        d.time_ns = m.call(it).time_created_ns;
        d.signature = m.call(it).signature;
        found = true;
      }
    }
  }
  return d;
}

// The first call number at which two members issued calls that would not match. The numbers
// are walked as the members recorded them (a heap over their cursors): time grows with the calls
// recorded, never with the gaps between their numbers.
std::optional<Divergence> mismatch(const FrJob& job, const GroupView& v, uint32_t g) {
  const int64_t hi = v.min_last;
  std::vector<const MemberSeqs*> judged;
  std::vector<const uint32_t*> cursor;
  for (const auto& m : v.members) {
    if (m.unknown || m.begin == m.end) continue;
    judged.push_back(&m);
    cursor.push_back(m.begin);
  }
  if (judged.size() < 2) return std::nullopt;
  using Head = std::pair<int64_t, std::size_t>;  // (seq, member)
  std::priority_queue<Head, std::vector<Head>, std::greater<Head>> heap;
  for (std::size_t k = 0; k < judged.size(); ++k) heap.push({judged[k]->call(cursor[k]).seq, k});
  while (!heap.empty() && heap.top().first <= hi) {
    const int64_t s = heap.top().first;
    const FrCall* ref = nullptr;
    bool differs = false;
    while (!heap.empty() && heap.top().first == s) {
      const std::size_t k = heap.top().second;
      heap.pop();
      const FrCall& c = judged[k]->call(cursor[k]);
      if (ref == nullptr) {
        ref = &c;
      } else if (c.signature != ref->signature &&
                 signature_difference(job.signatures[ref->signature],
                                      job.signatures[c.signature])) {
        differs = true;
      }
      while (cursor[k] != judged[k]->end && judged[k]->call(cursor[k]).seq <= s) ++cursor[k];
      if (cursor[k] != judged[k]->end) heap.push({judged[k]->call(cursor[k]).seq, k});
    }
    if (!differs) continue;
    Divergence d;
    d.kind = DivergenceKind::kMismatch;
    d.group = g;
    d.seq = s;
    d.no_dump = v.no_dump;
    bool first = true;
    for (std::size_t k = 0; k < judged.size(); ++k) {
      const FrCall* c = judged[k]->at(s);
      if (c == nullptr) continue;
      if (first || c->time_created_ns < d.time_ns) d.time_ns = c->time_created_ns;
      first = false;
      auto it = std::find_if(d.variants.begin(), d.variants.end(), [&](const auto& var) {
        return var.first == c->signature ||
               !signature_difference(job.signatures[var.first], job.signatures[c->signature]);
      });
      if (it == d.variants.end()) {
        d.variants.push_back({c->signature, {judged[k]->rank}});
      } else {
        it->second.push_back(judged[k]->rank);
      }
    }
    std::stable_sort(d.variants.begin(), d.variants.end(), [](const auto& a, const auto& b) {
      return a.second.size() > b.second.size();
    });
    d.signature = d.variants[0].first;
    d.detail = *signature_difference(job.signatures[d.variants[0].first],
                                     job.signatures[d.variants[1].first]);
    d.issued = d.variants[0].second;
    for (std::size_t k = 1; k < d.variants.size(); ++k) {
      d.not_issued.insert(d.not_issued.end(), d.variants[k].second.begin(),
                          d.variants[k].second.end());
    }
    std::sort(d.not_issued.begin(), d.not_issued.end());
    return d;
  }
  return std::nullopt;
}

// Sends and receives matched per ordered pair of members, in order (NCCL records p2p calls as
// "send a->b" / "recv b<-a" with group-local ranks; Gloo records none).
void p2p_divergences(const Alignment& a, uint32_t g, std::vector<Divergence>& out) {
  const auto& members = a.job().groups[g].members;
  std::map<std::pair<int64_t, int64_t>, std::vector<const FrCall*>> sends, recvs;
  for (int64_t r : members) {
    const FrRankDump* d = a.dump(r);
    if (d == nullptr) continue;
    auto [b, e] = a.calls_on(r, g, true);
    for (const uint32_t* it = b; it != e; ++it) {
      const FrCall& c = d->calls[*it];
      if (c.p2p_src < 0 || c.p2p_dst < 0 || c.p2p_src >= static_cast<int64_t>(members.size()) ||
          c.p2p_dst >= static_cast<int64_t>(members.size()))
        continue;
      const auto key = std::make_pair(members[c.p2p_src], members[c.p2p_dst]);
      const std::string& op = a.job().signatures[c.signature].op;
      if (op == "send" && key.first == r) sends[key].push_back(&c);
      if (op == "recv" && key.second == r) recvs[key].push_back(&c);
    }
  }
  auto judge = [&](const auto& have, const auto& other, DivergenceKind kind, bool sender) {
    for (const auto& [key, calls] : have) {
      const int64_t self = sender ? key.first : key.second;
      const int64_t peer = sender ? key.second : key.first;
      const FrRankDump* pd = a.dump(peer);
      const FrRankDump* sd = a.dump(self);
      if (pd == nullptr || pd->wrapped || sd->wrapped) continue;
      auto it = other.find(key);
      const std::size_t matched = it == other.end() ? 0 : it->second.size();
      if (calls.size() <= matched) continue;
      const FrCall& c = *calls[matched];
      Divergence d;
      d.kind = kind;
      d.group = g;
      d.seq = c.seq;
      d.time_ns = c.time_created_ns;
      d.signature = c.signature;
      d.issued = {self};
      d.not_issued = {peer};
      out.push_back(std::move(d));
    }
  };
  judge(sends, recvs, DivergenceKind::kSendWithoutRecv, true);
  judge(recvs, sends, DivergenceKind::kRecvWithoutSend, false);
}

bool by_time(const Divergence& a, const Divergence& b) {
  if (a.time_ns != b.time_ns) return a.time_ns < b.time_ns;
  return a.group < b.group;
}

}  // namespace

namespace {

// The divergences of an aligned job, and each group's last call number every judged member
// reached (min_last, what tells a rank's last call unmatched).
std::vector<Divergence> divergences_of(const Alignment& a, std::vector<std::string>* notes,
                                       std::vector<int64_t>* group_min_last) {
  const FrJob& job = a.job();
  std::vector<Divergence> out;
  std::vector<std::string> unjudged;
  if (group_min_last != nullptr) group_min_last->assign(job.groups.size(), 0);
  for (uint32_t g = 0; g < job.groups.size(); ++g) {
    const GroupView v = view_of(a, g);
    if (group_min_last != nullptr) (*group_min_last)[g] = v.min_last;
    for (const auto& m : v.members) {
      if (m.unknown)
        unjudged.push_back(fmt::format("rank {} on group '{}'", m.rank, job.groups[g].name));
    }
    const bool unknown = job.groups[g].members_inferred;
    if (auto d = mismatch(job, v, g)) {
      d->members_unknown = unknown;
      out.push_back(std::move(*d));
    } else if (auto m = missing_call(v, g, unknown)) {
      out.push_back(std::move(*m));
    }
    p2p_divergences(a, g, out);
  }
  if (notes != nullptr && !unjudged.empty()) {
    notes->push_back(fmt::format(
        "not judged (its recorder's ring buffer had dropped every call on the group; raise "
        "TORCH_FR_BUFFER_SIZE): {}{}",
        fmt::join(unjudged.begin(), unjudged.begin() + std::min<std::size_t>(unjudged.size(), 8),
                  ", "),
        unjudged.size() > 8 ? fmt::format(" and {} more", unjudged.size() - 8) : ""));
  }
  std::stable_sort(out.begin(), out.end(), by_time);
  return out;
}

}  // namespace

std::vector<Divergence> find_divergences(const FrJob& job, std::vector<std::string>* notes) {
  return divergences_of(Alignment(job), notes, nullptr);
}

std::vector<int64_t> Divergence::blamed() const {
  std::vector<int64_t> out = not_issued;
  out.insert(out.end(), no_dump.begin(), no_dump.end());
  return out;
}

const char* root_kind_name(RootKind k) {
  switch (k) {
    case RootKind::kIdleRank:
      return "idle_rank";
    case RootKind::kMissingDump:
      return "missing_dump";
    case RootKind::kCycle:
      return "cycle";
    case RootKind::kOutOfOrder:
      return "out_of_order";
    case RootKind::kMismatch:
      return "mismatch";
    case RootKind::kPending:
      return "pending";
  }
  return "?";
}

namespace {

std::string group_phrase(const FrJob& job, uint32_t g) {
  const FrGroup& group = job.groups[g];
  const bool desc = !group.desc.empty() && group.desc != "undefined";
  return fmt::format("group '{}'{}", group.name, desc ? fmt::format(" ({})", group.desc) : "");
}

std::string call_phrase(const FrJob& job, const Divergence& d) {
  return fmt::format("{} #{} on {}", job.signatures[d.signature].op, d.seq,
                     group_phrase(job, d.group));
}

// Who waits in which divergence, and who is blamed by which: the graph the root is found in.
struct WaitGraph {
  std::vector<std::vector<std::size_t>> waits_in;   // per rank: divergences it is stuck in
  std::vector<std::vector<std::size_t>> blamed_by;  // per rank: divergences that blame it
  std::vector<uint8_t> has_dump;
  // Its last call is on a group whose members are unknown and where no other rank was seen
  // calling: a collective of one rank cannot block, so it waits there for a member no dump shows
  // (or the group is larger than seen); it cannot be called idle.
  std::vector<uint8_t> unknown_wait;
  bool idle(int64_t r) const {
    const auto k = static_cast<std::size_t>(r);
    return has_dump[k] && waits_in[k].empty() && !unknown_wait[k];
  }
  bool maybe_waiting(int64_t r) const {
    const auto k = static_cast<std::size_t>(r);
    return has_dump[k] && waits_in[k].empty() && unknown_wait[k];
  }
};

WaitGraph wait_graph(const Alignment& a, const std::vector<Divergence>& divs, int64_t world) {
  WaitGraph w;
  const auto n = static_cast<std::size_t>(world);
  w.waits_in.resize(n);
  w.blamed_by.resize(n);
  w.has_dump.assign(n, 0);
  w.unknown_wait.assign(n, 0);
  for (int64_t r = 0; r < world; ++r) {
    const FrRankDump* d = a.dump(r);
    w.has_dump[static_cast<std::size_t>(r)] = d != nullptr;
    if (d != nullptr && !d->calls.empty() && !d->calls.back().is_p2p) {
      const FrGroup& g = a.job().groups[d->calls.back().group];
      w.unknown_wait[static_cast<std::size_t>(r)] = g.members_inferred && g.members.size() < 2;
    }
  }
  for (std::size_t i = 0; i < divs.size(); ++i) {
    const Divergence& d = divs[i];
    for (int64_t r : d.issued) w.waits_in[static_cast<std::size_t>(r)].push_back(i);
    // Every member of a mismatched call is inside it; its minority is blamed.
    if (d.kind == DivergenceKind::kMismatch)
      for (int64_t r : d.not_issued) w.waits_in[static_cast<std::size_t>(r)].push_back(i);
    for (int64_t r : d.blamed()) w.blamed_by[static_cast<std::size_t>(r)].push_back(i);
  }
  return w;
}

bool is_root(const Divergence& d, const WaitGraph& w) {
  if (d.kind == DivergenceKind::kMismatch) return true;
  for (int64_t r : d.not_issued)
    if (w.idle(r) || w.maybe_waiting(r)) return true;
  return d.not_issued.empty() && (!d.no_dump.empty() || d.members_unknown);
}

// The ranks whose waits lead to divergence `root`: the issuers of every divergence from which a
// chain (a blamed rank that itself waits in the next) reaches it.
int64_t explained_waits(std::size_t root, const std::vector<Divergence>& divs, const WaitGraph& w) {
  std::vector<uint8_t> seen_div(divs.size(), 0), seen_rank(w.waits_in.size(), 0);
  std::vector<std::size_t> todo = {root};
  seen_div[root] = 1;
  int64_t count = 0;
  while (!todo.empty()) {
    const std::size_t i = todo.back();
    todo.pop_back();
    for (int64_t r : divs[i].issued) {
      auto& seen = seen_rank[static_cast<std::size_t>(r)];
      if (seen) continue;
      seen = 1;
      ++count;
      // Whoever waits on r (a divergence blaming r) waits, through r, on this one.
      for (std::size_t j : w.blamed_by[static_cast<std::size_t>(r)]) {
        if (!seen_div[j]) {
          seen_div[j] = 1;
          todo.push_back(j);
        }
      }
    }
  }
  return count;
}

// The frame a call's stack was issued from in the job's own code (not torch.distributed's).
const FrFrame* site_of(const FrJob& job, uint32_t stack) {
  for (const auto& f : job.stacks[stack])
    if (f.filename.find("/torch/") == std::string::npos) return &f;
  return job.stacks[stack].empty() ? nullptr : &job.stacks[stack].front();
}

// Whether none of `ranks` (the first 64) ever recorded a call from `site` (nullopt: some did),
// and then whether they went on recording calls after `issuer` first called from it (a line only
// the issuers reach, step after step). `calls_seen`: the calls those ranks recorded.
std::optional<bool> site_never_reached(const Alignment& a, const FrFrame& site,
                                       const FrRankDump& issuer, const std::vector<int64_t>& ranks,
                                       int64_t* calls_seen) {
  const FrJob& job = a.job();
  std::vector<uint8_t> same(job.stacks.size(), 0);
  for (std::size_t k = 0; k < job.stacks.size(); ++k) {
    const FrFrame* f = site_of(job, static_cast<uint32_t>(k));
    same[k] = f != nullptr && f->filename == site.filename && f->line == site.line &&
              f->name == site.name;
  }
  int64_t first = std::numeric_limits<int64_t>::max();
  for (const auto& c : issuer.calls)
    if (same[c.stack]) first = std::min(first, c.time_created_ns);
  *calls_seen = 0;
  bool alive_after = false;
  for (std::size_t k = 0; k < ranks.size() && k < 64; ++k) {
    const FrRankDump* d = a.dump(ranks[k]);
    if (d == nullptr) continue;
    *calls_seen += static_cast<int64_t>(d->calls.size());
    for (const auto& c : d->calls) {
      if (same[c.stack]) return std::nullopt;
      alive_after = alive_after || c.time_created_ns > first;
    }
  }
  return alive_after;
}

// The readings of a root divergence: what each side did, the likelier first.
// Long: one case per root kind, each its summary and readings in the trainer's words; split, the
// sentences would scatter over helpers that each say half of one.
void read_root(const Alignment& a, const Divergence& d, Root& root) {
  const FrJob& job = a.job();
  const std::string call = call_phrase(job, d);
  switch (root.kind) {
    case RootKind::kMismatch: {
      std::vector<std::string> sides;
      for (const auto& [sig, ranks] : d.variants)
        sides.push_back(
            fmt::format("{} issued {}", ranks_phrase(ranks, 4), job.signatures[sig].op));
      const bool tie =
          d.variants.size() == 2 && d.variants[0].second.size() == d.variants[1].second.size();
      root.summary = fmt::format("call #{} on {} differs between members ({}): {}", d.seq,
                                 group_phrase(job, d.group), d.detail, fmt::join(sides, "; "));
      root.readings.push_back(
          fmt::format("{} issued a call the others did not ({}): the odd one out",
                      ranks_phrase(d.not_issued, 4), d.detail));
      if (tie) {
        root.readings.push_back(
            fmt::format("{} did: the sides are as many, the dumps cannot say which is wrong",
                        ranks_phrase(d.issued, 4)));
      }
      return;
    }
    case RootKind::kMissingDump:
      root.summary = fmt::format(
          "{} left no dump; {} wait{} for {} in {}, which every member with a dump issued",
          ranks_phrase(d.no_dump, 4), ranks_phrase(d.issued, 4), d.issued.size() == 1 ? "s" : "",
          d.no_dump.size() == 1 ? "it" : "them", call);
      root.readings.push_back(fmt::format(
          "{} died before the call (a Gloo abort, a dead node: no dump) or never reached it",
          ranks_phrase(d.no_dump, 4)));
      return;
    case RootKind::kPending:
      if (!root.culprits.empty()) {
        root.summary = fmt::format(
            "{} never issued {}; {} wait{} in it; {} last called a group whose other members no "
            "dump shows, and may wait there",
            ranks_phrase(root.culprits, 4), call, ranks_phrase(d.issued, 4),
            d.issued.size() == 1 ? "s" : "", root.culprits.size() == 1 ? "it" : "each");
        root.readings.push_back(
            "give --world N or the layout (--tp/--pp/--cp/--dp): the members of those groups then "
            "say who they wait for");
        return;
      }
      root.summary = fmt::format(
          "{} wait{} in {}, which every rank given issued and which never completed: a member "
          "outside the dumps given",
          ranks_phrase(d.issued, 4), d.issued.size() == 1 ? "s" : "", call);
      root.readings.push_back(
          "a member of the group left no dump, or the world is larger than the dumps given: "
          "give --world N or the layout to name it");
      return;
    case RootKind::kCycle:
    case RootKind::kOutOfOrder:
    case RootKind::kIdleRank:
      break;
  }
  if (root.kind == RootKind::kCycle) return;  // summarised from its steps
  root.summary = fmt::format("{} never issued {}; {} wait{} in it", ranks_phrase(root.culprits, 4),
                             call, ranks_phrase(d.issued, 4), d.issued.size() == 1 ? "s" : "");
  const std::string skipped = fmt::format(
      "{} never issued it: {} died, skipped it, or hang{} outside collectives (the last call "
      "{} recorded completed on every member)",
      ranks_phrase(root.culprits, 4), root.culprits.size() == 1 ? "it" : "they",
      root.culprits.size() == 1 ? "s" : "", root.culprits.size() == 1 ? "it" : "each");
  // The issuers' call from a line the blamed ranks never reached in anything they recorded:
  // the call may belong on a subgroup of the issuers instead.
  const FrRankDump* issuer = d.issued.empty() ? nullptr : a.dump(d.issued.front());
  const FrCall* c = nullptr;
  if (issuer != nullptr) {
    for (const auto& x : issuer->calls)
      if (!x.is_p2p && x.group == d.group && x.seq == d.seq) c = &x;
  }
  const FrFrame* site = c != nullptr ? site_of(job, c->stack) : nullptr;
  int64_t seen = 0;
  const std::optional<bool> never =
      site != nullptr ? site_never_reached(a, *site, *issuer, root.culprits, &seen) : std::nullopt;
  if (never && !*never) {  // they stopped before the issuers reached it: skipped it, or died
    root.readings.push_back(skipped);
    root.readings.push_back(fmt::format(
        "{}'s call belongs on a subgroup of {}: {} never issued a call from {} ({}:{}) in the "
        "{} calls {} recorded",
        ranks_phrase(d.issued, 4), d.issued.size() == 1 ? "it" : "them",
        ranks_phrase(root.culprits, 4), site->name, site->filename, site->line, seen,
        root.culprits.size() == 1 ? "it" : "they"));
  } else if (never) {
    root.readings.push_back(fmt::format(
        "{}'s call belongs on a subgroup of {}: {} never issued a call from {} ({}:{}) in the {} "
        "calls {} recorded",
        ranks_phrase(d.issued, 4), d.issued.size() == 1 ? "it" : "them",
        ranks_phrase(root.culprits, 4), site->name, site->filename, site->line, seen,
        root.culprits.size() == 1 ? "it" : "they"));
    root.readings.push_back(skipped);
    root.summary +=
        fmt::format(", from a line {} never reached: ", root.culprits.size() == 1 ? "it" : "they") +
        "the call may belong on a subgroup, or they skipped it";
  } else {
    root.readings.push_back(skipped);
  }
}

// A cycle of waits, found by following blamed ranks from `start` into the divergences they wait
// in until one repeats (every blamed rank waits somewhere when no divergence is a root).
std::vector<WaitStep> find_cycle(std::size_t start, const std::vector<Divergence>& divs,
                                 const WaitGraph& w) {
  std::vector<std::size_t> path;  // divergences in order
  std::vector<int64_t> via;       // via[k]: the blamed rank of path[k] followed to path[k+1]
  std::map<std::size_t, std::size_t> at;  // divergence -> its position in path
  std::size_t cur = start;
  while (!at.count(cur)) {
    at[cur] = path.size();
    path.push_back(cur);
    int64_t next_rank = -1;
    std::size_t next = cur;
    for (int64_t r : divs[cur].not_issued) {
      const auto& in = w.waits_in[static_cast<std::size_t>(r)];
      if (!in.empty()) {
        next_rank = r;
        next = in.front();
        break;
      }
    }
    if (next_rank < 0) return {};
    via.push_back(next_rank);
    cur = next;
  }
  const std::size_t from = at[cur];
  std::vector<WaitStep> steps;
  for (std::size_t k = from; k < path.size(); ++k) {
    WaitStep s;
    s.divergence = path[k];
    s.rank = k == from ? via.back() : via[k - 1];
    s.waits_for = divs[path[k]].blamed();
    steps.push_back(std::move(s));
  }
  return steps;
}

// Idle culprits whose last call was on a group with a member that left no dump: they recorded
// nothing after it because it failed or hangs there (Gloo aborts a rank that receives a buffer of
// another size or dtype before it can dump, and its partners' calls then fail): the members
// without a dump are the root, the idle ranks their first symptom.
void missing_partners_as_root(const Alignment& a, const Divergence& d, Root& root) {
  if (root.kind != RootKind::kIdleRank) return;
  const FrJob& job = a.job();
  std::vector<int64_t> missing;
  std::vector<std::string> where;
  for (int64_t r : root.culprits) {
    const FrRankDump* dump = a.dump(r);
    if (dump == nullptr || dump->calls.empty() || dump->calls.back().is_p2p) return;
    const FrCall& last = dump->calls.back();
    std::vector<int64_t> here;
    for (int64_t m : job.groups[last.group].members)
      if (a.dump(m) == nullptr) here.push_back(m);
    if (here.empty()) return;  // this one stopped with every partner present: it is a root
    missing.insert(missing.end(), here.begin(), here.end());
    if (where.size() < 4)
      where.push_back(fmt::format("rank {} in {} #{} on {}", r, job.signatures[last.signature].op,
                                  last.seq, group_phrase(job, last.group)));
  }
  std::sort(missing.begin(), missing.end());
  missing.erase(std::unique(missing.begin(), missing.end()), missing.end());
  const std::vector<int64_t> symptoms = root.culprits;
  root.kind = RootKind::kMissingDump;
  root.culprits = missing;
  root.summary = fmt::format(
      "{} left no dump; {} stopped in a call with {} ({}) and never issued {}, where {} wait{}",
      ranks_phrase(missing, 4), ranks_phrase(symptoms, 4), missing.size() == 1 ? "it" : "them",
      fmt::join(where, "; "), call_phrase(job, d), ranks_phrase(d.issued, 4),
      d.issued.size() == 1 ? "s" : "");
  root.readings.clear();
  root.readings.push_back(fmt::format(
      "{} died in that call (Gloo aborts a rank that receives a buffer of another size or dtype; a "
      "dead node): {} failed or wait{} there, and the others wait on {}",
      ranks_phrase(missing, 4), ranks_phrase(symptoms, 4), symptoms.size() == 1 ? "s" : "",
      symptoms.size() == 1 ? "it" : "them"));
}

// Whether `rank`'s blocking call (its last) left the order its earlier steps kept: after the
// earlier run of calls that best matches the calls just before it (the longest common run, up to
// 16 calls: the same groups, stacks and signatures), it made another call than it makes now.
// nullopt: nothing earlier to compare with.
std::optional<bool> left_its_order(const Alignment& a, int64_t rank) {
  const FrRankDump* dump = a.dump(rank);
  if (dump == nullptr || dump->calls.size() < 3) return std::nullopt;
  const auto& calls = dump->calls;
  const std::size_t now = calls.size() - 1;  // where it blocks
  auto same = [&](std::size_t x, std::size_t y) {
    return calls[x].group == calls[y].group && calls[x].stack == calls[y].stack &&
           calls[x].signature == calls[y].signature && calls[x].is_p2p == calls[y].is_p2p;
  };
  constexpr std::size_t kRun = 16;
  std::size_t best_len = 0, best = 0;
  for (std::size_t q = now - 1; q-- > 0;) {
    std::size_t len = 0;
    while (len < kRun && len <= q && same(q - len, now - 1 - len)) ++len;
    if (len > best_len) {
      best_len = len;
      best = q;
    }
  }
  if (best_len == 0) return std::nullopt;
  return !same(best + 1, now);
}

// Long: the choice of the root in its three outcomes (a root that explains the most waits, a
// cycle one side of which left its order, a cycle), each ordering the divergences for the report.
Root root_of(const Alignment& a, std::vector<Divergence>& divs, const WaitGraph& w) {
  Root root;
  std::optional<std::size_t> best;
  int64_t best_explains = -1;
  bool tie = false;
  std::size_t checked = 0;
  for (std::size_t i = 0; i < divs.size(); ++i) {  // in time order
    if (!is_root(divs[i], w)) continue;
    if (++checked > 256) break;
    const int64_t e = explained_waits(i, divs, w);
    if (e > best_explains) {
      best = i;
      best_explains = e;
      tie = false;
    } else if (e == best_explains) {
      tie = true;
    }
  }
  if (!best) {
    root.kind = RootKind::kCycle;
    root.cycle = find_cycle(0, divs, w);
    std::vector<std::string> parts;
    for (const auto& st : root.cycle) {
      root.culprits.push_back(st.rank);
      parts.push_back(fmt::format("rank {} waits in {} for {}", st.rank,
                                  call_phrase(a.job(), divs[st.divergence]),
                                  ranks_phrase(st.waits_for, 4)));
    }
    std::sort(root.culprits.begin(), root.culprits.end());
    root.culprits.erase(std::unique(root.culprits.begin(), root.culprits.end()),
                        root.culprits.end());
    root.summary = fmt::format("a cycle of waits: {}", fmt::join(parts, "; "));
    // Which side left the order of calls its own earlier steps kept, if exactly that side did.
    std::vector<int64_t> left, kept;
    for (int64_t r : root.culprits) {
      const auto o = left_its_order(a, r);
      if (o && *o) left.push_back(r);
      if (o && !*o) kept.push_back(r);
    }
    if (!left.empty() && !kept.empty() && left.size() + kept.size() == root.culprits.size()) {
      root.kind = RootKind::kOutOfOrder;
      // The cycle's divergence that blames the side that left its order comes first.
      for (const WaitStep& step : std::vector<WaitStep>(root.cycle)) {
        const std::size_t k = step.divergence;
        const auto& ni = divs[k].not_issued;
        if (std::find(ni.begin(), ni.end(), left.front()) != ni.end()) {
          for (auto& st : root.cycle) {
            if (st.divergence == k)
              st.divergence = 0;
            else if (st.divergence == 0)
              st.divergence = k;
          }
          std::swap(divs[0], divs[k]);
          break;
        }
      }
      root.summary = fmt::format(
          "{} left the order of calls {} earlier steps kept and never issued {}; {} wait{} in it "
          "(a cycle of waits: {})",
          ranks_phrase(left, 4), left.size() == 1 ? "its" : "their", call_phrase(a.job(), divs[0]),
          ranks_phrase(divs[0].issued, 4), divs[0].issued.size() == 1 ? "s" : "",
          fmt::join(parts, "; "));
      root.readings.push_back(fmt::format(
          "{} skipped the call, or issued the step's calls in another order than in {} earlier "
          "steps, while {} kept the order",
          ranks_phrase(left, 4), left.size() == 1 ? "its" : "their", ranks_phrase(kept, 4)));
      root.culprits = left;
      root.explains = explained_waits(0, divs, w);
      return root;
    }
    root.readings.push_back(
        "the sides issue their calls in opposite orders: one of them has the order wrong "
        "(each side's frames below)");
    root.explains =
        root.cycle.empty() ? 0 : explained_waits(root.cycle.front().divergence, divs, w);
    if (!root.cycle.empty()) std::swap(divs[0], divs[root.cycle.front().divergence]);
    for (auto& st : root.cycle) {  // indices after the swap
      if (st.divergence == 0)
        st.divergence = root.cycle.front().divergence;
      else if (st.divergence == root.cycle.front().divergence)
        st.divergence = 0;
    }
    return root;
  }
  const Divergence& d = divs[*best];
  root.explains = best_explains;
  root.by_time = tie;
  if (d.kind == DivergenceKind::kMismatch) {
    root.kind = RootKind::kMismatch;
    root.culprits = d.not_issued;
  } else {
    for (int64_t r : d.not_issued)
      if (w.idle(r)) root.culprits.push_back(r);
    if (root.culprits.empty()) {
      for (int64_t r : d.not_issued)
        if (w.maybe_waiting(r)) root.culprits.push_back(r);
    }
    if (!root.culprits.empty() && w.idle(root.culprits.front())) {
      root.kind = RootKind::kIdleRank;
    } else if (!root.culprits.empty()) {
      root.kind = RootKind::kPending;
    } else if (!d.no_dump.empty()) {
      root.kind = RootKind::kMissingDump;
      root.culprits = d.no_dump;
    } else {
      root.kind = RootKind::kPending;
    }
  }
  read_root(a, d, root);
  missing_partners_as_root(a, d, root);
  if (tie) {
    root.summary += " (the earliest of several divergences that explain as many waits)";
  }
  // The root's divergence first, the others in time order.
  std::rotate(divs.begin(), divs.begin() + static_cast<std::ptrdiff_t>(*best),
              divs.begin() + static_cast<std::ptrdiff_t>(*best) + 1);
  return root;
}

}  // namespace

// Long: the analysis in its order (divergences, each rank's last call, the root and the roles,
// what keeps a job without divergence from passing, the naming, what the report shows); each step
// is a call or a loop over the result it fills.
PostmortemResult analyse_flight_records(FrJob job_given, const PostmortemOptions& options) {
  PostmortemResult res;
  res.job = std::move(job_given);
  const FrJob& job = res.job;
  res.notes = job.notes;
  for (const auto& d : job.ranks) res.total_calls += static_cast<int64_t>(d.calls.size());
  const Alignment a(job);
  std::vector<int64_t> group_min_last;
  res.divergences = divergences_of(a, &res.notes, &group_min_last);

  // Each rank's last call, and whether some member of its group never issued it.
  res.ranks.resize(static_cast<std::size_t>(job.world));
  for (int64_t r = 0; r < job.world; ++r) {
    RankState& s = res.ranks[static_cast<std::size_t>(r)];
    s.rank = r;
    const FrRankDump* d = a.dump(r);
    if (d == nullptr) {
      s.role = RankRole::kMissing;
      continue;
    }
    s.calls = static_cast<int64_t>(d->calls.size());
    if (d->calls.empty()) continue;
    s.last_call = d->calls.size() - 1;
    const FrCall& c = d->calls.back();
    s.last_call_unmatched = !c.is_p2p && c.seq > group_min_last[c.group];
  }
  for (uint32_t g = 0; g < job.groups.size(); ++g)
    if (job.groups[g].members_inferred) res.unknown_groups.push_back(g);

  if (res.diverged()) {
    const WaitGraph w = wait_graph(a, res.divergences, job.world);
    for (auto& d : res.divergences) {
      for (int64_t r : d.not_issued) d.blames_idle_rank = d.blames_idle_rank || w.idle(r);
    }
    res.root = root_of(a, res.divergences, w);
    for (const auto& d : res.divergences) {
      for (int64_t r : d.issued) {
        auto& s = res.ranks[static_cast<std::size_t>(r)];
        if (s.role == RankRole::kComplete) s.role = RankRole::kWaiting;
      }
      if (d.kind == DivergenceKind::kMismatch) {
        for (int64_t r : d.not_issued) {
          auto& s = res.ranks[static_cast<std::size_t>(r)];
          if (s.role == RankRole::kComplete) s.role = RankRole::kWaiting;
        }
      }
    }
    for (const auto& d : res.divergences) {  // blamed ranks that wait nowhere: causes too
      for (int64_t r : d.not_issued)
        if (w.idle(r)) res.ranks[static_cast<std::size_t>(r)].role = RankRole::kCulprit;
    }
    for (int64_t r : res.root->culprits) {
      auto& s = res.ranks[static_cast<std::size_t>(r)];
      if (s.role != RankRole::kMissing) s.role = RankRole::kCulprit;
    }
  }
  if (static_cast<int64_t>(res.divergences.size()) > options.max_divergences) {
    res.notes.push_back(fmt::format("{} divergences found; the first {} are kept",
                                    res.divergences.size(), options.max_divergences));
    res.divergences.resize(static_cast<std::size_t>(options.max_divergences));
    if (res.root) {  // steps of a cycle beyond what is kept lose their divergence
      auto& cyc = res.root->cycle;
      cyc.erase(std::remove_if(
                    cyc.begin(), cyc.end(),
                    [&](const WaitStep& st) { return st.divergence >= res.divergences.size(); }),
                cyc.end());
    }
  }
  for (const auto& s : res.ranks) {
    switch (s.role) {
      case RankRole::kMissing:
        res.missing.push_back(s.rank);
        break;
      case RankRole::kComplete:
        res.complete.push_back(s.rank);
        break;
      case RankRole::kWaiting:
        res.waiting.push_back(s.rank);
        break;
      case RankRole::kCulprit:
        res.culprits.push_back(s.rank);
        break;
    }
  }
  // What keeps a job without divergence from passing (SPEC §12: never green on a hung job).
  if (!job.world_known) {
    res.unverified.push_back(fmt::format(
        "the world size is unknown (the dumps do not state it: Gloo's never do; {} rank{} seen): "
        "give --world N or the layout (--tp/--pp/--cp/--dp), so that a rank without a dump is "
        "seen missing",
        job.ranks.size(), job.ranks.size() == 1 ? "" : "s"));
  }
  if (!res.missing.empty()) {
    res.unverified.push_back(fmt::format("{} of {} left no dump: what {} did cannot be checked",
                                         ranks_phrase(res.missing, 4), job.world,
                                         res.missing.size() == 1 ? "it" : "they"));
  }
  if (!res.unknown_groups.empty()) {
    std::vector<std::string> names;
    for (std::size_t k = 0; k < res.unknown_groups.size() && k < 8; ++k)
      names.push_back(group_phrase(job, res.unknown_groups[k]));
    res.unverified.push_back(fmt::format(
        "the members of {} group{} ({}{}) are unknown: no pg_config lists them (Gloo's recorder "
        "lists none) and no layout gives them; a member that never called on one cannot be seen: "
        "give the layout (--tp/--pp/--cp/--dp)",
        res.unknown_groups.size(), res.unknown_groups.size() == 1 ? "" : "s",
        fmt::join(names, ", "), res.unknown_groups.size() > 8 ? ", ..." : ""));
  }
  if (res.diverged()) {
    res.matches = match_protocols(job, res.divergences[0], options, &res.naming_note);
  }
  compose_report(res, options);
  return res;
}

PostmortemResult postmortem(FrJob job, const JobShape& shape, const PostmortemOptions& options) {
  resolve_groups(job, shape);
  return analyse_flight_records(std::move(job), options);
}

}  // namespace lossguard::oracle

namespace lossguard::oracle {

std::optional<GroupKind> megatron_group_kind(std::string desc) {
  const std::string gloo = "_GLOO";
  if (desc.size() > gloo.size() && desc.compare(desc.size() - gloo.size(), gloo.size(), gloo) == 0)
    desc.resize(desc.size() - gloo.size());
  static const std::pair<const char*, GroupKind> kNames[] = {
      {"TENSOR_MODEL_PARALLEL_GROUP", GroupKind::kTp},
      {"PIPELINE_MODEL_PARALLEL_GROUP", GroupKind::kPp},
      {"CONTEXT_PARALLEL_GROUP", GroupKind::kCp},
      {"DATA_PARALLEL_GROUP", GroupKind::kDp},
      {"DATA_PARALLEL_GROUP_WITH_CP", GroupKind::kDpCp},
      {"MODEL_PARALLEL_GROUP", GroupKind::kMp}};
  for (const auto& [name, kind] : kNames) {
    if (desc == name) return kind;
  }
  return std::nullopt;
}

namespace {

// The world from what is known: pg_config, --world, the layout; they must agree.
void resolve_world(FrJob& job, const JobShape& given) {
  std::vector<std::pair<int64_t, std::string>> claims;
  if (job.world_known) claims.push_back({job.world, job.world_source});
  if (given.world) claims.push_back({*given.world, "--world"});
  if (given.layout) {
    const Topology& t = *given.layout;
    claims.push_back(
        {t.world(), fmt::format("the layout TP{} PP{} CP{} DP{}", t.tp(), t.pp(), t.cp(), t.dp())});
  }
  if (claims.empty()) return;
  for (const auto& [n, from] : claims) {
    if (n < 1 || n > kMaxFrWorld)
      throw_input_error("{} gives a world of {} ranks: postmortem aligns 1 to {}", from, n,
                        kMaxFrWorld);
    if (n != claims.front().first) {
      throw_input_error("{} gives a world of {} ranks but {} gives {}: they must agree",
                        claims.front().second, claims.front().first, from, n);
    }
  }
  int64_t highest = -1;
  for (const auto& d : job.ranks) highest = std::max(highest, d.rank);
  if (highest >= claims.front().first) {
    throw_input_error("a dump names rank {}, outside the world of {} ranks that {} gives", highest,
                      claims.front().first, claims.front().second);
  }
  if (!job.world_known) {
    job.world = claims.front().first;
    job.world_known = true;
    job.world_source = given.world ? "--world" : "layout";
  }
  for (auto& g : job.groups) {
    if (g.name != "0" || !g.members_inferred) continue;
    g.members.resize(static_cast<std::size_t>(job.world));
    std::iota(g.members.begin(), g.members.end(), int64_t{0});
    g.members_inferred = false;
    g.from_world = true;
  }
  for (const auto& g : job.groups) {
    if (!g.members.empty() && g.members.back() >= job.world) {
      throw_input_error("group '{}' has member {}, outside the world of {} ranks", g.name,
                        g.members.back(), job.world);
    }
  }
}

// The layouts a group's members may come from: the one given, else every dense layout of a known
// world (none when the world is unknown).
std::vector<Topology> candidate_layouts(const FrJob& job, const JobShape& given) {
  if (given.layout) return {*given.layout};
  if (!job.world_known || job.world > (int64_t{1} << 20)) return {};
  return dense_layouts(job.world);
}

// A group without Megatron's description whose callers are exactly one group of the given layout.
void match_undescribed(FrJob& job, const Topology& t, std::vector<std::string>& completed) {
  for (auto& group : job.groups) {
    if (!group.members_inferred || group.members.empty() || megatron_group_kind(group.desc))
      continue;
    if (group.members.back() >= t.world()) continue;
    std::optional<std::vector<int64_t>> exact;
    for (GroupKind k : kAllGroupKinds) {
      std::vector<int64_t> m = t.members(t.group_of(k, group.members.front()));
      if (m == group.members) exact = std::move(m);
    }
    if (!exact) continue;
    group.members_inferred = false;
    group.members_from_layout = true;
    completed.push_back(fmt::format("'{}' ({})", group.name, group.desc));
  }
}

}  // namespace

// Long: the world, the described groups' agreement over the candidate layouts, the undescribed
// groups' exact matches and the note that says which: one pass per source of members.
void resolve_groups(FrJob& job, const JobShape& given) {
  resolve_world(job, given);
  std::vector<std::pair<uint32_t, GroupKind>> described;
  for (uint32_t g = 0; g < job.groups.size(); ++g) {
    const FrGroup& group = job.groups[g];
    if (!group.members_inferred || group.members.empty()) continue;
    if (auto k = megatron_group_kind(group.desc)) described.push_back({g, *k});
  }
  std::vector<std::string> completed;
  const std::vector<Topology> layouts_tried = candidate_layouts(job, given);
  // The members each consistent layout gives each described group; nullopt once layouts differ.
  std::vector<std::optional<std::vector<int64_t>>> agreed(described.size());
  std::vector<std::string> layouts;
  for (const Topology& t : described.empty() ? std::vector<Topology>{} : layouts_tried) {
    std::map<std::tuple<std::string, int, int64_t>, uint32_t> taken;
    bool ok = true;
    for (const auto& [g, kind] : described) {
      const auto& members = job.groups[g].members;
      if (members.back() >= t.world()) {
        ok = false;
        break;
      }
      const GroupRef ref = t.group_of(kind, members.front());
      for (int64_t m : members) ok = ok && t.group_of(kind, m) == ref;
      // Two groups of one description are two groups of the layout.
      auto [it, fresh] = taken.try_emplace({job.groups[g].desc, static_cast<int>(kind), ref.id}, g);
      ok = ok && (fresh || it->second == g);
      if (!ok) break;
    }
    if (!ok) continue;
    layouts.push_back(fmt::format("TP{} PP{} CP{} DP{}", t.tp(), t.pp(), t.cp(), t.dp()));
    for (std::size_t k = 0; k < described.size(); ++k) {
      const auto& [g, kind] = described[k];
      std::vector<int64_t> full = t.members(t.group_of(kind, job.groups[g].members.front()));
      if (layouts.size() == 1) {
        agreed[k] = std::move(full);
      } else if (agreed[k] && *agreed[k] != full) {
        agreed[k].reset();
      }
    }
  }
  if (given.layout && !described.empty() && layouts.empty()) {
    throw_input_error(
        "the layout TP{} PP{} CP{} DP{} does not hold the groups the dumps describe as Megatron's "
        "(their callers fall in two groups of one kind): not this job's layout",
        given.layout->tp(), given.layout->pp(), given.layout->cp(), given.layout->dp());
  }
  for (std::size_t k = 0; k < described.size() && !layouts.empty(); ++k) {
    FrGroup& group = job.groups[described[k].first];
    if (!agreed[k]) continue;
    group.members = *agreed[k];
    group.members_inferred = false;
    group.members_from_layout = true;
    completed.push_back(fmt::format("'{}' ({})", group.name, group.desc));
  }
  if (given.layout) match_undescribed(job, *given.layout, completed);
  if (!completed.empty()) {
    job.notes.push_back(fmt::format(
        "members of group(s) {}{} from {}{}",
        fmt::join(completed.begin(), completed.begin() + std::min<std::size_t>(completed.size(), 8),
                  ", "),
        completed.size() > 8 ? fmt::format(" and {} more", completed.size() - 8) : "",
        given.layout ? "the layout given"
                     : fmt::format("Megatron's layout: every layout of {} "
                                   "ranks that fits the groups' "
                                   "descriptions (",
                                   job.world),
        given.layout
            ? ""
            : fmt::format(
                  "{}{}) gives them the same ranks",
                  fmt::join(layouts.begin(),
                            layouts.begin() + std::min<std::size_t>(layouts.size(), 4), ", "),
                  layouts.size() > 4 ? ", ..." : "")));
  }
}

Judgement PostmortemResult::judgement() const {
  if (no_collectives()) {
    return Judgement::nothing_verified(
        "the dumps hold no collective call (was TORCH_FR_BUFFER_SIZE > 0 in the job?)");
  }
  if (diverged()) return Judgement::verified(false, true);
  if (!unverified.empty()) {
    return Judgement::nothing_verified(
        fmt::format("no divergence among the dumps given, but {}", fmt::join(unverified, "; ")));
  }
  return Judgement::verified();
}

}  // namespace lossguard::oracle
