// The candidate, as a CP-sharded trainer computes it: each CP rank takes its zig-zag token chunks,
// keeps the logits it holds, counts the effective tokens they predict, and computes its partial
// loss in the dump's dtype with LibTorch ops; denominators are summed over ranks (the all-reduce),
// the loss is the SUM of the partials, and each rank's autograd gradient is scattered back into the
// full gradient.
#include "trainer/candidate.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <malloc.h>

#include <cstring>
#include <future>
#include <limits>
#include <new>
#include <stdexcept>

#include "trainer/contract_plan.h"
#include "trainer/shard_plan.h"

namespace lossguard::trainer {

namespace {

at::ScalarType scalar_type(DType d) {
  switch (d) {
    case DType::kFloat16:
      return at::kHalf;
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kFloat32:
      return at::kFloat;
    case DType::kFloat64:
      return at::kDouble;
    default:
      return at::kFloat;
  }
}

// A view of the batch's memory, not a copy (logits can be GiBs): the candidate only reads it
// (index_select, dtype conversions), never writes in place, and the batch outlives the run.
at::Tensor borrowed_tensor(const HostArray& a) {
  std::vector<int64_t> shape(a.shape.begin(), a.shape.end());
  return at::from_blob(const_cast<std::byte*>(a.data), shape,
                       at::TensorOptions().dtype(scalar_type(a.dtype)));
}

// What every block of a run computes with: the batch, the spec, the input, the coefficients.
struct BlockInputs {
  const CandidateInput* in;
  const at::Tensor& x;  // the loss input, a view of the batch
  at::ScalarType dt;    // the working dtype
  LossInput input;
  const TrainerDenominators& d;
  const ContractCoefficients& by_contract;
  const at::Tensor& old_all;  // ppo-clip from log-probs: old log-probs and advantages, in dt
  const at::Tensor& adv_all;
};

struct Block {
  std::vector<int64_t> rows;
  at::Tensor grad;  // [rows, cols] in the working dtype
  double partial = 0.0;
};

// Counts: every rank counts its own effective tokens; the all-reduce sums them. Per-sample
// effective tokens summed over ranks, and N.
std::pair<std::vector<int64_t>, int64_t> count_owned_tokens(const Batch& b, const ShardPlan& plan,
                                                            int64_t cp) {
  const int64_t rows = b.num_response_tokens();
  const at::Tensor mask =
      at::from_blob(const_cast<uint8_t*>(b.loss_mask.data()), {rows}, at::kByte).to(at::kLong);
  std::vector<int64_t> m(static_cast<std::size_t>(b.num_samples()), 0);
  int64_t n_fixed = 0;
  for (int64_t rank = 0; rank < cp; ++rank) {
    std::vector<int64_t> idx;
    for (const auto& o : plan.owned[rank]) idx.push_back(o.row);
    const at::Tensor rank_rows = at::tensor(idx, at::kLong);
    const at::Tensor w = idx.empty() ? at::zeros({0}, at::kLong) : mask.index_select(0, rank_rows);
    n_fixed += w.sum().item<int64_t>();
    auto wa = w.accessor<int64_t, 1>();
    for (std::size_t k = 0; k < idx.size(); ++k)
      m[plan.owned[rank][k].sample] += wa[static_cast<int64_t>(k)];
  }
  return {std::move(m), n_fixed};
}

// A rank's rows [b0, b1): their partial loss in the working dtype, and its gradient by autograd.
Block compute_block(const BlockInputs& bi, const std::vector<OwnedRow>& mine, std::size_t b0,
                    std::size_t b1) {
  const CandidateInput* in = bi.in;
  const Batch& b = *in->batch;
  const LossSpec& spec = in->spec;
  const LossInput input = bi.input;
  const at::Tensor& x = bi.x;
  const TrainerDenominators& d = bi.d;
  const ContractCoefficients& by_contract = bi.by_contract;
  Block out_block;
  std::vector<int64_t>& idx = out_block.rows;
  std::vector<int64_t> targets;
  std::vector<double> coeff;
  for (std::size_t k = b0; k < b1; ++k) {
    const OwnedRow& o = mine[k];
    idx.push_back(o.row);
    const int64_t i = o.sample;
    const int64_t j = o.row - b.response_offsets[i];
    coeff.push_back((in->contract != nullptr ? by_contract.coeff[o.row]
                                             : token_coefficient(d, spec, i, b.loss_mask[o.row])) *
                    (in->weight_scale != nullptr ? (*in->weight_scale)[o.row] : 1.0));
    if (input == LossInput::kLogits) {
      // RL: tokens[P + j]. SFT (P = 0): row j is position j, predicting tokens[j + 1]; the
      // last row's label is 0, as Relax's compute_sft_response_chunk pads it.
      const int64_t p = b.prompt_length(i), next = p > 0 ? p + j : j + 1;
      targets.push_back(next < b.total_lengths[i] ? b.tokens[b.token_offsets[i] + next] : 0);
    }
  }
  const at::Tensor rows_idx = at::tensor(idx, at::kLong);
  // A block of consecutive rows (every block at CP 1, nearly every block of a large
  // vocabulary's rows: see the loop below) is a view of the mapped dump, not a copy: one pass
  // over the block less.
  bool consecutive = true;
  for (std::size_t k = 1; k < idx.size() && consecutive; ++k) {
    consecutive = idx[k] == idx[0] + static_cast<int64_t>(k);
  }
  const at::Tensor leaf = (consecutive ? x.narrow(0, idx.front(), static_cast<int64_t>(idx.size()))
                                       : x.index_select(0, rows_idx))
                              .detach()
                              .requires_grad_(true);
  const at::Tensor c = at::tensor(coeff, at::kDouble).to(bi.dt);
  at::Tensor partial;
  {
    c10::AutoGradMode enable(true);
    at::Tensor l;
    if (input == LossInput::kLogits) {
      // nll_loss of log_softmax, as torch.nn.functional.cross_entropy computes it: the same
      // values as -log_softmax(z).gather(y), but its backward writes -1 at the targets of a
      // zero-filled gradient, where gather's backward is a scatter_add that PyTorch 2.x runs
      // on a float copy of the whole bf16 block (half of the candidate's time). No target is
      // ignored (nll_loss's default skips -100): one outside the vocabulary is an error, as
      // gather's was.
      const at::Tensor y = at::tensor(targets, at::kLong);
      l = at::nll_loss(at::log_softmax(leaf, -1), y, /*weight=*/{}, at::Reduction::None,
                       std::numeric_limits<int64_t>::min());
    } else if (spec.loss == LossKind::kNll) {
      l = -leaf;
    } else if (spec.loss == LossKind::kPpoClip) {
      const at::Tensor old = bi.old_all.index_select(0, rows_idx);
      const at::Tensor adv = bi.adv_all.index_select(0, rows_idx);
      const at::Tensor rho = at::exp(leaf - old);
      const at::Tensor clipped = at::clamp(rho, 1.0 - spec.eps_low, 1.0 + spec.eps_high);
      l = at::maximum(-rho * adv, -clipped * adv);
    } else {
      l = leaf;
    }
    partial = (l * c).sum();
    partial.backward();
  }
  out_block.partial = partial.to(at::kDouble).item<double>();
  out_block.grad = leaf.grad().contiguous();
  return out_block;
}

// Every rank's blocks in turn, each block's gradient handed to the sink; the sum of the partial
// losses. Up to `block` rows a block.
double run_blocks(const BlockInputs& bi, const ShardPlan& plan, int64_t cp, int64_t block,
                  int64_t row_bytes) {
  const CandidateInput* in = bi.in;
  const auto& owned = plan.owned;
  const bool split_at_jumps = row_bytes >= (int64_t{64} << 10);
  double total = 0.0;
  std::future<void> judging;
  Block judged;  // the block the sink is reading
  auto finish_judging = [&] {
    if (judging.valid()) judging.get();  // rethrows the sink's error
    judged = Block{};
  };
  try {
    for (int64_t rank = 0; rank < cp; ++rank) {
      const auto& mine = owned[rank];
      for (std::size_t b0 = 0, b1 = 0; b0 < mine.size(); b0 = b1) {
        // Up to `block` rows; rows of 64 KiB or more (a vocabulary's logits) also end a block
        // of 1 MiB or more where the rank's rows jump (a zig-zag chunk's end), so that most
        // blocks are views of the dump instead of index_select copies (5% of a 150k-vocabulary
        // check at CP 4). Smaller blocks and small rows run on across the jump: a block per
        // short chunk (or per chunk of 100k samples' per-token values) would cost more in
        // LibTorch's per-call overhead than the copy.
        b1 = b0 + 1;
        while (b1 < mine.size() && b1 - b0 < static_cast<std::size_t>(block) &&
               (mine[b1].row == mine[b1 - 1].row + 1 || !split_at_jumps ||
                static_cast<int64_t>(b1 - b0) * row_bytes < (int64_t{1} << 20)))
          ++b1;
        Block next = compute_block(bi, mine, b0, b1);
        finish_judging();
        total += next.partial;
        judged = std::move(next);
        judging = std::async(std::launch::async, [&in, &judged] {
          in->sink(judged.rows.data(), static_cast<int64_t>(judged.rows.size()),
                   judged.grad.data_ptr());
        });
      }
    }
    finish_judging();
  } catch (...) {
    if (judging.valid()) judging.wait();  // the sink reads `judged` until it returns
    throw;
  }
  return total;
}

void run(const CandidateInput* in, CandidateOutput* out) {
  // glibc maps and unmaps an allocation over its mmap threshold each time (a page fault per 4 KiB,
  // each page zeroed by the kernel: 40% of the time here); at its largest allowed value (32 MiB)
  // with blocks whose float working tensors stay under 16 MiB, they stay in the heap and are
  // reused.
  static const bool heap_tuned = [] {
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 256 << 20);
    return true;
  }();
  (void)heap_tuned;
  try {
    c10::AutoGradMode outer_no_grad(false);  // re-enabled per block
    const Batch& b = *in->batch;
    const LossSpec& spec = in->spec;
    const int64_t cp = in->cp;
    const LossInput input = loss_input(b, spec.loss);
    const HostArray& x_host = loss_input_array(b, input);
    const at::Tensor x = borrowed_tensor(x_host);
    const at::ScalarType dt = x.scalar_type();
    out->dtype = std::string(dtype_name(x_host.dtype));

    // 1. Each rank's rows. 2. Counts and the denominator (the contract's when one is given).
    const ShardPlan plan_rows = plan_shards(b, cp, in->layout);
    out->row_rank = plan_rows.row_rank;
    out->row_chunk = plan_rows.row_chunk;
    auto [m, n_fixed] = count_owned_tokens(b, plan_rows, cp);
    const TrainerDenominators d = trainer_denominators(b, spec, cp, std::move(m), n_fixed);
    out->denominator = d.denominator;
    ContractCoefficients by_contract;
    if (in->contract != nullptr) {
      by_contract = contract_coefficients(
          b, plan_rows, cp,
          {in->contract, in->placement, in->tp, in->global_batch_size, spec.l_norm});
      out->denominator = by_contract.global_count;
    }

    // 3. Each rank's partial loss in the working dtype, and its gradient by autograd, a block of
    // the rank's rows at a time (the loss is a sum over tokens, and a row's gradient depends only
    // on its own input and coefficient): each block's gradient goes to the sink, so memory stays
    // two blocks' worth (one computed, one judged) whatever the vocabulary.
    if (!in->sink) throw std::logic_error("the torch candidate: no gradient sink");
    // ppo-clip's other inputs, in the working dtype, once for every rank.
    at::Tensor old_all, adv_all;
    if (input == LossInput::kLogProbs && spec.loss == LossKind::kPpoClip) {
      old_all = borrowed_tensor(b.per_token.at("old_log_probs")).to(dt);
      adv_all = borrowed_tensor(b.per_token.at("advantages")).to(dt);
    }
    const int64_t cols = x_host.shape.size() == 2 ? x_host.shape[1] : 1;
    // Rows per block: the float working tensors (log_softmax's) under 16 MiB each.
    const int64_t block = std::max<int64_t>(1, (int64_t{16} << 20) / (cols * 4));
    const int64_t row_bytes = cols * static_cast<int64_t>(dtype_size_bytes(x_host.dtype));
    const BlockInputs bi{in, x, dt, input, d, by_contract, old_all, adv_all};
    out->loss = run_blocks(bi, plan_rows, cp, block, row_bytes);
  } catch (const std::bad_alloc&) {
    out->error = "out of memory";
    out->error_kind = ErrorKind::kInternal;
  } catch (const std::exception& e) {
    std::string msg = e.what();
    out->error = msg.substr(0, msg.find('\n'));
    out->error_kind = error_kind_of(e);
  }
}

const TrainerApi kApi = {kTrainerAbiVersion, run};

}  // namespace

}  // namespace lossguard::trainer

extern "C" __attribute__((visibility("default"))) const lossguard::trainer::TrainerApi*
lossguard_trainer_api() {
  return &lossguard::trainer::kApi;
}
