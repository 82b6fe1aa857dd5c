// CP layouts beyond the plain zig-zag (SPEC §2): per-sample padded lengths and --pad-multiple,
// the all-gather layout and Relax's dynamic CP. Each is checked token by token against an
// independent per-token formulation written here from the SPEC's words, and I1-I4 must hold over
// thousands of random samples. Also the per-sample values of SPEC §1 (removed, sample_denom).
#include <gtest/gtest.h>

#include <numeric>
#include <set>

#include "core/errors.h"
#include "oracle/audit/audit.h"
#include "oracle/count/denominators.h"
#include "oracle/count/placement.h"
#include "oracle/weights/weights.h"
#include "synth/cases.h"

namespace lossguard::oracle {
namespace {

// The logit position that predicts mask index j of sample (t, r), or -1 when none does (the last
// SFT entry). SPEC §2: RL index j is predicted by position P-1+j; SFT index j is position j.
int64_t predictor(int64_t t, int64_t r, int64_t j) {
  if (r == t) return j < t - 1 ? j : -1;
  return t - r - 1 + j;
}

int64_t zigzag_owner(int64_t pos, int64_t cp, int64_t cs) {
  const int64_t chunk = pos / cs;
  return chunk < cp ? chunk : 2 * cp - 1 - chunk;
}

Batch random_batch(uint64_t seed, int64_t n, const char* kind = "random") {
  synth::GenOptions o;
  o.seed = seed;
  o.num_samples = n;
  o.min_prompt = 0;
  o.max_prompt = 30;
  o.max_response = 40;
  o.vocab_size = 0;
  return synth::make_case(kind, o);
}

void expect_invariants_hold(const Batch& b, const OwnedCounts& c, const Placement* p,
                            const std::string& what) {
  for (const auto& inv : check_invariants(b, c, Policy::kFixed, {}, p))
    EXPECT_TRUE(inv.ok) << what << ": " << inv.name << ": " << inv.detail;
}

TEST(Layouts, PerSamplePaddedLengthsMoveOwnersAsThePerTokenRuleSays) {
  int64_t moved = 0;
  for (int trial = 0; trial < 30; ++trial) {
    Batch b = random_batch(500 + trial, 100, trial % 3 == 0 ? "sft-preshifted" : "random");
    const int64_t tp = 1 + trial % 2, cp = trial % 4 == 0 ? 4 : 2, align = tp * cp * 2;
    for (int64_t i = 0; i < b.num_samples(); ++i)  // Relax's maybe_padded_total_lengths
      b.padded_total_lengths.push_back((b.total_lengths[i] + align - 1) / align * align);
    const OwnedCounts c = count_owned_tokens(b, {1, cp}, {});
    // --pad-multiple gives the same as the per-sample field when the multiple is Relax's.
    Batch unpadded = b;
    unpadded.padded_total_lengths.clear();
    ShardLayout by_flag;
    by_flag.pad_multiple = align;
    const OwnedCounts f = count_owned_tokens(unpadded, {1, cp}, by_flag);
    const OwnedCounts plain = count_owned_tokens(unpadded, {1, cp}, {});
    for (int64_t i = 0; i < b.num_samples(); ++i) {
      const int64_t t = b.total_lengths[i], r = b.response_lengths[i];
      const int64_t cs = b.padded_total_lengths[i] / (2 * cp);
      std::vector<int64_t> want(static_cast<std::size_t>(cp), 0);
      for (int64_t j = 0; j < r; ++j) {
        const int64_t pos = predictor(t, r, j);
        if (pos >= 0) want[zigzag_owner(pos, cp, cs)] += b.loss_mask[b.response_offsets[i] + j];
      }
      bool differs = false;
      for (int64_t rank = 0; rank < cp; ++rank) {
        ASSERT_EQ(c.count(1, static_cast<std::size_t>(i), rank), want[rank]) << i;
        ASSERT_EQ(f.count(1, static_cast<std::size_t>(i), rank), want[rank]) << i;
        differs |= plain.count(1, static_cast<std::size_t>(i), rank) != want[rank];
      }
      moved += differs;
    }
    expect_invariants_hold(b, c, nullptr, "padded");
  }
  EXPECT_GT(moved, 100);  // the padding really moves tokens between ranks on many samples
}

TEST(Layouts, AllgatherOwnsEachTokenOnceByItsStreamPosition) {
  int64_t straddling = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const Batch b = random_batch(900 + trial, 80, trial % 4 == 0 ? "sft-preshifted" : "random");
    const int64_t cp = int64_t{2} << (trial % 3), tp = 1 + trial % 2;
    const int64_t pad = trial % 2 == 0 ? 1 : 16;
    const Placement p = place_samples(b.num_samples(), 1 + trial % 3, 1 + trial % 4,
                                      trial % 2 ? Split::kRoundRobin : Split::kContiguous);
    StepLayout l = static_layout(p, cp, tp, {});
    l.cp_layout = CpLayout::kAllgather;
    l.allgather_pad = pad;
    StepLayout one = static_layout(p, 1, tp, {});
    std::vector<std::string> problems;
    const OwnedCounts c = count_owned_tokens(b, {one, l}, &problems);
    EXPECT_TRUE(problems.empty());
    // Independently: each micro-batch's samples concatenated, padded to a multiple of cp*tp*pad,
    // cut in cp equal parts; a token belongs to the part holding its predicting logit.
    std::vector<int64_t> want(static_cast<std::size_t>(b.num_samples() * cp), 0);
    for (const auto& rank : p) {
      for (const auto& mb : rank) {
        int64_t total = 0;
        for (int64_t i : mb) total += b.total_lengths[i];
        const int64_t unit = cp * tp * pad;
        const int64_t part = std::max<int64_t>((total + unit - 1) / unit * unit / cp, 1);
        int64_t offset = 0;
        for (int64_t i : mb) {
          const int64_t t = b.total_lengths[i], r = b.response_lengths[i];
          std::set<int64_t> ranks;
          for (int64_t j = 0; j < r; ++j) {
            const int64_t pos = predictor(t, r, j);
            if (pos < 0 || !b.loss_mask[b.response_offsets[i] + j]) continue;
            ++want[static_cast<std::size_t>(i * cp + (offset + pos) / part)];
            ranks.insert((offset + pos) / part);
          }
          straddling += ranks.size() > 1;
          offset += t;
        }
      }
    }
    for (int64_t i = 0; i < b.num_samples(); ++i)
      for (int64_t rank = 0; rank < cp; ++rank)
        ASSERT_EQ(c.count(1, static_cast<std::size_t>(i), rank),
                  want[static_cast<std::size_t>(i * cp + rank)])
            << "trial " << trial << " sample " << i << " rank " << rank;
    expect_invariants_hold(b, c, &p, "allgather");
  }
  EXPECT_GT(straddling, 50);
}

TEST(Layouts, DynamicCpPicksThePowerOfTwoAndSubgroupsOfSpecSection2) {
  // One DP rank, static CP 4. Micro-batch 0: longest 20 tokens at 8 per GPU: ceil(20/8) = 3 -> 4
  // (one group). Micro-batch 1: longest 7 -> 1, but 4 sub-groups for 3 samples is too many:
  // doubled to 2 (2 sub-groups). Micro-batch 2: longest 9 -> 2; 2 sub-groups for 5 samples.
  const std::vector<int64_t> lengths = {20, 5, 7, 3, 6, 9, 2, 8, 4, 1, 1};
  const Placement p = {{{0, 1}, {2, 3, 4}, {5, 6, 7, 8, 9}}};
  const StepLayout l = dynamic_cp_layout(lengths, p, 4, 8);
  ASSERT_EQ(l.microbatches.size(), 3u);
  EXPECT_EQ(l.microbatches[0].cp_size, 4);
  EXPECT_EQ(l.microbatches[0].groups.size(), 1u);
  EXPECT_EQ(l.microbatches[1].cp_size, 2);
  EXPECT_EQ(l.microbatches[1].groups.size(), 2u);
  EXPECT_EQ(l.microbatches[2].cp_size, 2);
  // Balanced by length, longest first to the lighter sub-group: 9 | 8; 4 -> (8) = 12; 2 -> (9) =
  // 11; 1 -> (11) = 12. Sub-group 0 holds samples 5, 6, 9; sub-group 1 samples 7, 8.
  EXPECT_EQ(l.microbatches[2].groups[0], (std::vector<int64_t>{5, 6, 9}));
  EXPECT_EQ(l.microbatches[2].groups[1], (std::vector<int64_t>{7, 8}));
  // MAX over DP: DP rank 1's micro-batch 0 holds a 30-token sample (ceil(30/8) = 4), which lifts
  // DP rank 0's micro-batch 0 (7 tokens: 1 alone) to 4 as well.
  const std::vector<int64_t> two = {7, 7, 30, 1};
  const StepLayout l2 = dynamic_cp_layout(two, {{{0, 1}}, {{2, 3}}}, 4, 8);
  EXPECT_EQ(l2.microbatches[0].cp_size, 4);
  EXPECT_EQ(l2.microbatches[1].cp_size, 4);
  EXPECT_THROW(dynamic_cp_layout(two, {{{0, 1}}}, 3, 8), InputError);
}

TEST(Layouts, DynamicCpCountsHoldI1ToI4OverRandomBatches) {
  int64_t split_groups = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const Batch b = random_batch(1300 + trial, 90, trial % 4 == 0 ? "sft-preshifted" : "random");
    const int64_t cp = int64_t{2} << (trial % 3);
    const Placement p =
        place_samples(b.num_samples(), 1 + trial % 3, 1 + trial % 5, Split::kContiguous);
    std::vector<StepLayout> layouts = {static_layout(p, 1, 1, {})};
    const int64_t max_tokens = 8 + trial * 2;
    layouts.push_back(dynamic_cp_layout(b.total_lengths, p, cp, max_tokens));
    for (const MicroBatch& mb : layouts[1].microbatches) {
      EXPECT_EQ(mb.cp_size & (mb.cp_size - 1), 0);
      EXPECT_EQ(static_cast<int64_t>(mb.groups.size()), cp / mb.cp_size);
      std::size_t in_groups = 0;
      for (const auto& g : mb.groups) {
        in_groups += g.size();
        EXPECT_FALSE(g.empty());
        for (int64_t i : g) {  // a sub-group of cp_k ranks holds each sample within max_tokens
          if (mb.cp_size < cp) {
            EXPECT_LE(b.total_lengths[i], max_tokens * mb.cp_size);
          }
        }
      }
      EXPECT_EQ(in_groups, p[mb.dp_rank][mb.index].size());
      split_groups += mb.groups.size() > 1;
    }
    std::vector<std::string> problems;
    const OwnedCounts c = count_owned_tokens(b, layouts, &problems);
    EXPECT_TRUE(problems.empty());
    // Per sample: its sub-group's zig-zag at cp_k, on static ranks base .. base + cp_k.
    for (const MicroBatch& mb : layouts[1].microbatches) {
      for (std::size_t g = 0; g < mb.groups.size(); ++g) {
        for (int64_t i : mb.groups[g]) {
          const int64_t t = b.total_lengths[i], r = b.response_lengths[i];
          std::vector<int64_t> want(static_cast<std::size_t>(cp), 0);
          for (int64_t j = 0; j < r; ++j) {
            const int64_t pos = predictor(t, r, j);
            if (mb.cp_size == 1 && r > 0) {  // unsharded: the whole mask, SFT index T-1 too
              want[g] += b.loss_mask[b.response_offsets[i] + j];
              continue;
            }
            if (pos < 0) continue;
            const int64_t cs = (t + 2 * mb.cp_size - 1) / (2 * mb.cp_size);
            want[static_cast<int64_t>(g) * mb.cp_size + zigzag_owner(pos, mb.cp_size, cs)] +=
                b.loss_mask[b.response_offsets[i] + j];
          }
          for (int64_t rank = 0; rank < cp; ++rank)
            ASSERT_EQ(c.count(1, static_cast<std::size_t>(i), rank), want[rank])
                << "trial " << trial << " sample " << i;
        }
      }
    }
    expect_invariants_hold(b, c, &p, "dynamic CP");
  }
  EXPECT_GT(split_groups, 20);  // the property covered real sub-group splits
}

