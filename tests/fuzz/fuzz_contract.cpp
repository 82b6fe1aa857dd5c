// libFuzzer target: `weights` on contracts x layouts. A contract built from random components and
// scale terms (numbers from 1e-300 to 1e300 among them), a small batch and a layout (DP,
// micro-batches, static or dynamic CP), then the weights, the diagnosis, I5 and the verdict.
// Besides ASan and UBSan it traps when the verdict passes a non-finite or all-zero weight, a
// uniform scale Adam does not hide (<= 0, below 2^-10, above 2^64), or calls weights "exact" that
// an independent comparison with the objective's finds different; and it runs a second term with
// coefficients and masks of every kind through parse_term_contracts and evaluate_weights.
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/batch.h"
#include "core/contract.h"
#include "core/errors.h"
#include "core/term.h"
#include "oracle/count/placement.h"
#include "oracle/weights/weights.h"
#include "oracle/weights/weights_result.h"

namespace {

using namespace lossguard;

std::string random_contract(FuzzedDataProvider& in) {
  static const char* components[] = {
      "count=cp-local",    "count=full-sample", "count=samples",     "clamp=per-sample",
      "clamp=at-cp1",      "norm=none",         "norm=microbatch",   "norm=rank",
      "norm=global:dp",    "norm=global:cp",    "norm=global:world", "sample=mean",
      "grad=sum",          "grad=mean:dp",      "grad=mean:dp-cp",   "grad=mean:world",
      "norm=generation:1", "norm=generation:2", "norm=generation:3"};
  static const char* terms[] = {"cp",   "dp",  "tp",  "M",   "B",   "Bnz",  "L",
                                "1/cp", "1/M", "1/B", "1/L", "Lmb", "1/Lmb"};
  const std::vector<ContractPreset>& all = contract_presets();
  std::string c =
      in.ConsumeBool() ? all[in.ConsumeIntegralInRange<std::size_t>(0, all.size() - 1)].name : "";
  const int n = in.ConsumeIntegralInRange(0, 3);
  for (int k = 0; k < n; ++k) {
    c += (c.empty() ? "" : ",") +
         std::string(components[in.ConsumeIntegralInRange<std::size_t>(0, 18)]);
  }
  if (in.ConsumeBool()) {
    std::string scale;
    const int parts = in.ConsumeIntegralInRange(1, 4);
    for (int k = 0; k < parts; ++k) {
      std::string term;
      if (in.ConsumeBool()) {
        term = terms[in.ConsumeIntegralInRange<std::size_t>(0, 12)];
      } else {
        const double e = in.ConsumeFloatingPointInRange(-300.0, 300.0);
        term = std::to_string(std::pow(10.0, std::round(e)));
        if (in.ConsumeBool()) term = "1/" + term;
      }
      scale += (scale.empty() ? "" : "*") + term;
    }
    c += (c.empty() ? "" : ",") + ("scale=" + scale);
  }
  return c.empty() ? "truth" : c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const Reduction reduces[] = {Reduction::kPerToken, Reduction::kSampleMean,
                               Reduction::kSeqMeanTokenSum, Reduction::kSeqMeanTokenMean,
                               Reduction::kSeqMeanTokenSumNorm};
  const Reduction reduce = reduces[in.ConsumeIntegralInRange(0, 4)];
  BatchBuilder b;
  b.begin_file("fuzz");
  const int samples = in.ConsumeIntegralInRange(1, 10);
  std::vector<HostArray> keep;
  keep.reserve(static_cast<std::size_t>(samples) * 2);
  for (int i = 0; i < samples; ++i) {
    const int64_t t = in.ConsumeIntegralInRange<int64_t>(1, 30);
    const int64_t r = in.ConsumeIntegralInRange<int64_t>(0, t);
    keep.push_back(HostArray::from_i64(DType::kInt64, {t}, std::vector<int64_t>(t, 1)));
    SampleFields f;
    f.tokens = &keep.back();
    f.response_length = r;
    std::vector<int64_t> mask(static_cast<std::size_t>(r));
    for (auto& m : mask) m = in.ConsumeIntegralInRange(0, 3) != 0;
    keep.push_back(HostArray::from_i64(DType::kInt64, {r}, mask));
    f.loss_mask = &keep.back();
    b.add_sample(i, f);
  }
  const Batch batch = b.finish();
  const std::string text = random_contract(in);
  Contract contract;
  try {
    contract = parse_contract(text, reduce);
  } catch (const InputError&) {
    return 0;  // a contract the CLI refuses with exit 2 (a scale outside float32, ...)
  }
  const int64_t dp = in.ConsumeIntegralInRange<int64_t>(1, 4);
  const int64_t m = in.ConsumeIntegralInRange<int64_t>(1, 4);
  const int64_t cp = int64_t{1} << in.ConsumeIntegralInRange(0, 3);
  oracle::ObjectiveSizes sizes;
  if (in.ConsumeBool()) sizes.global_batch_size = in.ConsumeIntegralInRange<int64_t>(1, 20);
  if (in.ConsumeBool()) sizes.l_norm = in.ConsumeIntegralInRange<int64_t>(1, 40);
  const Placement p = oracle::place_samples(samples, dp, m, Split::kContiguous);
  StepLayout layout;
  try {
    layout = cp > 1 && in.ConsumeBool()
                 ? oracle::dynamic_cp_layout(batch.total_lengths, p, cp,
                                             in.ConsumeIntegralInRange<int64_t>(1, 40))
                 : static_layout(p, cp, in.ConsumeIntegralInRange<int64_t>(1, 2), {});
  } catch (const InputError&) {
    return 0;
  }
  const std::vector<double> truth = oracle::true_weights(batch, reduce, sizes);
  oracle::ContractWeights w;
  try {
    w = oracle::contract_weights(batch, layout, contract, sizes);
  } catch (const InputError&) {
    return 0;
  }
  int64_t n = 0;
  for (uint8_t x : batch.loss_mask) n += x;
  const oracle::WeightDiagnosis dg =
      oracle::diagnose_weights(batch, w.weight, truth, w.place, layout, n, w.global_count);
  std::vector<oracle::InvarianceResult> inv;
  try {
    inv = oracle::check_split_invariance(batch, layout, contract, sizes, Split::kContiguous, truth,
                                         {}, &w);
  } catch (const ScaleRangeError&) {
    return 0;  // a scale no trainer applies on some layout tried: exit 2, as the CLI says
  }
  const bool strict = in.ConsumeBool();
  const oracle::WeightsVerdict v = oracle::weights_verdict(dg, w, inv, strict);
  bool non_finite = false, all_zero = n > 0;
  for (std::size_t t = 0; t < w.weight.size(); ++t) {
    non_finite |= !std::isfinite(w.weight[t]) || !std::isfinite(truth[t]);
    if (truth[t] != 0.0 && w.weight[t] != 0.0) all_zero = false;
  }
  if ((non_finite || all_zero) && !v.here_fails) __builtin_trap();
  // A uniform scale passes only where Adam hides it (docs/semantics.md §9): 2^-10 <= s <= 2^64.
  // Independently: every effective token's ratio w/w* the same value s.
  if (!v.here_fails && !strict) {
    double s = NAN;
    bool uniform = true;
    for (std::size_t t = 0; t < w.weight.size(); ++t) {
      if (truth[t] == 0.0) continue;
      const double r = w.weight[t] / truth[t];
      if (std::isnan(s)) s = r;
      uniform &= std::fabs(r - s) <= 1e-9 * std::fabs(s);
    }
    if (uniform && !std::isnan(s) && !(s >= 0x1p-10 && s <= 0x1p64)) __builtin_trap();
  }
  // A second term (SPEC §11) with a coefficient that may be subnormal, empty or huge and a mask of
  // any kind, through the same path as `weights --term`: refused with exit 2 or weighed, never a
  // crash.
  if (in.ConsumeBool()) {
    static const char* coefs[] = {"0.1", "1e-320", "", "1e308", "-2", "nan", "1e-39", "3"};
    static const char* masks[] = {"loss", "all", "shift:1", "shift:40", "roll:2", "field", ""};
    std::string term = "kl:" + std::string(mode_name(reduce));
    const std::string coef = coefs[in.ConsumeIntegralInRange<std::size_t>(0, 7)];
    const std::string mask = masks[in.ConsumeIntegralInRange<std::size_t>(0, 6)];
    if (in.ConsumeBool()) term += ":" + coef;
    if (!mask.empty()) term += ":" + mask;
    std::vector<std::string> contracts = {text};
    if (in.ConsumeBool()) contracts.push_back("kl=" + random_contract(in));
    try {
      oracle::WeightsRequest q;
      q.terms = parse_term_contracts(std::string(mode_name(reduce)), contracts, {term});
      q.layout = layout;
      q.sizes = oracle::resolve_sizes(batch, sizes);
      q.strict_scale = strict;
      const oracle::WeightsResult r = oracle::evaluate_weights(batch, q);
      if (r.terms.size() != 2) __builtin_trap();
    } catch (const InputError&) {
    }
  }
  if (dg.exact()) {  // an independent look at "exact"
    for (std::size_t t = 0; t < w.weight.size(); ++t) {
      const double a = w.weight[t], e = truth[t];
      if (!(std::fabs(a - e) <= 1e-12 * std::max(std::fabs(a), std::fabs(e)))) __builtin_trap();
    }
  }
  return 0;
}
