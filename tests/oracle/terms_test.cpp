// Multi-term objectives (SPEC §11): term declarations and masks, each term's weights on a 3-sample
// batch derived by hand (a KL term, an MTP term at depth 1, an aux term over every response token),
// and a random property: a correct multi-term contract is split-invariant per term, and each buggy
// term's weights are exactly what its formula says.
#include <gtest/gtest.h>

#include <random>

#include "core/batch.h"
#include "core/contract.h"
#include "core/errors.h"
#include "core/term.h"
#include "oracle/count/placement.h"
#include "oracle/weights/weights.h"
#include "weights_batches.h"

namespace lossguard::oracle {
namespace {

using S = testing::HandSample;
using testing::expect_weights;

Batch make(const std::vector<S>& samples) {
  return testing::hand_made_batch(samples, "terms.json");
}
StepLayout layout(const Batch& b, int64_t dp, int64_t m, int64_t cp) {
  return testing::flag_layout(b, dp, m, cp);
}

// m = 1 1 1 | 1 0 | 1 1 1 1: N = 8; every response token: A = 9.
Batch hand_batch() { return make({{5, 3, {1, 1, 1}}, {4, 2, {1, 0}}, {6, 4, {1, 1, 1, 1}}}); }

TEST(Terms, DeclarationsParseAndBadOnesNameTheTerm) {
  Term kl = parse_term("kl:per-token:0.1");
  EXPECT_EQ(kl.name, "kl");
  EXPECT_EQ(kl.reduce, Reduction::kPerToken);
  EXPECT_DOUBLE_EQ(kl.coef, 0.1);
  EXPECT_EQ(kl.mask.kind, TermMaskKind::kLoss);
  Term mtp = parse_term("mtp:per-token:0.3:shift:1");
  EXPECT_EQ(mtp.mask.kind, TermMaskKind::kShift);
  EXPECT_EQ(mtp.mask.shift, 1);
  EXPECT_EQ(mtp.mask.text(), "shift:1");
  Term aux = parse_term("aux:sample-mean:all");  // no coefficient: 1
  EXPECT_DOUBLE_EQ(aux.coef, 1.0);
  EXPECT_EQ(aux.mask.kind, TermMaskKind::kAll);
  EXPECT_EQ(parse_term("z:per-token:-1e-3").coef, -1e-3);
  auto fails_with = [](const std::string& text, const std::string& needle) {
    try {
      parse_term(text);
      ADD_FAILURE() << text << " was accepted";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  fails_with("kl:per-token:0.1:rolled", "--term kl: unknown mask 'rolled'");
  fails_with("kl:per-token:nan", "--term kl: coefficient 'nan' is not a finite number");
  fails_with("kl:per-token:inf", "coefficient 'inf'");
  fails_with("kl:per-token:1e999", "coefficient '1e999'");
  fails_with("kl:per-token:0.1x", "coefficient '0.1x'");
  fails_with("kl:mean", "--term kl: reduce 'mean'");
  fails_with("kl", "NAME:REDUCE");
  fails_with("KL:per-token", "'KL' is not a term name");
  fails_with("norm:per-token", "'norm' is not a term name");  // would make --contract ambiguous
  fails_with("mtp:per-token:shift:0", "[1, 1048576]");
  fails_with("mtp:per-token:shift:x", "shift:J");
}

TEST(Terms, MasksByHand) {
  const Batch b = hand_batch();
  auto as_ints = [](const std::vector<uint8_t>& m) { return std::vector<int>(m.begin(), m.end()); };
  EXPECT_EQ(as_ints(term_mask(b, parse_term_mask("loss", "t"))),
            (std::vector<int>{1, 1, 1, 1, 0, 1, 1, 1, 1}));
  EXPECT_EQ(as_ints(term_mask(b, parse_term_mask("all", "t"))), std::vector<int>(9, 1));
  // shift:1: m_t · m_{t+1} within each sample; the last response token carries none.
  EXPECT_EQ(as_ints(term_mask(b, parse_term_mask("shift:1", "t"))),
            (std::vector<int>{1, 1, 0, 0, 0, 1, 1, 1, 0}));
  EXPECT_EQ(as_ints(term_mask(b, parse_term_mask("shift:3", "t"))),
            (std::vector<int>{0, 0, 0, 0, 0, 1, 0, 0, 0}));
  EXPECT_EQ(as_ints(term_mask(b, parse_term_mask("shift:9", "t"))), std::vector<int>(9, 0));
  EXPECT_THROW(term_mask(b, parse_term_mask("field", "t")), InputError);
  // roll:J is Megatron's rolled mask m_{t+J}: it differs from shift:J where m_t = 0 < m_{t+J}.
  const Batch gap = make({{5, 4, {0, 1, 1, 0}}});
  EXPECT_EQ(as_ints(term_mask(gap, parse_term_mask("shift:1", "t"))),
            (std::vector<int>{0, 1, 0, 0}));
  EXPECT_EQ(as_ints(term_mask(gap, parse_term_mask("roll:1", "t"))),
            (std::vector<int>{1, 1, 0, 0}));
  EXPECT_EQ(parse_term_mask("roll:2", "t").text(), "roll:2");
}

TEST(Terms, ThreeTermsWeightsByHand) {
  const Batch b = hand_batch();
  // KL, per-token, coefficient 0.1 over the loss mask: 0.1 m_t / 8 (the coefficient is applied by
  // the caller: the term's own weights are its objective's).
  const Batch kl = with_mask(b, term_mask(b, parse_term_mask("loss", "kl")));
  const double e = 1.0 / 8;
  expect_weights(true_weights(kl, Reduction::kPerToken, {}), {e, e, e, e, 0, e, e, e, e});
  // MTP depth 1: N_mtp = 2 + 0 + 3 = 5.
  const Batch mtp = with_mask(b, term_mask(b, parse_term_mask("shift:1", "mtp")));
  const double f = 1.0 / 5;
  expect_weights(true_weights(mtp, Reduction::kPerToken, {}), {f, f, 0, 0, 0, f, f, f, 0});
  // ... and as a sample mean: d_i follows the term's mask (2, 0, 3), B = 3, empty sample weighs 0.
  expect_weights(true_weights(mtp, Reduction::kSampleMean, {}),
                 {1. / 6, 1. / 6, 0, 0, 0, 1. / 9, 1. / 9, 1. / 9, 0});
  // Aux over every response token: A = 9, the masked token of sample 1 included.
  const Batch aux = with_mask(b, term_mask(b, parse_term_mask("all", "aux")));
  expect_weights(true_weights(aux, Reduction::kPerToken, {}), std::vector<double>(9, 1.0 / 9));

  // The bugs, each through the contract a buggy trainer applies to that term:
  // KL averaged per micro-batch (one sample each, M = 3), no ÷M: w = m_t / n_mb = 1/3, 1, 1/4.
  const StepLayout m3 = layout(b, 1, 3, 1);
  const ContractWeights kl_mb =
      contract_weights(kl, m3, parse_contract("norm=microbatch", Reduction::kPerToken), {});
  expect_weights(kl_mb.weight, {1. / 3, 1. / 3, 1. / 3, 1, 0, 1. / 4, 1. / 4, 1. / 4, 1. / 4});
  const WeightDiagnosis d_kl =
      diagnose_weights(kl, kl_mb.weight, true_weights(kl, Reduction::kPerToken, {}), kl_mb.place,
                       m3, 8, kl_mb.global_count);
  EXPECT_EQ(d_kl.kind, "per-microbatch");
  EXPECT_NEAR(d_kl.max_ratio, 8.0, 1e-12);  // the one-token micro-batch
  // Aux where every CP rank counts its full samples (cp·A) without the ×cp: uniform 1/cp.
  const StepLayout cp2 = layout(b, 1, 1, 2);
  const ContractWeights aux_cp = contract_weights(
      aux, cp2, parse_contract("count=full-sample,norm=global:dp-cp", Reduction::kPerToken), {});
  expect_weights(aux_cp.weight, std::vector<double>(9, 1.0 / 18));
  const WeightDiagnosis d_aux =
      diagnose_weights(aux, aux_cp.weight, true_weights(aux, Reduction::kPerToken, {}),
                       aux_cp.place, cp2, 9, aux_cp.global_count);
  EXPECT_EQ(d_aux.kind, "uniform-scale");
  EXPECT_EQ(d_aux.named, "1/cp");
  // MTP divided by the main count N = 8 instead of N_mtp = 5: uniform 5/8 against its truth.
  std::vector<double> mtp_main(9, 0.0);
  for (std::size_t t = 0; t < 9; ++t) mtp_main[t] = mtp.loss_mask[t] / 8.0;
  const ContractWeights mtp_place =
      contract_weights(mtp, m3, parse_contract("truth", Reduction::kPerToken), {});
  const WeightDiagnosis d_mtp = diagnose_weights(
      mtp, mtp_main, true_weights(mtp, Reduction::kPerToken, {}), mtp_place.place, m3, 5, 8);
  EXPECT_EQ(d_mtp.kind, "uniform-scale");
  EXPECT_NEAR(d_mtp.scale, 5.0 / 8, 1e-15);
}

// Random batches and layouts: under megatron-per-token applied to each term's own mask, every
// term is exact and split-invariant; the per-micro-batch KL gives exactly m_t / n_mb (n_mb the
// micro-batch's KL count on the token's CP rank), computed here from the ownership alone.
TEST(Terms, PropertyCorrectTermsAreSplitInvariantAndBuggyOnesFollowTheirFormula) {
  std::mt19937_64 rng(20261203);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 9);
    std::vector<S> samples;
    for (int i = 0; i < n; ++i) {
      const int64_t r = static_cast<int64_t>(rng() % 9);
      const int64_t t = r + 1 + static_cast<int64_t>(rng() % 7);
      std::vector<int64_t> mask(static_cast<std::size_t>(r));
      for (auto& m : mask) m = (rng() % 4) != 0;
      samples.push_back({t, r, mask});
    }
    const Batch b = make(samples);
    const int64_t dp = 1 + static_cast<int64_t>(rng() % 3), m = 1 + static_cast<int64_t>(rng() % 3),
                  cp = int64_t{1} << (rng() % 3);
    const StepLayout l = layout(b, dp, m, cp);
    for (const char* mask_text : {"loss", "shift:1", "shift:2", "all"}) {
      SCOPED_TRACE(::testing::Message() << "trial " << trial << " mask " << mask_text << " dp "
                                        << dp << " M " << m << " cp " << cp);
      const Batch tb = with_mask(b, term_mask(b, parse_term_mask(mask_text, "t")));
      const std::vector<double> truth = true_weights(tb, Reduction::kPerToken, {});
      const Contract good = parse_contract("megatron-per-token", Reduction::kPerToken);
      const ContractWeights w = contract_weights(tb, l, good, {});
      int64_t nk = 0;
      for (uint8_t x : tb.loss_mask) nk += x;
      EXPECT_EQ(diagnose_weights(tb, w.weight, truth, w.place, l, nk, w.global_count).kind,
                "exact");
      for (const auto& inv :
           check_split_invariance(tb, l, good, {}, Split::kContiguous, truth, {}, &w)) {
        EXPECT_TRUE(inv.ok) << inv.label;
      }
      // The per-micro-batch KL: the test's own count per (micro-batch, CP rank).
      const ContractWeights bug =
          contract_weights(tb, l, parse_contract("norm=microbatch", Reduction::kPerToken), {});
      std::vector<int64_t> count(l.microbatches.size() * static_cast<std::size_t>(cp), 0);
      for (int64_t i = 0; i < tb.num_samples(); ++i) {
        for (int64_t t = tb.response_offsets[i]; t < tb.response_offsets[i + 1]; ++t) {
          if (tb.loss_mask[t] && w.place.owner[t] >= 0)
            ++count[w.place.sample_microbatch[i] * cp + w.place.owner[t]];
        }
      }
      for (int64_t i = 0; i < tb.num_samples(); ++i) {
        for (int64_t t = tb.response_offsets[i]; t < tb.response_offsets[i + 1]; ++t) {
          const double want =
              tb.loss_mask[t] && w.place.owner[t] >= 0
                  ? 1.0 / static_cast<double>(
                              count[w.place.sample_microbatch[i] * cp + w.place.owner[t]])
                  : 0.0;
          EXPECT_NEAR(bug.weight[t], want, 1e-15) << "sample " << i << " token " << t;
        }
      }
    }
  }
}

}  // namespace
}  // namespace lossguard::oracle
