// Effective token weights (SPEC §9): every preset on small batches against weights derived by hand,
// the diagnosis of each bug shape, and split invariance as a property over thousands of random
// batches and layouts, each buggy preset breaking exactly where its formula says.
#include "oracle/weights/weights.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "core/batch.h"
#include "core/contract.h"
#include "core/errors.h"
#include "oracle/count/placement.h"
#include "oracle/count/token_placement.h"
#include "synth/cases.h"
#include "weights_batches.h"

namespace lossguard::oracle {
namespace {

using S = testing::HandSample;
using testing::expect_weights;

Batch make(const std::vector<S>& samples) { return testing::hand_made_batch(samples, "test.json"); }
StepLayout layout(const Batch& b, int64_t dp, int64_t m, int64_t cp) {
  return testing::flag_layout(b, dp, m, cp);
}

std::vector<double> weights_of(const Batch& b, const StepLayout& l, const std::string& contract,
                               Reduction reduce = Reduction::kPerToken) {
  return contract_weights(b, l, parse_contract(contract, reduce), {}).weight;
}

// The batch of the hand derivations: m = 3, 1, 4; N = 8.
Batch hand_batch() { return make({{5, 3, {1, 1, 1}}, {4, 2, {1, 0}}, {6, 4, {1, 1, 1, 1}}}); }

TEST(Weights, TruthPerReductionByHand) {
  const Batch b = hand_batch();
  const double e = 1.0 / 8;
  expect_weights(true_weights(b, Reduction::kPerToken, {}), {e, e, e, e, 0, e, e, e, e});
  // sample-mean, B = 3: m_t / (B m_i).
  const double a = 1.0 / 9, c = 1.0 / 3, d = 1.0 / 12;
  expect_weights(true_weights(b, Reduction::kSampleMean, {}), {a, a, a, c, 0, d, d, d, d});
  // A given B (rollouts counted as the trainer counts them) replaces the sample count.
  expect_weights(true_weights(b, Reduction::kSeqMeanTokenSum, {6, 0}),
                 {1. / 6, 1. / 6, 1. / 6, 1. / 6, 0, 1. / 6, 1. / 6, 1. / 6, 1. / 6});
  // seq-mean-token-sum-norm (Dr.GRPO): m_t / (B L_norm), L_norm defaults to the longest response
  // (4): 1/12 with B = 3.
  const double g = 1.0 / 12;
  expect_weights(true_weights(b, Reduction::kSeqMeanTokenSumNorm, {}), {g, g, g, g, 0, g, g, g, g});
  expect_weights(true_weights(b, Reduction::kSeqMeanTokenSumNorm, {6, 10}),
                 {1. / 60, 1. / 60, 1. / 60, 1. / 60, 0, 1. / 60, 1. / 60, 1. / 60, 1. / 60});
}

TEST(Weights, EveryPresetByHandAtCp1) {
  const Batch b = hand_batch();
  const double e = 1.0 / 8;
  const std::vector<double> truth = {e, e, e, e, 0, e, e, e, e};
  for (const char* exact : {"truth", "megatron-per-token", "relax", "relax-legacy", "slime",
                            "hf-num-items", "hf-num-items-across-devices", "verl-token-mean"}) {
    expect_weights(weights_of(b, layout(b, 1, 3, 1), exact), truth);  // no empty sample here
  }
  // One sample per micro-batch (M = 3): a mean per micro-batch ÷ M gives 1/(3 n_mb).
  const std::vector<double> per_mb = {1. / 9,  1. / 9,  1. / 9,  1. / 3, 0,
                                      1. / 12, 1. / 12, 1. / 12, 1. / 12};
  expect_weights(weights_of(b, layout(b, 1, 3, 1), "hf-ga"), per_mb);
  expect_weights(weights_of(b, layout(b, 1, 3, 1), "megatron-mean"), per_mb);
  expect_weights(weights_of(b, layout(b, 1, 3, 1), "verl-token-mean-legacy"), per_mb);
  // hf-num-items over DP 3 (one sample per rank): each rank divides by its own count, DDP ÷ 3.
  expect_weights(weights_of(b, layout(b, 3, 1, 1), "hf-num-items"), per_mb);
  // Sample-mean presets: dp·cp/B · 1/m_i ÷ (dp·cp) = m_t/(B m_i) on any layout.
  const std::vector<double> smean = {1. / 9,  1. / 9,  1. / 9,  1. / 3, 0,
                                     1. / 12, 1. / 12, 1. / 12, 1. / 12};
  for (const char* p : {"relax", "relax-legacy", "slime", "truth"}) {
    expect_weights(weights_of(b, layout(b, 3, 1, 2), p, Reduction::kSampleMean), smean);
  }
}

TEST(Weights, CpLocalCountsAtCp2ByHand) {
  // T = 10, R = 4: at CP 2 every response token is owned by rank 1 (SPEC §2 first row);
  // T = 16, R = 8: rank 0 owns 5, 6, 7 and rank 1 owns 0..4.
  const Batch b = make({{10, 4, {1, 1, 1, 1}}, {16, 8, {1, 1, 1, 1, 1, 1, 1, 1}}});
  const StepLayout l = layout(b, 1, 1, 2);
  // Rank 0 counts 3, rank 1 counts 9, N = 12. A count all-reduced over DP only (DP 1) leaves each
  // CP rank with its own count: w = 1/3 on rank 0's tokens, 1/9 on rank 1's.
  const double r0 = 1. / 3, r1 = 1. / 9;
  expect_weights(weights_of(b, l, "norm=global:dp"),
                 {r1, r1, r1, r1, r1, r1, r1, r1, r1, r0, r0, r0});
  // slime's full-sample count on both ranks (N·cp = 24) without its ×cp: every weight halves.
  const double h = 1. / 24;
  expect_weights(weights_of(b, l, "count=full-sample,clamp=per-sample,norm=global:dp-cp"),
                 std::vector<double>(12, h));
  expect_weights(weights_of(b, l, "slime"), std::vector<double>(12, 1. / 12));
}

TEST(Weights, DiagnosisNamesEachBugShape) {
  const Batch b = hand_batch();
  const std::vector<double> truth = true_weights(b, Reduction::kPerToken, {});
  auto diagnose = [&](const StepLayout& l, const std::string& c) {
    const ContractWeights w = contract_weights(b, l, parse_contract(c, Reduction::kPerToken), {});
    return diagnose_weights(b, w.weight, truth, w.place, l, 8, w.global_count);
  };
  EXPECT_EQ(diagnose(layout(b, 1, 3, 1), "megatron-per-token").kind, "exact");
  const WeightDiagnosis ga = diagnose(layout(b, 1, 3, 1), "hf-ga");
  EXPECT_EQ(ga.kind, "per-microbatch");
  EXPECT_NEAR(ga.min_ratio, 2. / 3, 1e-12);
  EXPECT_NEAR(ga.max_ratio, 8. / 3, 1e-12);
  EXPECT_EQ(ga.worst.sample, 1);  // the one-token micro-batch: 8/3 of its weight
  EXPECT_EQ(ga.worst.microbatch, 1);
  EXPECT_EQ(ga.worst.unit_tokens, 1);
  EXPECT_EQ(diagnose(layout(b, 3, 1, 1), "hf-num-items").kind, "per-rank");
  const WeightDiagnosis half = diagnose(layout(b, 1, 1, 2), "count=full-sample,norm=global:dp-cp");
  EXPECT_EQ(half.kind, "uniform-scale");
  EXPECT_NEAR(half.scale, 0.5, 1e-15);
  EXPECT_EQ(half.named, "1/cp");
  EXPECT_EQ(diagnose(layout(b, 2, 1, 1), "scale=2,norm=global:dp-cp").named, "dp");
  // A per-CP-shard mean (Megatron's 3-tuple loss under CP) is constant within each shard only.
  EXPECT_EQ(diagnose(layout(b, 1, 1, 2), "megatron-mean").kind, "per-cp-shard");
  // A weight on a masked token is its own finding, whatever else is wrong.
  ContractWeights w =
      contract_weights(b, layout(b, 1, 1, 1), parse_contract("truth", Reduction::kPerToken), {});
  w.weight[4] = 0.01;  // sample 1's masked token
  const WeightDiagnosis masked = diagnose_weights(b, w.weight, truth, w.place, layout(b, 1, 1, 1));
  EXPECT_EQ(masked.kind, "masked-weight");
  EXPECT_EQ(masked.worst.sample, 1);
  EXPECT_EQ(masked.worst.response_index, 1);
  // One token's weight off by 1e-4 relative is caught and located (per-sample: it is alone).
  w.weight[4] = 0.0;
  w.weight[6] *= 1.0 + 1e-4;
  const WeightDiagnosis one = diagnose_weights(b, w.weight, truth, w.place, layout(b, 1, 1, 1));
  EXPECT_EQ(one.mismatched, 1);
  EXPECT_EQ(one.worst.sample, 2);
  EXPECT_EQ(one.worst.response_index, 1);
}

TEST(Weights, Bug1IsAnNOverNPrimeScaleAtCp1AndBreaksSplitInvariance) {
  // An empty response (R = 0) and a fully masked one: relax-legacy counts each as 1 at CP = 1.
  const Batch b = make({{5, 3, {1, 1, 1}}, {4, 0, {}}, {6, 2, {0, 0}}, {6, 4, {1, 1, 1, 1}}});
  const std::vector<double> truth = true_weights(b, Reduction::kPerToken, {});
  const Contract legacy = parse_contract("relax-legacy", Reduction::kPerToken);
  const StepLayout cp1 = layout(b, 1, 1, 1);
  const ContractWeights w = contract_weights(b, cp1, legacy, {});
  const WeightDiagnosis d = diagnose_weights(b, w.weight, truth, w.place, cp1, 7, w.global_count);
  EXPECT_EQ(d.kind, "uniform-scale");
  EXPECT_NEAR(d.scale, 7. / 9, 1e-15);
  EXPECT_NE(d.named.find("N/N' = 7/9"), std::string::npos) << d.named;
  // Exact at CP 2, so only the layout variations show it.
  const auto inv =
      check_split_invariance(b, layout(b, 1, 1, 2), legacy, {}, Split::kContiguous, truth);
  int broken = 0;
  for (const auto& r : inv) {
    broken += !r.ok;
    if (!r.ok) {
      EXPECT_EQ(r.layout["cp"], 1) << r.label;
    }
  }
  EXPECT_EQ(broken, 1);
}

// The property of I5 over random batches: correct contracts are split-invariant and exact; each
// buggy one is exact exactly where its formula says, checked against formulas written here from
// counts.
TEST(Weights, SplitInvarianceAndBugFormulasOverRandomBatches) {
  synth::Rng rng(20261202);
  int batches = 0, hf_ga_exact = 0, hf_ga_wrong = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<S> samples;
    const int64_t n = rng.uniform_int(1, 10);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = rng.uniform_int(0, 24);
      const int64_t r = rng.uniform_int(0, t);
      std::vector<int64_t> mask(static_cast<std::size_t>(r));
      const bool masked = rng.uniform() < 0.15;
      for (auto& x : mask) x = masked ? 0 : rng.uniform() < 0.8;
      samples.push_back({t, r, mask});
    }
    const Batch b = make(samples);
    const int64_t dp = rng.uniform_int(1, 4), m = rng.uniform_int(1, 3), cp = rng.uniform_int(1, 4);
    const StepLayout l = layout(b, dp, m, cp);
    const std::vector<double> truth = true_weights(b, Reduction::kPerToken, {});
    int64_t big_n = 0, empties = 0;
    for (int64_t i = 0; i < b.num_samples(); ++i) {
      big_n += b.mask_sum(i);
      empties += b.mask_sum(i) == 0;
    }
    // The truth at CP > 1 drops a non-pre-shifted SFT sample's last token; keep batches without
    // one.
    bool sft_last = false;
    for (int64_t i = 0; i < b.num_samples(); ++i) {
      sft_last |= b.response_lengths[i] == b.total_lengths[i] && b.total_lengths[i] > 0 &&
                  b.loss_mask[b.response_offsets[i + 1] - 1];
    }
    if (sft_last) continue;
    ++batches;
    for (const char* correct : {"truth", "megatron-per-token", "relax"}) {
      const Contract c = parse_contract(correct, Reduction::kPerToken);
      const ContractWeights w = contract_weights(b, l, c, {});
      ASSERT_TRUE(diagnose_weights(b, w.weight, truth, w.place, l).exact())
          << correct << " trial " << trial;
      for (const auto& r : check_split_invariance(b, l, c, {}, Split::kContiguous, truth)) {
        ASSERT_TRUE(r.ok) << correct << " " << r.label << " trial " << trial;
      }
    }
    // slime: exact iff no sample is empty (its clamp counts each as 1 on every CP rank).
    const ContractWeights sl =
        contract_weights(b, l, parse_contract("slime", Reduction::kPerToken), {});
    const WeightDiagnosis sd = diagnose_weights(b, sl.weight, truth, sl.place, l);
    if (big_n > 0) {
      ASSERT_EQ(sd.exact(), empties == 0) << "trial " << trial;
      if (empties > 0) {
        ASSERT_NEAR(sd.scale, double(big_n) / double(big_n + empties), 1e-12);
      }
    }
    // relax-legacy: wrong exactly at CP = 1 with an empty sample, by N/(N + empties).
    const ContractWeights rl =
        contract_weights(b, l, parse_contract("relax-legacy", Reduction::kPerToken), {});
    const WeightDiagnosis rd = diagnose_weights(b, rl.weight, truth, rl.place, l);
    if (big_n > 0) {
      ASSERT_EQ(rd.exact(), cp > 1 || empties == 0) << "trial " << trial;
    }
    // hf-ga at CP 1: w_t = 1 / (M_d · dp · n_mb) for the token's micro-batch (a formula from
    // counts).
    if (cp == 1) {
      const Placement p = place_samples(b.num_samples(), dp, m, Split::kContiguous);
      const std::vector<double> ga = weights_of(b, l, "hf-ga");
      bool all_exact = true;
      for (int64_t d = 0; d < dp; ++d) {
        for (const auto& mb : p[d]) {
          int64_t n_mb = 0;
          for (int64_t i : mb) n_mb += b.mask_sum(i);
          for (int64_t i : mb) {
            for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
              const double want =
                  b.loss_mask[t] ? 1.0 / (double(p[d].size()) * double(dp) * double(n_mb)) : 0.0;
              ASSERT_NEAR(ga[t], want, 1e-15 + 1e-12 * want) << "trial " << trial;
              if (b.loss_mask[t]) all_exact &= std::fabs(want - truth[t]) <= 1e-12 * truth[t];
            }
          }
        }
      }
      const ContractWeights gw =
          contract_weights(b, l, parse_contract("hf-ga", Reduction::kPerToken), {});
      ASSERT_EQ(diagnose_weights(b, gw.weight, truth, gw.place, l).exact(),
                all_exact || big_n == 0);
      (all_exact ? hf_ga_exact : hf_ga_wrong)++;
    }
  }
  EXPECT_GT(batches, 1000);     // the others hold a non-pre-shifted SFT sample
  EXPECT_GT(hf_ga_wrong, 100);  // the property saw the bug, not only its absence
  EXPECT_GT(hf_ga_exact, 5);
}

