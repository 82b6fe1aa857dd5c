// libFuzzer target: the batch validator (SPEC §1) on arbitrary samples: lengths, masks, per-token
// fields and logits of arbitrary shapes and values, then the counting and replay code on what it
// accepts.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>

#include "core/batch.h"
#include "core/errors.h"
#include "oracle/count/denominators.h"
#include "oracle/count/findings.h"
#include "oracle/replay/replay.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace lossguard;
  FuzzedDataProvider in(data, size);
  try {
    BatchBuilder b;
    b.begin_file("fuzz");
    const int samples = in.ConsumeIntegralInRange(0, 8);
    for (int i = 0; i < samples; ++i) {
      const int64_t t = in.ConsumeIntegralInRange<int64_t>(0, 40);
      std::vector<int64_t> tokens(static_cast<std::size_t>(t));
      for (auto& x : tokens) x = in.ConsumeIntegralInRange<int64_t>(-2, 9);
      HostArray tok = HostArray::from_i64(DType::kInt64, {t}, tokens);
      SampleFields f;
      f.tokens = &tok;
      f.response_length = in.ConsumeIntegralInRange<int64_t>(-1, 41);
      if (in.ConsumeBool()) f.total_length = in.ConsumeIntegralInRange<int64_t>(-1, 41);
      const int64_t m = in.ConsumeIntegralInRange<int64_t>(0, 41);
      std::vector<double> mask(static_cast<std::size_t>(m));
      for (auto& x : mask)
        x = in.ConsumeIntegralInRange(0, 8) == 0 ? in.ConsumeFloatingPoint<double>()
                                                 : in.ConsumeIntegralInRange(0, 1);
      HostArray mk = HostArray::from_f64(DType::kFloat32, {m}, mask);
      if (in.ConsumeBool()) f.loss_mask = &mk;
      const int64_t rows = in.ConsumeIntegralInRange<int64_t>(0, 41),
                    cols = in.ConsumeIntegralInRange<int64_t>(1, 5);
      HostArray logits = HostArray::zeros(DType::kBFloat16, {rows, cols});
      if (in.ConsumeBool()) f.logits = &logits;
      HostArray lp = HostArray::zeros(DType::kFloat16, {in.ConsumeIntegralInRange<int64_t>(0, 41)});
      if (in.ConsumeBool()) f.per_token["log_probs"] = &lp;
      b.add_sample(i, f);
    }
    const Batch batch = b.finish();
    oracle::batch_findings(batch);
    const int64_t cp = in.ConsumeIntegralInRange<int64_t>(1, 5);
    oracle::OwnedCounts counts = oracle::count_owned_tokens(batch, {1, cp}, {});
    oracle::check_invariants(batch, counts, Policy::kLegacy, {}, nullptr);
    const oracle::Topology topo(in.ConsumeIntegralInRange<int64_t>(1, 2),
                                in.ConsumeIntegralInRange<int64_t>(1, 3), cp,
                                in.ConsumeIntegralInRange<int64_t>(1, 3));
    const auto placement =
        oracle::place_samples(batch.num_samples(), topo.dp(), 2, Split::kRoundRobin);
    const auto inputs = oracle::make_replay_inputs(
        batch, topo, placement, all_modes<oracle::Protocol>()[in.ConsumeIntegralInRange(0, 4)],
        oracle::ReduceMode::kSampleMean, Policy::kFixed, {});
    oracle::simulate(inputs);
  } catch (const InputError&) {
  }
  return 0;
}
