// The float32 exponential of the oracle's screen (row_math.h, LogitsScreen), for -87 <= x <= 2:
// straight-line arithmetic, so that the screen's loop vectorises 16 lanes wide. Nothing the oracle
// reports is computed with it: the screen only decides which chunks of a row must be compared in
// float64, and its bounds budget 2^-20 of relative error for this function.
//
// x = n ln2 + r with n = round(x / ln2) (a rounding by adding 1.5 * 2^23), ln2 in two parts
// (ln2_hi = 0.693359375 has 9 significant bits, so n * ln2_hi is exact for |n| < 2^15) and
// |r| <= ln2 / 2 + a few ulp. e^r is its Taylor polynomial of degree 7: the remainder is at most
// 0.3466^8 / 8! = 5.1e-9 relative, under 2^-27; Horner's rule in float32 adds a few ulp. 2^n goes
// into the exponent bits (normal for -126 <= n <= 127, so x is clamped to [-87, 2]; NaN stays NaN).
// tests/cli/check_test.cpp bounds the relative error against std::exp at 2^-22 over [-87, 2].
#pragma once
#include <cstdint>
#include <cstring>

namespace lossguard::oracle {

inline float exp_screen(float x) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  constexpr int32_t kShiftBits = 0x4b400000;
  float xc = x < -87.0f ? -87.0f : x;  // NaN compares false and stays
  xc = xc > 2.0f ? 2.0f : xc;
  const float t = xc * 1.44269504088896341f + kShift;
  const float n = t - kShift;
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &t, sizeof bits);
  const int32_t scale_bits = (bits - kShiftBits + 127) << 23;
  float scale;
  std::memcpy(&scale, &scale_bits, sizeof scale);
  return p * scale;
}

}  // namespace lossguard::oracle
