// The oracle's own float64 exponential for x <= 0, written as straight-line arithmetic so that the
// compiler vectorises the loops that call it (std::exp is a scalar call: over 10^9 logits it was
// most of `check`'s time). Shares nothing with kernels/, whose exp is float.
//
// x = n ln2 + r with n = round(x / ln2) (a rounding by adding 1.5 * 2^52), ln2 in Cody and Waite's
// two parts (fdlibm's ln2_hi has 21 trailing zero bits, so n * ln2_hi is exact for |n| < 2^21)
// and |r| <= ln2 / 2 + a few ulp. e^r is its Taylor polynomial of degree 13: the remainder is at
// most 0.3466^14 / 14! = 4e-18 relative, under 2^-53 = 1.1e-16; Horner's rule in float64 adds a
// few ulp. 2^n goes into the exponent bits. Below x = -708, e^x < 3.3e-308 is returned as 0 (so
// 2^n stays normal); NaN stays NaN. tests/oracle_exp64_test.cpp bounds the relative error against
// std::exp at 4 ulp (9e-16) over [-708, 0].
#pragma once
#include <cstdint>
#include <cstring>

namespace lossguard::oracle {

inline double exp_nonpositive(double x) {
  constexpr double kShift = 6755399441055744.0;  // 1.5 * 2^52
  constexpr int64_t kShiftBits = 0x4338000000000000;
  const double xc = x < -708.0 ? -708.0 : x;  // NaN compares false and stays
  const double t = xc * 1.4426950408889634074 + kShift;
  const double n = t - kShift;
  const double r = (xc - n * 6.93147180369123816490e-01) - n * 1.90821492927058770002e-10;
  double p = 1.0 / 6227020800.0;  // 1/13!
  p = p * r + 1.0 / 479001600.0;
  p = p * r + 1.0 / 39916800.0;
  p = p * r + 1.0 / 3628800.0;
  p = p * r + 1.0 / 362880.0;
  p = p * r + 1.0 / 40320.0;
  p = p * r + 1.0 / 5040.0;
  p = p * r + 1.0 / 720.0;
  p = p * r + 1.0 / 120.0;
  p = p * r + 1.0 / 24.0;
  p = p * r + 1.0 / 6.0;
  p = p * r + 0.5;
  p = p * r + 1.0;
  p = p * r + 1.0;
  int64_t bits;
  std::memcpy(&bits, &t, sizeof bits);
  const int64_t scale_bits = (bits - kShiftBits + 1023) << 52;
  double scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  const double y = p * scale;
  return x < -708.0 ? 0.0 : y;
}

}  // namespace lossguard::oracle
