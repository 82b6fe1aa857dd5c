// Real-mode replay: TCPStore rendezvous, the backend's collectives on every topology group this
// rank is in (gloo_collectives.cpp, nccl_collectives.cpp), the rank's protocol program
// (oracle/replay/replay.h) over them with deadlines, and the outcomes through the store to rank 0.
#include "distributed/real_replay.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <sstream>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "core/errors.h"
#include "core/format.h"
#include "distributed/collectives.h"
#include "distributed/wait_graph.h"

namespace lossguard::distributed {

namespace {

using Clock = std::chrono::steady_clock;
using oracle::GroupKind;

// Kept for the life of the process: rank 0 serves the store until every rank has read the exit
// code, and process groups whose peers hang are never destroyed (their destructors would wait on
// those peers).
c10::intrusive_ptr<c10d::Store>* g_store = nullptr;
int64_t g_live_ranks = 0;  // rank 0: ranks that posted an outcome (and so will read the exit code)
std::chrono::steady_clock::time_point g_run_start;  // when run() began on this rank

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// LOSSGUARD_INJECT_FAULT=kill:RANK:N makes rank RANK kill itself (SIGKILL) before its N-th
// collective (N = 0: before the rendezvous): how the fault-injection tests lose a rank, or the
// store, mid-protocol. LOSSGUARD_INJECT_FAULT=hang:RANK makes rank RANK never arrive (it sleeps
// until it is killed).
int injected_kill_point(int64_t rank) {
  // (LOSSGUARD_INJECT_FAULT=overshoot:RANK:S, which holds rank RANK S seconds past its verdict, is
  // read by agree_exit_code: the fault-timing tests plant it to prove they catch a late rank.)
  const char* spec = std::getenv("LOSSGUARD_INJECT_FAULT");
  long long r = -1, n = -1;
  if (spec != nullptr && std::sscanf(spec, "hang:%lld", &r) == 1 && r == rank) {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(60));
  }
  if (spec == nullptr || std::sscanf(spec, "kill:%lld:%lld", &r, &n) != 2 || r != rank) return -1;
  return static_cast<int>(n);
}

// A launcher that stops the job (torchrun, once one worker has failed, sends SIGTERM to the others)
// finds a rank blocked in a collective: it says so and exits 3 (a distributed fault), not with a
// signal. Only async-signal-safe calls in the handler; the message is formatted before it is
// installed.
char g_term_message[160];
std::size_t g_term_message_size = 0;
extern "C" void on_sigterm(int) {
  if (::write(2, g_term_message, g_term_message_size) < 0) {
  }
  ::_exit(kExitFault);
}
void exit_3_on_sigterm(int64_t rank) {
  const int n = std::snprintf(g_term_message, sizeof g_term_message,
                              "lossguard: rank %lld: stopped by the launcher (SIGTERM) before the "
                              "replay finished; exit 3\n",
                              static_cast<long long>(rank));
  g_term_message_size =
      n > 0 ? std::min<std::size_t>(static_cast<std::size_t>(n), sizeof g_term_message - 1) : 0;
  struct sigaction sa {};
  sa.sa_handler = on_sigterm;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
}

// LOSSGUARD_TIMING_FILE=PATH: each rank appends {"rank", "start", "timeout"} (start: the wall
// clock, in seconds since the epoch, when its deadline began) so that a test measures every rank
// against its own deadline, not against the launcher's start (start-up under load is not a hang).
void record_start(int64_t rank, double timeout_s) {
  const char* path = std::getenv("LOSSGUARD_TIMING_FILE");
  if (path == nullptr || *path == '\0') return;
  const double now =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  const std::string line =
      fmt::format("{{\"rank\": {}, \"start\": {:.6f}, \"timeout\": {}}}\n", rank, now, timeout_s);
  const int fd = ::open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd < 0) return;
  if (::write(fd, line.data(), line.size()) < 0) {
  }
  ::close(fd);
}

// The store every rank rendezvous through (a TCPStore served by rank 0 or the launcher's agent,
// prefixed by the run id), kept in g_store; false with `error` set when it cannot be reached.
bool connect_store(const LaunchEnv& env, std::chrono::milliseconds timeout, std::string* error) {
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(env.port);
    so.isServer = !env.agent_store && env.rank == 0;
    if (so.isServer) so.numWorkers = static_cast<std::size_t>(env.world_size);
    so.waitWorkers = false;
    so.timeout = timeout;
    auto base = c10::make_intrusive<c10d::TCPStore>(env.master_addr, so);
    g_store = new c10::intrusive_ptr<c10d::Store>(
        c10::make_intrusive<c10d::PrefixStore>(env.run_id, base));
    return true;
  } catch (const std::exception& e) {
    *error = fmt::format("rendezvous with the store at {}:{} failed: {}", env.master_addr, env.port,
                         first_line(e.what()));
    return false;
  }
}

