// Batch model and validation (SPEC §1), dtype conversions, findings.
#include "core/batch.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "core/errors.h"
#include "oracle/check/loss.h"
#include "oracle/count/findings.h"
#include "synth/cases.h"

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

TEST(Batch, ValidSampleBuildsPackedBatch) {
  HostArray t = ints({1, 2, 3, 4, 5}), m = ints({1, 0});
  SampleFields f;
  f.tokens = &t;
  f.response_length = 2;
  f.loss_mask = &m;
  BatchBuilder b;
  b.begin_file("a.json");
  b.add_sample(0, f);
  b.add_sample(1, f);
  Batch batch = b.finish();
  ASSERT_EQ(batch.num_samples(), 2);
  EXPECT_EQ(batch.tokens.size(), 10u);
  EXPECT_EQ(batch.num_response_tokens(), 4);
  EXPECT_EQ(batch.mask_sum(1), 1);
  EXPECT_EQ(batch.prompt_length(0), 3);
  EXPECT_EQ(batch.kind(0), SampleKind::kRl);
  EXPECT_EQ(batch.describe_sample(1), "a.json: sample 1");
}

struct BadCase {
  const char* name;
  std::function<void(SampleFields&, std::vector<HostArray>&)> mutate;
  const char* expected;
};

TEST(Batch, EveryValidationRuleNamesFileSampleFieldAndValues) {
  const std::vector<BadCase> cases = {
      {"R > T", [](SampleFields& f, auto&) { f.response_length = 9; },
       "response_length R = 9 exceeds total_length T = 5"},
      {"mask length",
       [](SampleFields& f, auto& keep) {
         keep.push_back(ints({1}));
         f.loss_mask = &keep.back();
       },
       "len(loss_mask) = 1 but response_length R = 2"},
      {"mask value",
       [](SampleFields& f, auto& keep) {
         keep.push_back(ints({1, 2}));
         f.loss_mask = &keep.back();
       },
       "loss_mask[1] = 2 (must be 0 or 1)"},
      {"mask fraction",
       [](SampleFields& f, auto& keep) {
         keep.push_back(floats({0.5, 1}));
         f.loss_mask = &keep.back();
       },
       "loss_mask[0] = 0.5"},
      {"per-token length",
       [](SampleFields& f, auto& keep) {
         keep.push_back(floats({0.5, 1, 2}));
         f.per_token["log_probs"] = &keep.back();
       },
       "len(log_probs) = 3 but response_length R = 2"},
      {"negative R", [](SampleFields& f, auto&) { f.response_length = -1; },
       "response_length = -1 is negative"},
      {"T disagrees", [](SampleFields& f, auto&) { f.total_length = 6; },
       "total_length = 6 disagrees with len(tokens) = 5"},
      {"negative T", [](SampleFields& f, auto&) { f.total_length = -2; },
       "total_length = -2 is negative"},
      {"logits rows",
       [](SampleFields& f, auto& keep) {
         keep.push_back(HostArray::zeros(DType::kFloat32, {3, 4}));
         f.logits = &keep.back();
       },
       "logits.shape[0] = 3 but response_length R = 2"},
      {"float tokens",
       [](SampleFields& f, auto& keep) {
         keep.push_back(floats({1, 2, 3, 4, 5}));
         f.tokens = &keep.back();
       },
       "field 'tokens' has dtype float64"},
      {"missing R", [](SampleFields& f, auto&) { f.response_length.reset(); },
       "field 'response_length' is missing"},
  };
  for (const auto& c : cases) {
    std::vector<HostArray> keep;
    keep.reserve(4);
    HostArray t = ints({1, 2, 3, 4, 5}), m = ints({1, 1});
    SampleFields good;
    good.tokens = &t;
    good.response_length = 2;
    good.loss_mask = &m;
    SampleFields bad = good;
    c.mutate(bad, keep);
    BatchBuilder b;
    b.begin_file("dump.json");
    b.add_sample(0, good);
    std::string msg;
    try {
      b.add_sample(7, bad);
    } catch (const InputError& e) {
      msg = e.what();
    }
    EXPECT_NE(msg.find("dump.json: sample 7: "), std::string::npos) << c.name << ": " << msg;
    EXPECT_NE(msg.find(c.expected), std::string::npos) << c.name << ": " << msg;
  }
}

