// The oracle's own numerics (SPEC §4, §5): analytic gradients against central finite differences,
// its vectorisable exp, the row statistics and the comparison screen, the gradient stream. No
// candidate, no CLI: the oracle_test binary (LibTorch-free).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "oracle/check/check.h"
#include "oracle/check/compare.h"
#include "oracle/check/grad_stream.h"
#include "oracle/check/loss.h"
#include "oracle/math/exp32.h"
#include "oracle/math/exp64.h"
#include "oracle/math/row_math.h"
#include "small_cases.h"
#include "synth/cases.h"
#include "test_util.h"

namespace lossguard {
namespace {
// A copy of `field` (logits or a per-token field) with element k moved by delta.
Batch perturbed(const Batch& b, const std::string& field, int64_t k, double delta) {
  Batch c = b;
  const HostArray& src = field == "logits" ? *b.logits : b.per_token.at(field);
  std::vector<double> v(static_cast<std::size_t>(src.numel()));
  for (int64_t i = 0; i < src.numel(); ++i) v[i] = src.get_f64(i);
  v[k] += delta;
  HostArray a = HostArray::from_f64(DType::kFloat64, src.shape, v);
  if (field == "logits")
    c.logits = a;
  else
    c.per_token[field] = a;
  return c;
}

TEST(Oracle, AnalyticGradientsMatchCentralFiniteDifferences) {
  const Batch b = testing::small_case("random", DType::kFloat64, 11, 6, 5);
  for (LossKind loss : {LossKind::kNll, LossKind::kPpoClip, LossKind::kGiven}) {
    for (Reduction reduce : all_reductions()) {
      LossSpec spec;
      spec.loss = loss;
      spec.reduce = reduce;
      spec.rho_rel_error = 1e-4;  // stay away from ppo-clip's kinks, where no derivative exists
      const oracle::OracleLoss o = oracle::oracle_loss(b, spec);
      const std::string field = loss_input_name(o.input);
      const int64_t n = static_cast<int64_t>(o.grad.size());
      int checked = 0;
      for (int64_t k = 0; k < n; k += std::max<int64_t>(1, n / 40)) {
        if (loss == LossKind::kPpoClip && o.near_clip_boundary[k]) continue;
        const double h = 1e-6;
        const double up = oracle::oracle_loss(perturbed(b, field, k, h), spec).loss;
        const double down = oracle::oracle_loss(perturbed(b, field, k, -h), spec).loss;
        const double fd = (up - down) / (2 * h);
        EXPECT_NEAR(o.grad[k], fd, 1e-7 + 1e-6 * std::fabs(fd))
            << loss_kind_name(loss) << " " << reduction_name(reduce) << " element " << k;
        ++checked;
      }
      EXPECT_GT(checked, 10);
    }
  }
}

TEST(Oracle, ZeroTokenBatchGivesZeroLossAndGradientNotNaN) {
  const Batch b = testing::small_case("zero-token", DType::kFloat32, 3);
  for (Reduction reduce : all_reductions()) {
    LossSpec spec;
    spec.reduce = reduce;
    const oracle::OracleLoss o = oracle::oracle_loss(b, spec);
    EXPECT_TRUE(o.no_signal);
    EXPECT_EQ(o.loss, 0.0);
    for (double g : o.grad) ASSERT_EQ(g, 0.0);
  }
}

TEST(OracleExp, WithinFourUlpOfTheLibraryExpOverTheWholeRange) {
  // The oracle's vectorisable exp (oracle/math/exp64.h) against glibc's correctly rounded-or-nearly
  // exp: a sweep of [-708, 0] plus the edges.
  double worst = 0.0;
  for (int64_t i = 0; i <= 2000000; ++i) {
    const double x = -708.0 * static_cast<double>(i) / 2000000.0 - 1e-3 * std::sin(i);
    if (x < -708.0) continue;
    const double want = std::exp(x), got = oracle::exp_nonpositive(x);
    worst = std::max(worst, std::fabs(got - want) / want);
  }
  EXPECT_LT(worst, 4 * std::ldexp(1.0, -53)) << "relative error " << worst;
  EXPECT_EQ(oracle::exp_nonpositive(0.0), 1.0);
  EXPECT_EQ(oracle::exp_nonpositive(-INFINITY), 0.0);
  EXPECT_EQ(oracle::exp_nonpositive(-800.0), 0.0);
  EXPECT_TRUE(std::isnan(oracle::exp_nonpositive(NAN)));
}

// A row as 16-bit values and as float32 (the same values): the 16-bit row loops read e^(z - s)
// from a table, the float32 ones from the polynomial; they must agree.
struct SixteenBitRow {
  std::vector<uint16_t> bits;
  std::vector<float> values;
};
SixteenBitRow sixteen_bit_row(DType dtype, const std::vector<double>& x) {
  SixteenBitRow r;
  for (double v : x) {
    const uint16_t b = dtype == DType::kBFloat16 ? float_to_bfloat16(static_cast<float>(v))
                                                 : float_to_half(static_cast<float>(v));
    r.bits.push_back(b);
    r.values.push_back(dtype == DType::kBFloat16 ? bfloat16_to_float(b) : half_to_float(b));
  }
  return r;
}

TEST(RowMath, SixteenBitStatisticsFromTheExpTableMatchThePolynomial) {
  // Rows of a 150k vocabulary in bf16 and fp16: the table path against the float32 (polynomial)
  // path on the same values. A chunk holding a value over 700 (bf16 only: fp16 ends at 65504 but
  // its logits here stay in range) or a NaN falls back to the polynomial.
  std::mt19937 gen(3);
  std::normal_distribution<double> n(0.0, 4.0);
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    for (int variant = 0; variant < 3; ++variant) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " variant " + std::to_string(variant));
      std::vector<double> x(151936);
      for (double& v : x) v = n(gen);
      if (variant == 1 && dt == DType::kBFloat16) x[70000] = 720.0;  // e^720: no table entry
      if (variant == 2) x[1234] = NAN;
      const SixteenBitRow r = sixteen_bit_row(dt, x);
      const auto a = oracle::logits_row_stats(r.bits.data(), dt, static_cast<int64_t>(x.size()));
      const auto b = oracle::logits_row_stats(r.values.data(), DType::kFloat32,
                                              static_cast<int64_t>(x.size()));
      if (variant == 2) {
        EXPECT_TRUE(a.non_finite && b.non_finite);
        EXPECT_TRUE(std::isnan(a.sum) && std::isnan(b.sum));
        continue;
      }
      EXPECT_EQ(a.max, b.max);
      EXPECT_EQ(a.max_abs, b.max_abs);
      EXPECT_FALSE(a.non_finite);
      EXPECT_NEAR(a.sum, b.sum, 1e-13 * b.sum);
      EXPECT_NEAR(a.spread, b.spread, 1e-12 * b.spread);
    }
  }
}

