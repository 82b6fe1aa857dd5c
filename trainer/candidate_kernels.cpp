// The candidate through kernels/ (check --impl kernels): every CP rank's effective tokens counted
// by the token-count kernel, the global zero-token flag reduced on the device and read once at the
// end, and the nll from logits by the fused log-prob/loss/gradient kernel (float arithmetic,
// gradient in the logits' dtype). Log-prob inputs need no fused kernel: an elementwise loop in
// float (double for float64). No LibTorch: this runs in process.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/errors.h"
#include "kernels/device_buffer.h"
#include "kernels/fused_xent.h"
#include "kernels/token_count.h"
#include "kernels/zero_flag.h"
#include "trainer/candidate.h"
#include "trainer/contract_plan.h"
#include "trainer/shard_plan.h"

namespace lossguard::trainer {

namespace {

using kernels::Device;
using kernels::DeviceBuffer;

// A host array's bytes where the kernels run: the host memory itself on the CPU, a copy on a GPU.
template <typename T>
const T* on_device(const T* host, std::size_t count, Device device,
                   std::vector<DeviceBuffer>& keep) {
  if (device == Device::kCpu) return host;
  keep.emplace_back(device, count * sizeof(T));
  keep.back().upload(host, count * sizeof(T));
  return keep.back().as<T>();
}

// log-prob and token-loss inputs: loss and gradient element by element in Acc.
template <typename Acc>
double elementwise(const Batch& b, const LossSpec& spec, const HostArray& x_host,
                   const std::vector<double>& coeff, const std::vector<int32_t>& row_rank,
                   HostArray* grad) {
  const int64_t rows = b.num_response_tokens();
  std::vector<double> x(static_cast<std::size_t>(rows)), old, adv,
      g(static_cast<std::size_t>(rows), 0.0);
  x_host.copy_f64(0, rows, x.data());
  if (spec.loss == LossKind::kPpoClip) {
    old.resize(static_cast<std::size_t>(rows));
    adv.resize(static_cast<std::size_t>(rows));
    b.per_token.at("old_log_probs").copy_f64(0, rows, old.data());
    b.per_token.at("advantages").copy_f64(0, rows, adv.data());
  }
  const Acc lo = static_cast<Acc>(1.0 - spec.eps_low), hi = static_cast<Acc>(1.0 + spec.eps_high);
  double total = 0.0;
  for (int64_t r = 0; r < rows; ++r) {
    if (row_rank[r] < 0 || coeff[r] == 0.0) continue;
    const Acc c = static_cast<Acc>(coeff[r]), v = static_cast<Acc>(x[r]);
    Acc l, dl;
    if (spec.loss == LossKind::kNll) {
      l = -v;
      dl = -1;
    } else if (spec.loss == LossKind::kPpoClip) {
      const Acc a = static_cast<Acc>(adv[r]);
      const Acc rho = std::exp(v - static_cast<Acc>(old[r]));
      const Acc unclipped = -rho * a, clipped = -std::clamp(rho, lo, hi) * a;
      l = std::max(unclipped, clipped);
      dl = (unclipped >= clipped || (rho >= lo && rho <= hi)) ? -rho * a : Acc(0);
    } else {
      l = v;
      dl = 1;
    }
    total += static_cast<double>(c * l);
    g[r] = static_cast<double>(c * dl);
  }
  *grad = HostArray::from_f64(x_host.dtype, x_host.shape, g);
  return total;
}

// 1. Counts: every rank's effective tokens for every sample ([S * cp] on the device), one pass over
// the masks on the device. The inputs' device copies go to `keep`, which outlives the counts.
DeviceBuffer count_tokens_on_device(const CandidateInput& in, std::vector<DeviceBuffer>& keep) {
  const Batch& b = *in.batch;
  const int64_t s = b.num_samples();
  const Device device = in.device;
  kernels::TokenCountArgs ca;
  ca.loss_mask = on_device(b.loss_mask.data(), b.loss_mask.size(), device, keep);
  ca.mask_offsets = on_device(b.response_offsets.data(), b.response_offsets.size(), device, keep);
  ca.total_lengths = on_device(b.total_lengths.data(), b.total_lengths.size(), device, keep);
  ca.response_lengths =
      on_device(b.response_lengths.data(), b.response_lengths.size(), device, keep);
  ca.num_samples = s;
  ca.cp_sizes = &in.cp;
  ca.num_cp = 1;
  ca.chunk = kernels::chunk_rule(in.layout);
  if (!b.padded_total_lengths.empty()) {
    ca.chunk.padded_lengths =
        on_device(b.padded_total_lengths.data(), b.padded_total_lengths.size(), device, keep);
  }
  const std::size_t num_counts = static_cast<std::size_t>(s * in.cp);
  DeviceBuffer counts(device, std::max<std::size_t>(num_counts, 1) * sizeof(int64_t));
  ca.counts = counts.as<int64_t>();
  kernels::count_tokens(ca, device);
  return counts;
}

// 3. Coefficients, per response row, from the counts (the verifier needs the per-sample counts on
// the host; the trainer's step does not); sets out->denominator.
std::vector<double> candidate_coefficients(const CandidateInput& in, const ShardPlan& plan,
                                           const DeviceBuffer& counts, CandidateOutput* out) {
  const Batch& b = *in.batch;
  const LossSpec& spec = in.spec;
  const int64_t cp = in.cp, s = b.num_samples(), rows = b.num_response_tokens();
  const std::size_t num_counts = static_cast<std::size_t>(s * cp);
  std::vector<int64_t> host_counts(num_counts);
  counts.download(host_counts.data(), num_counts * sizeof(int64_t));
  std::vector<int64_t> m(static_cast<std::size_t>(s), 0);
  int64_t n_fixed = 0;
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t r = 0; r < cp; ++r) m[i] += host_counts[static_cast<std::size_t>(i * cp + r)];
    n_fixed += m[i];
  }
  const TrainerDenominators d = trainer_denominators(b, spec, cp, std::move(m), n_fixed);
  out->denominator = d.denominator;
  std::vector<double> coeff(static_cast<std::size_t>(rows), 0.0);
  if (in.contract != nullptr) {
    ContractCoefficients by_contract = contract_coefficients(
        b, plan, cp, {in.contract, in.placement, in.tp, in.global_batch_size, spec.l_norm});
    coeff = std::move(by_contract.coeff);
    out->denominator = by_contract.global_count;
  } else {
    for (const auto& rank_rows : plan.owned) {
      for (const OwnedRow& o : rank_rows)
        coeff[o.row] = token_coefficient(d, spec, o.sample, b.loss_mask[o.row]);
    }
  }