// A random batch of up to 12 samples (RL, SFT and empty ones, masks 70% ones) and a random layout
// of it (DP, micro-batches, CP 1-4; all-gather 30% of the time), for the run-versus-token
// properties.
std::pair<Batch, StepLayout> random_batch_and_layout(synth::Rng& rng) {
  std::vector<S> samples;
  for (int64_t i = 0, n = rng.uniform_int(1, 12); i < n; ++i) {
    const int64_t t = rng.uniform_int(0, 30), r = rng.uniform_int(0, t);
    std::vector<int64_t> mask(static_cast<std::size_t>(r));
    for (auto& x : mask) x = rng.uniform() < 0.7;
    samples.push_back({t, r, mask});
  }
  Batch b = make(samples);
  StepLayout l = layout(b, rng.uniform_int(1, 3), rng.uniform_int(1, 3), rng.uniform_int(1, 4));
  if (rng.uniform() < 0.3) {
    l.cp_layout = CpLayout::kAllgather;
    l.allgather_pad = rng.uniform_int(1, 4);
  }
  return {std::move(b), std::move(l)};
}

// I5 compares each variation's weights with the base layout's run by run (owner runs and mask
// counts, no per-token vectors). Here, independently, token by token: both layouts' per-token
// weights, the greatest relative difference and its first token, over random batches (RL and SFT,
// empty samples), zig-zag and all-gather layouts and contracts that break in every dimension.
TEST(Weights, SplitInvarianceMatchesATokenByTokenComparison) {
  synth::Rng rng(20261203);
  const char* contracts[] = {"relax",
                             "relax-legacy",
                             "hf-ga",
                             "megatron-per-token",
                             "norm=microbatch",
                             "norm=rank,scale=1/dp",
                             "count=full-sample",
                             "truth,sample=mean"};
  int compared = 0, differing = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const auto [b, base] = random_batch_and_layout(rng);
    const Contract c = parse_contract(contracts[trial % 8], Reduction::kPerToken);
    const std::vector<double> truth = true_weights(b, Reduction::kPerToken, {});
    const std::vector<InvarianceResult> got =
        check_split_invariance(b, base, c, {}, Split::kContiguous, truth);
    const std::vector<double> ref = contract_weights(b, base, c, {}).weight;
    std::size_t j = 0;
    const int64_t base_m = base.num_microbatches(0);
    for (int dim = 0; dim < 3; ++dim) {
      for (int64_t x : {1, 2, 4, 8}) {
        const int64_t dp = dim == 0 ? x : base.dp, m = dim == 1 ? x : base_m,
                      cp = dim == 2 ? x : base.cp;
        if ((dim == 0 && x == base.dp) || (dim == 1 && x == base_m) || (dim == 2 && x == base.cp))
          continue;
        StepLayout l = layout(b, dp, m, cp);
        l.cp_layout = base.cp_layout;
        l.allgather_pad = base.allgather_pad;
        ContractWeights w;
        try {
          w = contract_weights(b, l, c, {});
        } catch (const InputError&) {
          continue;  // a layout that cannot hold the batch is not a variation
        }
        ASSERT_LT(j, got.size()) << "trial " << trial;
        const InvarianceResult& r = got[j++];
        ASSERT_EQ(r.layout["dp"], dp);
        ASSERT_EQ(r.layout["microbatches"], m);
        ASSERT_EQ(r.layout["cp"], cp);
        // A layout with more micro-batches than samples leaves some empty: no trainer builds it,
        // so it is listed as skipped, not weighed (none of these contracts is TRL's).
        const bool empty_cells = dp * m > b.num_samples();
        EXPECT_EQ(!r.skipped.empty(), empty_cells) << "trial " << trial << " " << r.label;
        if (empty_cells) continue;
        double worst = 0.0;
        int64_t worst_t = -1;
        for (std::size_t t = 0; t < ref.size(); ++t) {
          if (ref[t] == w.weight[t]) continue;
          const double rel =
              std::fabs(ref[t] - w.weight[t]) / std::max(std::fabs(ref[t]), std::fabs(w.weight[t]));
          if (rel > worst) {
            worst = rel;
            worst_t = static_cast<int64_t>(t);
          }
        }
        ++compared;
        EXPECT_DOUBLE_EQ(r.max_rel_diff, worst) << "trial " << trial << " " << r.label;
        EXPECT_EQ(r.ok, worst <= kWeightRelTol) << "trial " << trial << " " << r.label;
        if (worst_t < 0) continue;
        ++differing;
        int64_t i = 0;
        while (b.response_offsets[i + 1] <= worst_t) ++i;
        EXPECT_EQ(r.worst.sample, i) << "trial " << trial << " " << r.label;
        EXPECT_EQ(r.worst.response_index, worst_t - b.response_offsets[i]) << "trial " << trial;
        EXPECT_EQ(r.worst.cp_rank, w.place.owner[worst_t]) << "trial " << trial;
        EXPECT_EQ(r.worst.microbatch, l.microbatches[w.place.sample_microbatch[i]].index);
        EXPECT_EQ(r.worst.dp_rank, l.microbatches[w.place.sample_microbatch[i]].dp_rank);
        EXPECT_EQ(r.worst.got, w.weight[worst_t]);
        EXPECT_EQ(r.worst.want, ref[worst_t]);
      }
    }
    EXPECT_EQ(j, got.size()) << "trial " << trial;
  }
  EXPECT_GT(compared, 3000);
  EXPECT_GT(differing, 500);  // the comparison saw breaks, not only agreement
}

