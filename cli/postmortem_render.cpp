// `postmortem`'s text and JSON (cli/postmortem_render.h): only reads the result.
#include "cli/postmortem_render.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/printable.h"
#include "oracle/replay/rank_set.h"
#include "oracle/replay/replay_protocol.h"

namespace lossguard::cli {

namespace {

using oracle::Divergence;
using oracle::DivergenceKind;
using oracle::format_rank_set;
using oracle::ranks_phrase;

std::string group_text(const FrJob& job, uint32_t g) {
  const FrGroup& group = job.groups[g];
  std::string desc = group.desc.empty() || group.desc == "undefined" ? "" : group.desc + ", ";
  return fmt::format("group '{}' ({}{} {}{})", printable(group.name), printable(desc),
                     group.members.size(), group.members.size() == 1 ? "rank" : "ranks",
                     group.members.empty() ? "" : ": " + format_rank_set(group.members, 4)) +
         (group.members_inferred ? "*" : "");
}

std::string state_name(FrState s) {
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

// The job's own frames first: the torch.distributed wrappers every call passes through say
// nothing about where the job was.
std::vector<const FrFrame*> shown_frames(const FrJob& job, uint32_t stack, int64_t max) {
  std::vector<const FrFrame*> mine, all;
  for (const auto& f : job.stacks[stack]) {
    all.push_back(&f);
    if (f.filename.find("/torch/") == std::string::npos) mine.push_back(&f);
  }
  auto& use = mine.empty() ? all : mine;
  if (static_cast<int64_t>(use.size()) > max) use.resize(static_cast<std::size_t>(max));
  return use;
}

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

std::string topology_text(const oracle::Topology& t) {
  return fmt::format("TP{} PP{} CP{} DP{}", t.tp(), t.pp(), t.cp(), t.dp());
}

const FrRankDump* dump_of(const FrJob& job, int64_t rank) {
  auto it = std::lower_bound(job.ranks.begin(), job.ranks.end(), rank,
                             [](const FrRankDump& d, int64_t r) { return d.rank < r; });
  return it != job.ranks.end() && it->rank == rank ? &*it : nullptr;
}

void render_frames(std::ostream& out, const FrJob& job, uint32_t stack, int64_t max) {
  for (const FrFrame* f : shown_frames(job, stack, max))
    out << fmt::format("      at {} ({}:{})\n", printable(f->name), printable(f->filename),
                       f->line);
}

// A call's state as the dump says it: its own field, its retirement or pg_status (Gloo's
// entries all read "scheduled").
std::string state_text(const FrRankDump& d, const FrCall& c) {
  if (c.state == FrState::kCompleted) return "completed";
  if (d.finished(c)) return c.retired ? "retired: completed or failed" : "completed (pg_status)";
  // Gloo leaves a call "scheduled" until the recorder retires it, which can come after a dump
  // taken right after the call returned: not retired is not pending.
  return c.state == FrState::kScheduled ? "scheduled, not retired" : state_name(c.state);
}

// What a blamed rank last did: its last call and whether it completed on every member.
void render_last_call(std::ostream& out, const FrJob& job, const oracle::RankState& s,
                      const PostmortemRenderOptions& o, const std::string& who) {
  const FrRankDump* d = dump_of(job, s.rank);
  if (d == nullptr) {
    out << fmt::format("  {}: left no dump\n", who);
    return;
  }
  if (!s.last_call) {
    out << fmt::format("  {}: recorded no call at all\n", who);
    return;
  }
  const FrCall& c = d->calls[*s.last_call];
  out << fmt::format("  {}: last call {} ({}), {}\n", who, call_text(job, c), state_text(*d, c),
                     s.last_call_unmatched
                         ? "which some member never issued: it waits there, inside another "
                           "group's collective"
                         : "issued by every member; nothing recorded after it (it died, or hangs "
                           "outside collectives)");
  render_frames(out, job, c.stack, o.frames);
}

nlohmann::ordered_json frames_json(const FrJob& job, uint32_t stack) {
  nlohmann::ordered_json a = nlohmann::ordered_json::array();
  for (const auto& f : job.stacks[stack])
    a.push_back({{"name", f.name}, {"filename", f.filename}, {"line", f.line}});
  return a;
}

nlohmann::ordered_json signature_json(const FrSignature& s) {
  return {{"op", s.op},
          {"profiling_name", s.profiling_name},
          {"input_sizes", s.input_sizes},
          {"input_dtypes", s.input_dtypes},
          {"output_sizes", s.output_sizes},
          {"output_dtypes", s.output_dtypes}};
}

}  // namespace

namespace {

// Each side of a cycle of waits: where it waits, for whom, called from where.
void render_cycle(std::ostream& out, const FrJob& job, const oracle::PostmortemResult& r,
                  const PostmortemRenderOptions& o) {
  for (const auto& st : r.root->cycle) {
    const Divergence& d = r.divergences[st.divergence];
    out << fmt::format("  rank {} waits in {} #{} on {} for {}\n", st.rank,
                       printable(job.signatures[d.signature].op), d.seq, group_text(job, d.group),
                       ranks_phrase(st.waits_for));
    const FrRankDump* dump = dump_of(job, st.rank);
    if (dump == nullptr) continue;
    for (const auto& c : dump->calls) {
      if (!c.is_p2p && c.group == d.group && c.seq == d.seq) {
        render_frames(out, job, c.stack, o.frames);
        break;
      }
    }
  }
}

// The headline divergence: the blamed ranks grouped by what they last did, and where the issuers
// wait.
void render_divergence(std::ostream& out, const FrJob& job, const oracle::PostmortemResult& r,
                       const PostmortemRenderOptions& o) {
  const Divergence& d = r.divergences.front();
  if (r.root) {
    out << "\nROOT: " << printable(r.root->summary) << "\n";
    for (std::size_t k = 0; k < r.root->readings.size(); ++k)
      out << fmt::format("  {} {}\n",
                         k == 0 ? "reading:" : "     or:", printable(r.root->readings[k]));
    if (r.root->by_time)
      out << "  (several divergences explain as many waits: the earliest created was chosen)\n";
    render_cycle(out, job, r, o);
  }
  out << "\nDIVERGENCE: " << headline(job, d) << "\n";
  if (!d.no_dump.empty())
    out << fmt::format("  {} of the group left no dump\n", ranks_phrase(d.no_dump));
  std::map<std::string, std::vector<int64_t>> by_last;
  std::map<std::string, int64_t> example;
  for (int64_t rank : d.not_issued) {
    const auto& s = r.ranks[static_cast<std::size_t>(rank)];
    const FrRankDump* dump = dump_of(job, rank);
    std::string key = "none";
    if (dump && s.last_call) {
      const FrCall& c = dump->calls[*s.last_call];
      key = fmt::format("{}|{}|{}|{}", call_text(job, c), s.last_call_unmatched, c.stack,
                        c.state == FrState::kCompleted);
    }
    by_last[key].push_back(rank);
    example.try_emplace(key, rank);
  }
  for (const auto& [key, ranks] : by_last) {
    render_last_call(out, job, r.ranks[static_cast<std::size_t>(example[key])], o,
                     ranks_phrase(ranks));
  }
  if (d.kind != DivergenceKind::kMissingCall || d.issued.empty()) return;
  const FrRankDump* dump = dump_of(job, d.issued.front());
  if (dump == nullptr) return;
  for (const auto& c : dump->calls) {
    if (c.group == d.group && c.seq == d.seq && !c.is_p2p) {
      out << fmt::format("  {} {} in it{}\n", ranks_phrase(d.issued),
                         d.issued.size() == 1 ? "waits" : "wait", c.stack ? ", called from:" : "");
      render_frames(out, job, c.stack, o.frames);
      return;
    }
  }
}

std::string flag_group_text(const oracle::ProtocolMatch& m) {
  return m.flag_group
             ? fmt::format(" (flag on the {} group)", oracle::group_kind_name(*m.flag_group))
             : "";
}

// The protocols that diverge so, the first named, or why none was tried.
void render_matches(std::ostream& out, const oracle::PostmortemResult& r) {
  if (r.matches.empty()) {
    if (!r.naming_note.empty()) out << "\nnot named: " << printable(r.naming_note) << "\n";
    return;
  }
  const auto& m = r.matches.front();
  if (r.named()) {
    out << fmt::format("\nNAMED: {}{} on {}: {}\n", oracle::protocol_name(m.protocol),
                       flag_group_text(m), topology_text(m.topo),
                       oracle::protocol_description(m.protocol));
    out << fmt::format("  its simulated step diverges exactly so ({}){}\n", m.scenario,
                       m.also_topologies.empty() ? ""
                                                 : fmt::format("; the dumps fit {} too",
                                                               fmt::join(m.also_topologies, ", ")));
    return;
  }
  std::vector<std::string> names;
  for (const auto& x : r.matches)
    names.push_back(fmt::format("{}{}", oracle::protocol_name(x.protocol), flag_group_text(x)));
  out << fmt::format("\nCONSISTENT WITH {} protocols, not named: {}\n", r.matches.size(),
                     fmt::join(names, " or "));
  for (const auto& x : r.matches) {
    out << fmt::format("  {}{} on {} ({}): {}\n", oracle::protocol_name(x.protocol),
                       flag_group_text(x), topology_text(x.topo), x.scenario,
                       oracle::protocol_description(x.protocol));
  }
}

}  // namespace

void render_postmortem_text(std::ostream& out, const FrJob& job, const oracle::PostmortemResult& r,
                            const PostmortemRenderOptions& o) {
  const std::string version = job.ranks.empty() ? "?" : job.ranks.front().version;
  out << fmt::format(
      "postmortem: {} Flight Recorder dumps (version {}) of {}, {} calls on {} process groups\n",
      job.ranks.size(), printable(version),
      job.world_known ? fmt::format("{} ranks ({})", job.world, job.world_source)
                      : "a job of unknown size (no --world, no layout, no pg_config)",
      r.total_calls, job.groups.size());
  if (!r.missing.empty())
    out << fmt::format("  no dump from {}: suspects in every group they belong to\n",
                       ranks_phrase(r.missing));
  // What the loader and the alignment inferred, after the verdict: read when the verdict is
  // doubted.
  auto notes = [&] {
    bool inferred = false;
    for (const auto& g : job.groups) inferred = inferred || g.members_inferred;
    if (inferred)
      out << "* members unknown: only the ranks seen calling on the group (no pg_config, no "
             "layout)\n";
    for (const auto& n : r.notes) out << "note: " << printable(n) << "\n";
  };
  if (r.no_collectives()) {
    out << "\nNO COLLECTIVE recorded: nothing to align (was TORCH_FR_BUFFER_SIZE > 0?)\n";
    notes();
    return;
  }
  if (!r.diverged()) {
    if (!r.unverified.empty()) {
      out << "\nNO DIVERGENCE among the dumps given, NOT VERIFIED (exit 4): a hung job can look "
             "like this when\n";
      for (const auto& u : r.unverified) out << "  - " << printable(u) << "\n";
    } else {
      out << fmt::format(
          "\nNO DIVERGENCE: every group's calls matched through the last ({} ranks complete)\n",
          r.complete.size());
    }
    notes();
    return;
  }
  render_divergence(out, job, r, o);
  render_matches(out, r);
  auto count = [](const std::vector<int64_t>& ranks, const char* what) {
    return ranks.empty() ? fmt::format("0 {}", what)
                         : fmt::format("{} {} ({})", ranks.size(), what, format_rank_set(ranks, 4));
  };
  out << fmt::format("\nranks: {}, {}, {}, {}\n", count(r.culprits, "culprit"),
                     count(r.waiting, "waiting"), count(r.complete, "complete"),
                     count(r.missing, "missing"));
  if (r.divergences.size() > 1) {
    out << fmt::format("other divergences ({}):\n", r.divergences.size() - 1);
    for (std::size_t k = 1;
         k < r.divergences.size() && static_cast<int64_t>(k) <= o.shown_divergences; ++k)
      out << "  " << headline(job, r.divergences[k]) << "\n";  // escaped piecewise
    if (static_cast<int64_t>(r.divergences.size()) > o.shown_divergences + 1)
      out << "  ... (--json has all)\n";
  }
  notes();
}

namespace {

nlohmann::ordered_json divergence_json(const FrJob& job, const Divergence& d) {
  nlohmann::ordered_json x = {{"kind", oracle::divergence_kind_name(d.kind)},
                              {"group", job.groups[d.group].name},
                              {"group_desc", job.groups[d.group].desc},
                              {"seq", d.seq},
                              {"time_created_ns", d.time_ns},
                              {"call", signature_json(job.signatures[d.signature])},
                              {"issued", d.issued},
                              {"not_issued", d.not_issued},
                              {"no_dump", d.no_dump},
                              {"blames_idle_rank", d.blames_idle_rank},
                              {"pending", d.pending},
                              {"members_unknown", d.members_unknown},
                              {"summary", headline(job, d)}};
  if (d.kind == DivergenceKind::kMismatch) {
    nlohmann::ordered_json vars = nlohmann::ordered_json::array();
    for (const auto& [sig, ranks] : d.variants)
      vars.push_back({{"call", signature_json(job.signatures[sig])}, {"ranks", ranks}});
    x["variants"] = vars;
    x["detail"] = d.detail;
  }
  return x;
}

// The first 256 culprits, each with its last call.
nlohmann::ordered_json culprits_json(const FrJob& job, const oracle::PostmortemResult& r) {
  nlohmann::ordered_json last = nlohmann::ordered_json::array();
  for (int64_t rank : r.culprits) {
    if (last.size() >= 256) break;
    const auto& s = r.ranks[static_cast<std::size_t>(rank)];
    const FrRankDump* dump = dump_of(job, rank);
    nlohmann::ordered_json x = {{"rank", rank}, {"calls", s.calls}, {"last_call", nullptr}};
    if (dump && s.last_call) {
      const FrCall& c = dump->calls[*s.last_call];
      x["last_call"] = {{"group", job.groups[c.group].name},
                        {"seq", c.seq},
                        {"call", signature_json(job.signatures[c.signature])},
                        {"state", state_name(c.state)},
                        {"finished", dump->finished(c)},
                        {"timeout_ms", c.timeout_ms},
                        {"issued_by_every_member", !s.last_call_unmatched},
                        {"frames", frames_json(job, c.stack)}};
    }
    last.push_back(x);
  }
  return last;
}

}  // namespace

nlohmann::ordered_json postmortem_json(const FrJob& job, const oracle::PostmortemResult& r,
                                       const PostmortemRenderOptions& o) {
  (void)o;
  nlohmann::ordered_json j;
  j["world"] = job.world;
  j["world_known"] = job.world_known;
  j["world_source"] =
      job.world_known ? nlohmann::ordered_json(job.world_source) : nlohmann::ordered_json(nullptr);
  j["total_calls"] = r.total_calls;
  j["diverged"] = r.diverged();
  nlohmann::ordered_json groups = nlohmann::ordered_json::array();
  for (const auto& g : job.groups) {
    groups.push_back({{"name", g.name},
                      {"desc", g.desc},
                      {"size", g.members.size()},
                      {"members", format_rank_set(g.members, 64)},
                      {"members_source", g.members_source()},
                      {"members_inferred", g.members_inferred},
                      {"members_from_layout", g.members_from_layout}});
  }
  j["groups"] = groups;
  nlohmann::ordered_json divs = nlohmann::ordered_json::array();
  for (const auto& d : r.divergences) divs.push_back(divergence_json(job, d));
  j["divergences"] = divs;
  j["ranks"] = {{"culprit", r.culprits},
                {"waiting", r.waiting},
                {"complete", r.complete},
                {"missing", r.missing}};
  j["culprits"] = culprits_json(job, r);
  j["root"] = nullptr;
  if (r.root) {
    nlohmann::ordered_json cycle = nlohmann::ordered_json::array();
    for (const auto& st : r.root->cycle) {
      const Divergence& d = r.divergences[st.divergence];
      cycle.push_back({{"rank", st.rank},
                       {"group", job.groups[d.group].name},
                       {"group_desc", job.groups[d.group].desc},
                       {"seq", d.seq},
                       {"divergence", st.divergence},
                       {"waits_for", st.waits_for}});
    }
    j["root"] = {{"kind", oracle::root_kind_name(r.root->kind)},
                 {"culprits", r.root->culprits},
                 {"summary", r.root->summary},
                 {"readings", r.root->readings},
                 {"cycle", cycle},
                 {"explains_waiting_ranks", r.root->explains},
                 {"by_time", r.root->by_time}};
  }
  j["unverified"] = r.unverified;
  nlohmann::ordered_json matches = nlohmann::ordered_json::array();
  for (const auto& m : r.matches) {
    matches.push_back(
        {{"protocol", oracle::protocol_name(m.protocol)},
         {"description", oracle::protocol_description(m.protocol)},
         {"topology",
          {{"tp", m.topo.tp()}, {"pp", m.topo.pp()}, {"cp", m.topo.cp()}, {"dp", m.topo.dp()}}},
         {"flag_group", m.flag_group
                            ? nlohmann::ordered_json(oracle::group_kind_name(*m.flag_group))
                            : nlohmann::ordered_json(nullptr)},
         {"scenario", m.scenario},
         {"also_topologies", m.also_topologies}});
  }
  j["protocol_matches"] = matches;
  j["named"] = r.named();
  j["naming_note"] = r.naming_note.empty() ? nlohmann::ordered_json(nullptr)
                                           : nlohmann::ordered_json(r.naming_note);
  j["notes"] = r.notes;
  return j;
}

}  // namespace lossguard::cli
