// synth/: the seeded synthetic batches `gen` writes and the tests use: every case valid and the
// same for the same seed, each with the property its name promises.
#include <gtest/gtest.h>

#include <cstdint>

#include "core/batch.h"
#include "synth/cases.h"

namespace lossguard {
namespace {

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
}  // namespace lossguard
