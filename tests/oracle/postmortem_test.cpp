// The post-mortem alignment (SPEC §12) on Flight Recorder jobs written by hand: each divergence
// kind found where it was planted and nowhere else, the ranks' parts, the headline's choice, the
// membership completed from Megatron's layout, and the naming by the skip-decision protocols shown
// accepting the seed's deadlock and refusing the same dumps with the bug's trace removed.
#include "oracle/postmortem/postmortem.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <limits>
#include <map>

#include "core/errors.h"

namespace lossguard::oracle {
namespace {

// A job written call by call: `call(rank, group, op, ...)` appends to that rank's dump with the
// group's next call number on that rank.
class JobBuilder {
 public:
  explicit JobBuilder(int64_t world) {
    b_.job().world = world;
    b_.job().world_known = true;
    b_.job().world_source = "--world";
    for (int64_t r = 0; r < world; ++r) {
      FrRankDump d;
      d.rank = r;
      d.path = "rank" + std::to_string(r);
      d.version = "2.10";
      b_.job().ranks.push_back(d);
    }
  }
  uint32_t group(const std::string& name, std::vector<int64_t> members, std::string desc = "",
                 bool inferred = false) {
    const uint32_t g = b_.group(name, desc);
    b_.job().groups[g].members = std::move(members);
    b_.job().groups[g].members_inferred = inferred;
    return g;
  }
  // Appends a collective; returns its number on the group.
  int64_t call(int64_t rank, uint32_t g, const std::string& op, std::vector<int64_t> sizes = {1},
               const std::string& dtype = "Float", std::vector<FrFrame> frames = {}) {
    FrSignature s;
    s.op = op;
    s.profiling_name = "nccl:" + op;
    s.input_sizes = {sizes};
    s.output_sizes = {sizes};
    s.input_dtypes = {dtype};
    s.output_dtypes = {dtype};
    FrCall c;
    auto& d = b_.job().ranks[static_cast<std::size_t>(rank)];
    c.record_id = static_cast<int64_t>(d.calls.size());
    c.time_created_ns = ++clock_;
    c.group = g;
    c.seq = ++seq_[{rank, g}];
    c.signature = b_.signature(std::move(s));
    c.stack = b_.stack(std::move(frames));
    d.calls.push_back(c);
    return c.seq;
  }
  void p2p(int64_t rank, uint32_t g, const std::string& op, int32_t src, int32_t dst) {
    FrSignature s;
    s.op = op;
    s.profiling_name = fmt::format("nccl:{} {}{}{}", op, op == "send" ? src : dst,
                                   op == "send" ? "->" : "<-", op == "send" ? dst : src);
    FrCall c;
    auto& d = b_.job().ranks[static_cast<std::size_t>(rank)];
    c.record_id = static_cast<int64_t>(d.calls.size());
    c.time_created_ns = ++clock_;
    c.group = g;
    c.is_p2p = true;
    c.seq = ++p2p_seq_[{rank, g}];
    c.p2p_src = src;
    c.p2p_dst = dst;
    c.signature = b_.signature(std::move(s));
    d.calls.push_back(c);
  }
  FrJob& job() { return b_.job(); }