TEST(RowMath, ComparisonCountsExactlyTheElementsOutsideTheirBound) {
  // A gradient row c (p - onehot) of a bf16 row of logits with elements set at 0.5, 0.99, 1.01 and
  // 3 times their bound (the smallest of two, as check uses them), and elements between the
  // comparison's quick lower bound and the bound: compare_logits_row (vector loops, exp table,
  // screen) must count exactly the ones over, as a scalar loop with std::exp does.
  std::mt19937 gen(5);
  std::normal_distribution<double> n(0.0, 3.0);
  const int64_t v = 151936;
  std::vector<double> x(static_cast<std::size_t>(v));
  for (double& e : x) e = n(gen);
  const SixteenBitRow zr = sixteen_bit_row(DType::kBFloat16, x);
  std::vector<double> z(zr.values.begin(), zr.values.end());
  double m = -INFINITY;
  for (double e : z) m = std::max(m, e);
  double s = 0.0;
  for (double e : z) s += std::exp(e - m);
  const double lse = m + std::log(s), c = -3.0e-4;
  const oracle::ElementBoundRow bounds[2] = {{1e-30, 1.6e-2, 7.8e-3, 3.9e-3},
                                             {1e-30, 1.56e-2, 0.1, 7.8e-3}};
  auto tol = [&](double p, double lp) {
    const double aw = std::fabs(c * p);
    return std::min(oracle::element_tolerance(bounds[0], std::fabs(c), aw, p, lp),
                    oracle::element_tolerance(bounds[1], std::fabs(c), aw, p, lp));
  };
  std::vector<double> g(static_cast<std::size_t>(v));
  int64_t want_bad = 0;
  for (int64_t k = 0; k < v; ++k) {
    const double lp = lse - z[k], p = std::exp(-lp), w = c * p, t = tol(p, lp);
    // Most elements one bf16 rounding off (well inside); every 97th placed by hand.
    double got = static_cast<double>(bfloat16_to_float(float_to_bfloat16(static_cast<float>(w))));
    if (k % 97 == 0) {
      const double f[] = {0.5, 0.99, 1.01, 3.0};
      const double factor = f[(k / 97) % 4];
      got = w + factor * t;  // as float64: the comparison reads it exactly below
    }
    g[k] = got;
    if (std::fabs(got - w) > t) ++want_bad;
  }
  ASSERT_GT(want_bad, 700);
  // The comparison reads z and got in one dtype: float32 holds the bf16 logits exactly, and the
  // placed gradients to 2^-24, far inside the 1% margins above.
  std::vector<float> zf(z.begin(), z.end()), gf(g.begin(), g.end());
  int64_t exact_bad = 0;
  for (int64_t k = 0; k < v; ++k) {
    const double lp = lse - z[k], p = std::exp(-lp), w = c * p;
    if (std::fabs(static_cast<double>(gf[k]) - w) > tol(p, lp)) ++exact_bad;
  }
  EXPECT_EQ(exact_bad, want_bad);
  const auto r =
      oracle::compare_logits_row(zf.data(), gf.data(), DType::kFloat32, 0, v, c, lse, bounds, 2);
  EXPECT_EQ(r.mismatched, exact_bad);
  // And a right row (every element one bf16 rounding off) in bf16: nothing over, through the table.
  std::vector<uint16_t> gb(static_cast<std::size_t>(v));
  for (int64_t k = 0; k < v; ++k)
    gb[k] = float_to_bfloat16(static_cast<float>(c * std::exp(z[k] - lse)));
  const auto ok = oracle::compare_logits_row(zr.bits.data(), gb.data(), DType::kBFloat16, 0, v, c,
                                             lse, bounds, 2);
  EXPECT_EQ(ok.mismatched, 0);
  EXPECT_LE(ok.max_rel_diff, std::ldexp(1.0, -8) * 1.0001);
  // Elements past the bound in bf16, through the table: counted.
  for (int64_t k = 0; k < v; k += 1000)
    gb[k] = float_to_bfloat16(static_cast<float>(2.0 * c * std::exp(z[k] - lse)));
  const auto bad = oracle::compare_logits_row(zr.bits.data(), gb.data(), DType::kBFloat16, 0, v, c,
                                              lse, bounds, 2);
  EXPECT_EQ(bad.mismatched, (v + 999) / 1000);
}

