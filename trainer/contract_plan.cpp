// Contract coefficients, rank-centric (see contract_plan.h).
#include "trainer/contract_plan.h"

#include <algorithm>
#include <map>

#include "core/errors.h"

namespace lossguard::trainer {

namespace {

// A micro-batch of the step: (DP rank, micro-batch index on that rank).
using Cell = std::pair<int64_t, int64_t>;
// What each rank (d, r) counts for its micro-batch k: local[(d, k)][r].
using LocalCounts = std::map<Cell, std::vector<int64_t>>;

// Which micro-batch holds each sample ({-1, -1}: none).
std::vector<Cell> sample_cells(const Placement& placement, int64_t s) {
  const int64_t dp = static_cast<int64_t>(placement.size());
  std::vector<Cell> where(static_cast<std::size_t>(s), {-1, -1});
  for (int64_t d = 0; d < dp; ++d) {
    for (std::size_t k = 0; k < placement[d].size(); ++k) {
      for (int64_t i : placement[d][k]) where[i] = {d, static_cast<int64_t>(k)};
    }
  }
  return where;
}

// Per sample: its full mask sum (what every rank sees of it when it counts full samples).
std::vector<int64_t> full_mask_sums(const Batch& b) {
  const int64_t s = b.num_samples();
  std::vector<int64_t> full(static_cast<std::size_t>(s), 0);
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t)
      full[i] += b.loss_mask[t];
  }
  return full;
}

// Every rank's count for its micro-batches, CP rank by CP rank: the rank sees each of its
// micro-batch's samples; cp-local counts its owned effective rows.
LocalCounts local_counts(const Batch& b, const ShardPlan& plan, int64_t cp, const Contract& c,
                         const Placement& placement, const std::vector<Cell>& where,
                         const std::vector<int64_t>& full) {
  const int64_t dp = static_cast<int64_t>(placement.size());
  const int64_t s = b.num_samples();
  LocalCounts local;
  for (int64_t d = 0; d < dp; ++d) {
    for (std::size_t k = 0; k < placement[d].size(); ++k)
      local[{d, static_cast<int64_t>(k)}].assign(cp, 0);
  }
  auto clamp = [&](int64_t x) {
    const bool on = c.clamp == ClampRule::kPerSample || (c.clamp == ClampRule::kAtCp1 && cp == 1);
    return on ? std::max<int64_t>(x, 1) : x;
  };
  for (int64_t r = 0; r < cp; ++r) {
    std::vector<int64_t> owned_in_sample(static_cast<std::size_t>(s), 0);
    for (const OwnedRow& o : plan.owned[r]) owned_in_sample[o.sample] += b.loss_mask[o.row];
    for (int64_t i = 0; i < s; ++i) {
      if (where[i].first < 0) continue;
      int64_t x = 0;
      switch (c.count) {
        case CountRule::kCpLocal:
          x = clamp(owned_in_sample[i]);
          break;
        case CountRule::kFullSample:
          x = clamp(full[i]);
          break;
        case CountRule::kSamples:
          x = 1;
          break;
      }
      local[where[i]][r] += x;
    }
  }
  return local;
}

// The all-reduces: each rank's count over its micro-batches, and the denominator each contract's
// norm rule all-reduces from the counts.
struct AllReduced {
  const Contract& c;
  const LocalCounts& local;
  int64_t dp, cp, tp;
  std::vector<int64_t> per_rank;  // [dp * cp]: over the rank's micro-batches

  AllReduced(const Contract& contract, const LocalCounts& by_microbatch, int64_t num_dp,
             int64_t num_cp, int64_t num_tp)
      : c(contract), local(by_microbatch), dp(num_dp), cp(num_cp), tp(num_tp) {
    per_rank.assign(static_cast<std::size_t>(dp * cp), 0);
    for (const auto& [key, counts] : local) {
      for (int64_t r = 0; r < cp; ++r) per_rank[key.first * cp + r] += counts[r];
    }
  }

  // D of rank (d, r)'s micro-batch k.
  int64_t denominator(int64_t d, int64_t k, int64_t r) const {
    switch (c.norm) {
      case NormRule::kGeneration: {  // the generation batch of micro-batch k: k / S, every rank
        int64_t sum = 0;
        for (const auto& [key, counts] : local) {
          if (key.second / c.generation != k / c.generation) continue;
          for (int64_t x : counts) sum += x;
        }
        return sum;
      }
      case NormRule::kNone:
        return 1;
      case NormRule::kMicrobatch:
        return local.at({d, k})[r];
      case NormRule::kRank:
        return per_rank[d * cp + r];
      case NormRule::kGlobal: {
        int64_t sum = 0;
        for (int64_t d2 = 0; d2 < dp; ++d2) {
          for (int64_t r2 = 0; r2 < cp; ++r2) {
            const bool member = c.norm_group == ReduceGroup::kDpCp ||
                                c.norm_group == ReduceGroup::kWorld ||
                                (c.norm_group == ReduceGroup::kDp && r2 == r) ||
                                (c.norm_group == ReduceGroup::kCp && d2 == d);
            if (member) sum += per_rank[d2 * cp + r2];
          }
        }
        return c.norm_group == ReduceGroup::kWorld ? sum * tp : sum;
      }
    }
    return 1;
  }
};