  if (in.weight_scale != nullptr) {
    for (std::size_t row = 0; row < coeff.size(); ++row) coeff[row] *= (*in.weight_scale)[row];
  }
  return coeff;
}

// What the fused kernel reads per response row besides the logits.
struct XentRows {
  std::vector<int64_t> targets;
  std::vector<float> scale;
  std::vector<uint8_t> active;  // owned by a CP rank and weighed
};

// Every row's target token, gradient scale and whether it is active; throws InputError for an
// active row's target outside the vocabulary [0, v).
XentRows xent_rows(const Batch& b, const ShardPlan& plan, const std::vector<double>& coeff,
                   int64_t v) {
  const int64_t s = b.num_samples(), rows = b.num_response_tokens();
  XentRows x;
  x.targets.assign(static_cast<std::size_t>(rows), 0);
  x.scale.assign(static_cast<std::size_t>(rows), 0.0f);
  x.active.assign(static_cast<std::size_t>(rows), 0);
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t j = 0; j < b.response_lengths[i]; ++j) {
      const int64_t row = b.response_offsets[i] + j;
      // RL: tokens[P + j]. SFT (P = 0): row j predicts tokens[j + 1]; the last row's label
      // is 0 (Relax's compute_sft_response_chunk).
      const int64_t p = b.prompt_length(i), next = p > 0 ? p + j : j + 1;
      x.targets[row] = next < b.total_lengths[i] ? b.tokens[b.token_offsets[i] + next] : 0;
      x.scale[row] = static_cast<float>(coeff[row]);
      x.active[row] = plan.row_rank[row] >= 0 && coeff[row] != 0.0;
      if (x.active[row] && (x.targets[row] < 0 || x.targets[row] >= v)) {
        throw InputError(fmt::format(
            "{}: target token {} at response index {} is outside the vocabulary [0, {})",
            b.describe_sample(i), x.targets[row], j, v));
      }
    }
  }
  return x;
}

