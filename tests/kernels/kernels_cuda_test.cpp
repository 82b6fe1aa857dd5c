// The CUDA kernels against the CPU twins (counts, exactly) and against float64 loops (the fused
// cross entropy, under the same argued bounds as the twin), and the skip decision on the device.
// Every test skips, saying why, where the process sees no CUDA device.
#include <gtest/gtest.h>

#include "kernels/device_buffer.h"
#include "kernels/device_info.h"
#include "kernels/token_count.h"
#include "kernels/zero_flag.h"
#include "kernels_reference.h"

namespace lossguard::kernels {
namespace {

#define SKIP_WITHOUT_CUDA()                                                                  \
  do {                                                                                       \
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device: " << query_device_info().status; \
  } while (0)

template <typename T>
DeviceBuffer upload(const T* host, std::size_t count) {
  DeviceBuffer b(Device::kCuda, std::max<std::size_t>(count, 1) * sizeof(T));
  b.upload(host, count * sizeof(T));
  return b;
}

TEST(CudaTokenCount, AgreesExactlyWithTheCpuTwin) {
  SKIP_WITHOUT_CUDA();
  synth::Rng rng(test_seed());
  for (int trial = 0; trial < 12; ++trial) {
    synth::GenOptions o;
    o.seed = rng.next();
    o.masks_only = true;
    o.num_samples = rng.uniform_int(1, 300);
    o.max_response = rng.uniform_int(1, 5000);
    const Batch b = synth::make_case(trial % 2 ? "random" : "long-random", o);
    const std::vector<int64_t> cps = {1, 2, 3, 4, 8, 16};
    TokenCountArgs a = host_token_count_args(b, cps);
    std::vector<int64_t> want(static_cast<std::size_t>(token_count_size(a))), got(want.size(), -1);
    a.counts = want.data();
    count_tokens(a, Device::kCpu);
    DeviceBuffer mask = upload(b.loss_mask.data(), b.loss_mask.size()),
                 offsets = upload(b.response_offsets.data(), b.response_offsets.size()),
                 t = upload(b.total_lengths.data(), b.total_lengths.size()),
                 r = upload(b.response_lengths.data(), b.response_lengths.size()),
                 counts(Device::kCuda, want.size() * sizeof(int64_t));
    TokenCountArgs d = a;
    d.loss_mask = mask.as<uint8_t>();
    d.mask_offsets = offsets.as<int64_t>();
    d.total_lengths = t.as<int64_t>();
    d.response_lengths = r.as<int64_t>();
    d.counts = counts.as<int64_t>();
    count_tokens(d, Device::kCuda);
    counts.download(got.data(), got.size() * sizeof(int64_t));
    ASSERT_EQ(got, want) << "trial " << trial;
  }
}

TEST(CudaFusedXent, MatchesTheFloat64Reference) {
  SKIP_WITHOUT_CUDA();
  const XentRunner on_cuda = [](const XentArgs& h) {
    const std::size_t elem = dtype_size_bytes(h.dtype), rows = static_cast<std::size_t>(h.rows);
    const std::size_t n = rows * static_cast<std::size_t>(h.vocab);
    DeviceBuffer logits = upload(static_cast<const std::byte*>(h.logits), n * elem),
                 targets = upload(h.targets, rows), scale = upload(h.grad_scale, rows),
                 active = upload(h.active, rows),
                 lse(Device::kCuda, std::max<std::size_t>(rows, 1) * 4),
                 loss(Device::kCuda, std::max<std::size_t>(rows, 1) * 4),
                 grad(Device::kCuda, std::max<std::size_t>(n, 1) * elem);
    XentArgs d = h;
    d.logits = logits.data();
    d.targets = targets.as<int64_t>();
    d.grad_scale = scale.as<float>();
    d.active = active.as<uint8_t>();
    d.lse = lse.as<float>();
    d.token_loss = loss.as<float>();
    d.grad = grad.data();
    fused_xent(d, Device::kCuda);
    lse.download(h.lse, rows * 4);
    loss.download(h.token_loss, rows * 4);
    grad.download(h.grad, n * elem);
  };
  for (const XentCase& c : xent_cases()) {
    expect_xent_matches_reference(c, make_data(c, test_seed() + static_cast<uint64_t>(c.vocab)),
                                  on_cuda, "cuda");
  }
}

TEST(CudaSkipDecision, ReducedOnTheDeviceAndReadOnce) {
  SKIP_WITHOUT_CUDA();
  for (const std::vector<int64_t>& counts :
       {std::vector<int64_t>(100000, 0), std::vector<int64_t>{0, 0, 5},
        std::vector<int64_t>(70000, 1)}) {
    DeviceBuffer c = upload(counts.data(), counts.size()),
                 decision(Device::kCuda, sizeof(SkipDecision));
    reduce_skip_decision(c.as<int64_t>(), static_cast<int64_t>(counts.size()),
                         decision.as<SkipDecision>(), Device::kCuda);
    const SkipDecision got = read_skip_decision(decision.as<SkipDecision>(), Device::kCuda);
    int64_t want = 0;
    for (int64_t x : counts) want += x;
    EXPECT_EQ(got.num_tokens, want);
    EXPECT_EQ(got.skip, want == 0 ? 1 : 0);
  }
}

}  // namespace
}  // namespace lossguard::kernels