TEST(OracleExp, TheScreensFloatExpIsWithinItsBudget) {
  // logits_screen budgets 2^-20 of relative error for exp_screen; it is held to 2^-22 here, over a
  // dense sweep of its range [-87, 2] and every 61st float in [-1, 0] (the reduced arguments').
  // Both as this test's flags compile it, and as the row loops do (exp_screen_row: on this CPU's
  // instruction set, Horner's rule contracted into fused multiply-adds).
  std::vector<float> xs;
  for (int64_t i = 0; i <= 4000000; ++i)
    xs.push_back(-87.0f + 89.0f * static_cast<float>(i) / 4000000.0f);
  for (uint32_t bits = 0x3f800000u; bits > 0; bits -= std::min<uint32_t>(bits, 61)) {
    float x;  // -1 to 0, every 61st float
    std::memcpy(&x, &bits, 4);
    xs.push_back(-x);
  }
  std::vector<float> dispatched(xs.size());
  oracle::exp_screen_row(xs.data(), static_cast<int64_t>(xs.size()), dispatched.data());
  double worst = 0.0, worst_dispatched = 0.0;
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const double want = std::exp(static_cast<double>(xs[i]));
    worst =
        std::max(worst, std::fabs(static_cast<double>(oracle::exp_screen(xs[i])) - want) / want);
    worst_dispatched =
        std::max(worst_dispatched, std::fabs(static_cast<double>(dispatched[i]) - want) / want);
  }
  EXPECT_LT(worst, std::ldexp(1.0, -22)) << "relative error " << worst;
  EXPECT_LT(worst_dispatched, std::ldexp(1.0, -22))
      << "relative error " << worst_dispatched << " (" << oracle::row_math_isa() << ")";
  EXPECT_TRUE(std::isnan(oracle::exp_screen(NAN)));
}

