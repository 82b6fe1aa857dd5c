// Float64 oracle. Every reduction of SPEC §4 is linear in the per-token losses, loss = sum_t c_t *
// l_t, so the gradient w.r.t. any input is c_t times the per-token derivative.
#include "oracle/check/loss.h"

#include <algorithm>
#include <cmath>
#include <thread>

#include "core/errors.h"
#include "oracle/math/exp64.h"
#include "oracle/math/row_math.h"
#include "oracle/weights/weights.h"

namespace lossguard::oracle {

void CompensatedSum::add(double x) {
  const double t = sum_ + x;
  if (std::fabs(sum_) >= std::fabs(x)) {
    c_ += (sum_ - t) + x;
  } else {
    c_ += (x - t) + sum_;
  }
  sum_ = t;
}

namespace {

// The logits' per-row statistics (max, max |z|, sum of exp(z - max), spread) of every row with
// mask 1, and of every masked row whether it holds a NaN or an infinity (a bit test), rows split
// over the cores in runs of 16; a mapped file's pages are given back per run.
std::vector<RowStats> logits_stats(const Batch& b, int64_t v) {
  const int64_t rows = b.num_response_tokens();
  std::vector<RowStats> stats(static_cast<std::size_t>(rows));
  constexpr int64_t kRun = 16;
  const int64_t runs = (rows + kRun - 1) / kRun;
  const int64_t threads = std::max<int64_t>(
      1, std::min<int64_t>({runs, static_cast<int64_t>(std::thread::hardware_concurrency()), 16}));
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(threads));
  for (int64_t w = 0; w < threads; ++w) {
    pool.emplace_back([&, w] {
      try {
        for (int64_t run = w; run < runs; run += threads) {
          const int64_t r0 = run * kRun, r1 = std::min(rows, r0 + kRun);
          for (int64_t row = r0; row < r1; ++row) {
            if (!b.loss_mask[row]) {
              stats[static_cast<std::size_t>(row)].non_finite =
                  b.logits->any_non_finite(row * v, (row + 1) * v);
              continue;
            }
            stats[static_cast<std::size_t>(row)] =
                logits_row_stats(b.logits->data + static_cast<std::size_t>(row * v) *
                                                      dtype_size_bytes(b.logits->dtype),
                                 b.logits->dtype, v);
          }
          b.logits->drop_pages(r0 * v, r1 * v);
        }
      } catch (...) {
        errors[static_cast<std::size_t>(w)] = std::current_exception();
      }
    });
  }
  for (auto& t : pool) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return stats;
}

}  // namespace

namespace {

// c (softmax(z) - onehot(y)) of a row of logits, from the oracle's lse.
void logits_grad_row(const Batch& b, const OracleLoss& o, int64_t row, double* out) {
  const int64_t v = o.grad_cols;
  const double c = o.coeff[row];
  if (c == 0.0 || !b.loss_mask[row]) {
    std::fill(out, out + v, 0.0);
    return;
  }
  b.logits->copy_f64(row * v, v, out);
  const double lse = o.lse[row];
  for (int64_t k = 0; k < v; ++k) out[k] = c * exp_nonpositive(out[k] - lse);
  const int64_t y = o.target[row];
  out[y] = c * std::expm1(b.logits->get_f64(row * v + y) - lse);  // c (p_y - 1), no cancellation
}

}  // namespace

std::vector<RowStats> oracle_logits_stats(const Batch& b) {
  if (!b.logits) return {};
  return logits_stats(b, b.vocab_size());
}