TEST(Layouts, ADuplicatedOrMissingSampleIsNamed) {
  const Placement p = {{{0, 1}, {2}}, {{1, 3}}};
  const auto problems = placement_problems(p, 5);
  ASSERT_EQ(problems.size(), 2u);
  EXPECT_EQ(problems[0], "sample 1 is placed twice (DP rank 1 micro-batch 0 again)");
  EXPECT_EQ(problems[1], "sample 4 is placed nowhere");
}

TEST(SampleValues, RemovedZeroesTheMaskAndSampleDenomIsTheDivisor) {
  // Two samples of 3 response tokens; the first removed (slime's remove_sample), the second
  // divided by its rollout's mask total 6 (rollout_mask_sums) instead of its own 3.
  const HostArray tokens = HostArray::from_i64(DType::kInt64, {5}, {1, 2, 3, 4, 5});
  BatchBuilder builder;
  builder.begin_file("mem");
  SampleFields a;
  a.tokens = &tokens;
  a.response_length = 3;
  a.removed = true;
  builder.add_sample(0, a);
  SampleFields c = a;
  c.removed = false;
  c.sample_denom = 6.0;
  builder.add_sample(1, c);
  const Batch b = builder.finish();
  EXPECT_EQ(b.mask_sum(0), 0);
  EXPECT_EQ(b.mask_sum(1), 3);
  EXPECT_TRUE(b.is_removed(0));
  const std::vector<double> w = true_weights(b, Reduction::kSampleMean, {});
  for (int j = 0; j < 3; ++j) {
    EXPECT_EQ(w[j], 0.0);
    EXPECT_DOUBLE_EQ(w[3 + j], 1.0 / (2 * 6.0));  // m_t / (B d_i), B = 2
  }
  // A padded length below T is refused, naming the sample.
  BatchBuilder bad;
  bad.begin_file("mem");
  SampleFields p = a;
  p.removed.reset();
  p.padded_total_length = 4;
  try {
    bad.add_sample(7, p);
    FAIL() << "accepted a padded length below T";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("mem: sample 7: padded_total_length = 4 is below"),
              std::string::npos)
        << e.what();
  }
}