// The float32 screen in front of the float64 comparison must never hide a mismatch or a new worst
// element, and must certify a right row. Rows of 150k 16-bit logits (in bf16 including a tail of
// very unlikely tokens, lp up to ~60; in fp16 with a loss scale's c, so that c p stays normal) and
// gradients c p (1 + e) rounded to the dtype; the bound and the thresholds are set from the row's
// own exact differences (a scalar float64 loop with std::exp), a hair above or below them.
TEST(RowMath, TheScreenCertifiesOnlyChunksTheFloat64ComparisonPasses) {
  std::mt19937 gen(11);
  std::uniform_real_distribution<double> err(-3e-3, 3e-3);
  const int64_t v = 151936;
  for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
    const bool bf16 = dt == DType::kBFloat16;
    std::normal_distribution<double> logit(0.0, bf16 ? 3.0 : 1.0);
    for (double c : bf16 ? std::vector<double>{-3.0e-4, 1.0 / 3145.0, 5.0}
                         : std::vector<double>{2048.0, -4096.0}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " c " + std::to_string(c));
      std::vector<double> x(static_cast<std::size_t>(v));
      for (double& e : x) e = logit(gen);
      for (int64_t k = 0; bf16 && k < v; k += 501)
        x[static_cast<std::size_t>(k)] = -40.0 + 0.01 * (k % 7);
      const SixteenBitRow zr = sixteen_bit_row(dt, x);
      std::vector<double> z(zr.values.begin(), zr.values.end());
      double m = -INFINITY, sum = 0.0;
      for (double e : z) m = std::max(m, e);
      for (double e : z) sum += std::exp(e - m);
      const double lse = m + std::log(sum);
      std::vector<double> w(static_cast<std::size_t>(v));
      for (int64_t k = 0; k < v; ++k) w[k] = c * std::exp(z[k] - lse);
      for (int64_t k = 0; k < v; ++k) x[k] = w[k] * (1.0 + err(gen));
      const SixteenBitRow gr = sixteen_bit_row(dt, x);
      // The exact relative differences, and the largest absolute and relative ones.
      double max_abs = 0.0, max_rel = 0.0;
      int64_t at = 0;
      for (int64_t k = 0; k < v; ++k) {
        const double d = std::fabs(static_cast<double>(gr.values[k]) - w[k]);
        max_abs = std::max(max_abs, d);
        if (d / std::fabs(w[k]) > max_rel) max_rel = d / std::fabs(w[k]), at = k;
      }
      ASSERT_GT(max_rel, 1e-3);
      // Elements over a relative bound, counted here (several may share the largest difference:
      // equal logits and errors round to the same 16-bit value).
      auto over = [&](double rtol) {
        int64_t n = 0;
        for (int64_t k = 0; k < v; ++k)
          n += std::fabs(static_cast<double>(gr.values[k]) - w[k]) > rtol * std::fabs(w[k]);
        return n;
      };
      // The bound: rtol alone, so that element k is over it iff its relative difference is.
      auto run = [&](double rtol, double thr_abs, double thr_rel, bool screened) {
        const oracle::ElementBoundRow b{0.0, rtol, 0.0, 0.0};
        const oracle::LogitsScreen s = oracle::logits_screen(c, lse, &b, 1, thr_abs, thr_rel);
        EXPECT_TRUE(s.on);
        return oracle::compare_logits_row(zr.bits.data(), gr.bits.data(), dt, 0, v, c, lse, &b, 1,
                                          screened ? &s : nullptr);
      };
      const double big = 1e300;
      // Every element within a bound 1% above the largest relative difference, nothing to beat:
      // every chunk certified, so nothing is compared and no maximum reported.
      auto r = run(max_rel * 1.01, big, big, true);
      EXPECT_EQ(r.mismatched, 0);
      EXPECT_EQ(r.max_abs_diff, 0.0);
      // The bound 1e-7 under the largest relative difference: the element(s) at it are over, and
      // must be counted (the screen's own error is ~1e-5 relative: it cannot certify them).
      const int64_t want_over = over(max_rel * (1.0 - 1e-7));
      ASSERT_GE(want_over, 1);
      EXPECT_EQ(run(max_rel * (1.0 - 1e-7), big, big, false).mismatched, want_over);
      EXPECT_EQ(run(max_rel * (1.0 - 1e-7), big, big, true).mismatched, want_over)
          << "element " << at;
      // The bound 1e-7 over it: within, and the screen may not count what float64 passes.
      EXPECT_EQ(over(max_rel * (1.0 + 1e-7)), 0);
      EXPECT_EQ(run(max_rel * (1.0 + 1e-7), big, big, true).mismatched, 0);
      // A worst so far a hair under the row's largest difference: the chunks holding it are
      // compared, and report it as float64 does; a hair over: nothing to report.
      const auto all = run(max_rel * 1.01, big, big, false);
      EXPECT_NEAR(all.max_abs_diff, max_abs, 1e-12 * max_abs);
      EXPECT_EQ(run(max_rel * 1.01, max_abs * (1.0 - 1e-9), big, true).max_abs_diff,
                all.max_abs_diff);
      EXPECT_EQ(run(max_rel * 1.01, big, max_rel * (1.0 - 1e-9), true).max_rel_diff,
                all.max_rel_diff);
      EXPECT_EQ(run(max_rel * 1.01, max_abs * 1.01, max_rel * 1.01, true).max_abs_diff, 0.0);
    }
  }
}

