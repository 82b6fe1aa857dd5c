// CP ownership (SPEC §2) and denominators (SPEC §3): the worked examples with their published
// numbers, and property tests against a second, per-token formulation of the ownership rule.
#include <gtest/gtest.h>

#include <set>

#include "core/errors.h"
#include "oracle/count/cp_shard.h"
#include "oracle/count/denominators.h"
#include "synth/cases.h"

namespace lossguard::oracle {
namespace {

std::set<int64_t> owned(int64_t t, int64_t r, int64_t cp, int64_t rank) {
  std::set<int64_t> s;
  for (const IndexRange& ir : owned_mask_ranges(t, r, cp, rank, chunk_size(t, cp, {}))) {
    for (int64_t j = ir.begin; j < ir.end; ++j) s.insert(j);
  }
  return s;
}

TEST(CpShard, WorkedExamplesOfSpecSection2) {
  using S = std::set<int64_t>;
  EXPECT_EQ(owned(10, 4, 2, 0), S{});  // it holds token 9, but logit 8 is on r1
  EXPECT_EQ(owned(10, 4, 2, 1), (S{0, 1, 2, 3}));
  EXPECT_EQ(owned(16, 8, 2, 0), (S{5, 6, 7}));
  EXPECT_EQ(owned(16, 8, 2, 1), (S{0, 1, 2, 3, 4}));
  EXPECT_EQ(owned(12, 5, 4, 0), S{});
  EXPECT_EQ(owned(12, 5, 4, 1), S{});
  EXPECT_EQ(owned(12, 5, 4, 2), (S{4}));
  EXPECT_EQ(owned(12, 5, 4, 3), (S{0, 1, 2, 3}));
  EXPECT_EQ(owned(10, 0, 2, 0), S{});
  EXPECT_EQ(owned(10, 0, 2, 1), S{});
  EXPECT_EQ(owned(5, 4, 2, 0), (S{0, 1}));
  EXPECT_EQ(owned(5, 4, 2, 1), (S{2, 3}));
  EXPECT_EQ(owned(7, 7, 2, 0), (S{0, 1}));        // SFT: predictor indices
  EXPECT_EQ(owned(7, 7, 2, 1), (S{2, 3, 4, 5}));  // index 6 never owned
}

TEST(Denominators, WorkedExamplesTotals) {
  synth::GenOptions o;
  Batch b = synth::make_case("cp-examples",
                             o);  // (10,4) (16,8) (12,5) (10,0) (5,4) (7,7 SFT), masks all ones
  OwnedCounts c = count_owned_tokens(b, {1, 2, 4}, {});
  const std::vector<int64_t> cp2_totals = {4, 8, 5,
                                           0, 4, 6};  // the table's "total" column (cp = 2 rows)
  for (std::size_t k = 0; k < 6; ++k)
    EXPECT_EQ(effective_sample_count(Policy::kFixed, c, 1, k), cp2_totals[k]) << k;
  EXPECT_EQ(effective_sample_count(Policy::kFixed, c, 2, 2), 5);  // (12,5) at cp = 4
  EXPECT_EQ(global_denominator(Policy::kFixed, c, 0),
            4 + 8 + 5 + 0 + 4 + 7);  // cp = 1 sums the whole masks
  EXPECT_EQ(global_denominator(Policy::kFixed, c, 1),
            4 + 8 + 5 + 0 + 4 + 6);  // the SFT index 6 is dropped
  // Legacy counts the empty sample as 1 at cp = 1 only; slime counts max(m, 1) on every rank.
  EXPECT_EQ(global_denominator(Policy::kLegacy, c, 0), 29);
  EXPECT_EQ(global_denominator(Policy::kLegacy, c, 1), 27);
  EXPECT_EQ(global_denominator(Policy::kSlime, c, 1), 2 * 29);
}

// The ownership rule token by token: the response token at position t is predicted by logit t-1,
// which lies in chunk (t-1) / cs, held by rank chunk (first half) or 2cp-1-chunk (second half).
int64_t owner_of_position(int64_t pos, int64_t cp, int64_t cs) {
  const int64_t chunk = pos / cs;
  return chunk < cp ? chunk : 2 * cp - 1 - chunk;
}

TEST(Denominators, PropertyOwnershipMatchesPerTokenFormulationAndInvariantsHold) {
  synth::Rng rng(20261202);
  for (int trial = 0; trial < 40; ++trial) {
    synth::GenOptions o;
    o.seed = 1000 + trial;
    o.num_samples = 100;
    o.max_prompt = rng.uniform_int(0, 40);
    o.min_prompt = 0;
    o.max_response = rng.uniform_int(0, 60);
    o.vocab_size = 0;
    Batch b = synth::make_case(trial % 4 == 0 ? "sft-preshifted" : "random", o);
    std::vector<int64_t> cps;
    for (int64_t cp = 1; cp <= 16; ++cp) cps.push_back(cp);
    OwnedCounts c = count_owned_tokens(b, cps, {});
    int64_t num_zero = 0;
    for (std::size_t k = 0; k < c.samples.size(); ++k) num_zero += c.mask_sums[k] == 0;
    for (std::size_t ci = 0; ci < cps.size(); ++ci) {
      const int64_t cp = cps[ci];
      for (std::size_t k = 0; k < c.samples.size(); ++k) {
        const int64_t i = c.samples[k], t = b.total_lengths[i], r = b.response_lengths[i],
                      p = t - r;
        if (cp == 1) {
          ASSERT_EQ(c.count(ci, k, 0), c.mask_sums[k]);
          continue;
        }
        const int64_t cs = chunk_size(t, cp, {});
        std::vector<int64_t> want(static_cast<std::size_t>(cp), 0);
        const bool sft = r == t;
        for (int64_t j = 0; j < r; ++j) {
          const int64_t predictor =
              sft ? j : p + j - 1;           // SFT mask entries are in predictor coordinates
          if (predictor >= t - 1) continue;  // the last SFT entry predicts nothing
          want[owner_of_position(predictor, cp, cs)] += b.loss_mask[b.response_offsets[i] + j];
        }
        for (int64_t rank = 0; rank < cp; ++rank)
          ASSERT_EQ(c.count(ci, k, rank), want[rank]) << "sample " << i << " cp " << cp;
      }
      // Legacy over-counts cp = 1 by exactly the number of zero-token samples, nothing else.
      ASSERT_EQ(
          global_denominator(Policy::kLegacy, c, ci) - global_denominator(Policy::kFixed, c, ci),
          cp == 1 ? num_zero : 0);
    }
    const auto inv = check_invariants(b, c, Policy::kFixed, {}, nullptr);
    for (const auto& r : inv)
      EXPECT_TRUE(r.ok) << r.name << ": " << r.detail;  // pre-shifted SFT masks only
    const auto legacy = check_invariants(b, c, Policy::kLegacy, {}, nullptr);
    EXPECT_EQ(legacy[0].ok, num_zero == 0) << legacy[0].detail;
    if (num_zero > 0) {
      EXPECT_NE(legacy[0].detail.find(fmt::format("N(cp=2) = ")), std::string::npos);
    }
  }
}

TEST(Denominators, PartitionInvarianceOverDpAndMicrobatches) {
  synth::GenOptions o;
  o.num_samples = 37;
  o.vocab_size = 0;
  Batch b = synth::make_case("random", o);
  OwnedCounts c = count_owned_tokens(b, {1, 2, 4, 8}, {});
  for (int64_t dp : {1, 2, 3, 5}) {
    for (int64_t mb : {1, 2, 4}) {
      for (Split split : {Split::kContiguous, Split::kRoundRobin}) {
        Placement p = place_samples(b.num_samples(), dp, mb, split);
        std::set<int64_t> seen;
        for (const auto& rank : p) {
          for (const auto& micro : rank) seen.insert(micro.begin(), micro.end());
        }
        ASSERT_EQ(static_cast<int64_t>(seen.size()), b.num_samples());
        const auto inv = check_invariants(b, c, Policy::kFixed, {}, &p);
        EXPECT_TRUE(inv[2].ok) << inv[2].detail;
        EXPECT_EQ(inv[2].data["parts"], dp * mb);
      }
    }
  }
}

TEST(Denominators, PaddedAndBshdLayoutsMoveTokensNotTotals) {
  synth::GenOptions o;
  o.num_samples = 50;
  o.max_prompt = 20;
  o.max_response = 20;
  o.vocab_size = 0;
  Batch b = synth::make_case("random", o);
  OwnedCounts thd = count_owned_tokens(b, {1, 2, 4}, {});
  OwnedCounts padded = count_owned_tokens(b, {1, 2, 4}, {Packing::kThd, 64, 0});
  OwnedCounts bshd = count_owned_tokens(b, {1, 2, 4}, {Packing::kBshd, 0, 50});
  for (std::size_t c = 0; c < 3; ++c) {
    EXPECT_EQ(global_denominator(Policy::kFixed, thd, c),
              global_denominator(Policy::kFixed, padded, c));
    EXPECT_EQ(global_denominator(Policy::kFixed, thd, c),
              global_denominator(Policy::kFixed, bshd, c));
  }
  EXPECT_THROW(count_owned_tokens(b, {2}, {Packing::kThd, 6, 0}),
               InputError);  // shorter than samples
  EXPECT_THROW(count_owned_tokens(b, {4}, {Packing::kThd, 60, 0}),
               InputError);  // not a multiple of 8
  EXPECT_THROW(count_owned_tokens(b, {2}, {Packing::kBshd, 0, 3}), InputError);
}

TEST(Denominators, SftNotPreshiftedBreaksI1AndSaysWhy) {
  synth::GenOptions o;
  Batch b = synth::make_case("sft-not-preshifted", o);
  OwnedCounts c = count_owned_tokens(b, {1, 2}, {});
  const auto inv = check_invariants(b, c, Policy::kFixed, {}, nullptr);
  EXPECT_FALSE(inv[0].ok);
  EXPECT_NE(inv[0].detail.find("not pre-shifted"), std::string::npos) << inv[0].detail;
  EXPECT_EQ(global_denominator(Policy::kFixed, c, 0) - global_denominator(Policy::kFixed, c, 1),
            b.num_samples());
}

TEST(Denominators, LegacyNamesEveryEmptySample) {
  synth::GenOptions o;
  o.num_samples = 9;
  Batch b = synth::make_case("empty-responses", o);  // samples 1, 4, 7 are empty
  OwnedCounts c = count_owned_tokens(b, {1, 2}, {});
  const auto inv = check_invariants(b, c, Policy::kLegacy, {}, nullptr);
  EXPECT_FALSE(inv[0].ok);
  EXPECT_NE(inv[0].detail.find("+1 for each empty sample (R = 0): 1, 4, 7"), std::string::npos)
      << inv[0].detail;
  EXPECT_FALSE(inv[3].ok);
  const auto fixed = check_invariants(b, c, Policy::kFixed, {}, nullptr);
  for (const auto& r : fixed) EXPECT_TRUE(r.ok) << r.name;
  const auto slime = check_invariants(b, c, Policy::kSlime, {}, nullptr);
  EXPECT_TRUE(slime[0].ok)
      << slime[0].detail;     // consistent once the cp-scaled loss is accounted for
  EXPECT_FALSE(slime[3].ok);  // but an empty sample still counts 1
}

}  // namespace
}  // namespace lossguard::oracle
