// Tolerances and comparison (SPEC §5).
#include "oracle/compare.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace lossguard::oracle {

Tolerance default_tolerance(DType d) {
  switch (d) {
    case DType::kFloat16:
      return {1e-3, 1e-5};
    case DType::kBFloat16:
      return {1.6e-2, 1e-5};
    case DType::kFloat32:
      return {1.3e-6, 1e-5};
    default:
      return {1e-7, 1e-7};
  }
}

// A gradient element is a product of quantities each rounded once in the working dtype: for
// ppo-clip -c * rho * A with rho = exp(lp - old) (the difference, the exp, two products, the
// coefficient: 5 roundings), for nll from logits c * (softmax - onehot) (exp, sum, division,
// product: 4), otherwise 2. Each rounding contributes at most u (2^-11 fp16, 2^-8 bf16, 2^-24 fp32,
// 2^-53 fp64) relative error, so k * u bounds the element's relative error. PyTorch's fp16 default
// (1e-3, about 2u) is tighter than that for ppo-clip (5u = 2.4e-3); bf16, fp32 and fp64 defaults
// already exceed k * u.
double unit_roundoff(DType dtype) {
  return dtype == DType::kFloat16    ? std::ldexp(1.0, -11)
         : dtype == DType::kBFloat16 ? std::ldexp(1.0, -8)
         : dtype == DType::kFloat32  ? std::ldexp(1.0, -24)
                                     : std::ldexp(1.0, -53);
}

Tolerance gradient_tolerance(DType dtype, LossKind loss, Tolerance t) {
  const double u = unit_roundoff(dtype);
  // The roundings in each loss's gradient chain (see the header).
  const int k = loss == LossKind::kPpoClip ? 5 : loss == LossKind::kNll ? 4 : 2;
  t.rtol = std::max(t.rtol, k * u);
  return t;
}

// Why the loss value gets a wider bound than one element: the candidate forms each term c_t * l_t
// in the working dtype, where the per-dtype rtol bounds that term's error relative to the
// magnitudes it is computed from (`term_scale`, see OracleLoss: |c_t l_t|, plus |c_t| * 2 max|z_t|
// for logits, since l_t = logsumexp(z_t) - z_t[y] is formed by cancellation), then sums n terms in
// `accumulate` precision, which adds at most (n - 1) * u * sum|terms| (the textbook bound for
// recursive summation, u the unit round-off: 2^-24 for float32 accumulation, which torch uses for
// half types, 2^-53 for float64). For terms of one sign term_scale = |want| and the bound is the
// element tolerance plus (n - 1) u |want|; only cancellation (ppo-clip advantages of both signs)
// makes it wider. tests/check_test.cpp covers both.
double loss_tolerance(double want, double term_scale, int64_t n, DType /*dtype*/, DType accumulate,
                      Tolerance t) {
  const double u = accumulate == DType::kFloat64 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
  return t.atol + t.rtol * std::max(std::fabs(want), term_scale) +
         static_cast<double>(std::max<int64_t>(n - 1, 0)) * u * term_scale;
}

GradComparison compare_gradients(const Batch& b, const std::vector<double>& want,
                                 const HostArray& got, int64_t cols,
                                 const std::vector<int32_t>& row_rank,
                                 const std::vector<int8_t>& row_chunk, Tolerance t,
                                 const std::vector<uint8_t>* skip_rows,
                                 const std::vector<double>* logits_coeff, double u,
                                 bool atol_by_weight) {
  GradComparison c;
  const int64_t rows = b.num_response_tokens();
  // Half the smallest positive subnormal of the gradient's dtype.
  const double subnormal_floor = got.dtype == DType::kFloat16    ? std::ldexp(1.0, -25)
                                 : got.dtype == DType::kBFloat16 ? std::ldexp(1.0, -134)
                                 : got.dtype == DType::kFloat32  ? std::ldexp(1.0, -150)
                                                                 : std::ldexp(1.0, -1075);
  int64_t sample = 0;
  for (int64_t row = 0; row < rows; ++row) {
    while (b.response_offsets[sample + 1] <= row) ++sample;
    const bool masked = b.loss_mask[row] == 0;
    if (skip_rows != nullptr && (*skip_rows)[row]) {
      ++c.not_compared;
      continue;
    }
    for (int64_t k = 0; k < cols; ++k) {
      const int64_t flat = row * cols + k;
      const double g = got.get_f64(flat), w = want[flat];
      ++c.checked;
      const double abs_diff = std::fabs(g - w);
      const double rel_diff =
          w != 0.0 ? abs_diff / std::fabs(w) : (abs_diff == 0.0 ? 0.0 : INFINITY);
      double extra = 0.0;
      double atol = t.atol;
      if (logits_coeff != nullptr && atol_by_weight) {
        // PyTorch's atol (1e-5) is for values of order 1; a logits gradient element is c (p -
        // onehot) with c the token's weight (1/N: often 1e-4 or less), so 1e-5 hid errors of
        // several percent. Derived instead: the element's absolute error beyond its relative
        // bound is at most |c| u (p rounded to 0 in the working dtype, p <= u) plus half the
        // output dtype's smallest subnormal (c p rounded to 0 when written).
        atol = std::fabs((*logits_coeff)[row]) * u + subnormal_floor;
      }
      if (logits_coeff != nullptr && (*logits_coeff)[row] != 0.0) {
        // Autograd's log_softmax backward forms p = exp(log p) from log p rounded to the dtype
        // (relative error u |log p| in p) and rounds p itself (absolute error u p): the element c
        // (p - onehot) carries |c| u p (2 + |log p|) beyond one rounding of its value. For the
        // target, p - 1 cancels (p = 0.95 in bf16 is off by up to 0.002, 4% of 1 - p); for tiny p
        // the |log p| term dominates.
        const double c = (*logits_coeff)[row];
        const bool target = w / c < 0.0;
        const double prob = target ? 1.0 + w / c : w / c;
        if (prob > 0.0) extra = std::fabs(c) * u * prob * (2.0 + std::fabs(std::log(prob)));
      }
      const double rtol = t.rtol;
      const bool bad =
          !(abs_diff <= atol + extra + rtol * std::fabs(w));  // NaN counts as a mismatch
      if (masked && g != 0.0) ++c.masked_nonzero;
      if (bad) ++c.mismatched;
      auto locate = [&] {
        return GradLocation{sample,
                            row - b.response_offsets[sample],
                            cols > 1 ? k : -1,
                            row_rank.empty() ? -1 : row_rank[row],
                            row_chunk.empty() ? -1 : row_chunk[row],
                            g,
                            w,
                            abs_diff,
                            rel_diff};
      };
      if (abs_diff > c.max_abs_diff || (std::isnan(abs_diff) && !std::isnan(c.max_abs_diff))) {
        c.max_abs_diff = abs_diff;
        c.worst = locate();
      }
      if (rel_diff > c.max_rel_diff && std::isfinite(rel_diff)) {
        c.max_rel_diff = rel_diff;
        c.worst_relative = locate();
      }
    }
  }
  return c;
}

std::string describe(const GradLocation& l) {
  return fmt::format("sample {}, response index {}{}, CP rank {} chunk {}: got {:.9g}, want {:.9g}",
                     l.sample, l.response_index,
                     l.vocab_index >= 0 ? fmt::format(", vocab index {}", l.vocab_index) : "",
                     l.cp_rank, l.chunk, l.got, l.want);
}

}  // namespace lossguard::oracle