 private:
  FrJobBuilder b_;
  int64_t clock_ = 0;
  std::map<std::pair<int64_t, uint32_t>, int64_t> seq_, p2p_seq_;
};

TEST(Postmortem, CleanJobHasNoDivergenceAndEveryRankComplete) {
  JobBuilder j(3);
  const uint32_t w = j.group("0", {0, 1, 2}, "default_pg");
  for (int step = 0; step < 3; ++step) {
    for (int64_t r = 0; r < 3; ++r) j.call(r, w, "all_reduce", {8});
  }
  const PostmortemResult res = analyse_flight_records(j.job());
  EXPECT_FALSE(res.diverged());
  EXPECT_EQ(res.total_calls, 9);
  EXPECT_EQ(res.complete, (std::vector<int64_t>{0, 1, 2}));
  EXPECT_TRUE(res.culprits.empty());
}

TEST(Postmortem, RankThatStoppedIsTheCulpritAndTheOthersWait) {
  JobBuilder j(3);
  const uint32_t w = j.group("0", {0, 1, 2}, "default_pg");
  for (int step = 0; step < 3; ++step) {
    for (int64_t r = 0; r < 3; ++r) {
      if (step == 2 && r == 2) continue;  // rank 2 died before its third all-reduce
      j.call(r, w, "all_reduce", {8});
    }
  }
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_EQ(res.divergences.size(), 1u);
  const Divergence& d = res.divergences[0];
  EXPECT_EQ(d.kind, DivergenceKind::kMissingCall);
  EXPECT_EQ(d.seq, 3);
  EXPECT_EQ(d.issued, (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(d.not_issued, (std::vector<int64_t>{2}));
  EXPECT_TRUE(d.blames_idle_rank);  // rank 2's own last call completed on every member
  EXPECT_EQ(res.culprits, (std::vector<int64_t>{2}));
  EXPECT_EQ(res.waiting, (std::vector<int64_t>{0, 1}));
  EXPECT_FALSE(res.ranks[2].last_call_unmatched);
  EXPECT_TRUE(res.ranks[0].last_call_unmatched);
}

TEST(Postmortem, MismatchedOperationSizesAndDtypesAreFoundAtTheirCall) {
  for (const std::string what : {"op", "size", "dtype"}) {
    JobBuilder j(4);
    const uint32_t g = j.group("3", {0, 1, 2, 3}, "dp");
    for (int64_t r = 0; r < 4; ++r) j.call(r, g, "all_reduce", {4});
    for (int64_t r = 0; r < 4; ++r) {
      if (r != 1) {
        j.call(r, g, "all_reduce", {4});
      } else if (what == "op") {
        j.call(r, g, "broadcast", {4});
      } else if (what == "size") {
        j.call(r, g, "all_reduce", {5});
      } else {
        j.call(r, g, "all_reduce", {4}, "Long");
      }
    }
    const PostmortemResult res = analyse_flight_records(j.job());
    ASSERT_EQ(res.divergences.size(), 1u) << what;
    const Divergence& d = res.divergences[0];
    EXPECT_EQ(d.kind, DivergenceKind::kMismatch) << what;
    EXPECT_EQ(d.seq, 2) << what;
    ASSERT_EQ(d.variants.size(), 2u);
    EXPECT_EQ(d.variants[0].second, (std::vector<int64_t>{0, 2, 3})) << what;  // majority first
    EXPECT_EQ(d.variants[1].second, (std::vector<int64_t>{1})) << what;
    EXPECT_EQ(d.not_issued, (std::vector<int64_t>{1}));
    EXPECT_NE(d.detail.find(what == "op"     ? "operation"
                            : what == "size" ? "sizes"
                                             : "dtypes"),
              std::string::npos)
        << d.detail;
  }
}

TEST(Postmortem, UnevenCollectivesMayCarryDifferentSizes) {
  JobBuilder j(2);
  const uint32_t g = j.group("1", {0, 1}, "ep");
  j.call(0, g, "all_to_all", {6});
  j.call(1, g, "all_to_all", {9});
  EXPECT_FALSE(analyse_flight_records(j.job()).diverged());
  EXPECT_FALSE(signature_difference({"", "gather", {{3}}, {}, {"Float"}, {}},
                                    {"", "gather", {{0}}, {}, {"Float"}, {}}));
  EXPECT_TRUE(signature_difference({"", "all_reduce", {{3}}, {}, {"Float"}, {}},
                                   {"", "all_reduce", {{4}}, {}, {"Float"}, {}}));
}

TEST(Postmortem, SendWithoutReceiveIsFound) {
  JobBuilder j(2);
  const uint32_t g = j.group("0", {0, 1}, "default_pg");
  j.p2p(0, g, "send", 0, 1);
  j.p2p(1, g, "recv", 0, 1);
  j.p2p(0, g, "send", 0, 1);  // rank 1 never posts the second receive
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_EQ(res.divergences.size(), 1u);
  EXPECT_EQ(res.divergences[0].kind, DivergenceKind::kSendWithoutRecv);
  EXPECT_EQ(res.divergences[0].issued, (std::vector<int64_t>{0}));
  EXPECT_EQ(res.divergences[0].not_issued, (std::vector<int64_t>{1}));
  EXPECT_EQ(res.divergences[0].seq, 2);
}

TEST(Postmortem, HeadlineIsTheDivergenceBlamingARankThatWaitsNowhere) {
  // Rank 2 died after the world barrier; rank 1 waits for it in group A, and rank 0 waits in B
  // for rank 1. Rank 0's call came first, so time order alone would headline B, blaming rank 1,
  // which is only waiting: the root is rank 2.
  JobBuilder j(3);
  const uint32_t w = j.group("0", {0, 1, 2}, "default_pg");
  const uint32_t a = j.group("5", {1, 2}, "A");
  const uint32_t b = j.group("6", {0, 1}, "B");
  for (int64_t r = 0; r < 3; ++r) j.call(r, w, "barrier", {0});
  j.call(0, b, "all_reduce");
  j.call(1, a, "all_reduce");
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_EQ(res.divergences.size(), 2u);
  EXPECT_EQ(res.divergences[0].group, a);
  EXPECT_EQ(res.divergences[0].not_issued, (std::vector<int64_t>{2}));
  EXPECT_TRUE(res.divergences[0].blames_idle_rank);
  EXPECT_EQ(res.divergences[1].group, b);
  EXPECT_FALSE(res.divergences[1].blames_idle_rank);  // it blames rank 1, waiting in A
  // Rank 1 is a symptom: it waits in A for rank 2, the root, whose chain explains both waits.
  ASSERT_TRUE(res.root);
  EXPECT_EQ(res.root->kind, RootKind::kIdleRank);
  EXPECT_EQ(res.root->culprits, (std::vector<int64_t>{2}));
  EXPECT_EQ(res.root->explains, 2);
  EXPECT_FALSE(res.root->by_time);
  EXPECT_EQ(res.culprits, (std::vector<int64_t>{2}));
  EXPECT_EQ(res.waiting, (std::vector<int64_t>{0, 1}));
  EXPECT_TRUE(res.ranks[1].last_call_unmatched);
}

TEST(Postmortem, RankWhoseBufferDroppedEveryCallOnAGroupIsNotJudged) {
  JobBuilder j(2);
  const uint32_t g = j.group("0", {0, 1}, "default_pg");
  const uint32_t other = j.group("1", {1}, "solo");
  j.call(0, g, "all_reduce");
  j.call(1, other, "all_reduce");
  j.job().ranks[1].calls[0].record_id = 5000;  // its ring buffer wrapped
  j.job().ranks[1].wrapped = true;
  const PostmortemResult res = analyse_flight_records(j.job());
  EXPECT_FALSE(res.diverged());
  bool noted = false;
  for (const auto& n : res.notes)
    noted = noted || n.find("rank 1 on group '0'") != std::string::npos;
  EXPECT_TRUE(noted);
}

TEST(Postmortem, MegatronGroupsAreCompletedFromTheLayoutsTheyAdmit) {
  // TP2 PP2 (ranks 0-3): ranks 0 and 2 never reached the model-parallel all-reduce, so the
  // calls alone give MODEL_PARALLEL_GROUP the members {1, 3}; the pipeline group {1, 3} and the
  // one-rank DP+CP groups {2}, {3} admit TP2 PP2 and PP4, both of which give it 0-3.
  JobBuilder j(4);
  const uint32_t pp = j.group("2", {1, 3}, "PIPELINE_MODEL_PARALLEL_GROUP", true);
  const uint32_t dpa = j.group("4", {2}, "DATA_PARALLEL_GROUP_WITH_CP", true);
  const uint32_t dpb = j.group("6", {3}, "DATA_PARALLEL_GROUP_WITH_CP", true);
  const uint32_t mp = j.group("7", {1, 3}, "MODEL_PARALLEL_GROUP", true);
  j.call(2, dpa, "all_reduce", {1}, "Long");
  j.call(3, dpb, "all_reduce", {1}, "Long");
  j.call(1, pp, "broadcast", {1}, "Long");
  j.call(3, pp, "broadcast", {1}, "Long");
  j.call(1, mp, "all_reduce");
  j.call(3, mp, "all_reduce");
  {
    // With the callers alone the hang is invisible, so the job cannot pass either.
    const PostmortemResult before = analyse_flight_records(j.job());
    EXPECT_FALSE(before.diverged());
    EXPECT_FALSE(before.judgement().unverified.empty());
  }
  resolve_groups(j.job());
  EXPECT_EQ(j.job().groups[mp].members, (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_TRUE(j.job().groups[mp].members_from_layout);
  EXPECT_EQ(j.job().groups[pp].members, (std::vector<int64_t>{1, 3}));  // TP2 PP2 and PP4 differ
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_TRUE(res.diverged());
  EXPECT_EQ(res.divergences[0].group, mp);
  EXPECT_EQ(res.divergences[0].not_issued, (std::vector<int64_t>{0, 2}));
  ASSERT_FALSE(res.matches.empty());
  EXPECT_EQ(res.matches[0].protocol, Protocol::kPr285SrcLocal);
  EXPECT_EQ(res.matches[0].topo.tp(), 2);
  EXPECT_EQ(res.matches[0].topo.pp(), 2);
}

// The seed's deadlock as a 4-rank DP job records it: every rank all-reduces its token count over
// DP+CP; rank 0 alone broadcasts the flag on its one-rank pipeline group (src = PP-1 = 0 is not in
// the others' groups: they raise), steps (the grad norm on its one-rank model-parallel group) and
// waits in the next step's barrier.
// `count_size` and `count_dtype`: what the ranks all-reduce over DP+CP (the 1-element count).
JobBuilder seed_job(bool with_broadcast, std::vector<int64_t> count_size = {1},
                    const std::string& count_dtype = "Long") {
  JobBuilder j(4);
  const uint32_t w = j.group("0", {0, 1, 2, 3}, "default_pg");
  const uint32_t dpcp = j.group("5", {0, 1, 2, 3}, "DATA_PARALLEL_GROUP_WITH_CP", true);
  const uint32_t pp0 = j.group("1", {0}, "PIPELINE_MODEL_PARALLEL_GROUP", true);
  const uint32_t mp0 = j.group("6", {0}, "MODEL_PARALLEL_GROUP", true);
  for (int64_t r = 0; r < 4; ++r) j.call(r, dpcp, "all_reduce", count_size, count_dtype);
  if (with_broadcast) j.call(0, pp0, "broadcast", {1}, "Long");
  j.call(0, mp0, "all_reduce", {1}, "Float");
  j.call(0, w, "barrier", {0}, "Float");
  return j;
}

TEST(PostmortemNaming, TheSeedDeadlockIsNamedPr285AlwaysBroadcast) {
  JobBuilder j = seed_job(true);
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_TRUE(res.diverged());
  EXPECT_EQ(res.divergences[0].issued, (std::vector<int64_t>{0}));
  EXPECT_EQ(res.divergences[0].not_issued, (std::vector<int64_t>{1, 2, 3}));
  ASSERT_FALSE(res.matches.empty()) << res.naming_note;
  EXPECT_EQ(res.matches[0].protocol, Protocol::kPr285AlwaysBroadcast);
  EXPECT_EQ(res.matches[0].topo.pp(), 1);
  EXPECT_EQ(res.matches[0].topo.dp() * res.matches[0].topo.cp(), 4);
  for (const auto& m : res.matches) EXPECT_NE(m.protocol, Protocol::kPr285);  // the fix hangs not
}

TEST(PostmortemNaming, WithoutTheOneRankBroadcastNoProtocolIsClaimed) {
  // The same hang but rank 0 never broadcast: no skip-decision protocol issues that trace, so
  // naming one would be a guess.
  JobBuilder j = seed_job(false);
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_TRUE(res.diverged());
  for (const auto& m : res.matches) {
    EXPECT_NE(m.protocol, Protocol::kPr285AlwaysBroadcast);
    EXPECT_NE(m.protocol, Protocol::kPr285SrcLocal);
  }
}

TEST(PostmortemNaming, TheSeedIsNamedUniquely) {
  JobBuilder j = seed_job(true);
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_EQ(res.matches.size(), 1u) << res.naming_note;
  EXPECT_TRUE(res.named());
}

TEST(PostmortemNaming, ABucketIsNotACount) {
  // The same trace, but what the ranks all-reduce over DP+CP is a 256-element int32 bucket, not
  // a 1-element token count: no protocol's decision call carries that, so none is named.
  JobBuilder j = seed_job(true, {256}, "Int");
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_TRUE(res.diverged());
  for (const auto& m : res.matches) EXPECT_NE(m.protocol, Protocol::kPr285AlwaysBroadcast);
  EXPECT_FALSE(res.named());
}

TEST(PostmortemNaming, TheCountOverTheWorldGroupIsNamedToo) {
  // TP2 DP2 PP1, the seed's broadcast (src = PP-1 = 0 used as a global rank, on one-rank
  // pipeline groups): ranks 1-3 raise, rank 0 steps and waits in the grad norm's all-reduce on
  // its model-parallel group {0, 1}. The token count went over the world group, not DP+CP: the
  // count is then too large, but the hang is the seed's and is named so.
  JobBuilder j(4);
  const uint32_t w = j.group("0", {0, 1, 2, 3}, "default_pg");
  const uint32_t pp0 = j.group("1", {0}, "PIPELINE_MODEL_PARALLEL_GROUP", true);
  const uint32_t mp0 = j.group("6", {0, 1}, "MODEL_PARALLEL_GROUP", true);
  for (int64_t r = 0; r < 4; ++r) j.call(r, w, "all_reduce", {1}, "Long");
  j.call(0, pp0, "broadcast", {1}, "Long");
  j.call(0, mp0, "all_reduce", {1}, "Float");
  resolve_groups(j.job(), JobShape{std::nullopt, Topology(2, 1, 1, 2)});
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_TRUE(res.diverged());
  bool named = false;
  for (const auto& m : res.matches) named = named || m.protocol == Protocol::kPr285AlwaysBroadcast;
  EXPECT_TRUE(named) << res.naming_note;
}

TEST(PostmortemNaming, APointToPointDivergenceIsNotNamed) {
  JobBuilder j(2);
  const uint32_t g = j.group("0", {0, 1}, "default_pg");
  j.p2p(0, g, "send", 0, 1);
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_TRUE(res.diverged());
  EXPECT_TRUE(res.matches.empty());
  EXPECT_NE(res.naming_note.find("p2p"), std::string::npos);
}

TEST(PostmortemRoot, AWaitCycleIsShownWithBothSides) {
  // Ranks 0 and 1 issue two calls in opposite orders: 0 waits in X for 1, 1 waits in Y for 0.
  // Neither blamed rank is idle: the root is the cycle, both sides named.
  JobBuilder j(2);
  const uint32_t x = j.group("3", {0, 1}, "X");
  const uint32_t y = j.group("4", {0, 1}, "Y");
  j.call(0, x, "all_reduce");
  j.call(1, y, "all_reduce");
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_TRUE(res.root);
  EXPECT_EQ(res.root->kind, RootKind::kCycle);
  EXPECT_EQ(res.root->culprits, (std::vector<int64_t>{0, 1}));
  ASSERT_EQ(res.root->cycle.size(), 2u);
  std::map<int64_t, uint32_t> waits;
  for (const auto& st : res.root->cycle) {
    waits[st.rank] = res.divergences[st.divergence].group;
    EXPECT_EQ(st.waits_for.size(), 1u);
    EXPECT_NE(st.waits_for[0], st.rank);
  }
  EXPECT_EQ(waits[0], x);
  EXPECT_EQ(waits[1], y);
  EXPECT_NE(res.root->summary.find("cycle"), std::string::npos);
}

TEST(PostmortemRoot, TheSideThatLeftItsOrderOfCallsIsTheCulprit) {
  // Two steps of D (gradients), C (the count), W (barrier) on ranks 0 and 1; in the third rank 1
  // skips D. Rank 0 waits in D #3 for 1, rank 1 in C #3 for 0: a cycle, but rank 1's call after
  // the barrier was D in its earlier steps and is C now, while rank 0 kept its order.
  JobBuilder j(2);
  const uint32_t w = j.group("0", {0, 1}, "default_pg");
  const uint32_t dg = j.group("3", {0, 1}, "D");
  const uint32_t cg = j.group("4", {0, 1}, "C");
  for (int step = 0; step < 3; ++step) {
    for (int64_t r : {0, 1}) {
      if (step < 2 || r == 0) j.call(r, dg, "all_reduce", {256});
      if (step == 2 && r == 0) continue;  // it waits in D
      j.call(r, cg, "all_reduce", {1}, "Long");
      if (step < 2) j.call(r, w, "barrier", {0});
    }
  }
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_TRUE(res.root);
  EXPECT_EQ(res.root->kind, RootKind::kOutOfOrder);
  EXPECT_EQ(res.root->culprits, (std::vector<int64_t>{1}));
  EXPECT_EQ(res.divergences[0].group, dg);
  EXPECT_EQ(res.divergences[0].not_issued, (std::vector<int64_t>{1}));
  EXPECT_EQ(res.root->cycle.size(), 2u);  // both sides still shown
  // Without an earlier step to compare with, it stays a cycle.
  JobBuilder k(2);
  const uint32_t dk = k.group("3", {0, 1}, "D");
  const uint32_t ck = k.group("4", {0, 1}, "C");
  k.call(0, dk, "all_reduce", {256});
  k.call(1, ck, "all_reduce", {1}, "Long");
  EXPECT_EQ(analyse_flight_records(k.job()).root->kind, RootKind::kCycle);
}

TEST(PostmortemRoot, TheRootExplainingMoreWaitsWinsOverTheEarlierOne) {
  // Two independent stops: rank 1 is short on A (rank 0 waits, created first); rank 5 is short
  // on B where ranks 2, 3, 4 wait (created later). By clock A comes first; by causality B
  // explains three waits to A's one.
  JobBuilder j(6);
  const uint32_t a = j.group("1", {0, 1}, "A");
  const uint32_t b = j.group("2", {2, 3, 4, 5}, "B");
  for (int64_t r : {0, 1}) j.call(r, a, "all_reduce");
  for (int64_t r : {2, 3, 4, 5}) j.call(r, b, "all_reduce");
  j.call(0, a, "all_reduce");
  for (int64_t r : {2, 3, 4}) j.call(r, b, "all_reduce");
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_TRUE(res.root);
  EXPECT_EQ(res.divergences[0].group, b);
  EXPECT_EQ(res.root->culprits, (std::vector<int64_t>{5}));
  EXPECT_EQ(res.root->explains, 3);
  EXPECT_FALSE(res.root->by_time);
  EXPECT_EQ(res.culprits, (std::vector<int64_t>{1, 5}));  // both stopped; B is the headline
}

TEST(PostmortemRoot, EqualRootsAreBrokenByTimeAndSaySo) {
  JobBuilder j(4);
  const uint32_t a = j.group("1", {0, 1}, "A");
  const uint32_t b = j.group("2", {2, 3}, "B");
  j.call(2, b, "all_reduce");  // created first
  j.call(0, a, "all_reduce");
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_TRUE(res.root);
  EXPECT_EQ(res.divergences[0].group, b);
  EXPECT_TRUE(res.root->by_time);
}

TEST(PostmortemRoot, AMissingDumpThatExplainsThePendingWaitsIsTheRoot) {
  // World 4, rank 3 left no dump (its node died); ranks 0-2 issued all-reduce #2 on the world
  // group, which started and never completed (not retired, pg_status says 1): every wait points
  // to rank 3.
  JobBuilder j(4);
  const uint32_t w = j.group("0", {0, 1, 2, 3}, "default_pg");
  for (int64_t r = 0; r < 3; ++r) {
    j.call(r, w, "all_reduce");
    j.call(r, w, "all_reduce");
    auto& d = j.job().ranks[static_cast<std::size_t>(r)];
    d.calls[0].retired = true;
    d.calls[1].state = FrState::kStarted;
    d.calls[0].pg_id = d.calls[1].pg_id = 0;
    d.pg_status = {{0, 1}};
  }
  j.job().ranks.pop_back();  // rank 3's dump
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_TRUE(res.root);
  EXPECT_EQ(res.root->kind, RootKind::kMissingDump);
  EXPECT_EQ(res.root->culprits, (std::vector<int64_t>{3}));
  EXPECT_EQ(res.divergences[0].seq, 2);
  EXPECT_EQ(res.missing, (std::vector<int64_t>{3}));
  EXPECT_TRUE(res.judgement().faulted);
  // A Gloo dump: the call never reads "started", and an unretired one proves nothing (the recorder
  // retires it after the call returns; a dump taken at once still shows it): no divergence, and
  // not a pass either.
  for (auto& d : j.job().ranks) d.calls[1].state = FrState::kScheduled;
  const PostmortemResult gloo = analyse_flight_records(j.job());
  EXPECT_FALSE(gloo.diverged());
  EXPECT_FALSE(gloo.judgement().unverified.empty());
  // The same dumps with the call completed (the job finished; rank 3's file was lost): likewise.
  for (auto& d : j.job().ranks) d.pg_status = {{0, 2}};
  const PostmortemResult done = analyse_flight_records(j.job());
  EXPECT_FALSE(done.diverged());
  const Judgement jd = done.judgement();
  EXPECT_FALSE(jd.faulted);
  EXPECT_NE(jd.unverified.find("rank 3"), std::string::npos) << jd.unverified;
}

TEST(PostmortemRoot, NoDivergenceWithTheWorldUnknownIsNotAPass) {
  JobBuilder j(2);
  const uint32_t w = j.group("0", {0, 1}, "default_pg");
  j.call(0, w, "all_reduce");
  j.call(1, w, "all_reduce");
  EXPECT_TRUE(analyse_flight_records(j.job()).judgement().unverified.empty());
  j.job().world_known = false;
  const Judgement jd = analyse_flight_records(j.job()).judgement();
  EXPECT_NE(jd.unverified.find("--world"), std::string::npos) << jd.unverified;
}

TEST(PostmortemRoot, CallNumbersFarApartCostTheirCallsNotTheirGap) {
  // Numbers 1, 2^40 and near INT64_MAX: the alignment walks the calls recorded (a loop over the
  // numbers in between would never end).
  JobBuilder j(2);
  const uint32_t g = j.group("0", {0, 1}, "default_pg");
  for (int64_t r : {0, 1}) {
    j.call(r, g, "all_reduce");
    j.call(r, g, "all_reduce");
    j.call(r, g, "all_reduce");
    auto& calls = j.job().ranks[static_cast<std::size_t>(r)].calls;
    calls[1].seq = int64_t{1} << 40;
    calls[2].seq = std::numeric_limits<int64_t>::max() - r;
  }
  const PostmortemResult res = analyse_flight_records(j.job());
  ASSERT_TRUE(res.diverged());  // rank 1's last number is one short of rank 0's
  EXPECT_EQ(res.divergences[0].not_issued, (std::vector<int64_t>{1}));
}

TEST(PostmortemGroups, TheLayoutGivenSetsTheWorldAndTheMembers) {
  JobBuilder j(4);
  j.job().world_known = false;
  const uint32_t w = j.group("0", {0, 1, 2}, "default_pg", true);
  const uint32_t dp = j.group("3", {0, 2}, "", true);   // no description: exactly a DP group
  const uint32_t odd = j.group("4", {0, 3}, "", true);  // no group of TP2 DP2 is {0, 3}
  j.call(0, w, "barrier", {0});
  resolve_groups(j.job(), JobShape{std::nullopt, Topology(2, 1, 1, 2)});
  EXPECT_TRUE(j.job().world_known);
  EXPECT_EQ(j.job().world_source, "layout");
  EXPECT_EQ(j.job().groups[w].members, (std::vector<int64_t>{0, 1, 2, 3}));
  EXPECT_FALSE(j.job().groups[w].members_inferred);
  EXPECT_TRUE(j.job().groups[dp].members_from_layout);
  EXPECT_TRUE(j.job().groups[odd].members_inferred);
  // --world and the layout must agree; a dump beyond the world is refused.
  JobBuilder k(4);
  k.job().world_known = false;
  EXPECT_THROW(resolve_groups(k.job(), JobShape{6, Topology(2, 1, 1, 2)}), InputError);
  EXPECT_THROW(resolve_groups(k.job(), JobShape{3, std::nullopt}), InputError);
}

// What the text prints is in the result, composed once under the options: the headline's line, the
// blamed ranks grouped by their last call (ordered by its text), where the issuer waits and the
// frames shown of it, the culprits' last calls.
TEST(PostmortemReport, TheResultHoldsWhatTheTextPrints) {
  JobBuilder j(4);
  const uint32_t w = j.group("0", {0, 1, 2, 3}, "default_pg");
  const uint32_t solo = j.group("5", {3});
  for (int64_t r = 0; r < 4; ++r) j.call(r, w, "all_reduce");
  j.call(3, solo, "broadcast");
  j.call(0, w, "barrier", {0}, "Float",
         {{"barrier", "/usr/lib/python3/torch/distributed/c10d.py", 1},
          {"train_step", "train.py", 10},
          {"main", "train.py", 20}});
  PostmortemOptions o;
  o.frames = 1;
  const PostmortemResult res = analyse_flight_records(j.job(), o);
  ASSERT_TRUE(res.diverged());
  EXPECT_EQ(res.job.ranks.size(), 4u);  // the result owns the job its indices point into
  EXPECT_EQ(
      res.divergences[0].summary,
      "rank 0 issued barrier #2 on group '0' (default_pg, 4 ranks: 0-3); ranks 1-3 never did");
  EXPECT_EQ(res.listed_divergences, 0u);

  ASSERT_EQ(res.blamed_by_last_call.size(), 2u);
  const LastCallGroup& both = res.blamed_by_last_call[0];
  EXPECT_EQ(both.ranks, (std::vector<int64_t>{1, 2}));
  ASSERT_TRUE(both.last_call);
  EXPECT_EQ(both.last_call->call.group, w);
  EXPECT_EQ(both.state, "scheduled, not retired");
  EXPECT_FALSE(both.unmatched);
  EXPECT_EQ(both.summary,
            "ranks 1, 2: last call all_reduce #1 on group '0' (default_pg, 4 ranks: 0-3) "
            "Float[[1]] (scheduled, not retired), issued by every member; nothing recorded after "
            "it (it died, or hangs outside collectives)");
  const LastCallGroup& three = res.blamed_by_last_call[1];
  EXPECT_EQ(three.ranks, (std::vector<int64_t>{3}));
  ASSERT_TRUE(three.last_call);
  EXPECT_EQ(three.last_call->call.group, solo);
  EXPECT_NE(three.summary.find("rank 3: last call broadcast #1 on group '5' (1 rank: 3)"),
            std::string::npos)
      << three.summary;

  ASSERT_TRUE(res.issuer_call);
  EXPECT_EQ(res.issuer_call->summary, "rank 0 waits in it, called from:");
  EXPECT_EQ(res.issuer_call->call.call.seq, 2);
  EXPECT_EQ(res.issuer_call->call.frames, (std::vector<std::size_t>{1}));  // the job's own first

  EXPECT_EQ(res.culprits, (std::vector<int64_t>{1, 2, 3}));
  ASSERT_EQ(res.culprit_calls.size(), 3u);
  ASSERT_TRUE(res.culprit_calls[2].last_call);
  EXPECT_EQ(res.culprit_calls[2].last_call->group, solo);
  EXPECT_FALSE(res.culprit_calls[2].finished);

  o.frames = 0;
  EXPECT_TRUE(analyse_flight_records(j.job(), o).issuer_call->call.frames.empty());
}

// `postmortem`, the one entry point, resolves the groups from the shape the user gives before the
// analysis: the CLI never does it itself.
TEST(PostmortemReport, TheEntryPointResolvesTheGroupsFromTheShapeGiven) {
  JobBuilder j(2);
  j.job().world_known = false;
  const uint32_t w = j.group("0", {0, 1}, "default_pg");
  j.call(0, w, "all_reduce");
  j.call(1, w, "all_reduce");
  EXPECT_FALSE(analyse_flight_records(j.job()).judgement().unverified.empty());
  const PostmortemResult res = postmortem(j.job(), JobShape{2, std::nullopt}, {});
  EXPECT_TRUE(res.job.world_known);
  EXPECT_EQ(res.job.world_source, "--world");
  EXPECT_TRUE(res.judgement().unverified.empty());
  EXPECT_THROW(postmortem(j.job(), JobShape{1, std::nullopt}, {}), InputError);
}

TEST(FlightRecord, ProfilingNamesNormaliseAcrossBackends) {
  EXPECT_EQ(parse_profiling_name("gloo:all_reduce")->op, "all_reduce");
  EXPECT_EQ(parse_profiling_name("nccl:allreduce_coalesced")->op, "all_reduce");
  EXPECT_EQ(parse_profiling_name("nccl:_allgather_base")->op, "all_gather");
  const auto send = parse_profiling_name("nccl:send 1->2");
  ASSERT_TRUE(send);
  EXPECT_EQ(send->op, "send");
  EXPECT_EQ(send->src, 1);
  EXPECT_EQ(send->dst, 2);
  const auto recv = parse_profiling_name("gloo:recv 3<-?");
  ASSERT_TRUE(recv);
  EXPECT_EQ(recv->src, -1);
  EXPECT_EQ(recv->dst, 3);
  EXPECT_FALSE(parse_profiling_name("all_reduce"));
  EXPECT_FALSE(parse_profiling_name("nccl:send 1-2"));
}

}  // namespace
}  // namespace lossguard::oracle