// `weights` reports the summary from each sample's owner runs (no per-token vector); `--per-token`
// and audit diagnose per-token vectors. Both must say the same: over random batches (RL, SFT,
// empty and unplaced-free), zig-zag and all-gather layouts, contracts with every kind of break and
// a truth scaled as a loss term's is, every field of the diagnosis and of the shard table.
TEST(Weights, SummaryFromRunsEqualsThePerTokenDiagnosis) {
  synth::Rng rng(20261204);
  const char* contracts[] = {"relax",
                             "relax-legacy",
                             "hf-ga",
                             "truth",
                             "norm=microbatch",
                             "norm=rank,scale=1/dp",
                             "count=full-sample",
                             "truth,sample=mean",
                             "truth,scale=cp"};
  std::set<std::string> kinds;
  for (int trial = 0; trial < 800; ++trial) {
    const auto [b, l] = random_batch_and_layout(rng);
    const Contract c = parse_contract(contracts[trial % 9], Reduction::kPerToken);
    const Reduction reduce = trial % 2 ? Reduction::kPerToken : Reduction::kSampleMean;
    std::vector<double> per_sample = true_sample_weights(b, reduce, {});
    const double scale = trial % 3 == 0 ? 0.5 : 1.0;  // a term judged relative to main's scale
    std::vector<double> truth = true_weights(b, reduce, {});
    for (double& w : per_sample) w *= scale;
    for (double& w : truth) w *= scale;
    int64_t n = 0;
    for (uint8_t m : b.loss_mask) n += m;
    ContractWeights w;
    try {
      w = contract_weights(b, l, c, {});
    } catch (const InputError&) {
      continue;
    }
    const WeightDiagnosis want =
        diagnose_weights(b, w.weight, truth, w.place, l, n, w.global_count);
    const std::vector<ShardRatio> want_shards = shard_ratios(b, w.weight, truth, w.place, l);
    const WeightsSummary got = summarize_weights(b, l, c, {}, per_sample, n);
    const WeightDiagnosis& d = got.diagnosis;
    const std::string at = fmt::format("trial {} contract {}", trial, contracts[trial % 9]);
    kinds.insert(want.kind);
    EXPECT_EQ(d.kind, want.kind) << at;
    EXPECT_EQ(d.scale, want.scale) << at;
    EXPECT_EQ(d.named, want.named) << at;
    EXPECT_EQ(d.tokens, want.tokens) << at;
    EXPECT_EQ(d.mismatched, want.mismatched) << at;
    EXPECT_EQ(d.masked_weighted, want.masked_weighted) << at;
    EXPECT_EQ(d.non_finite, want.non_finite) << at;
    if (want.kind != "exact") {
      EXPECT_EQ(d.min_ratio, want.min_ratio) << at;
      EXPECT_EQ(d.max_ratio, want.max_ratio) << at;
      EXPECT_EQ(d.worst.sample, want.worst.sample) << at;
      EXPECT_EQ(d.worst.response_index, want.worst.response_index) << at;
      EXPECT_EQ(d.worst.dp_rank, want.worst.dp_rank) << at;
      EXPECT_EQ(d.worst.microbatch, want.worst.microbatch) << at;
      EXPECT_EQ(d.worst.cp_rank, want.worst.cp_rank) << at;
      EXPECT_EQ(d.worst.got, want.worst.got) << at;
      EXPECT_EQ(d.worst.want, want.worst.want) << at;
      EXPECT_EQ(d.worst.unit_tokens, want.worst.unit_tokens) << at;
    }
    EXPECT_EQ(d.summary(), want.summary()) << at;
    EXPECT_EQ(got.global_count, w.global_count) << at;
    EXPECT_EQ(got.problems, w.problems) << at;
    ASSERT_EQ(got.shards.size(), want_shards.size()) << at;
    for (std::size_t k = 0; k < want_shards.size(); ++k) {
      EXPECT_EQ(got.shards[k].tokens, want_shards[k].tokens) << at << " shard " << k;
      EXPECT_EQ(got.shards[k].masked_weighted, want_shards[k].masked_weighted) << at;
      if (want_shards[k].tokens > 0) {
        EXPECT_EQ(got.shards[k].min_ratio, want_shards[k].min_ratio) << at << " shard " << k;
        EXPECT_EQ(got.shards[k].max_ratio, want_shards[k].max_ratio) << at << " shard " << k;
      }
    }
  }
  // The property saw every diagnosis a contract can give here, not only "exact".
  for (const char* k : {"exact", "uniform-scale", "per-microbatch", "per-cp-shard"})
    EXPECT_EQ(kinds.count(k), 1u) << k;
}