// 4. Loss and gradient from logits through the fused kernel, block by block of rows: the logits a
// block reads (uploaded to the GPU per block), its gradient handed to the sink before the next
// block overwrites it. Memory: one block. Returns the SUM over CP ranks of each rank's partial
// loss.
double fused_xent_candidate(const CandidateInput& in, const HostArray& x_host,
                            const ShardPlan& plan, const std::vector<double>& coeff) {
  const Batch& b = *in.batch;
  const Device device = in.device;
  const int64_t rows = b.num_response_tokens();
  if (!kernels::fused_xent_takes(x_host.dtype)) {
    throw InputError(fmt::format(
        "the kernels take float32, float16 or bfloat16 logits; these are {} (JSON dumps "
        "load as float64): use --impl torch",
        dtype_name(x_host.dtype)));
  }
  const int64_t v = x_host.shape.at(1);
  const XentRows x = xent_rows(b, plan, coeff, v);
  const std::size_t elem = dtype_size_bytes(x_host.dtype);
  const std::size_t row_bytes = static_cast<std::size_t>(v) * elem;
  const int64_t block = std::min<int64_t>(rows_per_block(row_bytes), std::max<int64_t>(rows, 1));
  const std::size_t block_bytes = static_cast<std::size_t>(block) * row_bytes;
  std::vector<float> token_loss(static_cast<std::size_t>(rows), 0.0f);
  std::vector<std::byte> host_grad(block_bytes);
  std::vector<int64_t> ids(static_cast<std::size_t>(block));
  const bool gpu = device != Device::kCpu;
  DeviceBuffer logits_dev, grad_dev, targets_dev, scale_dev, active_dev;
  DeviceBuffer lse(device, static_cast<std::size_t>(block) * 4),
      loss(device, static_cast<std::size_t>(block) * 4);
  if (gpu) {
    logits_dev = DeviceBuffer(device, block_bytes);
    grad_dev = DeviceBuffer(device, block_bytes);
    targets_dev = DeviceBuffer(device, static_cast<std::size_t>(block) * 8);
    scale_dev = DeviceBuffer(device, static_cast<std::size_t>(block) * 4);
    active_dev = DeviceBuffer(device, static_cast<std::size_t>(block));
  }
  for (int64_t r0 = 0; r0 < rows; r0 += block) {
    const int64_t n = std::min(block, rows - r0);
    kernels::XentArgs xa;
    xa.dtype = x_host.dtype;
    xa.rows = n;
    xa.vocab = v;
    xa.row_stride = v;
    const std::byte* z = x_host.data + static_cast<std::size_t>(r0) * row_bytes;
    if (!gpu) {
      xa.logits = z;
      xa.targets = x.targets.data() + r0;
      xa.grad_scale = x.scale.data() + r0;
      xa.active = x.active.data() + r0;
      xa.grad = host_grad.data();
    } else {
      logits_dev.upload(z, static_cast<std::size_t>(n) * row_bytes);
      targets_dev.upload(x.targets.data() + r0, static_cast<std::size_t>(n) * 8);
      scale_dev.upload(x.scale.data() + r0, static_cast<std::size_t>(n) * 4);
      active_dev.upload(x.active.data() + r0, static_cast<std::size_t>(n));
      xa.logits = logits_dev.data();
      xa.targets = targets_dev.as<int64_t>();
      xa.grad_scale = scale_dev.as<float>();
      xa.active = active_dev.as<uint8_t>();
      xa.grad = grad_dev.data();
    }
    xa.lse = lse.as<float>();
    xa.token_loss = loss.as<float>();
    kernels::fused_xent(xa, device);
    loss.download(token_loss.data() + r0, static_cast<std::size_t>(n) * 4);
    if (gpu) grad_dev.download(host_grad.data(), static_cast<std::size_t>(n) * row_bytes);
    for (int64_t k = 0; k < n; ++k) ids[static_cast<std::size_t>(k)] = r0 + k;
    in.sink(ids.data(), n, host_grad.data());
  }
  double total = 0.0;
  for (const auto& rank_rows : plan.owned) {
    double partial = 0.0;
    for (const OwnedRow& o : rank_rows) partial += coeff[o.row] * token_loss[o.row];
    total += partial;
  }
  return total;
}