// Fail fast: every rank posts its state (waiting on which call, failed, done) to the store; a
// waiting rank reads everyone's and stops waiting as soon as its call can never complete
// (wait_graph.h: a member that has not issued it failed, finished, or waits in a cycle), instead of
// at --timeout. A verdict counts only when two reads 200 ms apart agree and no rank posted in
// between. The store is only an accelerator here: each of its calls may take at most a second (a
// store that died with rank 0 must not stack reconnect retries on every collective), and after its
// first failure it is left alone and the deadlines decide.
class StateBoard {
 public:
  StateBoard(c10d::Store& store, const LaunchEnv& env, const oracle::Topology& t)
      : store_(store), env_(env), t_(t), posted_(static_cast<std::size_t>(env.world_size), false) {
    try {
      store_.setTimeout(std::chrono::milliseconds(1000));
    } catch (const std::exception&) {
      store_ok_ = false;
    }
  }

  // The call's number on its group, from 1 (counted as issued from now on).
  int issue(GroupKind kind) { return ++issued_[kind]; }

  void post(PostedState::Status status, const oracle::CollectiveCall* call, int seq) {
    if (!store_ok_) return;
    try {
      std::string text = fmt::format("{} {} {} {} {}", ++version_, static_cast<int>(status),
                                     call ? static_cast<int>(call->group.kind) : 0,
                                     call ? call->group.id : 0, seq);
      for (int k = 0; k < oracle::kNumGroupKinds; ++k) {
        const auto it = issued_.find(static_cast<GroupKind>(k));
        text += fmt::format(" {}", it == issued_.end() ? 0 : it->second);
      }
      store_.set(fmt::format("state/{}", env_.rank), text);
    } catch (const std::exception&) {  // the store is gone: the others find out by their deadline
      store_ok_ = false;
    }
  }

  // Starts waiting on a call: the confirmations of the previous one do not count.
  void start_wait() {
    last_ask_ = Clock::now();
    seen_versions_.clear();
  }

  // Why this rank may stop waiting on `call` (#seq on its group) now, or "" to keep waiting.
  std::string give_up_reason(const oracle::CollectiveCall& call, int seq) {
    if (Clock::now() - last_ask_ < std::chrono::milliseconds(200)) return "";
    last_ask_ = Clock::now();
    std::vector<int> versions;
    std::vector<PostedState> states;
    if (!store_ok_) return "";
    try {
      states = read_states(&versions);
    } catch (const std::exception&) {
      store_ok_ = false;
      return "";
    }
    if (!stuck_ranks(t_, states)[static_cast<std::size_t>(env_.rank)]) {
      seen_versions_.clear();
      return "";
    }
    if (versions != seen_versions_) {  // confirm on the next read
      seen_versions_ = versions;
      return "";
    }
    std::vector<int64_t> failed, waiting;
    for (int64_t i = 0; i < t_.group_size(call.group.kind); ++i) {
      const int64_t m = t_.member(call.group, i);
      const PostedState& st = states[static_cast<std::size_t>(m)];
      const auto k = static_cast<std::size_t>(call.group.kind);
      if (k < st.issued.size() && st.issued[k] >= seq) continue;
      (st.status == PostedState::kWaiting ? waiting : failed).push_back(m);
    }
    return failed.empty()
               ? fmt::format(
                     "rank(s) {} wait elsewhere on calls that can never complete (a "
                     "deadlock, seen through the store)",
                     format_rank_set(waiting, 4))
               : fmt::format(
                     "rank(s) {} failed or finished without issuing it (seen through the store)",
                     format_rank_set(failed, 4));
  }

 private:
  std::vector<PostedState> read_states(std::vector<int>* versions) {
    std::vector<PostedState> states(static_cast<std::size_t>(env_.world_size));
    versions->assign(states.size(), 0);
    for (int64_t r = 0; r < env_.world_size; ++r) {
      const std::string key = fmt::format("state/{}", r);
      if (!posted_[r] && !store_.check({key})) continue;
      posted_[r] = true;
      const std::vector<uint8_t> bytes = store_.get(key);
      std::istringstream line(std::string(bytes.begin(), bytes.end()));
      int status = 0, kind = 0;
      int64_t id = 0;
      PostedState& st = states[r];
      line >> (*versions)[r] >> status >> kind >> id >> st.seq;
      st.status = static_cast<PostedState::Status>(status);
      st.group = {static_cast<GroupKind>(kind), id};
      st.issued.resize(oracle::kNumGroupKinds);
      for (int& c : st.issued) line >> c;
    }
    return states;
  }

