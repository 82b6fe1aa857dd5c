// oracle/audit's one result (AuditResult): the header, each step's verdict decided once under the
// options (strict_scale), its one-line summary and shard ratios, and the judgement. Expectations by
// hand: two DP ranks, one sample each of two response tokens, per-token objective, so N = 4 and
// every token's true weight is 1/4.
#include "oracle/audit/audit.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/rank_capture.h"

namespace lossguard::oracle {
namespace {

// Rank r of two holds sample `sample` (default r), both response tokens loss-bearing, each weighed
// w.
RankCapture rank(int64_t r, double w, int64_t sample = -1) {
  RankCapture c;
  c.file = "rank" + std::to_string(r);
  c.rank = r;
  c.world_size = 2;
  c.dp = 2;
  c.dp_rank = r;
  c.reduce = "per-token";
  CapturedMicroBatch mb;
  mb.sample_indices = {sample < 0 ? r : sample};
  mb.total_lengths = {3};
  mb.response_lengths = {2};
  mb.tokens = {1, 2, 3};
  mb.loss_masks = {1, 1};
  mb.token_weight = {w, w};
  c.microbatches.push_back(mb);
  return c;
}

// The shard ratios are asked for (what --svg draws).
AuditOptions with_shards(AuditOptions o = {}) {
  o.shard_ratios = true;
  return o;
}

TEST(AuditResult, HeaderStepsAndVerdictOfARightStep) {
  EXPECT_TRUE(
      audit_captures({rank(0, 0.25), rank(1, 0.25)}, {}).steps[0].shards.empty());  // not asked
  const AuditResult r = audit_captures({rank(0, 0.25), rank(1, 0.25)}, with_shards());
  EXPECT_EQ(r.header.captures, 2u);
  EXPECT_EQ(r.header.world_size, 2);
  EXPECT_EQ(r.header.dp, 2);
  EXPECT_EQ(r.header.cp, 1);
  ASSERT_EQ(r.steps.size(), 1u);
  const AuditStep& s = r.steps[0];
  EXPECT_FALSE(s.failed);
  EXPECT_FALSE(r.failed);
  EXPECT_FALSE(r.judgement().failed);
  EXPECT_EQ(s.global_tokens, 4);
  EXPECT_FALSE(s.summary.empty());
  // one micro-batch per DP rank, CP 1: two shards, each 2 tokens at ratio 1
  ASSERT_EQ(s.shards.size(), 2u);
  for (const ShardRatio& sh : s.shards) {
    EXPECT_EQ(sh.tokens, 2);
    EXPECT_DOUBLE_EQ(sh.min_ratio, 1.0);
    EXPECT_DOUBLE_EQ(sh.max_ratio, 1.0);
  }
}

// Every weight x3 (a constant uniform scale: not dp, cp or 1/M, which would fail whatever the
// option, since another layout would apply another update): a pass by default, a
// failure under strict_scale — the step's verdict, the result's and its judgement all follow the
// option, decided in the library (the renderer only reads `failed`).
TEST(AuditResult, StrictScaleDecidesTheVerdictOnce) {
  const std::vector<RankCapture> tripled = {rank(0, 0.75), rank(1, 0.75)};
  const AuditResult lax = audit_captures(tripled, {});
  ASSERT_EQ(lax.steps.size(), 1u);
  EXPECT_EQ(lax.steps[0].diagnosis.kind, "uniform-scale");
  EXPECT_DOUBLE_EQ(lax.steps[0].diagnosis.scale, 3.0);
  EXPECT_FALSE(lax.steps[0].failed);
  EXPECT_FALSE(lax.judgement().failed);
  AuditOptions strict;
  strict.strict_scale = true;
  const AuditResult hard = audit_captures(tripled, with_shards(strict));
  EXPECT_TRUE(hard.steps[0].failed);
  EXPECT_TRUE(hard.failed);
  EXPECT_TRUE(hard.judgement().failed);
  for (const ShardRatio& sh : hard.steps[0].shards) EXPECT_DOUBLE_EQ(sh.max_ratio, 3.0);
}

// A token weighed wrong on rank 1 only: the step fails whatever the option, and its summary names
// the per-rank pattern; a layout that holds a sample twice is not weighed: no shard ratios to draw.
TEST(AuditResult, AWrongRankFailsAndACoverageFailureHasNoShards) {
  const AuditResult r = audit_captures({rank(0, 0.25), rank(1, 0.5)}, {});
  ASSERT_EQ(r.steps.size(), 1u);
  EXPECT_TRUE(r.steps[0].failed);
  EXPECT_TRUE(r.judgement().failed);
  EXPECT_NE(r.steps[0].summary.find("per-DP-rank"), std::string::npos) << r.steps[0].summary;
  const AuditResult twice =
      audit_captures({rank(0, 0.25), rank(1, 0.25, 0)}, {});  // sample 0 twice
  ASSERT_EQ(twice.steps.size(), 1u);
  EXPECT_TRUE(twice.steps[0].failed);
  EXPECT_TRUE(twice.steps[0].shards.empty());
}

}  // namespace
}  // namespace lossguard::oracle
