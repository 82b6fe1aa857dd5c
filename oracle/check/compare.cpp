// Tolerances and comparison (SPEC §5).
#include "oracle/check/compare.h"

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

namespace {
// 1.6e-2, 1e-5: a tolerance as it is written in PyTorch's table.
std::string short_exponent(double x) {
  const int e = static_cast<int>(std::floor(std::log10(x) + 1e-9));
  const double mantissa = x / std::pow(10.0, e);
  return std::fabs(mantissa - std::round(mantissa)) < 1e-9
             ? fmt::format("{}e{}", static_cast<int>(std::round(mantissa)), e)
             : fmt::format("{:.2g}e{}", mantissa, e);
}
}  // namespace

std::string default_tolerances_text() {
  std::string s;
  const std::pair<const char*, DType> dtypes[] = {{"fp16", DType::kFloat16},
                                                  {"bf16", DType::kBFloat16},
                                                  {"fp32", DType::kFloat32},
                                                  {"fp64", DType::kFloat64}};
  for (const auto& [name, d] : dtypes) {
    const Tolerance t = default_tolerance(d);
    s += fmt::format("{}{} {}/{}", s.empty() ? "" : ", ", name, short_exponent(t.rtol),
                     short_exponent(t.atol));
  }
  return s;
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
// makes it wider. tests/cli/check_test.cpp covers both.
double loss_tolerance(double want, double term_scale, int64_t n, DType /*dtype*/, DType accumulate,
                      Tolerance t) {
  const double u = accumulate == DType::kFloat64 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
  return t.atol + t.rtol * std::max(std::fabs(want), term_scale) +
         static_cast<double>(std::max<int64_t>(n - 1, 0)) * u * term_scale;
}

std::string describe(const GradLocation& l) {
  return fmt::format("sample {}, response index {}{}, CP rank {} chunk {}: got {:.9g}, want {:.9g}",
                     l.sample, l.response_index,
                     l.vocab_index >= 0 ? fmt::format(", vocab index {}", l.vocab_index) : "",
                     l.cp_rank, l.chunk, l.got, l.want);
}

nlohmann::ordered_json location_json(const GradLocation& l) {
  return {{"sample", l.sample},
          {"response_index", l.response_index},
          {"vocab_index", l.vocab_index < 0 ? nlohmann::ordered_json(nullptr)
                                            : nlohmann::ordered_json(l.vocab_index)},
          {"cp_rank", l.cp_rank},
          {"chunk", l.chunk},
          {"got", l.got},
          {"want", l.want},
          {"abs_diff", l.abs_diff},
          {"rel_diff", std::isfinite(l.rel_diff) ? nlohmann::ordered_json(l.rel_diff)
                                                 : nlohmann::ordered_json(nullptr)}};
}

}  // namespace lossguard::oracle