  c10d::Store& store_;
  const LaunchEnv& env_;
  const oracle::Topology& t_;
  std::map<GroupKind, int> issued_;
  int version_ = 0;
  bool store_ok_ = true;
  std::vector<bool> posted_;
  Clock::time_point last_ask_;
  std::vector<int> seen_versions_;
};

// The rank's program over real collectives, call by call, until it finishes or a call is rejected
// (where torch.distributed checks it), mismatches or blocks. `kill_before`: the test-injected call
// number at which this rank dies.
void run_program(oracle::RankProgram& prog, Collectives& coll, StateBoard& board,
                 const oracle::Topology& t, int kill_before, double timeout_s) {
  int calls = 0;
  while (std::optional<oracle::CollectiveCall> call = prog.next()) {
    if (prog.reject(t, *call)) {
      board.post(PostedState::kFailed, nullptr, 0);
      return;
    }
    const int seq = board.issue(call->group.kind);
    if (++calls == kill_before) std::raise(SIGKILL);
    board.post(PostedState::kWaiting, &*call, seq);
    board.start_wait();
    try {
      const CallResult r = coll.run(*call, [&] { return board.give_up_reason(*call, seq); });
      if (r.mismatch) {
        prog.mismatch(*call, seq,
                      fmt::format("collective #{} on {}: the members issued different "
                                  "collectives (their op and payload tags differ)",
                                  seq, t.describe(call->group)));
        board.post(PostedState::kFailed, nullptr, 0);
        return;
      }
      prog.complete(r.value, r.nonfinite);
    } catch (const std::exception& e) {
      const std::string what = first_line(e.what());
      const bool gave_up = what.find("seen through the store") != std::string::npos;
      prog.block(*call, seq,
                 gave_up ? fmt::format("waiting in {}: {}", t.describe(call->group), what)
                         : fmt::format("waiting in {}: {} (gave up after {} s)",
                                       t.describe(call->group), what, timeout_s));
      board.post(PostedState::kFailed, nullptr, 0);
      return;
    }
  }
}

// Rank 0 collects every rank's outcome; a rank that never posts one died or never arrived. A live
// rank posts within one deadline of the start (its program blocks at most once), plus start-up
// skew.
std::vector<oracle::RankResult> collect_outcomes(c10d::Store& store, const LaunchEnv& env,
                                                 Clock::time_point deadline, double timeout_s) {
  std::vector<oracle::RankResult> ranks;
  g_live_ranks = env.world_size;
  for (int64_t r = 0; r < env.world_size; ++r) {
    const std::string key = fmt::format("outcome/{}", r);
    try {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      store.wait({key}, std::max(left, std::chrono::milliseconds(1)));
      const std::vector<uint8_t> bytes = store.get(key);
      ranks.push_back(rank_result_from_json(std::string(bytes.begin(), bytes.end())));
    } catch (const std::exception&) {
      --g_live_ranks;
      oracle::RankResult missing;
      missing.rank = r;
      missing.outcome = oracle::Outcome::kError;
      missing.summary = "never reported an outcome (the process died or never arrived)";
      missing.detail = fmt::format(
          "no outcome in the store {} s after the start (the --timeout plus 5 s)", timeout_s);
      ranks.push_back(missing);
    }
  }
  return ranks;
}

