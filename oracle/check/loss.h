// The float64 oracle for per-token losses, reductions and analytic gradients (SPEC §4, §5): plain
// loops and compensated summation over the full, unsharded batch. Shares no code with trainer/ or
// kernels/.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/modes.h"
#include "oracle/count/denominators.h"
#include "oracle/math/row_math.h"

namespace lossguard::oracle {

struct OracleLoss {
  LossInput input = LossInput::kLogits;
  int64_t denominator =
      0;  // N (the global fixed count, cp = 1) for per-token / token-mean; else B or K
  double loss = 0.0;
  std::vector<double> grad;  // d loss / d input: [sum R, V] for logits, [sum R] otherwise
  int64_t grad_cols = 1;
  std::vector<double> coeff;       // c_t, with loss = sum_t c_t * l_t (0 on masked tokens)
  std::vector<double> token_loss;  // l_t
  // sum_t |c_t| * (the magnitudes l_t is computed from): |l_t|, plus 2 max|z_t| for logits (l_t is
  // logsumexp - z_y, formed by cancellation), plus rho |A| |lp - old| for ppo-clip (rho = exp(lp -
  // old)).
  double term_scale = 0.0;
  bool no_signal = false;                   // zero effective tokens: loss 0, gradient 0
  std::vector<uint8_t> near_clip_boundary;  // per row (ppo-clip only), see LossSpec::rho_rel_error
  // From logits, per response row with mask 1 (0 elsewhere): the target y, lse = logsumexp(z),
  // log_sum = lse - max z, and spread = sum_k p_k (max z - z_k) (row_math.h): what a row's gradient
  // and the tolerances derived for a candidate's arithmetic are computed from.
  std::vector<int64_t> target;
  std::vector<double> lse, log_sum, spread;
  bool grad_materialised = false;  // `grad` holds every element (else only per-token inputs')
};

// Computes loss and gradient at CP = 1 under the `fixed` policy (the truth), whatever spec.policy
// says. From logits, `with_logits_grad` false leaves `grad` empty: check compares a row's gradient
// row by row as the candidate hands it over (grad_stream.h), so the [rows, vocab] float64 gradient
// never exists. The pass over the logits runs on every core and gives back the pages of a mapped
// file as it goes.
OracleLoss oracle_loss(const Batch& batch, const LossSpec& spec, bool with_logits_grad = true,
                       const std::vector<RowStats>* logits_stats = nullptr);

// The per-row statistics of the logits (row_math.h) of every row with mask 1, and every row's
// non_finite flag: the one pass over the logits an oracle_loss from logits makes. check computes
// it once per step and hands it to every (loss, reduction) case and to batch_findings instead of
// one pass each.
std::vector<RowStats> oracle_logits_stats(const Batch& batch);

// Neumaier's compensated sum.
class CompensatedSum {
 public:
  void add(double x);
  double value() const { return sum_ + c_; }

 private:
  double sum_ = 0.0, c_ = 0.0;
};

}  // namespace lossguard::oracle
