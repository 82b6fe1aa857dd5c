// The candidate's switch: the LibTorch plugin (liblossguard_trainer.so, loaded on first use) or the
// kernels, in process.
#include <cstdlib>
#include <cstring>

#include "core/errors.h"
#include "core/plugin_loader.h"
#include "kernels/fused_xent.h"
#include "lossguard/build_config.h"
#include "lossguard/plugin_paths.h"
#include "trainer/candidate.h"
#include "trainer/mutation.h"

namespace lossguard::trainer {

Arithmetic arithmetic_of(Impl impl, int64_t vocab, kernels::Device device) {
  Arithmetic a;
  if (impl == Impl::kKernels) {
    a.kind = Arithmetic::Kind::kFusedFloat;
    // CUDA: each of 512 threads adds its strided elements (rescaling its sum, one more rounding,
    // whenever its maximum grows), then 9 merges of (max, sum) pairs, each two roundings.
    a.exp_sum_chain = device == kernels::Device::kCuda ? 2 * ((vocab + 511) / 512) + 18
                                                       : kernels::kFusedXentSumChain;
  } else {
    a.kind = Arithmetic::Kind::kTorch;
    // PyTorch's CPU log_softmax adds a row's exponentials into one vector of 8 float lanes (AVX2;
    // 16 with AVX-512, a shorter chain), then adds the lanes.
    a.exp_sum_chain = (vocab + 7) / 8 + 8;
  }
  return a;
}

namespace {

// Gathers streamed rows into one array (no sink given, or a mutation that edits the whole output).
struct Collector {
  HostArray* grad;
  std::size_t row_bytes;
  static void rows(void* self, const int64_t* r, int64_t n, const void* data) {
    auto* c = static_cast<Collector*>(self);
    const auto* src = static_cast<const std::byte*>(data);
    for (int64_t k = 0; k < n; ++k) {
      std::memcpy(c->grad->mutable_data() + static_cast<std::size_t>(r[k]) * c->row_bytes,
                  src + static_cast<std::size_t>(k) * c->row_bytes, c->row_bytes);
    }
  }
};

// LibTorch's OpenMP workers spin after each parallel region by default, on the cores the oracle's
// comparison of the block they just produced needs (1.3 GB bf16 check: 7.4 s against 5.8 s
// passive). Set before libgomp loads with the plugin, on the thread that starts the load (setenv
// is not safe against a concurrent getenv); a user's own setting wins.
void set_omp_wait_policy() { setenv("OMP_WAIT_POLICY", "PASSIVE", /*overwrite=*/0); }

// The plugin's table, loaded once per process (a failure is remembered and thrown on every call).
const TrainerApi* torch_api() {
  return static_cast<const TrainerApi*>(
      load_plugin_table("the LibTorch trainer (liblossguard_trainer.so)", "LOSSGUARD_TRAINER",
                        LOSSGUARD_TRAINER_PLUGIN, "lossguard_trainer_api", kTrainerAbiVersion));
}

}  // namespace

TorchPreload::TorchPreload() {
  set_omp_wait_policy();
  thread_ = std::thread([] {
    try {
      torch_api();
    } catch (...) {  // remembered by load_plugin_table, and thrown where the candidate runs
    }
  });
}

TorchPreload::~TorchPreload() {
  if (thread_.joinable()) thread_.join();
}

CandidateOutput run_candidate(const CandidateInput& in_given) {
  // Test-only: a planted bug (LOSSGUARD_TEST_MUTATION, mutation.h) the tests expect check to catch.
  const std::optional<Mutation> mutation = mutation_from_environment();
  std::optional<Batch> mutated;
  CandidateInput in = in_given;
  if (mutation && (mutated = mutate_input(*mutation, *in.batch))) in.batch = &*mutated;
  std::vector<double> weight_scale;
  if (mutation && !(weight_scale = mutate_weights(*mutation, *in.batch, in.cp, in.layout)).empty())
    in.weight_scale = &weight_scale;
  CandidateOutput out;
  // Collect the gradient whole when nobody streams it, or when a mutation edits it afterwards.
  const bool collect = !in_given.sink || (mutation && mutates_output(*mutation));
  const LossInput which = loss_input(*in.batch, in.spec.loss);
  const HostArray& x = loss_input_array(*in.batch, which);
  const int64_t rows = in.batch->num_response_tokens();
  const std::size_t row_bytes =
      rows > 0 ? x.size_bytes() / static_cast<std::size_t>(rows) : dtype_size_bytes(x.dtype);
  Collector collector{&out.grad, row_bytes};
  if (collect) {
    out.grad = HostArray::zeros(x.dtype, x.shape);
    in.sink = GradSink{&collector, &Collector::rows};
  }
  if (in.impl == Impl::kKernels) {
    run_kernels_candidate(in, &out);
  } else {
    set_omp_wait_policy();
    torch_api()->run(&in, &out);
  }
  if (!out.error.empty()) {
    rethrow_error(out.error_kind == ErrorKind::kNone ? ErrorKind::kInternal : out.error_kind,
                  std::string("trainer (") + mode_name(in.impl) + "): " + out.error);
  }
  if (mutation) mutate_output(*mutation, *in_given.batch, &out);
  if (collect && in_given.sink)  // the mutated gradient, streamed as the candidate would have
    stream_rows(out.grad.data, rows, row_bytes, rows_per_block(row_bytes), in_given.sink);
  return out;
}

}  // namespace lossguard::trainer
