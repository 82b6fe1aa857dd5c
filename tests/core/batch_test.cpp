// core/'s batch model on its own (SPEC §1): the validating builder, every rule naming the file, the
// sample, the field and the values, packed lengths; and the 16-bit float conversions. Links only
// lossguard_core (its findings, the oracle's, are tests/oracle/findings_test.cpp).
#include "core/batch.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/array.h"
#include "core/errors.h"

namespace lossguard {
namespace {

HostArray ints(std::vector<int64_t> v) {
  return HostArray::from_i64(DType::kInt64, {static_cast<int64_t>(v.size())}, v);
}
HostArray floats(std::vector<double> v) {
  return HostArray::from_f64(DType::kFloat64, {static_cast<int64_t>(v.size())}, v);
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

}  // namespace
}  // namespace lossguard
