// The alignment of recorded calls per process group, the divergences and each rank's part in them
// (SPEC §12). One pass over every rank's calls, sorted by group, at 4 bytes a call beyond the calls
// themselves.
#include "oracle/postmortem/postmortem.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <tuple>

#include "core/errors.h"

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

std::optional<Divergence> missing_call(const GroupView& v, uint32_t g) {
  int64_t max_last = 0;
  for (const auto& m : v.members) {
    if (!m.unknown) max_last = std::max(max_last, m.last);
  }
  if (v.min_last >= max_last) return std::nullopt;
  const int64_t s = v.min_last + 1;
  Divergence d;
  d.kind = DivergenceKind::kMissingCall;
  d.group = g;
  d.seq = s;
  d.no_dump = v.no_dump;
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

std::optional<Divergence> mismatch(const FrJob& job, const GroupView& v, uint32_t g) {
  int64_t lo = 1, hi = v.min_last;
  for (const auto& m : v.members) {
    if (m.begin != m.end) lo = std::max(lo, m.first);
  }
  std::vector<const uint32_t*> cursor;
  std::vector<const MemberSeqs*> judged;
  for (const auto& m : v.members) {
    if (m.unknown || m.begin == m.end) continue;
    judged.push_back(&m);
    cursor.push_back(m.begin);
  }
  if (judged.size() < 2) return std::nullopt;
  for (int64_t s = lo; s <= hi; ++s) {
    const FrCall* ref = nullptr;
    bool differs = false;
    for (std::size_t k = 0; k < judged.size(); ++k) {
      const MemberSeqs& m = *judged[k];
      while (cursor[k] != m.end && m.call(cursor[k]).seq < s) ++cursor[k];
      if (cursor[k] == m.end || m.call(cursor[k]).seq != s) continue;  // a gap in its record
      const FrCall& c = m.call(cursor[k]);
      if (ref == nullptr) {
        ref = &c;
      } else if (c.signature != ref->signature &&
                 signature_difference(job.signatures[ref->signature],
                                      job.signatures[c.signature])) {
        differs = true;
      }
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
    if (auto d = mismatch(job, v, g)) {
      out.push_back(std::move(*d));
    } else if (auto m = missing_call(v, g)) {
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

PostmortemResult analyse_flight_records(const FrJob& job, const PostmortemOptions& options) {
  PostmortemResult res;
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
  for (const auto& d : res.divergences) {
    for (int64_t r : d.issued) {
      auto& s = res.ranks[static_cast<std::size_t>(r)];
      if (s.role == RankRole::kComplete) s.role = RankRole::kWaiting;
    }
    for (int64_t r : d.not_issued) res.ranks[static_cast<std::size_t>(r)].role = RankRole::kCulprit;
  }
  for (auto& d : res.divergences) {
    for (int64_t r : d.not_issued) {
      if (!res.ranks[static_cast<std::size_t>(r)].last_call_unmatched) d.blames_idle_rank = true;
    }
  }
  std::stable_sort(res.divergences.begin(), res.divergences.end(),
                   [](const Divergence& x, const Divergence& y) {
                     return x.blames_idle_rank && !y.blames_idle_rank;
                   });
  if (static_cast<int64_t>(res.divergences.size()) > options.max_divergences) {
    res.notes.push_back(fmt::format("{} divergences found; the first {} are kept",
                                    res.divergences.size(), options.max_divergences));
    res.divergences.resize(static_cast<std::size_t>(options.max_divergences));
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
  if (res.diverged()) {
    res.matches = match_protocols(job, res.divergences[0], options, &res.naming_note);
  }
  return res;
}

}  // namespace lossguard::oracle

namespace lossguard::oracle {

namespace {

std::optional<GroupKind> megatron_kind(std::string desc) {
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

}  // namespace

void resolve_megatron_groups(FrJob& job) {
  const int64_t world = job.world;
  if (world < 1 || world > (int64_t{1} << 20)) return;
  std::vector<std::pair<uint32_t, GroupKind>> described;
  for (uint32_t g = 0; g < job.groups.size(); ++g) {
    const FrGroup& group = job.groups[g];
    if (!group.members_inferred || group.members.empty()) continue;
    if (auto k = megatron_kind(group.desc)) described.push_back({g, *k});
  }
  if (described.empty()) return;
  // The members each consistent layout gives each described group; nullopt once layouts differ.
  std::vector<std::optional<std::vector<int64_t>>> agreed(described.size());
  std::vector<std::string> layouts;
  for (const Topology& t : dense_layouts(world)) {
    std::map<std::tuple<std::string, int, int64_t>, uint32_t> taken;
    bool ok = true;
    for (const auto& [g, kind] : described) {
      const auto& members = job.groups[g].members;
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
  if (layouts.empty()) return;
  std::vector<std::string> completed;
  for (std::size_t k = 0; k < described.size(); ++k) {
    FrGroup& group = job.groups[described[k].first];
    if (!agreed[k] || *agreed[k] == group.members) continue;
    group.members = *agreed[k];
    group.members_inferred = false;
    group.members_from_layout = true;
    completed.push_back(fmt::format("'{}' ({})", group.name, group.desc));
  }
  if (!completed.empty()) {
    job.notes.push_back(fmt::format(
        "members of group(s) {} completed from Megatron's layout: every layout of {} ranks that "
        "fits the groups' descriptions ({}{}) gives them the same ranks",
        fmt::join(completed, ", "), world,
        fmt::join(layouts.begin(), layouts.begin() + std::min<std::size_t>(layouts.size(), 4),
                  ", "),
        layouts.size() > 4 ? ", ..." : ""));
  }
}

Judgement PostmortemResult::judgement() const {
  if (no_collectives()) {
    return Judgement::nothing_verified(
        "the dumps hold no collective call (was TORCH_FR_BUFFER_SIZE > 0 in the job?)");
  }
  return Judgement::verified(false, diverged());
}

}  // namespace lossguard::oracle
