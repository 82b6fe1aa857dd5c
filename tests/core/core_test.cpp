// core/ on its own: the one sample classification, every mode's name table, and the pairing of
// --term declarations with their contracts. Links only lossguard_core.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/contract.h"
#include "core/errors.h"
#include "core/modes.h"
#include "core/term.h"

namespace lossguard {
namespace {

HostArray ints(std::vector<int64_t> v) {
  return HostArray::from_i64(DType::kInt64, {static_cast<int64_t>(v.size())}, v);
}

struct Sample {
  std::vector<int64_t> tokens;
  int64_t response_length;
  std::vector<int64_t> mask;
};

Batch batch_of(const std::vector<Sample>& samples) {
  BatchBuilder b;
  b.begin_file("hand.json");
  for (std::size_t i = 0; i < samples.size(); ++i) {
    const HostArray t = ints(samples[i].tokens), m = ints(samples[i].mask);
    SampleFields f;
    f.tokens = &t;
    f.response_length = samples[i].response_length;
    f.loss_mask = &m;
    b.add_sample(static_cast<int64_t>(i), f);
  }
  return b.finish();
}

// Every class, written down by hand from SPEC §1: the kind, why a sample has no effective token,
// and the SFT pre-shift state, with the notes a report prints.
TEST(SampleClass, EachSampleGetsTheClassSpecOneGivesIt) {
  const Batch b = batch_of({
      {{}, 0, {}},                // T = 0
      {{1, 2, 3}, 0, {}},         // R = 0
      {{1, 2, 3, 4}, 2, {0, 0}},  // fully masked
      {{1, 2, 3, 4}, 2, {1, 0}},  // RL
      {{5, 6, 7}, 3, {1, 1, 0}},  // SFT, pre-shifted
      {{5, 6, 7}, 3, {1, 1, 1}},  // SFT, not pre-shifted
      {{5, 6}, 2, {0, 0}},        // SFT, fully masked
  });
  struct Want {
    SampleKind kind;
    NoTokenReason why;
    bool sft, not_preshifted;
    const char* notes;
  };
  const Want want[] = {
      {SampleKind::kEmpty, NoTokenReason::kTZero, false, false, "T = 0"},
      {SampleKind::kEmpty, NoTokenReason::kEmptyResponse, false, false, "empty response"},
      {SampleKind::kEmpty, NoTokenReason::kFullyMasked, false, false, "fully masked"},
      {SampleKind::kRl, NoTokenReason::kNone, false, false, ""},
      {SampleKind::kSft, NoTokenReason::kNone, true, false, "SFT"},
      {SampleKind::kSft, NoTokenReason::kNone, true, true, "SFT, mask not pre-shifted"},
      {SampleKind::kEmpty, NoTokenReason::kFullyMasked, true, false, "fully masked, SFT"},
  };
  ASSERT_EQ(b.num_samples(), 7);
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    SCOPED_TRACE(i);
    const SampleClass c = b.classify(i, b.mask_sum(i));
    EXPECT_EQ(c.kind, want[i].kind);
    EXPECT_EQ(c.why_empty, want[i].why);
    EXPECT_EQ(c.sft, want[i].sft);
    EXPECT_EQ(c.sft_not_preshifted, want[i].not_preshifted);
    EXPECT_EQ(c.notes(), want[i].notes);
    EXPECT_EQ(b.kind(i), want[i].kind);
    // A sample has no effective token exactly when a reason is given.
    EXPECT_EQ(c.kind == SampleKind::kEmpty, c.why_empty != NoTokenReason::kNone);
  }
}

// Every name parses back to its value, no two values share a name, and the choices list them all.
template <typename E>
void expect_table_round_trips(const char* what) {
  SCOPED_TRACE(what);
  const std::vector<E> all = all_modes<E>();
  ASSERT_FALSE(all.empty());
  const std::string choices = mode_choices<E>();
  for (E v : all) {
    E back{};
    ASSERT_TRUE(parse_mode(mode_name(v), &back)) << mode_name(v);
    EXPECT_EQ(back, v) << mode_name(v);
    EXPECT_NE(choices.find(mode_name(v)), std::string::npos) << choices;
  }
  E none{};
  EXPECT_FALSE(parse_mode("no-such-mode", &none));
}

TEST(ModeNames, EveryTableRoundTrips) {
  expect_table_round_trips<LossKind>("LossKind");
  expect_table_round_trips<Reduction>("Reduction");
  expect_table_round_trips<LossInput>("LossInput");
  expect_table_round_trips<Policy>("Policy");
  expect_table_round_trips<Packing>("Packing");
  expect_table_round_trips<CpLayout>("CpLayout");
  expect_table_round_trips<Split>("Split");
  expect_table_round_trips<CountRule>("CountRule");
  expect_table_round_trips<ClampRule>("ClampRule");
  expect_table_round_trips<NormRule>("NormRule");
  expect_table_round_trips<ReduceGroup>("ReduceGroup");
  expect_table_round_trips<SampleRule>("SampleRule");
  expect_table_round_trips<GradRule>("GradRule");
  EXPECT_EQ(mode_choices<Split>(), "contiguous or round-robin");
}

// The single-component changes come from the name tables; written out by hand here, every one of
// them parses, and they are all the one-component moves there are (generation:S aside).
TEST(ContractChanges, AreEveryComponentValueOfTheTables) {
  const std::vector<std::string> by_hand = {
      "count=cp-local",    "count=full-sample", "count=samples",   "clamp=none",
      "clamp=per-sample",  "clamp=at-cp1",      "norm=none",       "norm=microbatch",
      "norm=rank",         "norm=global:dp",    "norm=global:cp",  "norm=global:world",
      "norm=global:dp-cp", "sample=mean",       "sample=none",     "grad=sum",
      "grad=mean:dp",      "grad=mean:cp",      "grad=mean:dp-cp", "grad=mean:world",
      "scale=1",           "scale=cp",          "scale=1/cp",      "scale=dp",
      "scale=1/dp",        "scale=1/M",         "scale=M"};
  std::vector<std::string> got = single_component_changes(), want = by_hand;
  std::sort(got.begin(), got.end());
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
  for (const auto& change : single_component_changes())
    EXPECT_NO_THROW(parse_contract("relax," + change, Reduction::kPerToken)) << change;
}

TEST(TermContracts, EachTermTakesItsOwnContractOrMains) {
  const auto terms = parse_term_contracts("per-token", {"megatron-per-token", "kl=norm=microbatch"},
                                          {"kl:per-token:0.1", "mtp:per-token:0.3:roll:1"});
  ASSERT_EQ(terms.size(), 3u);
  EXPECT_EQ(terms[0].term.name, kMainTerm);
  EXPECT_EQ(terms[0].contract.preset, "megatron-per-token");
  EXPECT_EQ(terms[1].term.name, "kl");
  EXPECT_EQ(terms[1].contract.norm, NormRule::kMicrobatch);
  EXPECT_DOUBLE_EQ(terms[1].term.coef, 0.1);
  EXPECT_EQ(terms[2].term.name, "mtp");
  EXPECT_EQ(terms[2].contract.preset, "megatron-per-token");  // main's
}

TEST(TermContracts, MistakesNameTheOptionAndTheTerm) {
  auto message = [](const std::string& reduce, std::vector<std::string> contracts,
                    std::vector<std::string> terms) {
    try {
      parse_term_contracts(reduce, contracts, terms);
    } catch (const InputError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message("bogus", {"relax"}, {}).find("--reduce must be"), std::string::npos);
  EXPECT_NE(message("per-token", {"kl=relax"}, {"kl:per-token"}).find("no contract for the main"),
            std::string::npos);
  EXPECT_NE(message("per-token", {"relax", "x=relax"}, {}).find("no term 'x'"), std::string::npos);
  EXPECT_NE(message("per-token", {"relax"}, {"kl:per-token", "kl:per-token"}).find("given twice"),
            std::string::npos);
  EXPECT_NE(message("per-token", {"relax"}, {"main:per-token"}).find("'main' is the term"),
            std::string::npos);
  EXPECT_NE(message("per-token", {"relax", "relax"}, {}).find("two contracts"), std::string::npos);
}

}  // namespace
}  // namespace lossguard
