// Picks the oracle's row loops for the best instruction set this CPU has (row_math.h).
#include "oracle/math/row_math.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace lossguard::oracle {

#define LOSSGUARD_ROW_MATH_DECLARE(isa)                                                        \
  namespace isa {                                                                              \
  RowStats logits_row_stats(const void* z, DType dtype, int64_t v);                            \
  RowComparison compare_logits_row(const void* z, const void* got, DType dtype, int64_t begin, \
                                   int64_t end, double c, double lse,                          \
                                   const ElementBoundRow* bounds, int num_bounds,              \
                                   const LogitsScreen* screen);                                \
  RowComparison compare_zero_row(const double* got, int64_t n, double tol, int64_t* nonzero);  \
  void row_to_f64(const void* src, DType dtype, int64_t n, double* out);                       \
  bool row_is_zero(const void* src, DType dtype, int64_t n);                                   \
  void exp_screen_row(const float* x, int64_t n, float* out);                                  \
  }
LOSSGUARD_ROW_MATH_DECLARE(generic)
#if defined(__x86_64__) && defined(LOSSGUARD_ORACLE_X86)
LOSSGUARD_ROW_MATH_DECLARE(avx2)
LOSSGUARD_ROW_MATH_DECLARE(avx512)
#endif

namespace {

struct RowMath {
  const char* name;
  RowStats (*stats)(const void*, DType, int64_t);
  RowComparison (*compare)(const void*, const void*, DType, int64_t, int64_t, double, double,
                           const ElementBoundRow*, int, const LogitsScreen*);
  RowComparison (*zero)(const double*, int64_t, double, int64_t*);
  void (*to_f64)(const void*, DType, int64_t, double*);
  bool (*is_zero)(const void*, DType, int64_t);
  void (*exp_screen_row)(const float*, int64_t, float*);
};

#define LOSSGUARD_ROW_MATH_TABLE(isa)                                                             \
  RowMath {                                                                                       \
#isa, isa::logits_row_stats, isa::compare_logits_row, isa::compare_zero_row, isa::row_to_f64, \
        isa::row_is_zero, isa::exp_screen_row                                                     \
  }

RowMath pick() {
#if defined(__x86_64__) && defined(LOSSGUARD_ORACLE_X86)
  __builtin_cpu_init();
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
  if (v4) return LOSSGUARD_ROW_MATH_TABLE(avx512);
  if (v3) return LOSSGUARD_ROW_MATH_TABLE(avx2);
#endif
  return LOSSGUARD_ROW_MATH_TABLE(generic);
}

const RowMath& row_math() {
  static const RowMath chosen = pick();
  return chosen;
}

}  // namespace

RowStats logits_row_stats(const void* z, DType dtype, int64_t v) {
  return row_math().stats(z, dtype, v);
}

RowComparison compare_logits_row(const void* z, const void* got, DType dtype, int64_t begin,
                                 int64_t end, double c, double lse, const ElementBoundRow* bounds,
                                 int num_bounds, const LogitsScreen* screen) {
  return row_math().compare(z, got, dtype, begin, end, c, lse, bounds, num_bounds, screen);
}

RowComparison compare_zero_row(const double* got, int64_t n, double tol, int64_t* nonzero) {
  return row_math().zero(got, n, tol, nonzero);
}

void row_to_f64(const void* src, DType dtype, int64_t n, double* out) {
  row_math().to_f64(src, dtype, n, out);
}

bool row_is_zero(const void* src, DType dtype, int64_t n) {
  return row_math().is_zero(src, dtype, n);
}

void exp_screen_row(const float* x, int64_t n, float* out) { row_math().exp_screen_row(x, n, out); }

const char* row_math_isa() { return row_math().name; }

