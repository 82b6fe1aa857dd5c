// Post-mortem of a distributed job from its Flight Recorder dumps (SPEC §12): the ranks' calls
// aligned per process group in issue order, the divergences (a member that never issued a call the
// others issued, a call whose operation, sizes or dtypes differ, a send without its receive), each
// rank's part in them, and the divergence named by the skip-decision protocol of SPEC §7 whose
// simulation (oracle/replay/replay.h) diverges the same way.
#pragma once
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
  int64_t max_divergences = 1000;   // kept in the result (the first ones in time)
  int64_t naming_max_world = 4096;  // the protocol search runs up to this many ranks
};

struct PostmortemResult {
  std::vector<Divergence> divergences;  // the headline first (see below), then in time order
  std::vector<RankState> ranks;         // [0, world)
  std::vector<int64_t> missing, complete, waiting, culprits;
  int64_t total_calls = 0;
  std::vector<ProtocolMatch> matches;  // for divergences[0]
  std::string naming_note;             // why no protocol was tried, when none was
  std::vector<std::string> notes;
  bool no_collectives() const { return total_calls == 0; }
  bool diverged() const { return !divergences.empty(); }
  // Nothing verified without a collective call; a divergence is the job's fault (exit 3).
  Judgement judgement() const;
};

// Groups that Megatron names by their group_desc (MODEL_PARALLEL_GROUP,
// DATA_PARALLEL_GROUP_WITH_CP, PIPELINE_MODEL_PARALLEL_GROUP, ...: megatron/core/parallel_state.py)
// and whose members were only inferred from the calls get their whole membership from Megatron's
// layout (SPEC §7) where every layout of `job.world` ranks consistent with all such groups gives
// the same; a note says which.
// Call it on a loaded job before analyse_flight_records (the CLI does).
void resolve_megatron_groups(FrJob& job);

// The headline divergence is the earliest one that blames an idle rank (one that is not itself
// waiting elsewhere: the root of a chain of waits), else the earliest.
PostmortemResult analyse_flight_records(const FrJob& job, const PostmortemOptions& options = {});

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
