// The result structs the subcommands render (count, weights, replay): each decides its verdict,
// its findings and its texts in oracle/, and is shown here deciding them, failing cases included.
#include <gtest/gtest.h>

#include <string>

#include "core/errors.h"
#include "oracle/count/count_result.h"
#include "oracle/replay/replay.h"
#include "oracle/weights/weights_result.h"
#include "synth/cases.h"
#include "weights_batches.h"

namespace lossguard::oracle {
namespace {

Batch random_batch(int64_t samples = 12) {
  synth::GenOptions o;
  o.seed = 3;
  o.num_samples = samples;
  o.vocab_size = 0;
  return synth::make_case("random", o);
}

TEST(CountResult, SizesAreSortedUniqueWithOneAddedForI1) {
  const CountSizes s = count_sizes({4, 2, 2});
  EXPECT_EQ(s.cp_sizes, (std::vector<int64_t>{1, 2, 4}));
  EXPECT_FALSE(s.cp1_requested);
  EXPECT_TRUE(count_sizes({2, 1}).cp1_requested);
  EXPECT_THROW(count_sizes({2, 0}), InputError);
}

// A placement that holds a sample twice is not a partition: I3 fails and names it, and the
// verdict with it; the same batch on a partition passes.
TEST(CountResult, APlacementThatIsNotAPartitionFailsI3AndTheVerdict) {
  const Batch b = random_batch();
  CountRequest r;
  r.sizes = count_sizes({1, 2, 4});
  Placement good = place_samples(b.num_samples(), 2, 2, Split::kContiguous);
  r.placement = &good;
  const CountResult pass = evaluate_count(b, r);
  EXPECT_TRUE(pass.ok());
  EXPECT_TRUE(pass.verified());
  ASSERT_EQ(pass.denominators.size(), 3u);
  EXPECT_EQ(pass.denominators[0], pass.denominators[2]);  // policy fixed: I1

  Placement twice = good;
  twice[1][0].push_back(good[0][0].front());
  r.placement = &twice;
  const CountResult fail = evaluate_count(b, r);
  EXPECT_FALSE(fail.ok());
  ASSERT_EQ(fail.invariants.size(), 4u);
  EXPECT_EQ(fail.invariants[2].name, "I3");
  EXPECT_FALSE(fail.invariants[2].ok);
  EXPECT_NE(fail.invariants[2].detail.find("not a partition"), std::string::npos);
}

// Under legacy, an empty response counts 1 at CP = 1 and 0 at CP > 1: I1 breaks.
TEST(CountResult, LegacyPolicyBreaksI1OnEmptyResponses) {
  synth::GenOptions o;
  o.vocab_size = 0;
  const Batch b = synth::make_case("empty-responses", o);
  CountRequest r;
  r.policy = Policy::kLegacy;
  r.sizes = count_sizes({1, 2});
  const CountResult c = evaluate_count(b, r);
  EXPECT_FALSE(c.ok());
  EXPECT_FALSE(c.invariants[0].ok);
  EXPECT_FALSE(c.empty.empty());
  EXPECT_EQ(c.denominators[0] - c.denominators[1], static_cast<int64_t>(c.empty.size()));
}

WeightsResult weigh(const Batch& b, std::vector<TermContract> terms, int64_t dp, int64_t m,
                    bool strict = false) {
  WeightsRequest q;
  q.terms = std::move(terms);
  q.layout = testing::flag_layout(b, dp, m, 1);
  q.vary = parse_variations({"dp", "microbatches"});
  q.sizes = resolve_sizes(b, {});
  q.strict_scale = strict;
  return evaluate_weights(b, q);
}

TEST(WeightsResult, VerdictsSayWhatFailsAndAUniformScalePassesUnlessStrict) {
  const Batch b = random_batch();
  const auto exact = weigh(b, parse_term_contracts("per-token", {"megatron-per-token"}, {}), 2, 3);
  EXPECT_FALSE(exact.fails());
  EXPECT_EQ(exact.verdict_text(),
            "pass: every token weighted as the objective says, on every layout tried");

  const auto hf = weigh(b, parse_term_contracts("per-token", {"hf-ga"}, {}), 2, 3);
  EXPECT_TRUE(hf.fails());
  EXPECT_EQ(hf.verdict_text(), "FAIL: the contract does not weight tokens as the objective says");

  const auto scaled = parse_term_contracts("per-token", {"megatron-per-token,scale=2"}, {});
  EXPECT_EQ(weigh(b, scaled, 2, 3).verdict_text(),
            "pass (a uniform scale; --strict-scale makes it fail)");
  EXPECT_TRUE(weigh(b, scaled, 2, 3, /*strict=*/true).fails());
}

// A KL term averaged per micro-batch beside a policy term on the global count: the term fails,
// relative to main, with a finding naming it; main itself passes.
TEST(WeightsResult, ATermOffRelativeToMainFailsByName) {
  const Batch b = random_batch();
  const auto r =
      weigh(b,
            parse_term_contracts("per-token", {"megatron-per-token", "kl=norm=microbatch"},
                                 {"kl:per-token:0.1"}),
            2, 3);
  ASSERT_EQ(r.terms.size(), 2u);
  EXPECT_FALSE(r.terms[0].verdict.fails);
  EXPECT_TRUE(r.terms[1].verdict.fails);
  EXPECT_TRUE(r.fails());
  EXPECT_NE(r.verdict_text().find("(term kl)"), std::string::npos) << r.verdict_text();
  ASSERT_EQ(r.findings.size(), 1u);
  EXPECT_EQ(r.findings[0].kind, "term_normalisation");
  // Each micro-batch's own count instead of the global one: the ratio is constant within a
  // micro-batch and differs between them, the shape SPEC §9 names per-microbatch.
  EXPECT_EQ(r.terms[1].dg.kind, "per-microbatch");
  EXPECT_EQ(r.terms[0].status, "as declared");
  EXPECT_NE(r.terms[1].status.find("per-micro-batch normalisation"), std::string::npos)
      << r.terms[1].status;
}

TEST(WeightsResult, UnknownVariationIsAnInputError) {
  EXPECT_THROW(parse_variations({"dp", "tp"}), InputError);
  const Variations none = parse_variations({"none"});
  EXPECT_FALSE(none.dp || none.microbatches || none.cp);
}

ReplayResult replay(const Batch& b, int64_t tp, int64_t pp, int64_t dp, Protocol p,
                    ReduceMode reduce = ReduceMode::kPerToken) {
  const Topology t(tp, pp, 1, dp);
  const Placement placement = place_samples(b.num_samples(), dp, 1, Split::kContiguous);
  return simulate(make_replay_inputs(b, t, placement, p, reduce, Policy::kFixed, {}));
}

// The verdict and the failing cases' messages come with the result: a correct protocol passes, a
// src-local broadcast faults, a decision read from values[0] under sample-mean is wrong.
TEST(ReplayResult, DecidesPassFaultAndWrongDecisionWithTheirMessages) {
  synth::GenOptions o;
  o.vocab_size = 0;
  const Batch zero = synth::make_case("zero-token", o);
  const ReplayResult ok = replay(zero, 2, 2, 1, Protocol::kPr285);
  EXPECT_TRUE(ok.ok());
  EXPECT_EQ(ok.wrong_decision_message(), "");
  EXPECT_EQ(ok.fault_message(), "");

  const ReplayResult fault = replay(zero, 2, 2, 1, Protocol::kPr285SrcLocal);
  EXPECT_FALSE(fault.ok());
  EXPECT_TRUE(fault.fault);
  EXPECT_NE(fault.fault_message(), "");

  const ReplayResult wrong = replay(zero, 1, 1, 2, Protocol::kValues0, ReduceMode::kSampleMean);
  EXPECT_TRUE(wrong.wrong_decision);
  EXPECT_NE(wrong.wrong_decision_message(), "");
  int64_t decided_wrong = 0;
  for (const auto& r : wrong.ranks) decided_wrong += wrong.decided_wrong(r);
  EXPECT_EQ(decided_wrong, 2);  // both ranks step on a zero-token batch
}

}  // namespace
}  // namespace lossguard::oracle
