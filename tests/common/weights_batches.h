// Helpers of the weights and terms tests: small batches by hand (lengths and masks), layouts from
// flags, and an exact comparison of weight vectors.
#pragma once
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/batch.h"
#include "core/layout.h"
#include "oracle/count/placement.h"

namespace lossguard::testing {

// A sample: total length T, response length R, its R mask entries (tokens are all 1).
struct HandSample {
  int64_t t, r;
  std::vector<int64_t> mask;
};

inline Batch hand_made_batch(const std::vector<HandSample>& samples,
                             const std::string& file = "test.json") {
  BatchBuilder bb(LoadNeeds{true, false, false});
  bb.begin_file(file);
  std::vector<HostArray> keep;
  keep.reserve(samples.size() * 2);
  for (std::size_t i = 0; i < samples.size(); ++i) {
    keep.push_back(
        HostArray::from_i64(DType::kInt64, {samples[i].t}, std::vector<int64_t>(samples[i].t, 1)));
    SampleFields f;
    f.tokens = &keep.back();
    f.response_length = samples[i].r;
    keep.push_back(HostArray::from_i64(DType::kInt64, {samples[i].r}, samples[i].mask));
    f.loss_mask = &keep.back();
    bb.add_sample(static_cast<int64_t>(i), f);
  }
  return bb.finish();
}

// DP x M micro-batches (contiguous placement) x CP, static.
inline StepLayout flag_layout(const Batch& b, int64_t dp, int64_t m, int64_t cp) {
  return static_layout(oracle::place_samples(b.num_samples(), dp, m, Split::kContiguous), cp, 1,
                       {});
}

inline void expect_weights(const std::vector<double>& got, const std::vector<double>& want,
                           double tol = 1e-15) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t t = 0; t < got.size(); ++t) EXPECT_NEAR(got[t], want[t], tol) << "token " << t;
}

}  // namespace lossguard::testing