LogitsScreen logits_screen(double c, double lse, const ElementBoundRow* bounds, int num_bounds,
                           double max_abs, double max_rel) {
  // Everything in units of |c|: the screen compares g' = fl(got * fl(1/c)) with p_f = e^(-lp_f),
  // lp_f = fl(fl(lse) - z) (z and got are 16-bit values, exact in float32), against the quick
  // lower bound of the float64 comparison, L = atol + |c| p (per_q + beta lp) with each term the
  // smallest of the bounds' (compare_row_direct's screen; every exact bound is at least L).
  // u = 2^-24, float32's unit roundoff; the float64 path's own roundings (~1e-15) vanish in the
  // margins of 2^-18 below.
  //  - |lp_f - lp| <= |lse| u + lp_f u (+ u, the second-order terms) =: delta, lp = lse - z.
  //  - p_f = e^(-lp_f) (1 + eps), |eps| <= 2^-20 (exp_screen, tested at 2^-22); with delta + eps
  //    under 1%: |p_f - p| <= 1.03 (delta + eps) p_f =: D_p p_f.
  //  - |g' - got/c| <= |got/c| 2^-22.8, and |g'| <= p_f + |g' - p_f|; diff_f = fl|g' - p_f| is
  //    |g' - p_f| to u. So the true |got - c p| / |c| is at most
  //      diff_f (1 + 2^-21.5) + p_f (D_p + 2^-22.8),
  //    and ub = diff_f k + p_f (d0 + d1 lp_f), with k = 1 + 2^-19, d0 = 1.1 ((|lse| + 1) u +
  //    2^-20) + 2^-21, d1 = 1.1 u, exceeds it after ub's own three roundings.
  //  - lw = p_f (1 - d) <= p, so ub <= max_rel' lw bounds the relative difference by max_rel.
  //  - The bound's terms shrunk by 2^-18 (and per_q by beta's share of delta, beta lp_f <=
  //    beta (lp + delta)), so that the float32 bound, after its roundings, stays under L / |c|.
  //  - An infinite ub (got / c past float's range) never passes, whatever the bound's terms became
  //    in float (an atol / |c| past float's range is +inf).
  //  - Flush-to-zero and denormals-are-zero, if a thread runs with them, move a value by at most
  //    2^-126 (2^-126 / |c| for got / c): under p_f 2^-22 wherever p >= 2^-100 max(1, 1/|c|),
  //    which lp_max keeps (and 64 keeps exp_screen's argument in range).
  LogitsScreen s;
  const double ac = std::fabs(c);
  if (num_bounds < 1 || !std::isfinite(lse) || std::fabs(lse) > 700.0 || !std::isfinite(c) ||
      !(ac >= 0x1p-60 && ac <= 0x1p60)) {
    return s;
  }
  const ElementBoundRow& b0 = bounds[0];
  const ElementBoundRow& b1 = num_bounds > 1 ? bounds[1] : bounds[0];
  const double atol = std::fmin(b0.atol, b1.atol);
  const double per_q = std::fmin(b0.rtol, b1.rtol) + std::fmin(b0.alpha, b1.alpha);
  const double beta = std::fmin(b0.beta, b1.beta);
  constexpr double u = 0x1p-24, shrink = 1.0 - 0x1p-18;
  const double per_q_s = per_q * shrink - beta * (std::fabs(lse) + 2.0) * 2.0 * u;
  const double d0 = 1.1 * ((std::fabs(lse) + 1.0) * u + 0x1p-20) + 0x1p-21;
  const double lp_max = std::fmin(64.0, 100.0 * std::log(2.0) - std::fmax(0.0, -std::log(ac)));
  // A screen that could certify nothing (its slack over the bound's relative part) stays off.
  if (!(atol >= 0.0 && beta >= 0.0 && per_q_s > 2.0 * d0) || lp_max <= 0.0) return s;
  s.on = true;
  s.lse = static_cast<float>(lse);
  s.inv_c = static_cast<float>(1.0 / c);
  s.d0 = static_cast<float>(d0);
  s.d1 = static_cast<float>(1.1 * u);
  s.k = static_cast<float>(1.0 + 0x1p-19);
  s.atol = static_cast<float>(atol / ac * shrink);
  s.per_q = static_cast<float>(per_q_s);
  s.beta = static_cast<float>(beta * shrink);
  s.lp_max = static_cast<float>(lp_max);
  // lp >= 0 exactly (lse >= max z); lp_f falls below 0 by at most delta (|lse| u for the largest
  // logit), and where it does, beta lp_f still stays above beta (lp - delta): per_q_s covers it.
  s.lp_min = static_cast<float>(-(std::fabs(lse) + 1.0) * 2.0 * u);
  s.max_abs = static_cast<float>(max_abs / ac * shrink);
  s.max_rel = static_cast<float>(max_rel * shrink);
  return s;
}

namespace {

std::vector<double> make_exp_table(DType dtype) {
  std::vector<double> t(65536);
  HostArray one;
  one.dtype = dtype;
  one.shape = {1};
  for (uint32_t bits = 0; bits < 65536; ++bits) {
    const auto b16 = static_cast<uint16_t>(bits);
    one.data = reinterpret_cast<const std::byte*>(&b16);
    const double x = one.get_f64(0);
    t[bits] = std::isfinite(x) && std::fabs(x) <= 700.0 ? std::exp(x)
                                                        : std::numeric_limits<double>::quiet_NaN();
  }
  return t;
}

}  // namespace

const double* exp_table_16(DType dtype) {
  if (dtype == DType::kBFloat16) {
    static const std::vector<double> t = make_exp_table(DType::kBFloat16);
    return t.data();
  }
  if (dtype == DType::kFloat16) {
    static const std::vector<double> t = make_exp_table(DType::kFloat16);
    return t.data();
  }
  return nullptr;
}

}  // namespace lossguard::oracle