// One rank's executor: rendezvous, the topology's process groups, the program's collectives each
// under the deadline, its outcome posted; rank 0 then collects every rank's.
void run(const RealReplayInput* in, RealReplayOutput* out) {
  const auto run_start = Clock::now();
  g_run_start = run_start;
  record_start(in->env.rank, in->timeout_s);
  const LaunchEnv& env = in->env;
  exit_3_on_sigterm(env.rank);
  const int kill_before = injected_kill_point(env.rank);
  if (kill_before == 0) std::raise(SIGKILL);
  const oracle::ReplayInputs& ri = *in->inputs;
  const oracle::Topology& t = ri.topo;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(in->timeout_s * 1000));
  if (!connect_store(env, timeout, &out->error)) return;
  c10d::Store& store = **g_store;

  oracle::RankProgram prog(&ri, env.rank);
  std::unique_ptr<Collectives> coll;
  bool ready = true;
  try {
    coll = in->backend == Backend::kNccl ? make_nccl_collectives(env, ri, *g_store, timeout)
                                         : make_gloo_collectives(env, ri, *g_store, timeout);
  } catch (const std::exception& e) {
    prog.fail(oracle::Outcome::kBlocked, "in process-group rendezvous",
              fmt::format("building the {} groups: {} (gave up after {} s)",
                          in->backend == Backend::kNccl ? "NCCL" : "Gloo", first_line(e.what()),
                          in->timeout_s));
    ready = false;
  }
  StateBoard board(store, env, t);
  if (!ready) {
    board.post(PostedState::kFailed, nullptr, 0);
  } else {
    run_program(prog, *coll, board, t, kill_before, in->timeout_s);
    const oracle::RankResult mine = prog.result();
    if (prog.finished() &&
        (mine.outcome == oracle::Outcome::kSkip || mine.outcome == oracle::Outcome::kStep)) {
      board.post(PostedState::kDone, nullptr, 0);
    }
  }
  (void)coll.release();  // never destroyed, see g_store

  try {
    // A store that died with rank 0 must not hold this rank past its deadline: every store call
    // from here on retries at most until then (the store's timeout bounds its reconnects).
    store.setTimeout(std::max(std::chrono::duration_cast<std::chrono::milliseconds>(
                                  run_start + timeout + std::chrono::seconds(5) - Clock::now()),
                              std::chrono::milliseconds(500)));
    store.set(fmt::format("outcome/{}", env.rank), rank_result_to_json(prog.result()));
  } catch (const std::exception& e) {
    out->error = fmt::format("posting the outcome to the store failed: {}", first_line(e.what()));
    return;
  }
  if (env.rank != 0) return;
  out->ranks =
      collect_outcomes(store, env, run_start + timeout + std::chrono::seconds(5), in->timeout_s);
}

int agree_exit_code_with_store(const RealReplayInput* in, int code) {
  if (g_store == nullptr) return code;
  c10d::Store& store = **g_store;
  // Rank 0 posts the code once it has every outcome or its deadline (its start + --timeout + 5 s)
  // passed: wait until then plus start-up skew, counted from this rank's start, not from now, so a
  // rank that already spent its deadline on a collective or on a dead store still exits within
  // --timeout + 10 s.
  const auto deadline = g_run_start +
                        std::chrono::milliseconds(static_cast<int64_t>(in->timeout_s * 1000)) +
                        std::chrono::seconds(8);
  const auto wait =
      std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
               std::chrono::milliseconds(500));
  try {
    if (in->env.rank == 0) {
      store.set("exit_code", std::to_string(code));
      // Serve the store until every live rank has read the code (or a few seconds pass).
      const auto until = Clock::now() + std::chrono::seconds(5);
      while (store.add("exit_code_read", 0) < g_live_ranks - 1 && Clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      return code;
    }
    store.setTimeout(wait);
    store.wait({"exit_code"}, wait);
    const std::vector<uint8_t> bytes = store.get("exit_code");
    store.add("exit_code_read", 1);
    const int agreed = std::stoi(std::string(bytes.begin(), bytes.end()));
    // Let rank 0, which holds the report, exit first: a launcher such as torchrun stops the
    // remaining ranks when the first one exits non-zero, and names that one as the root cause.
    if (agreed != 0) std::this_thread::sleep_for(std::chrono::milliseconds(500));
    return agreed;
  } catch (const std::exception&) {
    return -1;
  }
}

int agree_exit_code(const RealReplayInput* in, int code) {
  const int agreed = agree_exit_code_with_store(in, code);
  const char* spec = std::getenv("LOSSGUARD_INJECT_FAULT");
  long long r = -1, seconds = 0;
  if (spec != nullptr && std::sscanf(spec, "overshoot:%lld:%lld", &r, &seconds) == 2 &&
      r == in->env.rank) {
    std::this_thread::sleep_for(std::chrono::seconds(seconds));
  }
  return agreed;
}

const DistApi kApi = {kDistAbiVersion, run, agree_exit_code};

}  // namespace

}  // namespace lossguard::distributed

extern "C" __attribute__((visibility("default"))) const lossguard::distributed::DistApi*
lossguard_dist_api() {
  return &lossguard::distributed::kApi;
}