TEST(RowMath, TheScreenStaysOffOutsideItsDerivation) {
  const oracle::ElementBoundRow b{0.0, 4e-3, 0.0, 0.0};
  EXPECT_TRUE(oracle::logits_screen(1e-3, 12.0, &b, 1, 1.0, 1.0).on);
  EXPECT_FALSE(oracle::logits_screen(1e-3, NAN, &b, 1, 1.0, 1.0).on);
  EXPECT_FALSE(oracle::logits_screen(1e-3, 800.0, &b, 1, 1.0, 1.0).on);  // e^-lse past float
  EXPECT_FALSE(oracle::logits_screen(0.0, 12.0, &b, 1, 1.0, 1.0).on);
  EXPECT_FALSE(oracle::logits_screen(1e-30, 12.0, &b, 1, 1.0, 1.0).on);  // 1/c past float
  // A float32 candidate's bound (rtol 1e-6) is tighter than the screen's own error: off.
  const oracle::ElementBoundRow tight{0.0, 1e-6, 0.0, 0.0};
  EXPECT_FALSE(oracle::logits_screen(1e-3, 12.0, &tight, 1, 1.0, 1.0).on);
}

TEST(RowMath, TheScreenNeverPassesAnInfiniteGradient) {
  // An absolute bound past float's range once divided by |c| (atol 1e36, c 1e-4: +inf in the
  // screen's units), no worst to beat (a NaN worst so far, a huge relative one): a +inf gradient
  // element must still be counted, as float64 counts it.
  const int64_t v = 4096;
  std::vector<uint16_t> z(static_cast<std::size_t>(v), float_to_bfloat16(0.0f));
  const double c = 1e-4, lse = std::log(static_cast<double>(v));
  std::vector<uint16_t> g(static_cast<std::size_t>(v),
                          float_to_bfloat16(static_cast<float>(c / static_cast<double>(v))));
  g[100] = 0x7f80;  // +inf in bf16
  const oracle::ElementBoundRow b{1e36, 1e-2, 0.0, 0.0};
  const oracle::LogitsScreen s = oracle::logits_screen(c, lse, &b, 1, NAN, 1e300);
  ASSERT_TRUE(s.on);
  const auto exact =
      oracle::compare_logits_row(z.data(), g.data(), DType::kBFloat16, 0, v, c, lse, &b, 1);
  EXPECT_EQ(exact.mismatched, 1);
  EXPECT_EQ(
      oracle::compare_logits_row(z.data(), g.data(), DType::kBFloat16, 0, v, c, lse, &b, 1, &s)
          .mismatched,
      1);
}

