// The candidates (trainer/: LibTorch autograd and the kernels) run directly and judged by the
// oracle's evaluate_check, with no CLI in between; and evaluate_check shown rejecting a candidate
// whose denominator, loss, gradient, masked rows or zero-token flag is planted wrong.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>

#include "oracle/check/check.h"
#include "oracle/check/loss.h"
#include "synth/cases.h"
#include "trainer/candidate.h"

namespace lossguard {
namespace {

Batch make(const std::string& name, DType dtype) {
  synth::GenOptions o;
  o.seed = 5;
  o.num_samples = 12;
  o.vocab_size = 11;
  o.max_prompt = 6;
  o.max_response = 9;
  o.dtype = dtype;
  return synth::make_case(name, o);
}

struct Judged {
  trainer::CandidateOutput got;
  oracle::OracleLoss want;
  DType input = DType::kFloat32;
  oracle::CheckCase verdict;
};

// The candidate on `cp` ranks, its whole gradient collected, judged against the oracle.
Judged run_and_judge(const Batch& b, trainer::Impl impl, int64_t cp, LossKind loss,
                     Reduction reduce) {
  LossSpec spec;
  spec.loss = loss;
  spec.reduce = reduce;
  const LossInput which = loss_input(b, loss);
  const HostArray& x = loss_input_array(b, which);
  const oracle::CheckSettings settings;
  spec = oracle::with_rounding_slack(spec, x.dtype, settings);
  Judged j;
  j.input = x.dtype;
  j.want = oracle::oracle_loss(b, spec, /*with_logits_grad=*/false);
  trainer::CandidateInput in;
  in.batch = &b;
  in.spec = spec;
  in.cp = cp;
  in.impl = impl;
  j.got = trainer::run_candidate(in);  // no sink: the gradient comes back whole
  const int64_t vocab = x.shape.size() == 2 ? x.shape[1] : 1;
  j.verdict = oracle::evaluate_check(b, spec, j.want, j.got, x.dtype, settings,
                                     trainer::arithmetic_of(impl, vocab, kernels::Device::kCpu));
  return j;
}

using CandidateCase = std::tuple<std::string, trainer::Impl, DType>;
class CandidateAgainstOracle : public ::testing::TestWithParam<CandidateCase> {};

// Every CP size, loss and reduction of one (batch, candidate, dtype): each failure is reported,
// none hides the next.
TEST_P(CandidateAgainstOracle, EveryCpSizeLossAndReductionPasses) {
  const auto& [name, impl, dtype] = GetParam();
  const Batch b = make(name, dtype);
  for (int64_t cp : {1, 2, 4, 8}) {
    for (LossKind loss : {LossKind::kNll, LossKind::kPpoClip}) {
      for (Reduction reduce : all_modes<Reduction>()) {
        SCOPED_TRACE(
            fmt::format("cp={} loss={} reduce={}", cp, mode_name(loss), mode_name(reduce)));
        const Judged j = run_and_judge(b, impl, cp, loss, reduce);
        EXPECT_TRUE(j.verdict.ok()) << fmt::format("{}", fmt::join(j.verdict.why, "; "));
        EXPECT_EQ(j.got.denominator, j.want.denominator);
        EXPECT_EQ(j.got.dtype, dtype_name(dtype));
        if (j.want.no_signal) {
          EXPECT_EQ(j.got.loss, 0.0);
        }
        // The kernels reduce the zero-token flag on the device; LibTorch computes none.
        if (impl == trainer::Impl::kKernels) {
          EXPECT_EQ(j.got.skip_flag, std::optional<bool>(j.want.no_signal));
        } else {
          EXPECT_FALSE(j.got.skip_flag.has_value());
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Gen, CandidateAgainstOracle,
    ::testing::Combine(::testing::Values("random", "empty-responses", "fully-masked", "zero-token",
                                         "sft-preshifted", "t-zero"),
                       ::testing::Values(trainer::Impl::kTorch, trainer::Impl::kKernels),
                       ::testing::Values(DType::kFloat32, DType::kBFloat16)),
    [](const ::testing::TestParamInfo<CandidateCase>& info) {
      std::string name =
          fmt::format("{}_{}_{}", std::get<0>(info.param), mode_name(std::get<1>(info.param)),
                      dtype_name(std::get<2>(info.param)));
      for (char& c : name)
        if (c == '-') c = '_';
      return name;
    });

// The first response token with mask 1, and its row's element `column` in the gradient.
int64_t first_effective_row(const Batch& b) {
  for (int64_t t = 0; t < b.num_response_tokens(); ++t)
    if (b.loss_mask[t]) return t;
  return -1;
}
int64_t first_masked_row(const Batch& b) {
  for (int64_t t = 0; t < b.num_response_tokens(); ++t)
    if (!b.loss_mask[t]) return t;
  return -1;
}
void scale_element(HostArray& grad, int64_t row, double by) {
  const int64_t width = grad.shape.size() == 2 ? grad.shape[1] : 1;
  float* g = reinterpret_cast<float*>(grad.mutable_data()) + row * width;  // fp32 gradient
  g[0] = static_cast<float>(g[0] * by + (g[0] == 0.0f ? 1e-3 : 0.0));
}

// The same candidate output, one number planted wrong at a time: each is rejected, by the check
// that owns it, and the untouched output passes.
TEST(EvaluateCheck, RejectsEachPlantedError) {
  const Batch b = make("random", DType::kFloat32);
  for (trainer::Impl impl : {trainer::Impl::kTorch, trainer::Impl::kKernels}) {
    SCOPED_TRACE(mode_name(impl));
    const Judged base = run_and_judge(b, impl, 2, LossKind::kNll, Reduction::kPerToken);
    ASSERT_TRUE(base.verdict.ok());
    const oracle::CheckSettings settings;
    const Arithmetic arith = trainer::arithmetic_of(impl, 11, kernels::Device::kCpu);
    auto judge = [&](const CandidateResult& got) {
      LossSpec spec;
      return oracle::evaluate_check(b, spec, base.want, got, base.input, settings, arith);
    };
    CandidateResult den = base.got;
    den.denominator += 1;
    EXPECT_FALSE(judge(den).den_ok);

    CandidateResult loss = base.got;
    loss.loss *= 1.0 + 1e-3;
    const oracle::CheckCase l = judge(loss);
    EXPECT_FALSE(l.loss_ok);
    EXPECT_TRUE(l.den_ok);

    CandidateResult grad = base.got;
    grad.grad = HostArray::zeros(base.got.grad.dtype, base.got.grad.shape);
    std::memcpy(grad.grad.mutable_data(), base.got.grad.data, base.got.grad.size_bytes());
    const int64_t row = first_effective_row(b);
    ASSERT_GE(row, 0);
    scale_element(grad.grad, row, 1.01);
    const oracle::CheckCase g = judge(grad);
    EXPECT_EQ(g.grad.mismatched, 1);
    EXPECT_EQ(g.grad.worst.sample, [&] {
      int64_t i = 0;
      while (b.response_offsets[i + 1] <= row) ++i;
      return i;
    }());
    EXPECT_FALSE(g.ok());

    CandidateResult masked = base.got;
    masked.grad = HostArray::zeros(base.got.grad.dtype, base.got.grad.shape);
    std::memcpy(masked.grad.mutable_data(), base.got.grad.data, base.got.grad.size_bytes());
    const int64_t mrow = first_masked_row(b);
    ASSERT_GE(mrow, 0);
    scale_element(masked.grad, mrow, 1.0);  // a masked row's zero gradient made 1e-3
    EXPECT_GT(judge(masked).grad.masked_nonzero, 0);

    CandidateResult flag = base.got;
    flag.skip_flag = true;  // "skip" on a batch with effective tokens
    EXPECT_FALSE(judge(flag).flag_ok);
  }
}

}  // namespace
}  // namespace lossguard
