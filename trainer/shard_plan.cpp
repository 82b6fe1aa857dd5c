// The trainer's zig-zag split and coefficients (see shard_plan.h).
#include "trainer/shard_plan.h"

#include <algorithm>

#include "core/errors.h"
#include "kernels/token_count.h"

namespace lossguard::trainer {

ShardPlan plan_shards(const Batch& b, int64_t cp, const ShardLayout& layout) {
  ShardPlan plan;
  plan.owned.resize(static_cast<std::size_t>(cp));
  const int64_t rows = b.num_response_tokens();
  plan.row_rank.assign(static_cast<std::size_t>(rows), -1);
  plan.row_chunk.assign(static_cast<std::size_t>(rows), -1);
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    const int64_t t = b.total_lengths[i], r = b.response_lengths[i], p = t - r;
    const bool sft = r == t;
    if (cp == 1) {  // an unsharded trainer uses every row
      for (int64_t j = 0; j < r; ++j) plan.owned[0].push_back({b.response_offsets[i] + j, i, 0});
      continue;
    }
    const int64_t cs = kernels::chunk_size_of(t, cp, kernels::chunk_rule(layout),
                                              b.padded_total_length(i));  // header-only
    for (int64_t rank = 0; rank < cp; ++rank) {
      const int64_t chunks[2] = {rank, 2 * cp - 1 - rank};
      for (int8_t c = 0; c < 2; ++c) {
        for (int64_t q = chunks[c] * cs; q < (chunks[c] + 1) * cs; ++q) {
          if (q >= t - 1) break;  // padding, or the last token's logit (it predicts nothing)
          const int64_t index = sft ? q : q + 1 - p;  // SFT masks are in predictor coordinates
          if (!sft && q + 1 < p) continue;            // predicts a prompt token
          plan.owned[rank].push_back({b.response_offsets[i] + index, i, c});
        }
      }
    }
  }
  for (int64_t rank = 0; rank < cp; ++rank) {
    for (const auto& o : plan.owned[rank]) {
      if (plan.row_rank[o.row] != -1) throw InputError("a response row is owned by two CP ranks");
      plan.row_rank[o.row] = static_cast<int32_t>(rank);
      plan.row_chunk[o.row] = o.chunk;
    }
  }
  return plan;
}

TrainerDenominators trainer_denominators(const Batch& b, const LossSpec& spec, int64_t cp,
                                         std::vector<int64_t> m, int64_t n_fixed) {
  TrainerDenominators d;
  const int64_t s = b.num_samples();
  int64_t n_max1 = 0, max_r = 0;
  for (int64_t i = 0; i < s; ++i) {
    n_max1 += std::max<int64_t>(m[i], 1);
    d.k_nonempty += m[i] > 0;
    max_r = std::max(max_r, b.response_lengths[i]);
  }
  d.n = n_fixed;
  if (spec.policy == Policy::kLegacy && cp == 1) d.n = n_max1;  // Relax before PR #285
  if (spec.policy == Policy::kSlime) {                          // every rank counts full samples
    d.n = cp * n_max1;
    d.cp_scale = static_cast<double>(cp);
  }
  d.batch_size = static_cast<double>(std::max<int64_t>(s, 1));
  d.l_norm = spec.l_norm > 0 ? spec.l_norm : static_cast<double>(std::max<int64_t>(max_r, 1));
  switch (spec.reduce) {
    case Reduction::kPerToken:
    case Reduction::kTokenMean:
      d.denominator = d.n;
      break;
    case Reduction::kSampleMean:
    case Reduction::kSeqMeanTokenSum:
      d.denominator = s;
      break;
    case Reduction::kSeqMeanTokenMean:
      d.denominator = d.k_nonempty;
      break;
    case Reduction::kSeqMeanTokenSumNorm:  // B·L_norm
      d.denominator = std::llround(d.batch_size * d.l_norm);
      break;
  }
  d.m = std::move(m);
  d.sample_denom.resize(d.m.size());
  for (std::size_t i = 0; i < d.m.size(); ++i)
    d.sample_denom[i] = b.sample_denom(static_cast<int64_t>(i), d.m[i]);
  return d;
}

double token_coefficient(const TrainerDenominators& d, const LossSpec& spec, int64_t i, double w) {
  double c = 0.0;
  switch (spec.reduce) {
    case Reduction::kPerToken:
    case Reduction::kTokenMean:
      c = d.cp_scale / static_cast<double>(std::max<int64_t>(d.n, 1));
      break;
    case Reduction::kSampleMean:
      c = 1.0 / (std::max(d.sample_denom[i], 1.0) * d.batch_size);
      break;
    case Reduction::kSeqMeanTokenSum:
      c = 1.0 / d.batch_size;
      break;
    case Reduction::kSeqMeanTokenMean:
      c = d.m[i] > 0 ? 1.0 / (static_cast<double>(d.m[i]) * static_cast<double>(d.k_nonempty))
                     : 0.0;
      break;
    case Reduction::kSeqMeanTokenSumNorm:
      c = 1.0 / (d.batch_size * d.l_norm);
      break;
  }
  return w * c;
}

}  // namespace lossguard::trainer