TEST(Weights, AllGatherOwnsEveryTokenExactlyOnce) {
  synth::Rng rng(7);
  for (int trial = 0; trial < 500; ++trial) {
    std::vector<S> samples;
    for (int64_t i = 0, n = rng.uniform_int(1, 8); i < n; ++i) {
      const int64_t t = rng.uniform_int(1, 40), r = rng.uniform_int(0, t - 1);  // RL samples
      samples.push_back({t, r, std::vector<int64_t>(static_cast<std::size_t>(r), 1)});
    }
    const Batch b = make(samples);
    StepLayout l = layout(b, rng.uniform_int(1, 3), rng.uniform_int(1, 3), rng.uniform_int(2, 4));
    l.cp_layout = CpLayout::kAllgather;
    l.allgather_pad = rng.uniform_int(1, 8);
    const ContractWeights w =
        contract_weights(b, l, parse_contract("megatron-per-token", Reduction::kPerToken), {});
    for (std::size_t t = 0; t < w.place.owner.size(); ++t) {
      ASSERT_GE(w.place.owner[t], 0) << "trial " << trial << " token " << t;
      ASSERT_LT(w.place.owner[t], l.cp);
    }
    const auto truth = true_weights(b, Reduction::kPerToken, {});
    ASSERT_TRUE(diagnose_weights(b, w.weight, truth, w.place, l).exact()) << trial;
  }
}

