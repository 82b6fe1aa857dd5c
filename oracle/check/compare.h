// Comparison of a candidate with the oracle (SPEC §5): per-dtype tolerances, the loss-value bound
// for a sum of many terms, and element-wise gradient comparison. Mismatches are data: counted and
// located.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/array.h"
#include "core/batch.h"
#include "core/modes.h"

namespace lossguard::oracle {

struct Tolerance {
  double rtol = 0.0, atol = 0.0;
};
// PyTorch assert_close defaults: fp16 (1e-3, 1e-5), bf16 (1.6e-2, 1e-5), fp32 (1.3e-6, 1e-5), fp64
// (1e-7, 1e-7).
Tolerance default_tolerance(DType dtype);
// The table above as help text: "fp16 1e-3/1e-5, bf16 1.6e-2/1e-5, fp32 1.3e-6/1e-5, fp64
// 1e-7/1e-7".
std::string default_tolerances_text();
inline bool within(double got, double want, double atol, double rtol) {
  const double d = got > want ? got - want : want - got;
  return d <= atol + rtol * (want < 0 ? -want : want);
}

// The element tolerance for gradients of `loss`: the dtype default, widened to k roundings of the
// dtype where the gradient chain has k of them (see compare.cpp); this only changes fp16.
Tolerance gradient_tolerance(DType dtype, LossKind loss, Tolerance t);

// Allowed |got - want| for a loss summed from `num_terms` terms whose magnitudes add up to
// `term_scale`, computed in `dtype` and accumulated in `accumulate` (see the derivation in
// compare.cpp).
double loss_tolerance(double want, double term_scale, int64_t num_terms, DType dtype,
                      DType accumulate, Tolerance t);

struct GradLocation {
  int64_t sample = -1, response_index = -1, vocab_index = -1, cp_rank = -1, chunk = -1;
  double got = 0.0, want = 0.0, abs_diff = 0.0, rel_diff = 0.0;
};

struct GradComparison {
  int64_t checked = 0;
  int64_t mismatched = 0;
  int64_t masked_nonzero = 0;  // gradient entries of masked rows that are not exactly zero
  int64_t not_compared = 0;    // rows skipped: rho within rounding of a ppo-clip boundary
  double max_abs_diff = 0.0, max_rel_diff = 0.0;
  GradLocation worst;  // the greatest absolute difference
  GradLocation worst_relative;
  bool ok() const { return mismatched == 0 && masked_nonzero == 0; }
};

// "sample 3, response index 2, vocab index 7, CP rank 1 chunk 0: got ..., want ..."
std::string describe(const GradLocation& location);
// As SPEC §8's JSON: vocab_index null when none, rel_diff null when infinite.
nlohmann::ordered_json location_json(const GradLocation& location);

// The unit round-off of round to nearest in a dtype, 2^-p for p significand bits: 2^-11 fp16,
// 2^-8 bf16, 2^-24 fp32, 2^-53 fp64 (|fl(x) - x| <= u |x| for normal x).
double unit_roundoff(DType dtype);

}  // namespace lossguard::oracle
