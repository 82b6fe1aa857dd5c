// Check verdicts: exact denominators, the loss within its derived bound, every gradient element
// within its tolerance, masked rows exactly zero, and the kernels' device zero-token flag (SPEC §4,
// §5).
#include "oracle/check.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "oracle/denominators.h"

namespace lossguard::oracle {

namespace {

Tolerance base_tolerance(DType input, const CheckSettings& s) {
  Tolerance t = default_tolerance(input);
  if (s.rtol >= 0) t.rtol = s.rtol;
  if (s.atol >= 0) t.atol = s.atol;
  return t;
}

}  // namespace

LossSpec with_rounding_slack(LossSpec spec, DType input, const CheckSettings& s) {
  spec.rho_rel_error = std::max(base_tolerance(input, s).rtol, 4.0 * unit_roundoff(input));
  return spec;
}

CheckCase evaluate_check(const Batch& b, const LossSpec& spec, const OracleLoss& want,
                         const CandidateResult& got, DType input, const CheckSettings& s) {
  CheckCase c;
  c.tol = base_tolerance(input, s);
  int64_t terms = 0;
  for (double x : want.coeff) terms += x != 0.0;
  c.den_ok = !s.judge_denominator || got.denominator == want.denominator;
  c.loss_bound =
      loss_tolerance(want.loss, want.term_scale, terms, input,
                     input == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32, c.tol);
  c.loss_diff = std::fabs(got.loss - want.loss);
  c.loss_ok = c.loss_diff <= c.loss_bound && (!want.no_signal || got.loss == 0.0);
  const bool overridden = s.rtol >= 0;
  c.grad_tol = overridden ? c.tol : gradient_tolerance(input, spec.loss, c.tol);
  c.grad = compare_gradients(
      b, want.grad, got.grad, want.grad_cols, got.row_rank, got.row_chunk, c.grad_tol,
      spec.loss == LossKind::kPpoClip ? &want.near_clip_boundary : nullptr,
      want.input == LossInput::kLogits && !overridden ? &want.coeff : nullptr,
      unit_roundoff(input), /*atol_by_weight=*/s.atol < 0);
  // The kernels' zero-token flag, reduced on the device, must say what the oracle says.
  c.flag_ok = got.skip_flag < 0 || (got.skip_flag == 1) == want.no_signal;

  if (!c.den_ok) {
    std::vector<int64_t> zero;
    for (int64_t i = 0; i < b.num_samples(); ++i) {
      if (b.mask_sum(i) == 0) zero.push_back(i);
    }
    std::string reason;
    if (!zero.empty() && got.denominator - want.denominator == static_cast<int64_t>(zero.size())) {
      reason = fmt::format(
          ": +1 for each sample without effective tokens (policy {} counts max(m, 1)): {}",
          policy_name(spec.policy), format_index_list(zero));
    }
    c.why.push_back(fmt::format("denominator {} differs from the oracle's {}{}", got.denominator,
                                want.denominator, reason));
  }
  if (c.grad.mismatched > 0) c.why.push_back("worst gradient: " + describe(c.grad.worst));
  if (c.grad.not_compared > 0) {
    c.why.push_back(fmt::format(
        "note: {} token(s) with rho within rounding of a clip boundary: gradient not compared",
        c.grad.not_compared));
  }
  if (c.grad.masked_nonzero > 0) {
    c.why.push_back(fmt::format("{} gradient entries of masked tokens are not exactly zero",
                                c.grad.masked_nonzero));
  }
  if (want.no_signal && got.loss != 0.0) {
    c.why.push_back(fmt::format("a zero-token batch must give loss 0, got {}", got.loss));
  }
  if (!c.flag_ok) {
    c.why.push_back(
        fmt::format("the device zero-token flag says {} but the batch has {} effective tokens",
                    got.skip_flag == 1 ? "skip" : "step", want.no_signal ? "no" : "some"));
  } else if (got.skip_flag == 1) {
    c.why.push_back(
        "zero-token flag, reduced on the device and read once: skip (no optimizer.step(), no LR "
        "step)");
  }
  return c;
}

}  // namespace lossguard::oracle
