// `postmortem`'s text and JSON (cli/postmortem_render.h): only reads the result.
#include "cli/postmortem_render.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/format.h"
#include "core/printable.h"
#include "oracle/replay/replay_protocol.h"

namespace lossguard::cli {

namespace {

using oracle::Divergence;

std::string topology_text(const oracle::Topology& t) {
  return fmt::format("TP{} PP{} CP{} DP{}", t.tp(), t.pp(), t.cp(), t.dp());
}

void render_frames(std::ostream& out, const FrJob& job, const oracle::ShownCall& c) {
  for (std::size_t k : c.frames) {
    const FrFrame& f = job.stacks[c.call.stack][k];
    out << fmt::format("      at {} ({}:{})\n", printable(f.name), printable(f.filename), f.line);
  }
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

// The headline divergence: the root and each side of its cycle, the blamed ranks grouped by what
// they last did, and where the issuers wait.
void render_divergence(std::ostream& out, const oracle::PostmortemResult& r) {
  const Divergence& d = r.divergences.front();
  if (r.root) {
    out << "\nROOT: " << printable(r.root->summary) << "\n";
    for (std::size_t k = 0; k < r.root->readings.size(); ++k)
      out << fmt::format("  {} {}\n",
                         k == 0 ? "reading:" : "     or:", printable(r.root->readings[k]));
    if (r.root->by_time)
      out << "  (several divergences explain as many waits: the earliest created was chosen)\n";
    for (const auto& st : r.root->cycle) {
      out << "  " << st.summary << "\n";  // escaped piecewise
      if (st.call) render_frames(out, r.job, *st.call);
    }
  }
  out << "\nDIVERGENCE: " << d.summary << "\n";
  if (!d.no_dump.empty())
    out << fmt::format("  {} of the group left no dump\n", ranks_phrase(d.no_dump));
  for (const auto& g : r.blamed_by_last_call) {
    out << "  " << g.summary << "\n";
    if (g.last_call) render_frames(out, r.job, *g.last_call);
  }
  if (r.issuer_call) {
    out << "  " << r.issuer_call->summary << "\n";
    render_frames(out, r.job, r.issuer_call->call);
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

void render_postmortem_text(std::ostream& out, const oracle::PostmortemResult& r) {
  const FrJob& job = r.job;
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
    if (!r.unknown_groups.empty())
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
  render_divergence(out, r);
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
    for (std::size_t k = 1; k <= r.listed_divergences; ++k)
      out << "  " << r.divergences[k].summary << "\n";  // escaped piecewise
    if (r.divergences.size() - 1 > r.listed_divergences) out << "  ... (--json has all)\n";
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
                              {"summary", d.summary}};
  if (d.kind == oracle::DivergenceKind::kMismatch) {
    nlohmann::ordered_json vars = nlohmann::ordered_json::array();
    for (const auto& [sig, ranks] : d.variants)
      vars.push_back({{"call", signature_json(job.signatures[sig])}, {"ranks", ranks}});
    x["variants"] = vars;
    x["detail"] = d.detail;
  }
  return x;
}

// The culprits the result lists (the first 256), each with its last call and every frame of it.
nlohmann::ordered_json culprits_json(const oracle::PostmortemResult& r) {
  const FrJob& job = r.job;
  nlohmann::ordered_json last = nlohmann::ordered_json::array();
  for (const oracle::CulpritCall& k : r.culprit_calls) {
    nlohmann::ordered_json x = {{"rank", k.rank}, {"calls", k.calls}, {"last_call", nullptr}};
    if (k.last_call) {
      const FrCall& c = *k.last_call;
      x["last_call"] = {{"group", job.groups[c.group].name},
                        {"seq", c.seq},
                        {"call", signature_json(job.signatures[c.signature])},
                        {"state", oracle::call_state_name(c.state)},
                        {"finished", k.finished},
                        {"timeout_ms", c.timeout_ms},
                        {"issued_by_every_member", !k.unmatched},
                        {"frames", frames_json(job, c.stack)}};
    }
    last.push_back(x);
  }
  return last;
}

}  // namespace

nlohmann::ordered_json postmortem_json(const oracle::PostmortemResult& r) {
  const FrJob& job = r.job;
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
  j["culprits"] = culprits_json(r);
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