TEST(Weights, ContractSyntax) {
  const Contract c = parse_contract(
      "count=full-sample,clamp=per-sample,norm=global:dp,scale=dp*cp*1/B,grad=mean:dp-cp",
      Reduction::kPerToken);
  EXPECT_EQ(contract_components(c),
            "count=full-sample,clamp=per-sample,norm=global:dp,sample=none,scale=dp*cp*1/"
            "B,grad=mean:dp-cp");
  EXPECT_TRUE(c.preset.empty());
  EXPECT_EQ(parse_contract("slime", Reduction::kPerToken).preset, "slime");
  EXPECT_EQ(parse_contract("slime", Reduction::kPerToken),
            parse_contract("policy=slime,norm=global:dp-cp", Reduction::kPerToken));
  EXPECT_TRUE(
      parse_contract("megatron-per-token,norm=global:dp", Reduction::kPerToken).preset.empty());
  EXPECT_THROW(parse_contract("hf-gaa", Reduction::kPerToken), InputError);
  EXPECT_THROW(parse_contract("norm=global", Reduction::kPerToken), InputError);
  EXPECT_THROW(parse_contract("scale=cp*x", Reduction::kPerToken), InputError);
  EXPECT_THROW(parse_contract("count=everything", Reduction::kPerToken), InputError);
}

