// The five protocols on the simulator (SPEC §7): outcomes per rank as the spec predicts.
#include <gtest/gtest.h>

#include "core/errors.h"
#include "fixtures/cases.h"
#include "oracle/metrics.h"
#include "oracle/replay.h"

namespace lossguard::oracle {
namespace {

Batch batch_of(const std::string& name, int64_t samples = 8) {
  fixtures::GenOptions o;
  o.num_samples = samples;
  o.seed = 7;
  return fixtures::make_case(name, o);
}

ReplayResult replay(const Batch& b, int64_t tp, int64_t pp, int64_t cp, int64_t dp, Protocol p,
                    ReduceMode reduce = ReduceMode::kPerToken, int64_t microbatches = 1) {
  const Topology t(tp, pp, cp, dp);
  const Placement placement = place_samples(b.num_samples(), dp, microbatches, Split::kContiguous);
  return simulate(make_replay_inputs(b, t, placement, p, reduce, Policy::kFixed, {}));
}

bool passes(const ReplayResult& r) { return !r.fault && !r.wrong_decision; }

struct Topo {
  int64_t tp, pp, cp, dp;
};
const std::vector<Topo> kTopologies = {{1, 1, 1, 1}, {2, 1, 1, 1}, {1, 2, 1, 1}, {2, 2, 1, 1},
                                       {1, 1, 2, 2}, {1, 2, 2, 2}, {2, 2, 2, 2}, {1, 4, 1, 2},
                                       {4, 1, 2, 1}, {2, 3, 2, 1}};

TEST(Replay, Pr285PassesOnZeroTokenAndNonZeroBatchesForEveryTopology) {
  for (const char* c : {"zero-token", "random", "empty-responses"}) {
    const Batch b = batch_of(c);
    for (const auto& t : kTopologies) {
      for (int64_t mb : {1, 2}) {
        const ReplayResult r =
            replay(b, t.tp, t.pp, t.cp, t.dp, Protocol::kPr285, ReduceMode::kPerToken, mb);
        EXPECT_TRUE(passes(r)) << c << " TP" << t.tp << " PP" << t.pp << " CP" << t.cp << " DP"
                               << t.dp;
        EXPECT_EQ(r.expected_skip, std::string(c) == "zero-token");
        for (const auto& rr : r.ranks) {
          EXPECT_EQ(rr.optimizer_stepped, !r.expected_skip);
          EXPECT_EQ(rr.scheduler_stepped, !r.expected_skip);
          if (r.expected_skip) {
            EXPECT_EQ(rr.grad_norm, 0.0);
          }
          EXPECT_EQ(rr.update_successful, !r.expected_skip);
        }
      }
    }
  }
}

TEST(Replay, SrcLocalErrorsOnRanks0And2OfTp2Pp2AndGivesRank3TheWrongFlag) {
  const ReplayResult r = replay(batch_of("zero-token"), 2, 2, 1, 1, Protocol::kPr285SrcLocal);
  ASSERT_EQ(r.ranks.size(), 4u);
  EXPECT_EQ(r.ranks[0].outcome, Outcome::kError);
  EXPECT_EQ(r.ranks[2].outcome, Outcome::kError);
  EXPECT_NE(r.ranks[0].detail.find("src = 1 is not in its pipeline group [0, 2]"),
            std::string::npos)
      << r.ranks[0].detail;
  // Rank 3 computed "skip" itself but received stage 0's (rank 1's) flag and stepped.
  EXPECT_EQ(r.ranks[3].skip, false);
  EXPECT_NE(r.ranks[3].detail.find("received skip flag 0 from rank 1"), std::string::npos)
      << r.ranks[3].detail;
  EXPECT_EQ(r.ranks[3].outcome,
            Outcome::kBlocked);  // ranks 0 and 2 never reach the optimizer's all-reduce
  EXPECT_TRUE(r.fault);
  EXPECT_TRUE(r.wrong_decision);
  // On a batch with tokens the wrong source happens to carry the right decision, but ranks 0, 2
  // still fail.
  const ReplayResult n = replay(batch_of("random"), 2, 2, 1, 1, Protocol::kPr285SrcLocal);
  EXPECT_EQ(n.ranks[0].outcome, Outcome::kError);
  EXPECT_FALSE(n.wrong_decision);
}

TEST(Replay, AlwaysBroadcastFaultsAtPp1WithMoreThanOneRank) {
  for (const auto& t : kTopologies) {
    if (t.pp != 1) continue;
    const ReplayResult r =
        replay(batch_of("random"), t.tp, t.pp, t.cp, t.dp, Protocol::kPr285AlwaysBroadcast);
    const int64_t world = t.tp * t.cp * t.dp;
    EXPECT_EQ(r.fault, world > 1) << "TP" << t.tp << " CP" << t.cp << " DP" << t.dp;
    if (world > 1) {
      EXPECT_EQ(r.ranks[1].outcome,
                Outcome::kError);  // src = PP-1 = 0 is not in rank 1's group [1]
    }
  }
}

TEST(Replay, Values0DriftsWhenPerTokenLossIsOffAndPassesWhenOn) {
  const Batch zero = batch_of("zero-token");
  for (const auto& t : kTopologies) {
    const ReplayResult off =
        replay(zero, t.tp, t.pp, t.cp, t.dp, Protocol::kValues0, ReduceMode::kSampleMean);
    EXPECT_FALSE(off.fault);
    EXPECT_TRUE(off.wrong_decision);  // values[0] is a sample count: never 0, so it steps: drift
    for (const auto& rr : off.ranks) EXPECT_TRUE(rr.optimizer_stepped);
    ASSERT_FALSE(off.findings.empty());
    EXPECT_EQ(off.findings[0].kind, "parameter_drift");
    EXPECT_TRUE(
        passes(replay(zero, t.tp, t.pp, t.cp, t.dp, Protocol::kValues0, ReduceMode::kPerToken)));
    EXPECT_TRUE(passes(replay(batch_of("random"), t.tp, t.pp, t.cp, t.dp, Protocol::kValues0,
                              ReduceMode::kSampleMean)));
  }
}

TEST(Replay, NoSkipDriftsOnEveryZeroTokenBatch) {
  for (const auto& t : kTopologies) {
    const ReplayResult z =
        replay(batch_of("zero-token"), t.tp, t.pp, t.cp, t.dp, Protocol::kNoSkip);
    EXPECT_TRUE(z.wrong_decision);
    EXPECT_FALSE(z.fault);
    EXPECT_TRUE(passes(replay(batch_of("random"), t.tp, t.pp, t.cp, t.dp, Protocol::kNoSkip)));
  }
}

TEST(Replay, DecisionFollowsTheGlobalCountNotALocalOne) {
  // One DP rank holds every token, the others none: every rank must still step.
  Batch b = batch_of("zero-token", 6);
  fixtures::GenOptions o;
  o.num_samples = 1;
  o.empty_fraction = 0;
  o.masked_fraction = 0;
  Batch one = fixtures::make_case("random", o);
  BatchBuilder builder;
  builder.begin_file("mixed");
  for (const Batch* part : {&one, &b}) {
    for (int64_t i = 0; i < part->num_samples(); ++i) {
      HostArray tok = HostArray::from_i64(
          DType::kInt64, {part->total_lengths[i]},
          std::vector<int64_t>(part->tokens.begin() + part->token_offsets[i],
                               part->tokens.begin() + part->token_offsets[i + 1]));
      std::vector<int64_t> m(part->loss_mask.begin() + part->response_offsets[i],
                             part->loss_mask.begin() + part->response_offsets[i + 1]);
      HostArray mask = HostArray::from_i64(DType::kInt64, {part->response_lengths[i]}, m);
      SampleFields f;
      f.tokens = &tok;
      f.response_length = part->response_lengths[i];
      f.loss_mask = &mask;
      builder.add_sample(i, f);
    }
  }
  const Batch mixed = builder.finish();
  const ReplayResult r = replay(mixed, 1, 2, 2, 7, Protocol::kPr285);
  EXPECT_FALSE(r.expected_skip);
  EXPECT_TRUE(passes(r));
}

TEST(Replay, RankSetsAreCompressed) {
  EXPECT_EQ(format_rank_set({0, 1, 2, 3}), "0-3");
  EXPECT_EQ(format_rank_set({0, 2}), "0, 2");
  EXPECT_EQ(format_rank_set({0, 2, 4, 6, 9}), "0-6 step 2, 9");
  EXPECT_EQ(format_rank_set({1, 5}, 1), "1, ...");
}

TEST(Metrics, NormalisationFollowsSpecSection6) {
  EXPECT_THROW(normalize_metrics({1.0}, {"a", "b"}), MetricsError);
  const auto zero = normalize_metrics({0.0, 0.0, 0.0}, {"loss", "kl"});
  EXPECT_TRUE(zero.no_signal);
  EXPECT_EQ(zero.values[1].second, 0.0);
  try {
    normalize_metrics({0.0, 0.0, 2.5}, {"loss", "kl"});
    FAIL();
  } catch (const MetricsError& e) {
    EXPECT_NE(std::string(e.what()).find("kl = 2.5"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("loss ="), std::string::npos) << e.what();
  }
  const auto m = normalize_metrics({4.0, 2.0, 1.0}, {"loss", "kl"});
  EXPECT_FALSE(m.no_signal);
  EXPECT_EQ(m.values[0].second, 0.5);
  EXPECT_EQ(m.values[1].second, 0.25);
}

}  // namespace
}  // namespace lossguard::oracle
