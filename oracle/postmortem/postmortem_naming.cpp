// A divergence named by the skip-decision model (SPEC §12 "Naming"): every protocol of SPEC §7 is
// simulated (oracle/replay/replay.h) on each Megatron layout of the job's world that holds the
// divergent group, over a few data scenarios; the simulated ranks' calls become Flight Recorder
// dumps, the same alignment finds their divergences, and a protocol matches when one of them is the
// observed divergence (same kind, group members and ranks on each side) and each rank's own
// decision calls appear, in order, at the end of what it recorded.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <thread>

#include "oracle/postmortem/postmortem.h"
#include "oracle/replay/replay.h"

namespace lossguard::oracle {

namespace {

struct SimCall {
  Op op;
  GroupRef group;
  Payload payload;
};

// The name a Flight Recorder gives the operation: a MAX all-reduce is an all_reduce there.
const char* fr_op(Op op) { return op == Op::kAllReduceMax ? "all_reduce" : op_name(op); }

// A call as the comparison sees it: its operation, whether it carries integers (a count, a
// flag) or floating point (gradients, a norm), and how many elements: "all_reduce/int/1". A
// decision call carries one element; a gradient bucket any number ("*" in a simulated call).
std::string call_class(const FrSignature& s) {
  std::string cls = "none";
  for (const auto& d : s.input_dtypes) {
    const bool integer = d == "Long" || d == "Int" || d == "Short" || d == "Char" || d == "Byte" ||
                         d == "Bool" || d == "int64" || d == "int32";
    cls = integer ? "int" : "float";
  }
  int64_t n = 0;
  bool any = false;  // a simulated bucket: size -1
  for (const auto& shape : s.input_sizes) {
    int64_t k = 1;
    for (int64_t x : shape) {
      any = any || x < 0;
      k = x < 0 || k > (int64_t{1} << 40) ? k : k * x;
    }
    n += k;
  }
  return any ? fmt::format("{}/{}/*", s.op, cls) : fmt::format("{}/{}/{}", s.op, cls, n);
}

// Whether an observed call class fits a simulated one ("*" in the element count: any).
bool class_fits(const std::string& simulated, const std::string& observed) {
  if (simulated == observed) return true;
  const std::size_t k = simulated.rfind('/');
  return k != std::string::npos && simulated.compare(k, std::string::npos, "/*") == 0 &&
         observed.compare(0, k + 1, simulated, 0, k + 1) == 0;
}

// What decides a match: the divergence's kind, its group's members, how it splits them and what
// each side issued. A simulated barrier stands for whatever the job does next ("*").
struct Shape {
  DivergenceKind kind;
  std::vector<int64_t> members;
  std::vector<std::vector<int64_t>>
      sides;                       // missing call: {issued, not issued}; mismatch: variants
  std::vector<std::string> calls;  // per side: call_class, "" for none, "*" for any
  bool matches(const Shape& observed) const {
    if (kind != observed.kind || members != observed.members || sides != observed.sides)
      return false;
    for (std::size_t k = 0; k < calls.size(); ++k) {
      if (calls[k] != "*" && !class_fits(calls[k], observed.calls[k])) return false;
    }
    return true;
  }
};

Shape shape_of(const FrJob& job, const Divergence& d, bool simulated) {
  Shape s{d.kind, job.groups[d.group].members, {}, {}};
  if (d.kind == DivergenceKind::kMismatch) {
    std::vector<std::pair<std::vector<int64_t>, std::string>> sides;
    for (const auto& [sig, ranks] : d.variants)
      sides.push_back({ranks, call_class(job.signatures[sig])});
    std::sort(sides.begin(), sides.end());
    for (auto& [ranks, cls] : sides) {
      s.sides.push_back(ranks);
      s.calls.push_back(cls);
    }
  } else {
    s.sides = {d.issued, d.not_issued};
    const FrSignature& sig = job.signatures[d.signature];
    s.calls = {simulated && sig.op == "barrier" ? "*" : call_class(sig), ""};
  }
  return s;
}

const char* payload_dtype(Payload p) {
  switch (p) {
    case Payload::kCount:
    case Payload::kFlag:
      return "Long";
    case Payload::kNone:
      return "";
    default:
      return "Float";
  }
}

bool bucket_payload(Payload p) {
  return p == Payload::kGradients || p == Payload::kExpertGradients || p == Payload::kTokens;
}

struct Scenario {
  std::string label;
  std::vector<std::vector<int64_t>> tokens;  // [dp * CP + cp][micro-batch]
  std::vector<int64_t> nan_ranks;
};

std::vector<Scenario> scenarios_for(const Topology& t, const std::vector<int64_t>& ranks) {
  const auto slots = static_cast<std::size_t>(t.dp() * t.cp());
  std::vector<Scenario> out;
  out.push_back(
      {"a step with effective tokens", std::vector<std::vector<int64_t>>(slots, {1}), {}});
  out.push_back({"a zero-token step", std::vector<std::vector<int64_t>>(slots, {0}), {}});
  for (int64_t r : ranks) {
    const Coord c = t.coord(r);
    const auto slot = static_cast<std::size_t>(c.dp * t.cp() + c.cp);
    Scenario empty{fmt::format("rank {}'s micro-batch holds no effective token", r),
                   std::vector<std::vector<int64_t>>(slots, {1}),
                   {}};
    empty.tokens[slot] = {0};
    out.push_back(std::move(empty));
    Scenario fewer{fmt::format("rank {}'s DP rank has one micro-batch fewer", r),
                   std::vector<std::vector<int64_t>>(slots, {1, 1}),
                   {}};
    for (int64_t cp = 0; cp < t.cp(); ++cp)
      fewer.tokens[static_cast<std::size_t>(c.dp * t.cp() + cp)] = {1};
    out.push_back(std::move(fewer));
    out.push_back({fmt::format("a non-finite gradient on rank {}", r),
                   std::vector<std::vector<int64_t>>(slots, {1}),
                   {r}});
  }
  return out;
}

// The simulated step as Flight Recorder dumps: group "kind:id" with its members, a call's
// signature its operation and payload.
FrJob simulated_dumps(const Topology& t, const std::vector<std::vector<SimCall>>& traces,
                      const std::vector<std::vector<int64_t>>& times) {
  FrJobBuilder b;
  std::map<std::pair<int, int64_t>, uint32_t> group_ids;
  std::map<std::pair<int, int>, uint32_t> signatures;  // (op, payload): a few per simulation
  b.job().world = t.world();
  b.job().ranks.resize(traces.size());
  for (std::size_t r = 0; r < traces.size(); ++r) {
    FrRankDump& d = b.job().ranks[r];
    d.rank = static_cast<int64_t>(r);
    std::map<uint32_t, int64_t> seq;
    for (std::size_t k = 0; k < traces[r].size(); ++k) {
      const SimCall& c = traces[r][k];
      auto [it, fresh] = group_ids.try_emplace({static_cast<int>(c.group.kind), c.group.id}, 0u);
      if (fresh) {
        it->second = b.group(fmt::format("{}:{}", group_kind_name(c.group.kind), c.group.id), "");
        b.job().groups[it->second].members = t.members(c.group);
      }
      FrCall call;
      call.record_id = static_cast<int64_t>(k);
      call.time_created_ns = times[r][k];
      call.group = it->second;
      call.seq = ++seq[it->second];
      auto [sig, new_sig] =
          signatures.try_emplace({static_cast<int>(c.op), static_cast<int>(c.payload)}, 0u);
      if (new_sig) {
        FrSignature s;
        s.op = fr_op(c.op);
        s.profiling_name = fmt::format("sim:{} {}", s.op, payload_name(c.payload));
        if (c.payload != Payload::kNone) {
          // A decision call (a count, a flag, a norm) carries one element; buckets any number.
          s.input_sizes = {{bucket_payload(c.payload) ? -1 : 1}};
          s.input_dtypes = {payload_dtype(c.payload)};
        }
        s.output_sizes = s.input_sizes;
        s.output_dtypes = s.input_dtypes;
        sig->second = b.signature(std::move(s));
      }
      call.signature = sig->second;
      d.calls.push_back(call);
    }
  }
  return b.take();
}

// Where the job describes a group as Megatron does, the simulated call's group must be of that
// kind (DP and DP+CP alike): one-rank groups of another kind hold the same members. A group
// without such a description fits by its members alone.
bool kind_fits(GroupKind simulated, const std::string& desc) {
  const auto k = megatron_group_kind(desc);
  if (!k || *k == simulated) return true;
  const auto dp = [](GroupKind x) { return x == GroupKind::kDp || x == GroupKind::kDpCp; };
  return dp(*k) && dp(simulated);
}

// Whether `sim`'s calls (without the trailing barrier that stands for the next step) appear in
// order at the end of what `rank` recorded: same operation, dtype class and element count, same
// group members — or, for the token count, a group holding them (a job may all-reduce its count
// over the world group instead of DP x CP).
bool tail_matches(const FrJob& job, const FrRankDump& observed, const Topology& t,
                  const std::vector<SimCall>& sim) {
  std::size_t n = sim.size();
  while (n > 0 && sim[n - 1].op == Op::kBarrier) --n;
  int64_t j = static_cast<int64_t>(observed.calls.size()) - 1;
  for (std::size_t i = n; i-- > 0;) {
    const SimCall& c = sim[i];
    const std::vector<int64_t> members = t.members(c.group);
    FrSignature want;
    want.op = fr_op(c.op);
    if (c.payload != Payload::kNone) {
      want.input_sizes = {{bucket_payload(c.payload) ? -1 : 1}};
      want.input_dtypes = {payload_dtype(c.payload)};
    }
    const std::string cls = call_class(want);
    const bool count = c.payload == Payload::kCount;
    while (j >= 0) {
      const FrCall& o = observed.calls[static_cast<std::size_t>(j)];
      const auto& om = job.groups[o.group].members;
      if (!o.is_p2p && class_fits(cls, call_class(job.signatures[o.signature])) &&
          kind_fits(c.group.kind, job.groups[o.group].desc) &&
          (om == members || (count && om.size() > members.size() &&
                             std::includes(om.begin(), om.end(), members.begin(), members.end()))))
        break;
      --j;
    }
    if (j < 0) return false;
    --j;
  }
  return true;
}

// The observed divergence and the ranks whose traces a model must explain.
struct Observed {
  const FrJob& job;
  Shape shape;
  std::vector<int64_t> judged;  // issuers and blamed ranks, the first 64
};

ReplayInputs scenario_inputs(const Topology& t, Protocol p, std::optional<GroupKind> flag_group,
                             const Scenario& sc) {
  ReplayInputs in;
  in.topo = t;
  in.protocol = p;
  if (flag_group) in.flag_group = *flag_group;
  in.microbatch_tokens = sc.tokens;
  in.local_samples.assign(sc.tokens.size(), 0);
  for (std::size_t s = 0; s < sc.tokens.size(); ++s) {
    in.local_samples[s] = static_cast<int64_t>(sc.tokens[s].size());
    for (int64_t n : sc.tokens[s]) in.global_tokens += n;
  }
  in.nan_ranks = sc.nan_ranks;
  in.num_samples = 1;
  return in;
}

// Whether the protocol's simulated step, on `in`, diverges as observed (one of its divergences has
// the observed shape) and every judged rank recorded its calls at the end of its trace.
bool diverges_as_observed(const Observed& o, const ReplayInputs& in) {
  const Topology& t = in.topo;
  const auto world = static_cast<std::size_t>(t.world());
  std::vector<std::vector<SimCall>> traces(world);
  std::vector<std::vector<int64_t>> times(world);
  int64_t clock = 0;
  simulate(in, [&](int64_t r, const CollectiveCall& c) {
    traces[static_cast<std::size_t>(r)].push_back({c.op, c.group, c.payload});
    times[static_cast<std::size_t>(r)].push_back(++clock);
  });
  const FrJob sim = simulated_dumps(t, traces, times);
  bool same = false;
  for (const auto& sd : find_divergences(sim, nullptr))
    same = same || shape_of(sim, sd, true).matches(o.shape);
  if (!same) return false;
  for (int64_t r : o.judged) {
    const auto& dumps = o.job.ranks;
    auto it = std::lower_bound(dumps.begin(), dumps.end(), r,
                               [](const FrRankDump& x, int64_t v) { return x.rank < v; });
    if (it == dumps.end() || it->rank != r ||
        !tail_matches(o.job, *it, t, traces[static_cast<std::size_t>(r)]))
      return false;
  }
  return true;
}

bool same_layout(const Topology& a, const Topology& b) {
  return a.tp() == b.tp() && a.pp() == b.pp() && a.cp() == b.cp() && a.dp() == b.dp();
}

std::string topology_name(const Topology& t) {
  return fmt::format("TP{} PP{} CP{} DP{}", t.tp(), t.pp(), t.cp(), t.dp());
}

}  // namespace

// Long: the search in its order (what cannot be named, the layouts consistent with the known
// groups, protocols x flag groups x scenarios, the note when none fits).
std::vector<ProtocolMatch> match_protocols(const FrJob& job, const Divergence& d,
                                           const PostmortemOptions& options, std::string* note) {
  std::vector<ProtocolMatch> out;
  auto say = [&](std::string s) {
    if (note != nullptr) *note = std::move(s);
  };
  if (d.kind != DivergenceKind::kMissingCall && d.kind != DivergenceKind::kMismatch) {
    say("a p2p divergence: no skip-decision protocol issues p2p calls");
    return out;
  }
  const int64_t world = job.world;
  if (world < 1 || world > options.naming_max_world) {
    say(fmt::format("the protocol search runs up to {} ranks; the job has {}",
                    options.naming_max_world, world));
    return out;
  }
  if (!d.no_dump.empty()) {
    say("a member of the divergent group has no dump: its part cannot be compared with a model");
    return out;
  }
  Observed observed{job, shape_of(job, d, false), d.issued};
  // The skip-decision programs issue all-reduces (counts, flags, norms, gradient buckets),
  // broadcasts of a flag, the MoE all-to-all and barriers: a divergence in any other call
  // (a reduce-scatter, an all-gather) is none of theirs, whatever the layout.
  static const char* kIssued[] = {"all_reduce/int/1", "all_reduce/float/1", "all_reduce/float/*",
                                  "broadcast/int/1",  "all_to_all/float/*", "all_to_all/int/*"};
  for (const std::string& cls : observed.shape.calls) {
    if (cls.empty() || cls.rfind("barrier/", 0) == 0) continue;
    bool issued = false;
    for (const char* k : kIssued) issued = issued || class_fits(k, cls);
    if (!issued) {
      say(
          fmt::format("no skip-decision protocol issues a call like {} (what the divergence's "
                      "side issued)",
                      cls));
      return out;
    }
  }
  const std::vector<int64_t>& members = observed.shape.members;
  if (members.empty()) return out;
  std::vector<int64_t> representatives;
  if (!d.not_issued.empty()) representatives.push_back(d.not_issued.front());
  if (!d.issued.empty()) representatives.push_back(d.issued.front());
  observed.judged.insert(observed.judged.end(), d.not_issued.begin(), d.not_issued.end());
  if (observed.judged.size() > 64) observed.judged.resize(64);

  // Groups whose members are known: a layout that lacks one of them is not this job's.
  std::vector<const FrGroup*> known;
  for (const auto& g : job.groups)
    if (!g.members_inferred && !g.members.empty() && g.members.back() < world) known.push_back(&g);
  auto holds = [](const Topology& t, const std::vector<int64_t>& m) {
    if (static_cast<int64_t>(m.size()) == t.world()) return true;
    for (GroupKind k : kAllGroupKinds) {
      if (t.group_size(k) == static_cast<int64_t>(m.size()) &&
          t.members(t.group_of(k, m.front())) == m)
        return true;
    }
    return false;
  };
  // A group Megatron describes is a group of that kind in the layout (DATA_PARALLEL_GROUP is DP
  // without CP: at CP 1 it is DP+CP's group too, which the layout then gives the same members).
  auto holds_as_described = [&](const Topology& t, const FrGroup& g) {
    const auto kind = megatron_group_kind(g.desc);
    if (!kind) return holds(t, g.members);
    return t.group_size(*kind) == static_cast<int64_t>(g.members.size()) &&
           t.members(t.group_of(*kind, g.members.front())) == g.members;
  };
  int64_t layouts_skipped = 0;
  std::vector<Topology> layouts;
  for (const Topology& t : dense_layouts(world)) {
    if (!holds(t, members)) continue;
    bool consistent = true;
    for (const FrGroup* g : known) consistent = consistent && holds_as_described(t, *g);
    if (consistent) {
      layouts.push_back(t);
    } else {
      ++layouts_skipped;
    }
  }
  // Each layout's matches, (protocol, flag group, scenario) in table order; the layouts run on
  // every core (each simulation is independent and reads only `observed`).
  struct Hit {
    Protocol protocol;
    std::optional<GroupKind> flag_group;
    std::string scenario;
  };
  std::vector<std::vector<Hit>> hits(layouts.size());
  std::vector<int64_t> tries(layouts.size(), 0);
  auto search = [&](std::size_t k) {
    const Topology& t = layouts[k];
    const std::vector<Scenario> scenarios = scenarios_for(t, representatives);
    for (const auto& [p, name] : ModeNames<Protocol>::kTable) {
      (void)name;
      std::vector<std::optional<GroupKind>> flag_groups = {std::nullopt};
      if (protocol_parts(p).flag_broadcast)
        flag_groups = {GroupKind::kTp, GroupKind::kCp, GroupKind::kDp};
      for (const auto& fg : flag_groups) {
        for (const Scenario& sc : scenarios) {
          ++tries[k];
          if (!diverges_as_observed(observed, scenario_inputs(t, p, fg, sc))) continue;
          hits[k].push_back({p, fg, sc.label});
          break;  // one scenario per protocol and layout is enough
        }
      }
    }
  };
  const std::size_t workers = std::max<std::size_t>(
      1, std::min<std::size_t>(layouts.size(), std::thread::hardware_concurrency()));
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t k = next++; k < layouts.size(); k = next++) search(k);
  };
  std::vector<std::thread> threads;
  for (std::size_t w = 1; w < workers; ++w) threads.emplace_back(work);
  work();
  for (auto& th : threads) th.join();
  std::map<std::pair<Protocol, int>, std::size_t> found;  // (protocol, flag group) -> out index
  int64_t tried = 0;
  for (std::size_t k = 0; k < layouts.size(); ++k) {
    tried += tries[k];
    const Topology& t = layouts[k];
    for (const Hit& h : hits[k]) {
      const auto key =
          std::make_pair(h.protocol, h.flag_group ? static_cast<int>(*h.flag_group) : -1);
      auto [fit, fresh] = found.try_emplace(key, out.size());
      auto& also =
          fresh ? out.emplace_back(ProtocolMatch{h.protocol, t, h.scenario, h.flag_group, {}})
                      .also_topologies
                : out[fit->second].also_topologies;
      const std::string n = topology_name(t);
      if (!fresh && also.size() < 4 && !same_layout(out[fit->second].topo, t) &&
          std::find(also.begin(), also.end(), n) == also.end())
        also.push_back(n);
    }
  }
  if (out.empty()) {
    say(fmt::format(
        "no protocol of the skip-decision model diverges this way ({} simulations "
        "over the layouts of {} ranks that hold the job's groups{})",
        tried, world,
        layouts_skipped > 0 ? fmt::format("; {} layouts lack one of them", layouts_skipped) : ""));
  }
  std::stable_sort(out.begin(), out.end(), [](const ProtocolMatch& a, const ProtocolMatch& b) {
    return static_cast<int>(a.protocol) < static_cast<int>(b.protocol);
  });
  return out;
}

}  // namespace lossguard::oracle