// Weights that are inf or NaN (measured by audit, or a contract's arithmetic) never pass: a
// relative comparison with inf holds (|inf - 1| <= tol * inf), so the diagnosis looks first.
TEST(Weights, NonFiniteWeightsAreNeverExactOrAScale) {
  const Batch b = hand_batch();
  const StepLayout l = layout(b, 1, 1, 1);
  const std::vector<double> truth = true_weights(b, Reduction::kPerToken, {});
  for (double bad : {INFINITY, -INFINITY, NAN}) {
    std::vector<double> got = truth;
    got[1] = bad;
    const WeightDiagnosis d = diagnose_weights(b, got, truth, place_tokens(b, l).place, l);
    EXPECT_EQ(d.kind, "non-finite") << bad;
    EXPECT_EQ(d.non_finite, 1);
    EXPECT_EQ(d.worst.sample, 0);
    EXPECT_EQ(d.worst.response_index, 1);
    EXPECT_TRUE(d.fails(false));
    // every weight infinite: still not a uniform scale
    const std::vector<double> all(truth.size(), bad);
    EXPECT_TRUE(diagnose_weights(b, all, truth, place_tokens(b, l).place, l).fails(false));
  }
}

// A trainer that applies no gradient (every weight 0) is not a "uniform scale ×0" that passes.
TEST(Weights, AllZeroWeightsFailEvenWithoutStrictScale) {
  const Batch b = hand_batch();
  const StepLayout l = layout(b, 1, 1, 1);
  const std::vector<double> truth = true_weights(b, Reduction::kPerToken, {});
  const std::vector<double> zero(truth.size(), 0.0);
  const WeightDiagnosis d = diagnose_weights(b, zero, truth, place_tokens(b, l).place, l);
  EXPECT_EQ(d.kind, "zero");
  EXPECT_TRUE(d.fails(false));
  EXPECT_NE(d.summary().find("no gradient"), std::string::npos) << d.summary();
  // a tiny but non-zero common scale is still a scale
  std::vector<double> tiny = truth;
  for (double& w : tiny) w *= 1e-30;
  EXPECT_EQ(diagnose_weights(b, tiny, truth, place_tokens(b, l).place, l).kind, "uniform-scale");
}

// A contract's numbers must multiply to a float32 normal number; the text echoes every digit.
TEST(Weights, ContractScalesOutsideFloat32AreInputErrors) {
  for (const char* c : {"scale=1e308", "scale=1e200*1e200", "scale=1e-200*1e-200", "scale=1e-39",
                        "megatron-per-token,scale=1e39"}) {
    EXPECT_THROW(parse_contract(c, Reduction::kPerToken), InputError) << c;
  }
  EXPECT_NO_THROW(parse_contract("scale=1e38*1/4096", Reduction::kPerToken));
  EXPECT_EQ(scale_text(parse_contract("scale=1.00000001", Reduction::kPerToken).scale),
            "1.00000001");
  EXPECT_EQ(scale_text(parse_contract("scale=1/3*cp", Reduction::kPerToken).scale),
            "0.3333333333333333*cp");
}

// Two CP sub-groups of one micro-batch that both list a sample (dynamic CP): the second placement
// is a problem and is counted nowhere (it used to index owners of the first sub-group from the
// second's base: heap corruption).
TEST(Weights, ASampleInTwoSubGroupsIsNamedAndCountedOnce) {
  const Batch b = hand_batch();
  StepLayout l;
  l.dp = 1;
  l.cp = 2;
  l.microbatches.push_back({0, 0, 1, {{0, 1}, {1, 2}}, false});
  const ContractWeights w =
      contract_weights(b, l, parse_contract("truth", Reduction::kPerToken), {});
  ASSERT_EQ(w.problems.size(), 1u);
  EXPECT_NE(w.problems[0].find("sample 1 is placed twice"), std::string::npos) << w.problems[0];
  EXPECT_NE(w.problems[0].find("sub-groups 0 and 1"), std::string::npos) << w.problems[0];
  EXPECT_EQ(w.global_count, 8);  // every effective token once
}