// Long: SPEC §4's definition written out once in float64 — per-sample sums, each token's
// coefficient, the loss and its gradient — so it reads against the table it implements.
OracleLoss oracle_loss(const Batch& b, const LossSpec& spec, bool with_logits_grad,
                       const std::vector<RowStats>* cached) {
  OracleLoss o;
  o.input = loss_input(b, spec.loss);
  const int64_t rows = b.num_response_tokens();
  const int64_t v = o.input == LossInput::kLogits ? b.vocab_size() : 1;
  o.grad_cols = v;
  o.coeff.assign(static_cast<std::size_t>(rows), 0.0);
  o.token_loss.assign(static_cast<std::size_t>(rows), 0.0);
  o.near_clip_boundary.assign(static_cast<std::size_t>(rows), 0);
  const bool logits = o.input == LossInput::kLogits;
  if (logits) {
    o.target.assign(static_cast<std::size_t>(rows), 0);
    o.lse.assign(static_cast<std::size_t>(rows), 0.0);
    o.log_sum.assign(static_cast<std::size_t>(rows), 0.0);
    o.spread.assign(static_cast<std::size_t>(rows), 0.0);
  }
  o.grad_materialised = !logits || with_logits_grad;
  if (o.grad_materialised) o.grad.assign(static_cast<std::size_t>(rows * v), 0.0);

  // Per-sample mask sums, and the reduction's coefficient for each token (SPEC §4 table).
  const int64_t s = b.num_samples();
  std::vector<int64_t> m(static_cast<std::size_t>(s));
  int64_t n_tokens = 0, k_nonempty = 0, max_r = 0;
  for (int64_t i = 0; i < s; ++i) {
    m[i] = b.mask_sum(i);
    n_tokens += m[i];
    k_nonempty += m[i] > 0;
    max_r = std::max(max_r, b.response_lengths[i]);
  }
  const double l_norm =
      spec.l_norm > 0 ? spec.l_norm : static_cast<double>(std::max<int64_t>(max_r, 1));
  switch (spec.reduce) {
    case Reduction::kPerToken:
    case Reduction::kTokenMean:
      o.denominator = n_tokens;
      break;
    case Reduction::kSampleMean:
    case Reduction::kSeqMeanTokenSum:
      o.denominator = s;
      break;
    case Reduction::kSeqMeanTokenMean:
      o.denominator = k_nonempty;
      break;
    case Reduction::kSeqMeanTokenSumNorm:  // B·L_norm, B the global batch size in samples
      o.denominator =
          std::llround(static_cast<double>(spec.global_batch_size > 0 ? spec.global_batch_size
                                                                      : std::max<int64_t>(s, 1)) *
                       l_norm);
      break;
  }
  o.no_signal = n_tokens == 0;

  // The objective's weight of each token (SPEC §9): loss = sum_t w*_t · l_t.
  const std::vector<double> weight =
      true_weights(b, spec.reduce, {spec.global_batch_size, spec.l_norm});
  std::vector<RowStats> own;
  if (logits && (cached == nullptr || cached->size() != static_cast<std::size_t>(rows)))
    own = logits_stats(b, v);
  const std::vector<RowStats>& stats = logits && own.empty() && cached != nullptr ? *cached : own;
  CompensatedSum loss, magnitude;
  for (int64_t i = 0; i < s; ++i) {
    const int64_t p = b.prompt_length(i);
    for (int64_t j = 0; j < b.response_lengths[i]; ++j) {
      const int64_t row = b.response_offsets[i] + j;
      if (!b.loss_mask[row]) continue;
      const double c = weight[row];
      // Per-token loss and its derivative w.r.t. the input.
      double l = 0.0, scale = 0.0;
      if (o.input == LossInput::kLogits) {
        // The target (SPEC §1, §4): RL row j predicts response token j, tokens[P + j]; an SFT
        // sample's row j is the logit at position j, predicting tokens[j + 1], and its last row
        // has no next token: Relax's dummy label 0.
        const int64_t* sample_tokens = b.tokens.data() + b.token_offsets[i];
        const int64_t y = p > 0                        ? sample_tokens[p + j]
                          : j + 1 < b.total_lengths[i] ? sample_tokens[j + 1]
                                                       : 0;
        if (y < 0 || y >= v)
          throw_input_error("{}: response token {} = {} is outside the vocabulary [0, {})",
                            b.describe_sample(i), j, y, v);
        const RowStats& st = stats[static_cast<std::size_t>(row)];
        const double lse = st.max + std::log(st.sum);
        l = lse - b.logits->get_f64(row * v + y);
        scale = 2.0 * st.max_abs;
        o.target[row] = y;
        o.lse[row] = lse;
        o.log_sum[row] = std::log(st.sum);
        o.spread[row] = st.spread;
        o.coeff[row] = c;
        if (o.grad_materialised) logits_grad_row(b, o, row, o.grad.data() + row * v);
      } else if (spec.loss == LossKind::kNll) {
        l = -b.per_token.at("log_probs").get_f64(row);
        o.grad[row] = -c;
      } else if (spec.loss == LossKind::kPpoClip) {
        const double lp = b.per_token.at("log_probs").get_f64(row);
        const double old = b.per_token.at("old_log_probs").get_f64(row);
        const double a = b.per_token.at("advantages").get_f64(row);
        const double rho = std::exp(lp - old);
        const double clipped = std::clamp(rho, 1.0 - spec.eps_low, 1.0 + spec.eps_high);
        const double unclipped_term = -rho * a, clipped_term = -clipped * a;
        l = std::max(unclipped_term, clipped_term);
        scale = rho * std::fabs(a) * std::fabs(lp - old);
        const double slack = spec.rho_rel_error * rho * (1.0 + std::fabs(lp - old));
        if (std::fabs(rho - (1.0 - spec.eps_low)) <= slack ||
            std::fabs(rho - (1.0 + spec.eps_high)) <= slack) {
          o.near_clip_boundary[row] = 1;
        }
        const bool inside = rho >= 1.0 - spec.eps_low && rho <= 1.0 + spec.eps_high;
        o.grad[row] = (unclipped_term >= clipped_term || inside) ? c * (-rho * a) : 0.0;
      } else {
        l = b.per_token.at("token_loss").get_f64(row);
        o.grad[row] = c;
      }
      o.coeff[row] = c;
      o.token_loss[row] = l;
      loss.add(c * l);
      magnitude.add(std::fabs(c) * (std::fabs(l) + scale));
    }
  }
  o.loss = loss.value();
  o.term_scale = magnitude.value();
  return o;
}

}  // namespace lossguard::oracle
