// The oracle's per-row float64 loops over a vocabulary row: the logsumexp statistics of a row of
// logits, and the comparison of a candidate's gradient row with c (softmax - onehot). Built once
// per x86 instruction set (row_math_{generic,avx2,avx512}.cpp from row_math_body.h) and picked at
// run time, so that exp_nonpositive (exp64.h) runs 4 or 8 lanes wide: over a 150k vocabulary these
// loops are most of `check`'s time. Plain float64 arithmetic; nothing from kernels/.
#pragma once
#include <cstdint>

#include "core/array.h"

namespace lossguard::oracle {

struct RowStats {
  double max = 0.0;      // max_k z_k (-inf for an empty row; NaN is skipped here, caught by sum)
  double max_abs = 0.0;  // max_k |z_k|
  double sum = 0.0;      // sum_k exp(z_k - max)  (NaN if any z_k is NaN or +inf)
  // sum_k p_k (max - z_k), p = softmax(z): how far below the maximum the softmax's mass lies. A
  // candidate that forms z_k - max in float carries a relative error u |max - z_k| into term k of
  // its sum, so u * spread bounds the relative error that adds to the sum.
  double spread = 0.0;
  // A NaN or an infinity in the row (sum or max_abs not finite), so that the one pass over the
  // logits also tells which rows batch_findings must look at element by element.
  bool non_finite = false;
};
// The statistics of a row of v logits in their own float dtype, read in place.
RowStats logits_row_stats(const void* z, DType dtype, int64_t v);

// One bound on |got_k - w_k| for w_k = c (p_k - [k == y]), p_k = exp(z_k - lse):
//   atol + rtol |w_k| + |c| p_k grow(alpha + beta (lse - z_k))      (lse - z_k = -log p_k >= 0)
// alpha + beta |log p| bounds the absolute error of the log p a candidate exponentiates, so p is
// off by a factor e^x with x that bound: e^x - 1 <= x + x^2 for x <= ln 2 (the x^2 term matters:
// bf16 log p of -20 is off by up to 0.08), times 1 + rtol for the roundings after it; past ln 2 a
// candidate's p may be off by 100% and the element is not bounded.
struct ElementBoundRow {
  double atol = 0.0, rtol = 0.0, alpha = 0.0, beta = 0.0;
};
inline double grow(double x, double rtol) {
  return x <= 0.6931471805599453 ? (x + x * x) * (1.0 + rtol) : 1e300;
}
// The bound for an element with |c| = ac, |w| = aw, p and lp = -log p: the one formula the row
// loops and the scalar comparisons share.
inline double element_tolerance(const ElementBoundRow& b, double ac, double aw, double p,
                                double lp) {
  return b.atol + b.rtol * aw + ac * p * grow(b.alpha + b.beta * lp, b.rtol);
}

struct RowComparison {
  int64_t mismatched = 0;     // elements outside the smallest of the bounds (NaN counts)
  double max_abs_diff = 0.0;  // NaN if any difference is NaN
  double max_rel_diff = 0.0;  // over w_k != 0, finite ratios only
};
// A float32 screen in front of the float64 comparison of a 16-bit row (bf16 and fp16: the dtypes
// of real logits). A chunk of the row is certified, and not compared in float64, only if float32
// arithmetic with every rounding error bounded (logits_screen's derivation, row_math.cpp) proves
// that each of its elements is within its bound (the quick lower bound of compare_logits_row) and
// that none holds a larger |difference| than `max_abs` or a larger relative difference than
// `max_rel`: the worst the caller has seen so far. A certified chunk can change no count and no
// reported maximum; every other chunk is compared in float64 as without a screen. Twice the lanes
// of float64 and no table gather: most of a right candidate's rows pass it.
struct LogitsScreen {
  bool on = false;  // false: no chunk is certified (a row or bounds outside the derivation)
  // In units of c (got / c against p): lse as float, 1/c, the bound on the relative error of p
  // (d0 + d1 lp), the factor on |difference|, the bound's terms shrunk, the range of lp screened,
  // and the thresholds.
  float lse = 0, inv_c = 0, d0 = 0, d1 = 0, k = 0, atol = 0, per_q = 0, beta = 0, lp_min = 0,
        lp_max = 0;
  float max_abs = 0, max_rel = 0;
};
// The screen of a row with coefficient c and log-sum-exp lse under `num_bounds` (1 or 2) bounds;
// max_abs and max_rel as above (a NaN max_abs certifies against no absolute maximum, as `worse`).
LogitsScreen logits_screen(double c, double lse, const ElementBoundRow* bounds, int num_bounds,
                           double max_abs, double max_rel);

// Compares got[k] with w_k for k in [begin, end) of a row of logits z and a gradient row got, both
// in `dtype` and read in place; the target column is excluded by the caller (its w has the -c
// term; it is compared on its own). An element passes if it is within the smallest of the
// `num_bounds` (1 or 2) bounds. With a `screen` (16-bit dtypes only; ignored for others), the
// chunks it certifies count nothing and report no maximum (see LogitsScreen).
RowComparison compare_logits_row(const void* z, const void* got, DType dtype, int64_t begin,
                                 int64_t end, double c, double lse, const ElementBoundRow* bounds,
                                 int num_bounds, const LogitsScreen* screen = nullptr);

// Row k of a zero truth (a masked row, a zero weight): elements of `got` over `tol` are
// mismatches; `nonzero` counts those not exactly 0; max_abs_diff is max |got|.
RowComparison compare_zero_row(const double* got, int64_t n, double tol, int64_t* nonzero);

// Whether n values of a float dtype are all +0 or -0 (the bits, without a conversion).
bool row_is_zero(const void* src, DType dtype, int64_t n);

// n values of a float dtype (bfloat16, float16, float32, float64) as float64, vectorised.
void row_to_f64(const void* src, DType dtype, int64_t n, double* out);

// e^x in float64 for every bit pattern x of a 16-bit float dtype (bfloat16, float16), indexed by
// the bits; NaN where x is not finite or |x| > 700. Built once per dtype; nullptr for other dtypes.
// The row loops read e^(x - s) of a 16-bit row as e^x e^-s (a gather instead of a polynomial: the
// exponential was half of the comparison's time) wherever |s| <= 700 and the row's chunk has no NaN
// entry: both factors then stay normal, and the product is within 2.5 ulp of e^(x - s), closer than
// the polynomial of x - s, whose rounded argument alone costs |x - s| ulp.
const double* exp_table_16(DType dtype);

// exp_screen (exp32.h) of n values as the row loops' instruction set compiles it (contracted into
// fused multiply-adds there): for the test of its error bound.
void exp_screen_row(const float* x, int64_t n, float* out);

// The instruction set the row loops run on: "avx512", "avx2" or "generic".
const char* row_math_isa();

}  // namespace lossguard::oracle
