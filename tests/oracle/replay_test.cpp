// The five protocols on the simulator (SPEC §7): outcomes per rank as the spec predicts.
#include "oracle/replay/replay.h"

#include <gtest/gtest.h>

#include "core/errors.h"
#include "core/format.h"
#include "oracle/count/metrics.h"
#include "oracle/count/placement.h"
#include "synth/cases.h"

namespace lossguard::oracle {
namespace {

Batch batch_of(const std::string& name, int64_t samples = 8) {
  synth::GenOptions o;
  o.num_samples = samples;
  o.seed = 7;
  return synth::make_case(name, o);
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
  synth::GenOptions o;
  o.num_samples = 1;
  o.empty_fraction = 0;
  o.masked_fraction = 0;
  Batch one = synth::make_case("random", o);
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

// Data-dependent participation (SPEC §7): inputs written by hand, per (dp, cp) and micro-batch,
// so each expectation follows from the protocol's description alone.
ReplayInputs hand_inputs(const Topology& t, Protocol p,
                         const std::vector<std::vector<int64_t>>& microbatch_tokens,
                         GradSync sync = GradSync::kLastMicrobatch) {
  ReplayInputs in;
  in.topo = t;
  in.protocol = p;
  in.grad_sync = sync;
  in.microbatch_tokens = microbatch_tokens;
  for (const auto& mbs : microbatch_tokens) {
    for (int64_t n : mbs) in.global_tokens += n;
    in.local_samples.push_back(static_cast<int64_t>(mbs.size()));
  }
  return in;
}

std::vector<Outcome> outcomes(const ReplayResult& r) {
  std::vector<Outcome> o;
  for (const auto& rr : r.ranks) o.push_back(rr.outcome);
  return o;
}

TEST(ReplayParticipation, LocalBackwardSkipOfTheLastMicrobatchDesynchronisesTheGradientAllReduce) {
  // DP2: DP rank 0's last micro-batch has no token, DP rank 1's has 4.
  const Topology dp2(1, 1, 1, 2);
  const std::vector<std::vector<int64_t>> tokens = {{5, 0}, {3, 4}};
  // Local decision: rank 0 skips the backward that would issue its DDP all-reduce and goes on to
  // the step's count all-reduce, which meets rank 1's gradient all-reduce: a mismatch on both.
  const ReplayResult local = simulate(hand_inputs(dp2, Protocol::kMicrobatchSkipLocal, tokens));
  EXPECT_EQ(outcomes(local), (std::vector<Outcome>{Outcome::kMismatch, Outcome::kMismatch}));
  EXPECT_NE(local.ranks[0].detail.find("gradient bucket"), std::string::npos)
      << local.ranks[0].detail;
  EXPECT_NE(local.ranks[0].detail.find("skipped the backward of 1 of its 2"), std::string::npos)
      << local.ranks[0].detail;
  // Decided on the DP+CP-reduced count (4): nobody skips; both step.
  EXPECT_TRUE(passes(simulate(hand_inputs(dp2, Protocol::kMicrobatchSkip, tokens))));
  // Megatron without overlap issues the all-reduce in finalize_model_grads, whatever backward ran.
  EXPECT_TRUE(passes(
      simulate(hand_inputs(dp2, Protocol::kMicrobatchSkipLocal, tokens, GradSync::kFinalize))));
  // A last micro-batch empty on every rank is skipped everywhere: no hang, but the backward that
  // issues the all-reduce never ran, so each replica steps on its own gradients.
  const ReplayResult all_empty =
      simulate(hand_inputs(dp2, Protocol::kMicrobatchSkip, {{5, 0}, {3, 0}}));
  EXPECT_FALSE(all_empty.fault);
  EXPECT_TRUE(all_empty.wrong_decision);
  ASSERT_FALSE(all_empty.findings.empty());
  EXPECT_EQ(all_empty.findings[0].kind, "unsynced_gradients");
  EXPECT_TRUE(passes(simulate(
      hand_inputs(dp2, Protocol::kMicrobatchSkip, {{5, 0}, {3, 0}}, GradSync::kFinalize))));
}

TEST(ReplayParticipation, LocalBackwardSkipHangsACpGroupWhoseShortSampleOneRankDoesNotOwn) {
  // CP2 DP1: the only sample's effective tokens all land on CP rank 1.
  const ReplayResult r =
      simulate(hand_inputs(Topology(1, 1, 2, 1), Protocol::kMicrobatchSkipLocal, {{0}, {3}}));
  EXPECT_EQ(outcomes(r), (std::vector<Outcome>{Outcome::kMismatch, Outcome::kMismatch}));
  EXPECT_TRUE(
      passes(simulate(hand_inputs(Topology(1, 1, 2, 1), Protocol::kMicrobatchSkip, {{0}, {3}}))));
  // PP2: the last stage's local decision reaches the first stage by the pipeline broadcast; the
  // mismatch is in each stage's own DP+CP group.
  const ReplayResult pp =
      simulate(hand_inputs(Topology(1, 2, 2, 1), Protocol::kMicrobatchSkipLocal, {{0}, {3}}));
  // (rank = cp + 2 pp): the last stage's CP ranks 2, 3 mismatch in their DP+CP group; stage 0
  // then waits for them (rank 0 in the step's pipeline broadcast, rank 1 in its gradient
  // all-reduce, which rank 0 skipped).
  EXPECT_EQ(outcomes(pp), (std::vector<Outcome>{Outcome::kBlocked, Outcome::kBlocked,
                                                Outcome::kMismatch, Outcome::kMismatch}));
}

TEST(ReplayParticipation, EveryMicrobatchSyncMatchesTheWrongMicrobatchesThenMismatches) {
  // FSDP-style sync in every backward: rank 0 skips micro-batch 0, so its micro-batch 1 all-reduce
  // meets rank 1's micro-batch 0 one (same payload: silently the wrong gradients), and rank 1's
  // micro-batch 1 all-reduce meets rank 0's count all-reduce.
  const ReplayResult r = simulate(hand_inputs(Topology(1, 1, 1, 2), Protocol::kMicrobatchSkipLocal,
                                              {{0, 5}, {3, 4}}, GradSync::kEveryMicrobatch));
  EXPECT_EQ(outcomes(r), (std::vector<Outcome>{Outcome::kMismatch, Outcome::kMismatch}));
  EXPECT_NE(r.ranks[1].summary.find("collective #2 on the dp_cp group"), std::string::npos)
      << r.ranks[1].summary;
}

TEST(ReplayParticipation, UnevenMicrobatchCountsHangMoeAllToAllsUnlessPaddedToTheMax) {
  // DP2 EP2 (world 2): DP rank 0 has 3 micro-batches, DP rank 1 has 2; every forward and backward
  // exchanges tokens over the expert-parallel group [0, 1].
  const Topology t(1, 1, 1, 2, 2);
  const std::vector<std::vector<int64_t>> tokens = {{4, 4, 4}, {4, 4}};
  const ReplayResult local = simulate(hand_inputs(t, Protocol::kMicrobatchesLocal, tokens));
  EXPECT_EQ(outcomes(local), (std::vector<Outcome>{Outcome::kBlocked, Outcome::kBlocked}));
  EXPECT_NE(local.ranks[0].summary.find("all_to_all (MoE token dispatch (forward), micro-batch 2)"),
            std::string::npos)
      << local.ranks[0].summary;
  const ReplayResult max = simulate(hand_inputs(t, Protocol::kMicrobatchesMax, tokens));
  EXPECT_TRUE(passes(max));
  EXPECT_NE(max.ranks[1].detail.find("ran 1 dummy micro-batch(es) after its 2"), std::string::npos)
      << max.ranks[1].detail;
  // Dense DDP alone reduces once, in the last backward: uneven counts are harmless there...
  EXPECT_TRUE(
      passes(simulate(hand_inputs(Topology(1, 1, 1, 2), Protocol::kMicrobatchesLocal, tokens))));
  // ... but not with a reduce in every backward (ZeRO-3 / FSDP).
  EXPECT_TRUE(simulate(hand_inputs(Topology(1, 1, 1, 2), Protocol::kMicrobatchesLocal, tokens,
                                   GradSync::kEveryMicrobatch))
                  .fault);
  // A DP rank with no micro-batch at all.
  EXPECT_TRUE(simulate(hand_inputs(t, Protocol::kMicrobatchesLocal, {{4}, {}})).fault);
  EXPECT_TRUE(passes(simulate(hand_inputs(t, Protocol::kMicrobatchesMax, {{4}, {}}))));
}

TEST(ReplayParticipation, NonFiniteGradientSkipIsCorrectOnlyAfterTheNormsAllReduce) {
  // TP2 DP2 (world 4): rank = tp + 2 dp. NaN on rank 1 reaches rank 3 through the DDP all-reduce
  // over DP+CP [1, 3]; the norm's all-reduce over the model-parallel groups [0, 1], [2, 3]
  // reaches everyone.
  const Topology t(2, 1, 1, 2);
  ReplayInputs in = hand_inputs(t, Protocol::kNanSkip, {{4}, {4}});
  in.nan_ranks = {1};
  const ReplayResult good = simulate(in);
  EXPECT_TRUE(good.expected_skip);
  EXPECT_TRUE(passes(good));
  for (const auto& r : good.ranks) {
    EXPECT_EQ(r.outcome, Outcome::kSkip);
    EXPECT_FALSE(r.grad_norm.has_value());  // Megatron returns None for a non-finite norm
  }
  // Per rank, before the all-reduce: ranks 1 and 3 skip, ranks 0 and 2 wait for them in the
  // norm's all-reduce; 1 and 3 then wait at the next step's barrier.
  in.protocol = Protocol::kNanSkipLocal;
  const ReplayResult local = simulate(in);
  EXPECT_EQ(outcomes(local), std::vector<Outcome>(4, Outcome::kBlocked));
  EXPECT_NE(local.ranks[0].summary.find("grad_norm"), std::string::npos) << local.ranks[0].summary;
  // Rank 0 decides on its own gradient (finite) and broadcasts "step": every rank steps with NaN.
  in.protocol = Protocol::kNanSkipRank0;
  const ReplayResult rank0 = simulate(in);
  EXPECT_FALSE(rank0.fault);
  EXPECT_TRUE(rank0.wrong_decision);
  ASSERT_FALSE(rank0.findings.empty());
  EXPECT_EQ(rank0.findings[0].kind, "nonfinite_step");
  // ... and gets it right when the NaN is in rank 0's own DP+CP group.
  in.nan_ranks = {2};
  EXPECT_TRUE(passes(simulate(in)));
  // Dense and expert gradients travel apart. TP2 DP3 EP3 ETP1 (world 6): NaN on rank 1 reaches 3
  // and 5 through the dense DP+CP all-reduce [1, 3, 5] and 4 through the expert-DP one [1, 4],
  // but not rank 0, whose groups are [0, 2, 4] (dense) and [0, 3] (expert): rank 0 says "step".
  ReplayInputs moe =
      hand_inputs(Topology(2, 1, 1, 3, 3, 1), Protocol::kNanSkipRank0, {{4}, {4}, {4}});
  moe.nan_ranks = {1};
  const ReplayResult moe_rank0 = simulate(moe);
  EXPECT_FALSE(moe_rank0.fault);
  EXPECT_TRUE(moe_rank0.wrong_decision);
  moe.protocol = Protocol::kNanSkip;  // the norms' all-reduces (mp, emp) reach everyone
  EXPECT_TRUE(passes(simulate(moe)));
  // A protocol with no non-finite check steps on NaN: a wrong decision, not a hang.
  in.protocol = Protocol::kPr285;
  const ReplayResult none = simulate(in);
  EXPECT_TRUE(none.wrong_decision);
  EXPECT_FALSE(none.fault);
}

TEST(ReplayParticipation, FlagBroadcastWithAGroupLocalSrcFailsOnEveryGroupWithoutRank0) {
  const Topology t(2, 1, 1, 2);  // tp groups [0, 1], [2, 3]; dp groups [0, 2], [1, 3]
  ReplayInputs in = hand_inputs(t, Protocol::kFlagBroadcastSrcLocal, {{0}, {0}});
  const ReplayResult tp = simulate(in);
  EXPECT_EQ(outcomes(tp), (std::vector<Outcome>{Outcome::kBlocked, Outcome::kBlocked,
                                                Outcome::kError, Outcome::kError}));
  EXPECT_NE(tp.ranks[2].detail.find("src = 0 is not in its tensor-parallel group [2, 3]"),
            std::string::npos)
      << tp.ranks[2].detail;
  in.flag_group = GroupKind::kDp;
  EXPECT_EQ(outcomes(simulate(in)), (std::vector<Outcome>{Outcome::kBlocked, Outcome::kError,
                                                          Outcome::kBlocked, Outcome::kError}));
  for (GroupKind g : {GroupKind::kTp, GroupKind::kDp, GroupKind::kCp}) {
    in.flag_group = g;
    in.protocol = Protocol::kFlagBroadcast;
    EXPECT_TRUE(passes(simulate(in))) << group_kind_name(g);
  }
  // With PP2 the flag lives on the last stage, which never holds rank 0: every group fails.
  ReplayInputs pp = hand_inputs(Topology(2, 2, 1, 1), Protocol::kFlagBroadcastSrcLocal, {{0}});
  const ReplayResult r = simulate(pp);
  EXPECT_EQ(r.ranks[2].outcome, Outcome::kError);
  EXPECT_EQ(r.ranks[3].outcome, Outcome::kError);
}

TEST(ReplayParticipation, RankListsAndTokenPacking) {
  EXPECT_EQ(parse_rank_list("3,0-1,1", 4), (std::vector<int64_t>{0, 1, 3}));
  EXPECT_THROW(parse_rank_list("4", 4), InputError);
  EXPECT_THROW(parse_rank_list("x", 4), InputError);
  // In order, at most 10 tokens per micro-batch; a sample longer than that alone.
  const Placement p = pack_by_tokens({{{0, 1, 2}, {3, 4}}, {{5}}}, {5, 5, 5, 2, 12, 3}, 10);
  EXPECT_EQ(p, (Placement{{{0, 1}, {2, 3}, {4}}, {{5}}}));
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