TEST(Batch, PackedLengthsMustAddUp) {
  HostArray tokens = ints({1, 2, 3, 4, 5, 6}), tl = ints({3, 4}), rl = ints({1, 2});
  PackedFields f;
  f.tokens = &tokens;
  f.total_lengths = &tl;
  f.response_lengths = &rl;
  BatchBuilder b;
  b.begin_file("p.safetensors");
  try {
    b.add_packed(f);
    FAIL() << "expected an InputError";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("len(tokens) = 6 disagrees with sum(total_lengths) = 7"),
              std::string::npos)
        << e.what();
  }
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

TEST(DType, HalfAndBFloat16RoundTripEveryBitPattern) {
  // Every finite 16-bit pattern must survive float conversion and back (round to nearest even is
  // exact for representable values); NaNs stay NaN.
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const auto h = static_cast<uint16_t>(bits);
    const float fh = half_to_float(h), fb = bfloat16_to_float(h);
    if (std::isnan(fh)) {
      EXPECT_TRUE(std::isnan(half_to_float(float_to_half(fh))));
    } else {
      ASSERT_EQ(float_to_half(fh), h) << bits;
    }
    if (std::isnan(fb)) {
      EXPECT_TRUE(std::isnan(bfloat16_to_float(float_to_bfloat16(fb))));
    } else {
      ASSERT_EQ(float_to_bfloat16(fb), h) << bits;
    }
  }
  EXPECT_EQ(half_to_float(0x3c00), 1.0f);
  EXPECT_EQ(half_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(bfloat16_to_float(0x3f80), 1.0f);
  EXPECT_EQ(float_to_bfloat16(1.00390625f), 0x3f80);  // tie rounds to even
}

TEST(Gen, EveryCaseIsValidAndSeeded) {
  for (const auto& c : synth::list_cases()) {
    synth::GenOptions o;
    o.seed = 42;
    Batch a = synth::make_case(c.name, o), b = synth::make_case(c.name, o);
    EXPECT_GT(a.num_samples(), 0) << c.name;
    EXPECT_EQ(a.tokens, b.tokens) << c.name;
    EXPECT_EQ(a.loss_mask, b.loss_mask) << c.name;
  }
}

TEST(Gen, CasesHaveTheirDefiningProperty) {
  synth::GenOptions o;
  Batch zero = synth::make_case("zero-token", o);
  for (int64_t i = 0; i < zero.num_samples(); ++i) EXPECT_EQ(zero.mask_sum(i), 0);
  Batch empty = synth::make_case("empty-responses", o);
  int64_t n_empty = 0;
  for (int64_t i = 0; i < empty.num_samples(); ++i) n_empty += empty.response_lengths[i] == 0;
  EXPECT_GT(n_empty, 0);
  Batch sft = synth::make_case("sft-not-preshifted", o);
  for (int64_t i = 0; i < sft.num_samples(); ++i) {
    EXPECT_EQ(sft.response_lengths[i], sft.total_lengths[i]);
    EXPECT_EQ(sft.loss_mask[sft.response_offsets[i + 1] - 1], 1);
  }
  Batch pre = synth::make_case("sft-preshifted", o);
  for (int64_t i = 0; i < pre.num_samples(); ++i) {
    if (pre.response_lengths[i] == pre.total_lengths[i]) {
      EXPECT_EQ(pre.loss_mask[pre.response_offsets[i + 1] - 1], 0);
    }
  }
  Batch r = synth::make_case("random", o);
  ASSERT_TRUE(r.logits.has_value());
  EXPECT_EQ(r.per_token.size(), per_token_field_names().size());
}

}  // namespace
}  // namespace lossguard::oracle