// 4. Loss and gradient from log-prob or token-loss inputs, element by element, the gradient handed
// to the sink in one piece.
double elementwise_candidate(const CandidateInput& in, const HostArray& x_host,
                             const ShardPlan& plan, const std::vector<double>& coeff) {
  const Batch& b = *in.batch;
  const int64_t rows = b.num_response_tokens();
  HostArray grad;
  const double total = x_host.dtype == DType::kFloat64
                           ? elementwise<double>(b, in.spec, x_host, coeff, plan.row_rank, &grad)
                           : elementwise<float>(b, in.spec, x_host, coeff, plan.row_rank, &grad);
  std::vector<int64_t> ids(static_cast<std::size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) ids[static_cast<std::size_t>(r)] = r;
  if (rows > 0) in.sink(ids.data(), rows, grad.data);
  return total;
}

}  // namespace

// The kernels candidate in a trainer's order (counts, the device flag, each CP rank's shard through
// the fused kernel, the gradient streamed out), as the LibTorch one.
void run_kernels_candidate(const CandidateInput& in, CandidateOutput* out) {
  try {
    const Batch& b = *in.batch;
    const int64_t cp = in.cp, s = b.num_samples();
    const Device device = in.device;
    const LossInput input = loss_input(b, in.spec.loss);
    const HostArray& x_host = loss_input_array(b, input);
    out->dtype = std::string(dtype_name(x_host.dtype));
    ShardPlan plan = plan_shards(b, cp, in.layout);

    for (int64_t i = 0; i < s; ++i)
      chunk_size(b.total_lengths[i], cp, in.layout, b.padded_total_length(i));  // throws if bad
    if (!in.sink) throw std::logic_error("run_kernels_candidate: no gradient sink");
    std::vector<DeviceBuffer> keep;
    const DeviceBuffer counts = count_tokens_on_device(in, keep);
    // 2. The skip decision stays on the device until the end.
    DeviceBuffer decision(device, sizeof(kernels::SkipDecision));
    kernels::reduce_skip_decision(counts.as<int64_t>(), s * cp,
                                  decision.as<kernels::SkipDecision>(), device);
    const std::vector<double> coeff = candidate_coefficients(in, plan, counts, out);
    out->loss = input == LossInput::kLogits ? fused_xent_candidate(in, x_host, plan, coeff)
                                            : elementwise_candidate(in, x_host, plan, coeff);
    out->row_rank = std::move(plan.row_rank);
    out->row_chunk = std::move(plan.row_chunk);
    out->skip_flag =
        kernels::read_skip_decision(decision.as<kernels::SkipDecision>(), device).skip ==
        1;  // the one sync
  } catch (const std::bad_alloc&) {
    out->error = "out of memory";
    out->error_kind = ErrorKind::kInternal;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    out->error = msg.substr(0, msg.find('\n'));
    out->error_kind = error_kind_of(e);
  }
}

}  // namespace lossguard::trainer
