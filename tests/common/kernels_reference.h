// Shared by the kernels' CPU and CUDA tests: seeds from the test's name, seeded logits in every
// dtype, and the fused cross entropy checked element by element against float64 loops under argued
// bounds.
#pragma once
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "kernels/fused_xent.h"
#include "synth/cases.h"

namespace lossguard::kernels {

inline uint64_t seed_of(const std::string& name) {  // seeds derived from the test's name
  uint64_t h = 1469598103934665603ull;
  for (char c : name) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}
inline uint64_t test_seed() {
  return seed_of(::testing::UnitTest::GetInstance()->current_test_info()->name());
}

// ---- fused cross entropy ----

struct XentCase {
  DType dtype;
  int64_t rows, vocab;
  double spread;  // logits ~ N(0, spread^2)
};

struct XentData {
  std::vector<uint16_t> bits;  // fp16 / bf16 storage
  std::vector<float> f32;
  std::vector<double> exact;  // the values the kernel sees, in double
  std::vector<int64_t> targets;
  std::vector<float> scale;
  std::vector<uint8_t> active;
};

inline XentData make_data(const XentCase& c, uint64_t seed) {
  synth::Rng rng(seed);
  XentData d;
  const int64_t n = c.rows * c.vocab;
  d.exact.resize(static_cast<std::size_t>(n));
  if (c.dtype == DType::kFloat32)
    d.f32.resize(static_cast<std::size_t>(n));
  else
    d.bits.resize(static_cast<std::size_t>(n));
  for (int64_t k = 0; k < n; ++k) {
    const float x = static_cast<float>(rng.normal() * c.spread);
    if (c.dtype == DType::kFloat32) {
      d.f32[k] = x;
      d.exact[k] = x;
    } else if (c.dtype == DType::kFloat16) {
      d.bits[k] = float_to_half(x);
      d.exact[k] = half_to_float(d.bits[k]);
    } else {
      d.bits[k] = float_to_bfloat16(x);
      d.exact[k] = bfloat16_to_float(d.bits[k]);
    }
  }
  for (int64_t r = 0; r < c.rows; ++r) {
    d.targets.push_back(rng.uniform_int(0, c.vocab - 1));
    const int64_t kind = rng.uniform_int(0, 9);  // some inactive rows, some zero coefficients
    d.active.push_back(kind != 0);
    d.scale.push_back(kind == 1 ? 0.0f : static_cast<float>((rng.uniform() - 0.3) * 2.0));
  }
  return d;
}

// What the kernel is allowed, argued from its arithmetic (u = 2^-24, float):
//  - lse: each exp has a relative error of a few u (polynomial, range reduction, the rounding of z
//  - m);
//    a block's 2048 terms are added in 16 float lanes (128 terms each: at most 128 u), the lanes
//    and blocks in float and double (16 u more); log and the final add: 2 u (1 + |lse|). So |d lse|
//    <= (128 + 16 + 8) u + 2 u |lse|.
//  - token loss l = lse - z_y: |d lse| plus one rounding of l.
//  - gradient c p (p = exp(z - lse)): p inherits |d lse| as a relative error, plus exp, the block
//    factor and the product (8 u); then one rounding to the output dtype (u_out |g|, or half the
//    smallest subnormal step where the result is subnormal: 2^-25 in fp16). exp flushes below e^-86
//    (4e-38) to 0: |c| e^-86 absolute. The target's
//    c expm1(z_y - lse) moves by c p_y |d lse| too, as d/dx expm1(x) = p_y.
inline double lse_bound(double lse) {
  const double u = std::ldexp(1.0, -24);
  return (128 + 16 + 8) * u + 2 * u * std::fabs(lse);
}

// Runs the kernel under test on host-memory arguments.
using XentRunner = std::function<void(const XentArgs&)>;

inline void expect_xent_matches_reference(const XentCase& c, const XentData& d,
                                          const XentRunner& run, const std::string& what) {
  const int64_t n = c.rows * c.vocab;
  std::vector<float> lse(static_cast<std::size_t>(c.rows), -1.0f),
      loss(static_cast<std::size_t>(c.rows), -1.0f);
  std::vector<uint16_t> grad_bits(c.dtype == DType::kFloat32 ? 0 : static_cast<std::size_t>(n),
                                  0xffff);
  std::vector<float> grad_f32(c.dtype == DType::kFloat32 ? static_cast<std::size_t>(n) : 0, NAN);
  XentArgs a;
  a.logits = c.dtype == DType::kFloat32 ? static_cast<const void*>(d.f32.data()) : d.bits.data();
  a.dtype = c.dtype;
  a.rows = c.rows;
  a.vocab = c.vocab;
  a.row_stride = c.vocab;
  a.targets = d.targets.data();
  a.grad_scale = d.scale.data();
  a.active = d.active.data();
  a.lse = lse.data();
  a.token_loss = loss.data();
  a.grad = c.dtype == DType::kFloat32 ? static_cast<void*>(grad_f32.data()) : grad_bits.data();
  run(a);
  const double u = std::ldexp(1.0, -24);
  const double u_out = c.dtype == DType::kFloat32   ? u
                       : c.dtype == DType::kFloat16 ? std::ldexp(1.0, -11)
                                                    : std::ldexp(1.0, -8);
  const double half_subnormal_step = c.dtype == DType::kFloat16    ? std::ldexp(1.0, -25)
                                     : c.dtype == DType::kBFloat16 ? std::ldexp(1.0, -134)
                                                                   : std::ldexp(1.0, -150);
  auto got_grad = [&](int64_t k) -> double {
    if (c.dtype == DType::kFloat32) return grad_f32[k];
    return c.dtype == DType::kFloat16 ? half_to_float(grad_bits[k])
                                      : bfloat16_to_float(grad_bits[k]);
  };
  for (int64_t r = 0; r < c.rows; ++r) {
    const double* z = d.exact.data() + r * c.vocab;
    const std::string where =
        fmt::format("{}: row {} of [{}, {}] {}", what, r, c.rows, c.vocab, dtype_name(c.dtype));
    if (!d.active[r]) {
      EXPECT_EQ(lse[r], 0.0f) << where;
      EXPECT_EQ(loss[r], 0.0f) << where;
      for (int64_t v = 0; v < c.vocab; ++v)
        ASSERT_EQ(got_grad(r * c.vocab + v), 0.0) << where << ", inactive row, vocab " << v;
      continue;
    }
    double m = -INFINITY;
    for (int64_t v = 0; v < c.vocab; ++v) m = std::max(m, z[v]);
    double s = 0.0;
    for (int64_t v = 0; v < c.vocab; ++v) s += std::exp(z[v] - m);
    const double want_lse = m + std::log(s);
    const double dl = lse_bound(want_lse);
    ASSERT_NEAR(lse[r], want_lse, dl) << where;
    const double want_loss = want_lse - z[d.targets[r]];
    ASSERT_NEAR(loss[r], want_loss, dl + u * std::fabs(want_loss)) << where;
    const double cr = d.scale[r];
    for (int64_t v = 0; v < c.vocab; ++v) {
      const double p = std::exp(z[v] - want_lse);
      const double want = cr * (v == d.targets[r] ? std::expm1(z[v] - want_lse) : p);
      // The target entry is c·expm1(z - lse): near -c when p is small, so the p·(...) term (the
      // argument's error, carried by d expm1/dt = p) misses expm1's own rounding, which is relative
      // to its value, not to p. CUDA's expm1f is within 1 ulp (CUDA Math API, single precision:
      // expm1f 1 ulp), at most 2u relative for a normal float; seen on an H200: 0.8 ulp of -0.746
      // at p ~ 0.002.
      const double own_rounding = v == d.targets[r] ? 2 * u * std::fabs(want) : 0.0;
      const double bound = std::fabs(cr) * p * (dl + 8 * u) + u_out * std::fabs(want) +
                           own_rounding + half_subnormal_step + std::fabs(cr) * std::exp(-86.0);
      const double got = got_grad(r * c.vocab + v);
      if (cr == 0.0) {
        ASSERT_EQ(got, 0.0) << where << ", zero coefficient, vocab " << v;
      }
      ASSERT_NEAR(got, want, bound)
          << where << ", vocab " << v << " (target " << d.targets[r] << ")";
    }
  }
}

inline const std::vector<XentCase>& xent_cases() {
  static const std::vector<XentCase> cases = {
      {DType::kFloat32, 7, 1, 1.0},      {DType::kFloat32, 5, 15, 3.0},
      {DType::kFloat32, 5, 17, 3.0},     {DType::kFloat32, 3, 2047, 2.0},
      {DType::kFloat32, 3, 2049, 2.0},   {DType::kFloat32, 6, 5003, 8.0},
      {DType::kFloat32, 9, 4096, 30.0},  {DType::kFloat16, 6, 1031, 2.0},
      {DType::kFloat16, 4, 4099, 6.0},   {DType::kBFloat16, 6, 1031, 2.0},
      {DType::kBFloat16, 4, 4099, 20.0}, {DType::kFloat32, 0, 64, 1.0},
  };
  return cases;
}

}  // namespace lossguard::kernels