// The step's sizes the scale reads (all but the micro-batch's own).
ScaleSizes step_sizes(const Batch& b, const ContractRun& run, int64_t dp, int64_t cp,
                      const std::vector<int64_t>& full) {
  const int64_t s = b.num_samples();
  int64_t nonzero = 0, max_r = 1;
  for (int64_t i = 0; i < s; ++i) {
    nonzero += full[i] > 0;
    max_r = std::max(max_r, b.response_lengths[i]);
  }
  ScaleSizes sizes;
  sizes.cp = cp;
  sizes.dp = dp;
  sizes.tp = run.tp;
  sizes.batch = run.global_batch_size > 0 ? run.global_batch_size : std::max<int64_t>(s, 1);
  sizes.batch_nonzero = std::max<int64_t>(nonzero, 1);
  sizes.l_norm = run.l_norm > 0 ? run.l_norm : static_cast<double>(max_r);
  return sizes;
}

// The gradient's divisor: the size of the group a mean gradient is averaged over (1: summed).
double grad_group_size(const Contract& c, int64_t dp, int64_t cp, int64_t tp) {
  double group = 1.0;
  if (c.grad == GradRule::kMean) {
    switch (c.grad_group) {
      case ReduceGroup::kDpCp:
        group = static_cast<double>(dp * cp);
        break;
      case ReduceGroup::kDp:
        group = static_cast<double>(dp);
        break;
      case ReduceGroup::kCp:
        group = static_cast<double>(cp);
        break;
      case ReduceGroup::kWorld:
        group = static_cast<double>(dp * cp * tp);
        break;
    }
  }
  return group;
}

// Each rank's factor for each of its micro-batches, once (the all-reduced counts are per rank and
// micro-batch, not per token).
std::map<Cell, std::vector<double>> microbatch_factors(const Batch& b, const Contract& c,
                                                       const Placement& placement,
                                                       const AllReduced& reduced, ScaleSizes sizes,
                                                       double group) {
  const int64_t cp = reduced.cp;
  std::map<Cell, std::vector<double>> factor;
  for (const auto& [key, counts] : reduced.local) {
    sizes.microbatches = static_cast<int64_t>(placement[key.first].size());
    sizes.microbatch_max_response = 1;
    for (int64_t i : placement[key.first][key.second]) {
      sizes.microbatch_max_response =
          std::max(sizes.microbatch_max_response, b.response_lengths[i]);
    }
    const double scale = scale_value(c.scale, sizes);
    std::vector<double>& f = factor[key];
    f.resize(static_cast<std::size_t>(cp));
    for (int64_t r = 0; r < cp; ++r) {
      f[r] =
          scale /
          static_cast<double>(std::max<int64_t>(reduced.denominator(key.first, key.second, r), 1)) /
          group;
    }
  }
  return factor;
}

}  // namespace

// The candidate's contract arithmetic in a trainer's order (placement, counts, all-reduces,
// factors), written apart from the oracle's (oracle/weights/contract_weights.cpp) so that the two
// can disagree.
ContractCoefficients contract_coefficients(const Batch& b, const ShardPlan& plan, int64_t cp,
                                           const ContractRun& run) {
  const Contract& c = *run.contract;
  const Placement& placement = *run.placement;
  const int64_t dp = static_cast<int64_t>(placement.size());
  const std::vector<Cell> where = sample_cells(placement, b.num_samples());
  const std::vector<int64_t> full = full_mask_sums(b);
  const LocalCounts local = local_counts(b, plan, cp, c, placement, where, full);
  const AllReduced reduced(c, local, dp, cp, run.tp);
  ContractCoefficients out;
  for (int64_t x : reduced.per_rank) out.global_count += x;
  std::map<Cell, std::vector<double>> factor =
      microbatch_factors(b, c, placement, reduced, step_sizes(b, run, dp, cp, full),
                         grad_group_size(c, dp, cp, run.tp));
  out.coeff.assign(static_cast<std::size_t>(b.num_response_tokens()), 0.0);
  for (int64_t r = 0; r < cp; ++r) {
    for (const OwnedRow& o : plan.owned[r]) {
      const auto& place = where[o.sample];
      if (place.first < 0 || !b.loss_mask[o.row]) continue;
      double w = factor[place][r];
      if (c.sample == SampleRule::kMean)
        w /= std::max(b.sample_denom(o.sample, full[o.sample]), 1.0);
      out.coeff[o.row] = w;
    }
  }
  return out;
}

}  // namespace lossguard::trainer