// The candidate's gradient as a whole array, fed to a GradStream in `order` (blocks of `block`
// rows), and the result.
oracle::GradComparison stream_in_blocks(const Batch& b, const oracle::OracleLoss& want,
                                        const HostArray& grad, std::vector<int64_t> order,
                                        int64_t block, int64_t skip_row = -1) {
  oracle::GradStreamSettings gs;
  gs.bounds = {oracle::ElementBound{1e-12, 0, 1e-6, 0, 0, 0, 0, 0}};
  gs.got_dtype = grad.dtype;
  oracle::GradStream stream(b, want, gs);
  const int64_t cols = want.grad_cols;
  const std::size_t row_bytes = static_cast<std::size_t>(cols) * dtype_size_bytes(grad.dtype);
  std::vector<int64_t> ids;
  std::vector<std::byte> buf;
  for (std::size_t k = 0; k < order.size(); k += static_cast<std::size_t>(block)) {
    ids.clear();
    buf.clear();
    for (std::size_t j = k; j < std::min(order.size(), k + static_cast<std::size_t>(block)); ++j) {
      if (order[j] == skip_row) continue;
      ids.push_back(order[j]);
      buf.insert(buf.end(), grad.data + order[j] * row_bytes,
                 grad.data + (order[j] + 1) * row_bytes);
    }
    if (!ids.empty()) stream.add(ids.data(), static_cast<int64_t>(ids.size()), buf.data());
  }
  return stream.finish({}, {});
}

TEST(GradStream, AnyOrderAndBlockingGivesTheSameVerdictAndMissingRowsAreZeros) {
  // The oracle's own float64 gradient, written as float32 with one element pushed out of
  // tolerance, streamed in order, reversed, and in odd blocks: the same counts and the same worst
  // element (found by hand: the pushed one) every time. A row left out counts as zeros: all its
  // nonzero elements mismatch.
  const Batch b = testing::small_case("random", DType::kFloat32, 11, 16, 33);
  LossSpec spec;
  const oracle::OracleLoss want = oracle::oracle_loss(b, spec, /*with_logits_grad=*/false);
  const oracle::OracleLoss full = oracle::oracle_loss(b, spec);
  const int64_t rows = b.num_response_tokens(), v = b.vocab_size();
  std::vector<double> g(full.grad);
  int64_t row = -1;
  for (int64_t r = 0; r < rows && row < 0; ++r)
    if (full.coeff[r] != 0.0) row = r;
  ASSERT_GE(row, 0);
  g[row * v + 5] *= 1.01;
  const HostArray grad = HostArray::from_f64(DType::kFloat32, {rows, v}, g);
  std::vector<int64_t> order(static_cast<std::size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) order[static_cast<std::size_t>(r)] = r;
  const auto a = stream_in_blocks(b, want, grad, order, rows);
  std::reverse(order.begin(), order.end());
  const auto c = stream_in_blocks(b, want, grad, order, 7);
  const auto m = stream_in_blocks(b, full, grad, order, 3);  // a materialised truth
  for (const auto* x : {&a, &c, &m}) {
    EXPECT_EQ(x->checked, rows * v);
    EXPECT_EQ(x->mismatched, 1);
    EXPECT_EQ(x->worst.response_index, row - b.response_offsets[x->worst.sample]);
    EXPECT_EQ(x->worst.vocab_index, 5);
    EXPECT_NEAR(x->worst.got, static_cast<float>(g[row * v + 5]), 0.0);
  }
  // Leave out the row after `row` with a nonzero weight.
  int64_t other = -1;
  for (int64_t r = row + 1; r < rows && other < 0; ++r)
    if (full.coeff[r] != 0.0) other = r;
  ASSERT_GE(other, 0);
  const auto missing = stream_in_blocks(b, want, grad, order, 5, other);
  int64_t nonzero = 0;
  for (int64_t k = 0; k < v; ++k) nonzero += full.grad[other * v + k] != 0.0;
  EXPECT_EQ(missing.checked, rows * v);
  EXPECT_EQ(missing.mismatched, 1 + nonzero);
}

TEST(GradStream, RowsDeliveredTwiceAreAnInternalError) {
  const Batch b = testing::small_case("random", DType::kFloat32, 3, 4, 5);
  LossSpec spec;
  const oracle::OracleLoss want = oracle::oracle_loss(b, spec, false);
  oracle::GradStream stream(b, want, {});
  std::vector<float> row(5, 0.0f);
  const int64_t id = 0;
  stream.add(&id, 1, row.data());
  EXPECT_THROW(stream.add(&id, 1, row.data()), std::logic_error);
}

}  // namespace
}  // namespace lossguard