// The presets of the real trainers' paths (TRL 1.16 GRPO loss types, verl 0.9 modes, Megatron-core
// 0.16's 2-tuple) and the generation-batch count, by hand on the hand batch (m = 3, 1, 4; R = 3, 2,
// 4; N = 8, B = 3) with one sample per micro-batch (DP 1, M = 3).
TEST(Weights, RealTrainerPresetsByHandOneSamplePerMicrobatch) {
  const Batch b = hand_batch();
  const StepLayout l = layout(b, 1, 3, 1);
  // mask 1 1 1 | 1 0 | 1 1 1 1
  auto per_sample = [](double a, double c, double d) {
    return std::vector<double>{a, a, a, c, 0, d, d, d, d};
  };
  // A sample's token mean ÷ M (one sample per micro-batch): m_t / (3 m_i).
  const auto sample_mean = per_sample(1. / 9, 1. / 3, 1. / 12);
  expect_weights(weights_of(b, l, "trl-grpo", Reduction::kSampleMean), sample_mean);
  expect_weights(weights_of(b, l, "verl-seq-mean-token-mean", Reduction::kSampleMean), sample_mean);
  expect_weights(weights_of(b, l, "megatron-2tuple"), sample_mean);
  // The same misconfigured under the per-token flag: × dp·cp = 1 here.
  expect_weights(weights_of(b, l, "megatron-2tuple-per-token-flag"), sample_mean);
  // geo_mean: no ÷ M: m_t / m_i.
  expect_weights(weights_of(b, l, "verl-geo-mean", Reduction::kSampleMean),
                 per_sample(1. / 3, 1, 1. / 4));
  // dr_grpo: token sums ÷ (1 completion · L = 4) ÷ M = 3: 1/12 every token.
  expect_weights(weights_of(b, l, "trl-dr-grpo", Reduction::kSeqMeanTokenSumNorm),
                 per_sample(1. / 12, 1. / 12, 1. / 12));
  // verl v1 without loss_scale_factor: ÷ (B = 3 · the micro-batch's longest response 3, 2, 4).
  expect_weights(
      weights_of(b, l, "verl-seq-mean-token-sum-norm-v1", Reduction::kSeqMeanTokenSumNorm),
      per_sample(1. / 9, 1. / 6, 1. / 12));
  // dapo: the count over every rank's micro-batches of the step (S = M): m_t / N.
  expect_weights(weights_of(b, l, "trl-dapo"), per_sample(1. / 8, 1. / 8, 1. / 8));
  // dapo with steps_per_generation S = 1 at M = 3: each micro-batch its own generation batch,
  // w = m_t · S / (N_G · M) = m_t / (3 n_k).
  expect_weights(weights_of(b, l, "trl-dapo,norm=generation:1,scale=dp*1/M"),
                 per_sample(1. / 9, 1. / 3, 1. / 12));
  // S = 3 = M: the step's count again, the truth.
  expect_weights(weights_of(b, l, "trl-dapo,norm=generation:3,scale=dp*3*1/M"),
                 per_sample(1. / 8, 1. / 8, 1. / 8));
  // generation batches of 2 micro-batches: micro-batch k of every rank is in batch k / 2.
  const StepLayout l2 = layout(b, 1, 3, 1);
  const Contract g2 = parse_contract("norm=generation:2", Reduction::kPerToken);
  EXPECT_EQ(contract_components(g2),
            "count=cp-local,clamp=none,norm=generation:2,sample=none,scale=1,grad=sum");
  // micro-batches 0, 1 (m = 3 + 1) form batch 0; micro-batch 2 (m = 4) batch 1.
  expect_weights(contract_weights(b, l2, g2, {}).weight, per_sample(1. / 4, 1. / 4, 1. / 4));
  EXPECT_THROW(parse_contract("norm=generation:0", Reduction::kPerToken), InputError);
  EXPECT_THROW(parse_contract("norm=generation", Reduction::kPerToken), InputError);
}

