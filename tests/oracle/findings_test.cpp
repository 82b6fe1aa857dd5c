// The oracle's findings on a batch (oracle/count/findings.h, SPEC §1): a zero-length sample
// reported, every non-finite value found with its coordinates, from its own scan or from the row
// statistics of check's one pass over the logits (oracle/check/loss.h). The batch model itself is
// core's (tests/core/batch_test.cpp).
#include "oracle/count/findings.h"

#include <gtest/gtest.h>

#include <cmath>
#include <utility>
#include <vector>

#include "core/batch.h"
#include "oracle/check/loss.h"

namespace lossguard::oracle {
namespace {

HostArray ints(std::vector<int64_t> v) {
  return HostArray::from_i64(DType::kInt64, {static_cast<int64_t>(v.size())}, v);
}
HostArray floats(std::vector<double> v) {
  return HostArray::from_f64(DType::kFloat64, {static_cast<int64_t>(v.size())}, v);
}
// A batch of one sample read from `file`: its tokens and response length, and the optional fields.
Batch one_sample(const char* file, const HostArray& tokens, int64_t response_length,
                 const HostArray* logits, const HostArray* log_probs = nullptr,
                 const HostArray* loss_mask = nullptr) {
  SampleFields f;
  f.tokens = &tokens;
  f.response_length = response_length;
  f.logits = logits;
  f.loss_mask = loss_mask;
  if (log_probs != nullptr) f.per_token["log_probs"] = log_probs;
  BatchBuilder b;
  b.begin_file(file);
  b.add_sample(0, f);
  return b.finish();
}

TEST(Batch, ZeroLengthSampleIsLegalAndReported) {
  HostArray empty = ints({}), t = ints({1, 2, 3});
  SampleFields z, s;
  z.tokens = &empty;
  z.response_length = 0;
  s.tokens = &t;
  s.response_length = 1;
  BatchBuilder b;
  b.begin_file("z.json");
  b.add_sample(0, s);
  b.add_sample(1, z);
  Batch batch = b.finish();
  EXPECT_EQ(batch.num_samples(), 2);
  EXPECT_EQ(batch.kind(1), SampleKind::kEmpty);
  auto findings = batch_findings(batch);
  ASSERT_EQ(findings.size(), 1u);
  EXPECT_EQ(findings[0].kind, "zero_length_sample");
  EXPECT_EQ(findings[0].detail["sample"], 1);
}

TEST(Batch, NonFiniteValuesAreFindingsWithCoordinates) {
  HostArray t = ints({1, 2, 0, 2});  // targets 0 and 2, inside the vocabulary of 3
  HostArray logits = HostArray::from_f64(DType::kFloat32, {2, 3}, {0, 1, 2, 3, NAN, 5});
  HostArray lp = floats({-1, -INFINITY});
  const Batch batch = one_sample("n.pt", t, 2, &logits, &lp);
  auto findings = batch_findings(batch);
  ASSERT_EQ(findings.size(), 2u);
  EXPECT_EQ(findings[0].detail["field"], "logits");
  EXPECT_EQ(findings[0].detail["response_index"], 1);
  EXPECT_EQ(findings[0].detail["vocab_index"], 1);
  EXPECT_EQ(findings[1].detail["field"], "log_probs");
  EXPECT_EQ(findings[1].detail["value"], "-inf");
}

// check hands batch_findings the row statistics of its one pass over the logits, and the findings
// must be the same as from batch_findings' own scan: every non-finite value, masked or not, in
// every float dtype a dump holds.
TEST(Batch, NonFiniteFindingsFromTheRowStatisticsMatchTheFullScan) {
  for (DType dt : {DType::kBFloat16, DType::kFloat16, DType::kFloat32, DType::kFloat64}) {
    SCOPED_TRACE(dtype_name(dt));
    // One sample, prompt 1, response 5: rows 0..4 over a vocabulary of 4; row 2 masked.
    HostArray t = ints({0, 1, 2, 3, 0, 1}), m = ints({1, 1, 0, 1, 1});
    const double inf = INFINITY;
    HostArray logits = HostArray::from_f64(dt, {5, 4}, {0,   1,   2,  3,     // row 0: clean
                                                        1,   NAN, 0,  0,     // row 1: NaN, mask 1
                                                        inf, 0,   0,  1,     // row 2: +inf, masked
                                                        0,   0,   0,  -inf,  // row 3: -inf, mask 1
                                                        -1,  -2,  -3, -4});  // row 4: clean
    const Batch batch = one_sample("n.pt", t, 5, &logits, nullptr, &m);
    const std::vector<RowStats> stats = oracle_logits_stats(batch);
    ASSERT_EQ(stats.size(), 5u);
    EXPECT_FALSE(stats[0].non_finite);
    EXPECT_TRUE(stats[1].non_finite);
    EXPECT_TRUE(stats[2].non_finite);
    EXPECT_TRUE(stats[3].non_finite);
    EXPECT_FALSE(stats[4].non_finite);
    const auto full = batch_findings(batch);
    const auto from_stats = batch_findings(batch, 20, &stats);
    ASSERT_EQ(full.size(), 3u);
    ASSERT_EQ(from_stats.size(), full.size());
    const std::vector<std::pair<int, int>> where = {{1, 1}, {2, 0}, {3, 3}};
    for (std::size_t k = 0; k < full.size(); ++k) {
      EXPECT_EQ(from_stats[k].message, full[k].message);
      EXPECT_EQ(from_stats[k].detail, full[k].detail);
      EXPECT_EQ(full[k].detail["response_index"], where[k].first);
      EXPECT_EQ(full[k].detail["vocab_index"], where[k].second);
    }
    EXPECT_EQ(full[0].detail["value"], "nan");
    EXPECT_EQ(full[1].detail["value"], "inf");
    EXPECT_EQ(full[1].detail["masked"], true);
    EXPECT_EQ(full[2].detail["value"], "-inf");
  }
}

TEST(Batch, NonFiniteScanOfAnEmptyVocabularyFromRowStatistics) {
  // Logits [rows, 0]: nothing to scan, with or without the row statistics (rows of zero
  // elements once divided the scan's blocks by zero).
  HostArray t = ints({0, 1, 2}), lp = floats({-1, NAN});
  HostArray logits = HostArray::from_f64(DType::kBFloat16, {2, 0}, {});
  const Batch batch = one_sample("v0.pt", t, 2, &logits, &lp);
  const std::vector<RowStats> stats = oracle_logits_stats(batch);
  for (const auto& findings : {batch_findings(batch), batch_findings(batch, 20, &stats)}) {
    ASSERT_EQ(findings.size(), 3u);  // the NaN log-prob; targets 1 and 2 outside a vocabulary of 0
    EXPECT_EQ(findings[0].detail["field"], "log_probs");
    EXPECT_EQ(findings[1].kind, "target_out_of_vocab");
    EXPECT_EQ(findings[2].kind, "target_out_of_vocab");
  }
}

}  // namespace
}  // namespace lossguard::oracle