// I2 broken on purpose in a real run's captures: two DP ranks both computed sample 0, so each of
// its effective tokens is held twice; audit's coverage check must fail and name the sample and
// token.
TEST(Layouts, AuditCoverageFailsWhenATokenIsHeldTwice) {
  auto rank = [](int64_t r, std::vector<int64_t> samples) {
    RankCapture c;
    c.file = "rank" + std::to_string(r);
    c.rank = r;
    c.world_size = 2;
    c.dp = 2;
    c.dp_rank = r;
    c.reduce = "per-token";
    CapturedMicroBatch mb;
    for (int64_t i : samples) {
      mb.sample_indices.push_back(i);
      mb.total_lengths.push_back(3);
      mb.response_lengths.push_back(2);
      mb.tokens.insert(mb.tokens.end(), {1, 2, 3});
      mb.loss_masks.insert(mb.loss_masks.end(), {1, 1});
      mb.token_weight.insert(mb.token_weight.end(), {0.25, 0.25});
    }
    c.microbatches.push_back(mb);
    return c;
  };
  const auto steps = audit_captures({rank(0, {0}), rank(1, {0, 1})}, {}).steps;
  ASSERT_EQ(steps.size(), 1u);
  bool found = false;
  for (const auto& check : steps[0].checks) {
    if (check.name != "coverage") continue;
    found = true;
    ASSERT_TRUE(check.ok.has_value());
    EXPECT_FALSE(*check.ok);
    EXPECT_NE(check.detail.find("sample 0"), std::string::npos) << check.detail;
    EXPECT_TRUE(check.detail.find("twice") != std::string::npos ||
                check.detail.find("more than once") != std::string::npos)
        << check.detail;
  }
  EXPECT_TRUE(found);
  // The same with each sample held once passes coverage.
  const auto good = audit_captures({rank(0, {0}), rank(1, {1})}, {}).steps;
  for (const auto& check : good[0].checks) {
    if (check.name == "coverage") {
      EXPECT_TRUE(check.ok.value_or(false)) << check.detail;
    }
  }
}
}  // namespace
}  // namespace lossguard::oracle
