// Post-mortem of a distributed job from its Flight Recorder dumps (SPEC §12): the ranks' calls
// aligned per process group in issue order, the divergences (a member that never issued a call the
// others issued, a call whose operation, sizes or dtypes differ, a send without its receive), each
// rank's part in them, and the divergence named by the skip-decision protocol of SPEC §7 whose
// simulation (oracle/replay/replay.h) diverges the same way.
#pragma once
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/flight_record.h"
#include "core/judgement.h"
#include "oracle/replay/replay_protocol.h"
#include "oracle/replay/topology.h"

namespace lossguard::oracle {

enum class DivergenceKind { kMissingCall, kMismatch, kSendWithoutRecv, kRecvWithoutSend };
const char* divergence_kind_name(DivergenceKind k);  // "missing_call", "mismatch", ...

struct Divergence {
  DivergenceKind kind = DivergenceKind::kMissingCall;
  uint32_t group = 0;           // index into FrJob::groups
  int64_t seq = 0;              // the call's number on its group (collective_seq_id, p2p_seq_id)
  int64_t time_ns = 0;          // when the earliest of its calls was created
  uint32_t signature = 0;       // what the issuers issued (missing call, p2p) or the majority's
  std::vector<int64_t> issued;  // members that issued it (missing call); the p2p side that did
  std::vector<int64_t> not_issued;  // members with a dump that did not
  std::vector<int64_t> no_dump;     // members whose dump is missing: not judged
  // Mismatch: each distinct signature and the members that issued it, the majority first.
  std::vector<std::pair<uint32_t, std::vector<int64_t>>> variants;
  std::string detail;  // mismatch: what differs ("op all_reduce vs broadcast")
  // Whether some rank it blames (not_issued, a mismatch's minority) is not itself waiting in
  // another call that never completed: that rank died, hangs outside collectives or went on past
  // the call.
  bool blames_idle_rank = false;
  // The group's members are only the ranks seen calling on it (no pg_config, no layout): a member
  // outside the dumps may be the one short.
  bool members_unknown = false;
  // Every member with a dump issued the call and it never completed (a pending call): the
  // suspects are the members without a dump, or outside those known.
  bool pending = false;
  // One line (analyse_flight_records; empty in find_divergences): "rank 0 issued barrier #3 on
  // group '0' (default_pg, 4 ranks: 0-3); ranks 1-3 never did".
  std::string summary;
  std::vector<int64_t> blamed() const;  // not_issued, then no_dump
};

// The root of the waits, the headline (SPEC §12 "the culprit is found by causality"):
enum class RootKind {
  kIdleRank,     // blamed ranks recorded nothing after a call every member issued: they died,
                 // skipped the call or hang outside collectives
  kMissingDump,  // the waits point to members that left no dump
  kCycle,        // every blamed rank waits elsewhere, in a cycle of waits
  kOutOfOrder,   // a cycle of waits where one side left the order of calls its earlier steps
                 // kept (it skipped a call, or issued two in another order): that side
  kMismatch,     // one call with another operation, size or dtype on some members
  kPending       // a call every rank seen issued, never completed: a member outside the dumps;
                 // or blamed ranks whose last call is on a group of unknown members
};
const char* root_kind_name(RootKind k);  // "idle_rank", "missing_dump", "cycle", ...

// A recorded call the text shows, with the frames of its stack it shows.
struct ShownCall {
  FrCall call;                      // as its rank's dump recorded it
  std::vector<std::size_t> frames;  // indices into FrJob::stacks[call.stack]: the job's own frames
                                    // (not torch's) first, at most PostmortemOptions::frames
};

// One rank's wait in a cycle: it issued `seq` on `group` and waits there for `waits_for`.
struct WaitStep {
  int64_t rank = 0;
  std::size_t divergence = 0;  // index into PostmortemResult::divergences
  std::vector<int64_t> waits_for;
  std::string summary;            // "rank 5 waits in all_reduce #3 on group '13' (...) for rank 7"
  std::optional<ShownCall> call;  // its call there, where its dump holds it
};

struct Root {
  RootKind kind = RootKind::kIdleRank;
  std::vector<int64_t> culprits;  // with or without a dump (missing ranks are culprits too)
  std::vector<WaitStep> cycle;    // kCycle: each side's wait, in the order they wait on each other
  // What the dumps support, the likelier first; two where they cannot tell which side is wrong.
  std::vector<std::string> readings;
  int64_t explains = 0;  // ranks waiting in a divergence whose chain of waits leads here
  bool by_time = false;  // several roots explained as many waits: the earliest created won
  std::string summary;   // one line
};

enum class RankRole { kComplete, kWaiting, kCulprit, kMissing };
const char* rank_role_name(RankRole r);  // "complete", "waiting", "culprit", "missing"

struct RankState {
  int64_t rank = 0;
  RankRole role = RankRole::kComplete;
  int64_t calls = 0;
  // Its last recorded call (index into its FrRankDump::calls), and whether every member of that
  // call's group issued it too.
  std::optional<std::size_t> last_call;
  bool last_call_unmatched = false;
};

// A protocol of SPEC §7 whose simulated step diverges as the dumps do.
struct ProtocolMatch {
  Protocol protocol = Protocol::kPr285;
  Topology topo{1, 1, 1, 1};
  std::string scenario;                      // "a zero-token step", "a NaN gradient on rank 1", ...
  std::optional<GroupKind> flag_group;       // flag-broadcast protocols
  std::vector<std::string> also_topologies;  // other layouts the dumps cannot tell apart
};

struct PostmortemOptions {
  int64_t max_divergences = 1000;      // kept in the result (the root's first, then in time)
  int64_t naming_max_world = 1 << 17;  // the protocol search runs up to this many ranks
  int64_t frames = 4;                  // frames shown per call in the text (the job's own first)
  int64_t listed_divergences = 5;      // divergences the text lists after the headline (the JSON
                                       // has every one kept)
};

// Blamed ranks whose last calls read alike (one line of the text): what they last did.
struct LastCallGroup {
  std::vector<int64_t> ranks;
  bool dumped = true;                  // the first rank left a dump
  std::optional<ShownCall> last_call;  // the first rank's; none: it recorded no call
  std::string state;                   // as its dump says: "completed", "scheduled, not retired"...
  bool unmatched = false;              // some member of its group never issued it: it waits there
  std::string summary;                 // the line: "ranks 1-3: last call all_reduce #1 on ..."
};

// Where the issuers of a missing call wait: the call as the first of them recorded it.
struct IssuerCall {
  ShownCall call;
  std::string summary;  // "rank 0 waits in it, called from:"
};

// A culprit and its last call (the JSON's `culprits`).
struct CulpritCall {
  int64_t rank = 0;
  int64_t calls = 0;
  std::optional<FrCall> last_call;
  bool finished = false;   // no longer pending: its state, its retirement or pg_status
  bool unmatched = false;  // some member of its group never issued it
};

// `postmortem`'s one result: the job with its groups resolved, the analysis, and every sentence,
// grouping and frame the text and JSON print, decided once under the options.
struct PostmortemResult {
  FrJob job;                            // what every index below points into
  std::vector<Divergence> divergences;  // the headline first (see below), then in time order
  std::vector<RankState> ranks;         // [0, world)
  std::vector<int64_t> missing, complete, waiting, culprits;
  int64_t total_calls = 0;
  std::optional<Root> root;            // where the divergences' waits lead (diverged() only)
  std::vector<ProtocolMatch> matches;  // for divergences[0]
  std::string naming_note;             // why no protocol was tried, when none was
  std::vector<std::string> notes;
  // What keeps a job without divergence from passing: the world unknown, ranks without a dump,
  // groups whose members are unknown (empty: it passes).
  std::vector<std::string> unverified;
  std::vector<uint32_t> unknown_groups;  // groups whose members are only the ranks seen calling
  // Under the headline divergence: the ranks it blames (not_issued) grouped by what they last did,
  // ordered by that call's text; and, for a missing call, where its issuers wait.
  std::vector<LastCallGroup> blamed_by_last_call;
  std::optional<IssuerCall> issuer_call;
  std::vector<CulpritCall> culprit_calls;  // the first 256 culprits
  std::size_t listed_divergences = 0;      // divergences after the headline the text lists
  bool no_collectives() const { return total_calls == 0; }
  bool diverged() const { return !divergences.empty(); }
  // One protocol (and flag group) diverges as the dumps do: it is named; several are only
  // "consistent with".
  bool named() const { return matches.size() == 1; }
  // Nothing verified without a collective call, or without a divergence while the world or some
  // group's members are unknown or ranks left no dump; a divergence is the job's fault (exit 3).
  Judgement judgement() const;
};

// What the user says of the job's shape (postmortem --world, --tp/--pp/--cp/--dp).
struct JobShape {
  std::optional<int64_t> world;
  std::optional<Topology> layout;  // Megatron order tp-cp-dp-pp
};

// The world and the groups' members from what is known (SPEC §12 "never guessed"): the world
// from the dumps' pg_config, else `given.world`, else the layout's size (InputError where they
// disagree, or a dump's rank lies outside it); the default group is then the world. Groups
// Megatron names by their group_desc (MODEL_PARALLEL_GROUP, DATA_PARALLEL_GROUP_WITH_CP, ...:
// megatron/core/parallel_state.py) whose members were only seen calling get their whole
// membership from the given layout, else from every Megatron layout of a known world consistent
// with all such groups where those agree; a group without such a description whose callers are
// exactly one group of the given layout gets that group. Notes say which. postmortem() calls it.
void resolve_groups(FrJob& job, const JobShape& given = {});

// The kind of group Megatron describes so (MODEL_PARALLEL_GROUP -> kMp, ..._GLOO alike), or none.
std::optional<GroupKind> megatron_group_kind(std::string desc);

// The post-mortem of a loaded job (io::read_flight_records): its groups resolved from what the
// user says of its shape (resolve_groups), then analysed (analyse_flight_records). The one entry
// point of `lossguard postmortem`.
PostmortemResult postmortem(FrJob job, const JobShape& shape, const PostmortemOptions& options);

// The analysis of a job whose groups are taken as they stand (a job built by hand, or one
// resolve_groups completed): the divergences, the ranks' parts, the root, the protocols, and what
// the text and JSON print. The headline divergence is the earliest one that blames an idle rank
// (one that is not itself waiting elsewhere: the root of a chain of waits), else the earliest.
PostmortemResult analyse_flight_records(FrJob job, const PostmortemOptions& options = {});

// A call's state as its dump records it: "scheduled", "started", "completed", "other".
const char* call_state_name(FrState s);

// The divergences alone (time order), as analyse_flight_records finds them; shared with the
// protocol search, which runs it on simulated dumps.
std::vector<Divergence> find_divergences(const FrJob& job, std::vector<std::string>* notes);

// Whether two calls of one group would match in a real job (fr_trace's rules, simplified: the same
// operation; the same input sizes where every member sends the same; the same dtypes).
std::optional<std::string> signature_difference(const FrSignature& a, const FrSignature& b);

// The protocols of SPEC §7 that diverge as `d` does on some topology of `job.world` ranks.
std::vector<ProtocolMatch> match_protocols(const FrJob& job, const Divergence& d,
                                           const PostmortemOptions& options, std::string* note);

}  // namespace lossguard::oracle