// SPEC §9: a uniform scale that the layout sets fails by default and says what another layout
// does; a declared constant equal to it decides; a constant the layout cannot explain (here 1/B,
// the same under every layout) keeps the Adam rule. Expectations by hand: hand_batch has N = 8
// effective tokens in B = 3 samples.
TEST(Weights, AScaleTheLayoutSetsFailsByDefaultAndADeclaredConstantDecides) {
  const Batch b = hand_batch();
  const std::vector<double> truth = true_weights(b, Reduction::kPerToken, {});
  const StepLayout cp2 = layout(b, 1, 1, 2);
  // Every CP rank counts the full samples and the count is summed over CP: N' = 2N, w = w*/2.
  const ContractWeights w = contract_weights(
      b, cp2, parse_contract("count=full-sample,norm=global:dp-cp", Reduction::kPerToken), {});
  ScaleContext ctx;
  ctx.global_batch = 3;
  const WeightDiagnosis half =
      diagnose_weights(b, w.weight, truth, w.place, cp2, 8, w.global_count, kWeightRelTol, ctx);
  EXPECT_EQ(half.kind, "uniform-scale");
  EXPECT_EQ(half.named, "1/cp");
  EXPECT_TRUE(half.layout_dependent);
  EXPECT_FALSE(half.hidden_scale());
  EXPECT_TRUE(half.fails(/*strict_scale=*/false));
  EXPECT_EQ(half.same_step, "the same step at CP = 1 applies ×2 this update");
  EXPECT_NE(half.summary().find("uniform scale ×0.5 = 1/cp: the same step at CP = 1 applies ×2 "
                                "this update"),
            std::string::npos)
      << half.summary();
  // The same weights from a trainer that declares a loss coefficient 0.5: the declaration decides.
  ctx.declared = {{"coef", 0.5}};
  const WeightDiagnosis declared =
      diagnose_weights(b, w.weight, truth, w.place, cp2, 8, w.global_count, kWeightRelTol, ctx);
  EXPECT_FALSE(declared.layout_dependent);
  EXPECT_EQ(declared.declared, "coef = 0.5");
  EXPECT_FALSE(declared.fails(false));
  EXPECT_TRUE(declared.fails(true));
  EXPECT_NE(declared.summary().find("declared coef = 0.5 (also 1/cp)"), std::string::npos)
      << declared.summary();
  // Two symbols: a ×dp·cp compensation applied where none is needed (DP 3, CP 2).
  const StepLayout dp2cp2 = layout(b, 3, 1, 2);
  const ContractWeights w4 = contract_weights(
      b, dp2cp2, parse_contract("megatron-per-token,scale=dp*cp", Reduction::kPerToken), {});
  const WeightDiagnosis four = diagnose_weights(b, w4.weight, truth, w4.place, dp2cp2, 8);
  EXPECT_TRUE(four.layout_dependent) << four.summary();
  EXPECT_EQ(four.named, "cp*dp") << four.summary();
  EXPECT_EQ(four.same_step, "the same step at CP = 1 and DP = 1 applies ×0.166667 this update");
  // 1/B: the same under every layout of the step, so Adam's rule (reported, fails with strict).
  const StepLayout one = layout(b, 1, 1, 1);
  const ContractWeights wb = contract_weights(
      b, one, parse_contract("megatron-per-token,scale=1/B", Reduction::kPerToken), {});
  const WeightDiagnosis per_b =
      diagnose_weights(b, wb.weight, truth, wb.place, one, 8, wb.global_count, kWeightRelTol, ctx);
  EXPECT_EQ(per_b.named, "1/B");
  EXPECT_FALSE(per_b.layout_dependent);
  EXPECT_FALSE(per_b.fails(false));
  // A constant nothing names: reported, passes without --strict-scale.
  const ContractWeights w7 = contract_weights(
      b, cp2, parse_contract("megatron-per-token,scale=7", Reduction::kPerToken), {});
  const WeightDiagnosis seven = diagnose_weights(b, w7.weight, truth, w7.place, cp2, 8);
  EXPECT_EQ(seven.named, "");
  EXPECT_FALSE(seven.fails(false));
}

// SPEC §9: a failure names its factor per unit in the trainer's terms. hand_batch's micro-batches
// (one sample each) hold 3, 1 and 4 effective tokens; N = 8, M = 3.
TEST(Weights, APerMicroBatchFactorIsNamedByTheUnitsOwnCounts) {
  const Batch b = hand_batch();
  const std::vector<double> truth = true_weights(b, Reduction::kPerToken, {});
  const StepLayout l = layout(b, 1, 3, 1);
  ScaleContext ctx;
  ctx.reduce = Reduction::kPerToken;
  ctx.reduce_known = true;
  ctx.loss_site = "train.py: compute_loss";
  // Each micro-batch divided by its own count, then by N: w = m / (n_k N), w / w* = 1 / n_k. The
  // worst unit is micro-batch 2 (4 tokens, ×1/4).
  const ContractWeights exact =
      contract_weights(b, l, parse_contract("truth", Reduction::kPerToken), {});
  std::vector<double> twice = exact.weight;
  const int64_t n_of_sample[3] = {3, 1, 4};
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t)
      twice[t] /= static_cast<double>(n_of_sample[i]);
  }
  const WeightDiagnosis dbl =
      diagnose_weights(b, twice, truth, exact.place, l, 8, 0, kWeightRelTol, ctx);
  EXPECT_EQ(dbl.kind, "per-microbatch");
  EXPECT_EQ(dbl.factor, "1/n");
  EXPECT_EQ(dbl.advice,
            "micro-batch 2 of DP rank 0 is divided by its own 4 tokens, then by N = 8: divide by "
            "N only (in train.py: compute_loss)");
  EXPECT_NE(dbl.summary().find("; w/w* = 1/n in every unit"), std::string::npos) << dbl.summary();
  // The gradient-accumulation bug (hf-ga): a mean per micro-batch, ÷ M: w / w* = N / (n_k M).
  const ContractWeights ga =
      contract_weights(b, l, parse_contract("hf-ga", Reduction::kPerToken), {});
  ctx.loss_site.clear();
  const WeightDiagnosis g =
      diagnose_weights(b, ga.weight, truth, ga.place, l, 8, ga.global_count, kWeightRelTol, ctx);
  EXPECT_EQ(g.factor, "N/(n*M)");
  EXPECT_EQ(g.advice,
            "micro-batch 1 of DP rank 0 is divided by its own 1 token and M = 3 instead of N = 8: "
            "divide by N = 8");
  // Without the objective the sentence still says what to remove.
  const WeightDiagnosis bare = diagnose_weights(b, twice, truth, exact.place, l, 8);
  EXPECT_EQ(bare.advice,
            "micro-batch 2 of DP rank 0 is divided by its own 4 tokens on top of the objective's "
            "normalisation: remove that division");
  // A per-rank count (hf-num-items at DP 3, one sample per rank): w / w* = N / (n_rank dp).
  const StepLayout dp3 = layout(b, 3, 1, 1);
  const ContractWeights items =
      contract_weights(b, dp3, parse_contract("hf-num-items", Reduction::kPerToken), {});
  const WeightDiagnosis r = diagnose_weights(b, items.weight, truth, items.place, dp3, 8,
                                             items.global_count, kWeightRelTol, ctx);
  EXPECT_EQ(r.kind, "per-rank");
  EXPECT_EQ(r.factor, "N/(n*dp)");
}
}  // namespace
}  // namespace lossguard::oracle
