// The float64 oracle for per-token losses, reductions and analytic gradients (SPEC §4, §5): plain loops
// and compensated summation over the full, unsharded batch. Shares no code with trainer/ or kernels/.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "oracle/batch.h"
#include "oracle/denominators.h"

namespace lossguard::oracle {

enum class LossKind { kNll, kPpoClip, kGiven };
enum class Reduction { kPerToken, kSampleMean, kTokenMean, kSeqMeanTokenSum, kSeqMeanTokenMean, kSeqMeanTokenSumNorm };
enum class LossInput { kLogits, kLogProbs, kTokenLoss };  // what the gradient is taken with respect to

const char* loss_kind_name(LossKind k);
bool parse_loss_kind(const std::string& s, LossKind* out);
const char* reduction_name(Reduction r);
bool parse_reduction(const std::string& s, Reduction* out);
const std::vector<Reduction>& all_reductions();
const char* loss_input_name(LossInput i);

struct LossSpec {
  LossKind loss = LossKind::kNll;
  Reduction reduce = Reduction::kPerToken;
  Policy policy = Policy::kFixed;
  double eps_low = 0.2, eps_high = 0.2;
  double l_norm = 0.0;  // seq-mean-token-sum-norm; 0: the batch's maximum response length
  // ppo-clip's gradient jumps where rho crosses 1 - eps_low or 1 + eps_high. A candidate computing rho in a
  // low-precision dtype (inputs exact in the dtype, so relative error up to this much times 1 + |lp - old|:
  // one rounding of the difference, one of exp) may land on the other
  // side; such tokens are flagged `near_clip_boundary` and their gradient is not compared.
  double rho_rel_error = 0.0;
};

// Which input the loss reads: nll uses logits when the batch has them, else log_probs. Throws InputError
// naming the missing fields.
LossInput loss_input(const Batch& batch, LossKind loss);

struct OracleLoss {
  LossInput input = LossInput::kLogits;
  int64_t denominator = 0;     // N (the global fixed count, cp = 1) for per-token / token-mean; else B or K
  double loss = 0.0;
  std::vector<double> grad;    // d loss / d input: [sum R, V] for logits, [sum R] otherwise
  int64_t grad_cols = 1;
  std::vector<double> coeff;   // c_t, with loss = sum_t c_t * l_t (0 on masked tokens)
  std::vector<double> token_loss;  // l_t
  // sum_t |c_t| * (the magnitudes l_t is computed from): |l_t|, plus 2 max|z_t| for logits (l_t is
  // logsumexp - z_y, formed by cancellation), plus rho |A| |lp - old| for ppo-clip (rho = exp(lp - old)).
  double term_scale = 0.0;
  bool no_signal = false;      // zero effective tokens: loss 0, gradient 0
  std::vector<uint8_t> near_clip_boundary;  // per row (ppo-clip only), see LossSpec::rho_rel_error
};

// Computes loss and gradient at CP = 1 under the `fixed` policy (the truth), whatever spec.policy says.
OracleLoss oracle_loss(const Batch& batch, const LossSpec& spec);

// Neumaier's compensated sum.
class CompensatedSum {
 public:
  void add(double x);
  double value() const { return sum_ + c_; }

 private:
  double sum_ = 0.0, c_ = 0.0;
};

}  // namespace lossguard::oracle
