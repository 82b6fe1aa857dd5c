// A distributed job's PyTorch Flight Recorder dumps as data (SPEC §12): per rank, the collective
// and p2p calls its recorder kept, with the process groups, call signatures and stacks interned
// once per job so that 16,384 ranks of 2,000 calls fit in memory. io/flight_recorder.h reads it;
// oracle/postmortem/postmortem.h explains it.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace lossguard {

// The most ranks a job's dumps, --world or layout may claim (per-rank tables are sized by it).
inline constexpr int64_t kMaxFrWorld = int64_t{1} << 20;

// What the recorder had seen of a call when it dumped. Gloo records `scheduled` only.
enum class FrState : uint8_t { kScheduled, kStarted, kCompleted, kOther };

struct FrFrame {
  std::string name;
  std::string filename;
  int64_t line = 0;
};

// A call's operation and payload: what every member of a group must issue alike.
struct FrSignature {
  std::string profiling_name;  // as recorded: "gloo:all_reduce", "nccl:send 0->1"
  std::string op;              // normalised: "all_reduce", "broadcast", "send", "barrier", ...
  std::vector<std::vector<int64_t>> input_sizes, output_sizes;
  std::vector<std::string> input_dtypes, output_dtypes;
};

struct FrCall {
  int64_t record_id = 0;
  int64_t time_created_ns = 0;
  int64_t seq = 0;         // collective_seq_id, or p2p_seq_id when is_p2p
  uint32_t group = 0;      // index into FrJob::groups
  uint32_t signature = 0;  // index into FrJob::signatures
  uint32_t stack = 0;      // index into FrJob::stacks (stack 0 is empty)
  int32_t p2p_src = -1;    // group-local ranks of a send/recv ("send 1->2"); -1: none or "?"
  int32_t p2p_dst = -1;
  FrState state = FrState::kScheduled;
  bool is_p2p = false;
  // The recorder retired the call: it completed, or failed (Gloo retires a call that timed out on
  // some ranks): it is no longer pending, which says nothing about its partners.
  bool retired = false;
  int32_t pg_id = -1;      // the rank's own number for the group (the key of its pg_status)
  int64_t timeout_ms = 0;  // the call's timeout, as the job set it
};

struct FrGroup {
  std::string name;  // process_group[0]: the same on every rank ("0" is the default group)
  std::string desc;  // process_group[1]: "default_pg", "dp_group", "undefined"
  // Global ranks, sorted. From some dump's pg_config, else the ranks whose calls name the group.
  std::vector<int64_t> members;
  bool members_inferred = false;
  // Completed from the layout (oracle::resolve_groups): the one given (--tp/--pp/--cp/--dp), or
  // every Megatron layout of the world its group_desc and the other groups admit;
  // members_inferred is then false.
  bool members_from_layout = false;
  // Where the members come from, for the report: "pg_config", "world" (the default group),
  // "layout", or "calls" (members_inferred: only the ranks seen calling on it; incomplete).
  const char* members_source() const {
    return members_from_layout ? "layout"
           : members_inferred  ? "calls"
           : from_world        ? "world"
                               : "pg_config";
  }
  bool from_world = false;
};

struct FrRankDump {
  int64_t rank = 0;
  std::string path;
  std::string format;  // "pickle" or "json"
  std::string version;
  std::string comm_lib_version;
  std::vector<FrCall> calls;  // in record order
  // The recorder's ring buffer had overwritten older calls (the first kept record_id > 0).
  bool wrapped = false;
  // pg_status: per group (its pg_id on this rank) the last call completed on it,
  // as the recorder kept them (Gloo's entries all read "scheduled"; this says which completed).
  struct GroupStatus {
    int32_t pg_id = -1;
    int64_t last_completed = -1;
  };
  std::vector<GroupStatus> pg_status;
  // The last call number completed on the group with this pg_id, or -1.
  int64_t last_completed(int32_t pg_id) const {
    for (const auto& s : pg_status)
      if (s.pg_id == pg_id) return s.last_completed;
    return -1;
  }
  // Whether a call of this dump is no longer pending: its state, its retirement, or pg_status.
  bool finished(const FrCall& c) const {
    return c.state == FrState::kCompleted || c.retired ||
           (!c.is_p2p && c.pg_id >= 0 && c.seq <= last_completed(c.pg_id));
  }
};

struct FrJob {
  std::vector<FrRankDump> ranks;  // sorted by rank, one per rank
  std::vector<FrGroup> groups;
  std::vector<FrSignature> signatures;
  std::vector<std::vector<FrFrame>> stacks;
  // The job's size where it is known (world_known): from the default group's pg_config, from
  // --world or from the layout given (world_source says which); never from the highest rank seen.
  // Unknown, `world` is the highest rank seen plus one, sizing per-rank tables only. Ranks in
  // [0, world) without a dump are missing.
  int64_t world = 0;
  bool world_known = false;
  std::string world_source;        // "pg_config", "--world", "layout", or "" when unknown
  std::vector<std::string> notes;  // what the loader inferred or ignored, for the report
};

// Interns groups, signatures and stacks while a job is built (the loader, the simulator's traces).
class FrJobBuilder {
 public:
  FrJobBuilder();
  uint32_t group(const std::string& name, const std::string& desc);
  uint32_t signature(FrSignature s);
  uint32_t stack(std::vector<FrFrame> frames);
  // The same, keyed by a text the caller derives from the content (equal content, equal key; the
  // loader serialises the dump's own fields): `make` runs only for a key not seen yet, so a
  // repeated call costs one lookup.
  uint32_t signature_by_key(const std::string& key, const std::function<FrSignature()>& make);
  uint32_t stack_by_key(const std::string& key, const std::function<std::vector<FrFrame>()>& make);
  FrJob& job() { return job_; }
  FrJob take() { return std::move(job_); }

 private:
  FrJob job_;
  std::unordered_map<std::string, uint32_t> groups_, signatures_, stacks_;
  std::unordered_map<std::string, uint32_t> signature_keys_, stack_keys_;
};

// "all_reduce" from "gloo:all_reduce", "allreduce", "nccl:all_reduce_coalesced" ...: one name per
// operation whatever the backend wrote; p2p peers split off ("send 1->2": "send", 1, 2).
struct FrOpName {
  std::string backend;
  std::string op;
  int32_t src = -1, dst = -1;
};
std::optional<FrOpName> parse_profiling_name(const std::string& profiling_name);

}  // namespace lossguard
