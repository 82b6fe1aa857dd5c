// Effective token weights (SPEC §9) as the objective and a contract give them on a layout: the
// truth, the contract's counts, denominators and factors (per token or as owner runs) on the
// placement of oracle/count/token_placement.h, and the presets that reproduce given weights.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>

#include "core/errors.h"
#include "oracle/count/cp_shard.h"
#include "oracle/count/placement.h"
#include "oracle/count/token_placement.h"
#include "oracle/weights/weights.h"
#include "oracle/weights/weights_detail.h"

namespace lossguard::oracle {

using namespace weights_detail;

ObjectiveSizes resolve_sizes(const Batch& b, ObjectiveSizes z) {
  if (z.global_batch_size <= 0) z.global_batch_size = std::max<int64_t>(b.num_samples(), 1);
  if (z.l_norm <= 0) {
    int64_t max_r = 1;
    for (int64_t r : b.response_lengths) max_r = std::max(max_r, r);
    z.l_norm = static_cast<double>(max_r);
  }
  return z;
}

std::vector<double> true_sample_weights(const Batch& b, Reduction reduce,
                                        const ObjectiveSizes& sizes_in) {
  const ObjectiveSizes z = resolve_sizes(b, sizes_in);
  const int64_t s = b.num_samples();
  std::vector<int64_t> m(static_cast<std::size_t>(s));
  int64_t n = 0, nonzero = 0;
  for (int64_t i = 0; i < s; ++i) {
    m[i] = b.mask_sum(i);
    n += m[i];
    nonzero += m[i] > 0;
  }
  const double batch = static_cast<double>(z.global_batch_size);
  std::vector<double> w(static_cast<std::size_t>(s), 0.0);
  for (int64_t i = 0; i < s; ++i) {
    if (m[i] == 0) continue;
    double c = 0.0;
    switch (reduce) {
      case Reduction::kPerToken:
      case Reduction::kTokenMean:
        c = 1.0 / static_cast<double>(std::max<int64_t>(n, 1));
        break;
      case Reduction::kSampleMean:
        c = 1.0 / (batch * std::max(b.sample_denom(i, m[i]), 1.0));  // d_i, SPEC §3
        break;
      case Reduction::kSeqMeanTokenSum:
        c = 1.0 / batch;
        break;
      case Reduction::kSeqMeanTokenMean:
        c = 1.0 / (static_cast<double>(nonzero) * static_cast<double>(m[i]));
        break;
      case Reduction::kSeqMeanTokenSumNorm:  // Dr.GRPO: B·L_norm (verl agg_loss, TRL dr_grpo)
        c = 1.0 / (batch * z.l_norm);
        break;
    }
    w[i] = c;
  }
  return w;
}

std::vector<double> per_token_weights(const Batch& b, const std::vector<double>& per_sample) {
  std::vector<double> w(static_cast<std::size_t>(b.num_response_tokens()), 0.0);
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    for (int64_t row = b.response_offsets[i]; row < b.response_offsets[i + 1]; ++row) {
      w[row] = b.loss_mask[row] ? per_sample[i] : 0.0;
    }
  }
  return w;
}

std::vector<double> true_weights(const Batch& b, Reduction reduce, const ObjectiveSizes& sizes) {
  return per_token_weights(b, true_sample_weights(b, reduce, sizes));
}

namespace {

int64_t group_size(ReduceGroup g, const StepLayout& l) {
  switch (g) {
    case ReduceGroup::kDpCp:
      return l.dp * l.cp;
    case ReduceGroup::kDp:
      return l.dp;
    case ReduceGroup::kCp:
      return l.cp;
    case ReduceGroup::kWorld:
      return l.dp * l.cp * l.tp;
  }
  return 1;
}

bool same_shard(const ShardLayout& a, const ShardLayout& b) {
  return a.packing == b.packing && a.padded_total_length == b.padded_total_length &&
         a.max_seq_len == b.max_seq_len && a.pad_multiple == b.pad_multiple;
}

// The CP-local counts at CP size cs under a zig-zag layout (nullptr: not cacheable, count
// directly): from the cache, or counted once here.
const std::vector<int64_t>* owned_counts(const Batch& b, const StepLayout& layout, int64_t cs,
                                         const TermMasks& masks) {
  const int64_t s = b.num_samples();
  if (layout.cp_layout == CpLayout::kAllgather || s * cs > (int64_t{1} << 26)) return nullptr;
  OwnedCounts& cache = *masks.owned;
  std::lock_guard<std::mutex> lock(cache.mu);
  if (!cache.shard) cache.shard = layout.shard;
  if (!same_shard(*cache.shard, layout.shard)) return nullptr;
  auto& slot = cache.by_cp_size[cs];
  if (!slot) {
    auto counts = std::make_shared<std::vector<int64_t>>(static_cast<std::size_t>(s * cs), 0);
    std::vector<OwnedRun> runs;
    SampleSlot at;
    at.cp_size = cs;
    at.base = 0;
    for (int64_t i = 0; i < s && cs == 1; ++i) (*counts)[i] = masks.counted_sum[i];  // one owner
    for (int64_t i = 0; i < s && cs > 1; ++i) {
      owned_runs(b, i, layout, at, runs);
      const uint8_t* mask = masks.counted->data() + b.response_offsets[i];
      for (const OwnedRun& run : runs) {  // in order: a prefix-sum array would be read at random
        (*counts)[static_cast<std::size_t>(i * cs + run.owner)] +=
            count_mask_ones(mask + run.begin, run.end - run.begin);
      }
    }
    slot = std::move(counts);
  }
  return slot.get();
}

}  // namespace

namespace weights_detail {

TermMasks term_masks(const Batch& b, const Contract& contract, const ObjectiveSizes& sizes) {
  const int64_t s = b.num_samples();
  TermMasks out;
  out.own_sum.resize(static_cast<std::size_t>(s));
  for (int64_t i = 0; i < s; ++i) out.own_sum[i] = b.mask_sum(i);
  const std::vector<uint8_t>& counted =
      contract.count_of_main && sizes.main_mask != nullptr ? *sizes.main_mask : b.loss_mask;
  LG_CHECK(counted.size() == b.loss_mask.size(), "main mask of {} tokens for {}", counted.size(),
           b.loss_mask.size());
  out.counted_sum = out.own_sum;
  if (&counted != &b.loss_mask) {
    for (int64_t i = 0; i < s; ++i) {
      out.counted_sum[i] = 0;
      for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t)
        out.counted_sum[i] += counted[t];
    }
  }
  out.counted = &counted;
  return out;
}

}  // namespace weights_detail

namespace {

// Step 1 of contract_factors: each rank's count per micro-batch as the contract counts it
// ([num_mb * cp], as ContractWeights::count). A sample placed twice is counted where first placed:
// its owners are that sub-group's ranks only.
std::vector<int64_t> contract_counts(const Batch& b, const StepLayout& layout,
                                     const Contract& contract, const PlacedSamples& placed,
                                     const TermMasks& masks) {
  const int64_t s = b.num_samples(), cp = layout.cp;
  const auto num_mb = static_cast<int64_t>(layout.microbatches.size());
  std::vector<int64_t> count(static_cast<std::size_t>(num_mb * cp), 0);
  std::vector<int64_t> owned;
  std::vector<OwnedRun> runs;
  std::map<int64_t, const std::vector<int64_t>*> by_cp_size;  // this call's view of the cache
  std::set<int64_t> uncached;
  for (int64_t i = 0; i < s; ++i) {
    const SampleSlot& at = placed.slot[i];
    if (at.microbatch < 0) continue;
    const int64_t cs = at.cp_size, base = at.base;
    const bool clamp =
        contract.clamp == ClampRule::kPerSample || (contract.clamp == ClampRule::kAtCp1 && cs == 1);
    auto clamped = [&](int64_t x) { return clamp ? std::max<int64_t>(x, 1) : x; };
    int64_t* row = &count[static_cast<std::size_t>(at.microbatch * cp + base)];
    switch (contract.count) {
      case CountRule::kCpLocal: {
        const std::vector<int64_t>*& known = by_cp_size[cs];
        if (known == nullptr && !uncached.count(cs)) {
          known = owned_counts(b, layout, cs, masks);
          if (known == nullptr) uncached.insert(cs);
        }
        if (known != nullptr) {
          const int64_t* counts = known->data() + i * cs;
          for (int64_t r = 0; r < cs; ++r) row[r] += clamped(counts[r]);
          break;
        }
        owned.assign(static_cast<std::size_t>(cs), 0);
        owned_runs(b, i, layout, at, runs);
        const uint8_t* mask = masks.counted->data() + b.response_offsets[i];
        for (const OwnedRun& run : runs)
          owned[run.owner - base] += count_mask_ones(mask + run.begin, run.end - run.begin);
        for (int64_t r = 0; r < cs; ++r) row[r] += clamped(owned[r]);
        break;
      }
      case CountRule::kFullSample:
        for (int64_t r = 0; r < cs; ++r) row[r] += clamped(masks.counted_sum[i]);
        break;
      case CountRule::kSamples:
        for (int64_t r = 0; r < cs; ++r) row[r] += 1;
        break;
    }
  }
  return count;
}

// Step 2 of contract_factors: the denominator D of every (micro-batch, CP rank), from the counts'
// totals per rank, per DP and CP group, over every rank and per generation batch.
class ContractDenominators {
 public:
  ContractDenominators(const StepLayout& layout, const Contract& contract,
                       const std::vector<int64_t>& count)
      : layout_(layout), contract_(contract), count_(count) {
    const int64_t cp = layout.cp;
    const auto num_mb = static_cast<int64_t>(layout.microbatches.size());
    rank_total_.assign(static_cast<std::size_t>(layout.dp * cp), 0);
    for (int64_t k = 0; k < num_mb; ++k) {
      const int64_t d = layout.microbatches[k].dp_rank;
      if (d < 0 || d >= layout.dp)
        throw_input_error("micro-batch on DP rank {}, but DP is {}", d, layout.dp);
      for (int64_t c = 0; c < cp; ++c) rank_total_[d * cp + c] += count[k * cp + c];
    }
    over_dp_.assign(static_cast<std::size_t>(cp), 0);
    over_cp_.assign(static_cast<std::size_t>(layout.dp), 0);
    for (int64_t d = 0; d < layout.dp; ++d) {
      for (int64_t c = 0; c < cp; ++c) {
        over_dp_[c] += rank_total_[d * cp + c];
        over_cp_[d] += rank_total_[d * cp + c];
        all_ += rank_total_[d * cp + c];
      }
    }
    // norm=generation:S: micro-batch index / S names its generation batch; counted over every
    // rank.
    if (contract.norm == NormRule::kGeneration) {
      for (int64_t k = 0; k < num_mb; ++k) {
        const auto g = static_cast<std::size_t>(layout.microbatches[k].index / contract.generation);
        if (generation_total_.size() <= g) generation_total_.resize(g + 1, 0);
        for (int64_t c = 0; c < cp; ++c) generation_total_[g] += count[k * cp + c];
      }
    }
  }

  // D of micro-batch k's CP rank c.
  int64_t at(int64_t k, int64_t c) const {
    const int64_t cp = layout_.cp, d = layout_.microbatches[k].dp_rank;
    switch (contract_.norm) {
      case NormRule::kGeneration:
        return generation_total_[static_cast<std::size_t>(layout_.microbatches[k].index /
                                                          contract_.generation)];
      case NormRule::kNone:
        return 1;
      case NormRule::kMicrobatch:
        return count_[k * cp + c];
      case NormRule::kRank:
        return rank_total_[d * cp + c];
      case NormRule::kGlobal:
        switch (contract_.norm_group) {
          case ReduceGroup::kDpCp:
            return all_;
          case ReduceGroup::kDp:
            return over_dp_[c];
          case ReduceGroup::kCp:
            return over_cp_[d];
          case ReduceGroup::kWorld:
            return all_ * layout_.tp;
        }
    }
    return 1;
  }

 private:
  const StepLayout& layout_;
  const Contract& contract_;
  const std::vector<int64_t>& count_;  // [num_mb * cp]
  std::vector<int64_t> rank_total_;    // [dp * cp]
  std::vector<int64_t> over_dp_;       // [cp]: summed over DP ranks
  std::vector<int64_t> over_cp_;       // [dp]: summed over CP ranks
  int64_t all_ = 0;
  std::vector<int64_t> generation_total_;  // norm=generation:S only
};

// The longest response among micro-batch mb's samples.
int64_t longest_response(const Batch& b, const MicroBatch& mb) {
  const int64_t s = b.num_samples();
  int64_t longest = 0;
  for (const auto& group : mb.groups) {
    for (int64_t i : group) {
      if (i >= 0 && i < s) longest = std::max(longest, b.response_lengths[i]);
    }
  }
  return longest;
}

// Step 3 of contract_factors: factor[k * cp + c] of every (micro-batch, CP rank); 0 for a dummy
// micro-batch.
std::vector<double> contract_factor_values(const Batch& b, const StepLayout& layout,
                                           const Contract& contract, const ObjectiveSizes& z,
                                           int64_t nonzero,
                                           const ContractDenominators& denominator) {
  const int64_t cp = layout.cp;
  const auto num_mb = static_cast<int64_t>(layout.microbatches.size());
  const std::vector<int64_t> rank_microbatches = layout.microbatches_per_rank();
  const double grad_div = contract.grad == GradRule::kMean
                              ? static_cast<double>(group_size(contract.grad_group, layout))
                              : 1.0;
  std::vector<double> factor(static_cast<std::size_t>(num_mb * cp), 0.0);
  for (int64_t k = 0; k < num_mb; ++k) {
    const MicroBatch& mb = layout.microbatches[k];
    if (mb.dummy) continue;
    ScaleSizes sz;
    sz.cp = cp;
    sz.dp = layout.dp;
    sz.tp = layout.tp;
    sz.microbatches = rank_microbatches[mb.dp_rank];
    sz.batch = z.global_batch_size;
    sz.batch_nonzero = std::max<int64_t>(nonzero, 1);
    sz.l_norm = z.l_norm;
    sz.microbatch_max_response = std::max(sz.microbatch_max_response, longest_response(b, mb));
    const double scale = scale_value(contract.scale, sz);
    for (int64_t c = 0; c < cp; ++c) {
      factor[k * cp + c] =
          scale / static_cast<double>(std::max<int64_t>(denominator.at(k, c), 1)) / grad_div;
    }
  }
  return factor;
}

// SPEC §9's w_t formula in its three steps (counts, denominators, factors); a hot path of
// `weights` (bench/weights_bench.sh). A contract's weight for a token of sample i, owned by CP rank
// c in micro-batch k of DP rank d, is
//   w_t = m_t · scale · 1/max(D, 1) · (1/max(d_i, 1) if sample = mean) / (|G| if grad = mean:G)
// where D is the contract's count (none / micro-batch / rank / all-reduced over a group).
ContractFactors contract_factors(const Batch& b, const StepLayout& layout, const Contract& contract,
                                 const ObjectiveSizes& sizes_in, const PlacedSamples& placed,
                                 const TermMasks& masks) {
  const ObjectiveSizes z = resolve_sizes(b, sizes_in);
  const int64_t s = b.num_samples();
  ContractFactors out;
  const std::vector<int64_t>& m = masks.own_sum;
  int64_t nonzero = 0;
  for (int64_t i = 0; i < s; ++i) nonzero += m[i] > 0;

  out.count = contract_counts(b, layout, contract, placed, masks);
  for (int64_t x : out.count) out.global_count += x;
  const ContractDenominators denominator(layout, contract, out.count);
  out.factor = contract_factor_values(b, layout, contract, z, nonzero, denominator);
  out.per_sample.assign(static_cast<std::size_t>(s), 1.0);
  if (contract.sample == SampleRule::kMean) {
    for (int64_t i = 0; i < s; ++i)
      out.per_sample[i] = 1.0 / std::max(b.sample_denom(i, m[i]), 1.0);
  }
  return out;
}

}  // namespace

ContractWeights contract_weights(const Batch& b, const StepLayout& layout, const Contract& contract,
                                 const ObjectiveSizes& sizes_in, const PlacedTokens* given) {
  ContractWeights out;
  // The samples' slots (for the factors; cheap: no owner runs), and from them every token's owner
  // unless the caller placed the tokens already.
  const PlacedSamples samples = place_sample_slots(b, layout);
  PlacedTokens placed = given != nullptr ? *given : place_tokens_of(b, layout, samples);
  out.place = std::move(placed.place);
  out.problems = std::move(placed.problems);
  ContractFactors f =
      contract_factors(b, layout, contract, sizes_in, samples, term_masks(b, contract, sizes_in));
  out.count = std::move(f.count);
  out.global_count = f.global_count;
  const int64_t cp = layout.cp;
  out.weight.assign(static_cast<std::size_t>(b.num_response_tokens()), 0.0);
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    const int32_t k = out.place.sample_microbatch[i];
    if (k < 0) continue;
    const double* factor = f.factor.data() + static_cast<std::size_t>(k) * cp;
    const double per_sample = f.per_sample[i];
    for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
      const int16_t o = out.place.owner[t];
      if (o >= 0 && b.loss_mask[t]) out.weight[t] = factor[o] * per_sample;
    }
  }
  return out;
}

namespace weights_detail {

LayoutWeights layout_weights(const Batch& b, const StepLayout& l, const Contract& contract,
                             const ObjectiveSizes& sizes, const TermMasks& masks,
                             const PlacedSamples* placed) {
  LayoutWeights w;
  w.layout = &l;
  if (placed == nullptr) w.own = place_sample_slots(b, l);
  w.given = placed;
  w.factors = contract_factors(b, l, contract, sizes, w.placed(), masks);
  return w;
}

void value_runs(const Batch& b, int64_t i, const LayoutWeights& w, std::vector<OwnedRun>& scratch,
                std::vector<ValueRun>& out) {
  out.clear();
  const SampleSlot& at = w.placed().slot[i];
  if (at.microbatch < 0) return;
  owned_runs(b, i, *w.layout, at, scratch);
  const double* factor =
      w.factors.factor.data() + static_cast<std::size_t>(at.microbatch) * w.layout->cp;
  for (const OwnedRun& r : scratch) {
    ValueRun& v = out.emplace_back();  // field by field: see add_run (count/token_placement.cpp)
    v.begin = r.begin;
    v.end = r.end;
    v.owner = r.owner;
    v.value = factor[r.owner] * w.factors.per_sample[i];
  }
}

}  // namespace weights_detail

std::vector<std::string> matching_presets(const Batch& b, const StepLayout& layout,
                                          const std::vector<double>& got, Reduction reduce,
                                          const ObjectiveSizes& sizes, double tol,
                                          const PlacedTokens* given) {
  // Every candidate contract places the tokens the same way: once.
  std::optional<PlacedTokens> own;
  if (given == nullptr) own = place_tokens(b, layout);
  const PlacedTokens* placed = given != nullptr ? given : &*own;
  std::vector<std::string> out;
  const bool term = sizes.main_mask != nullptr;  // a loss term's weights: its presets too
  for (const auto& p : contract_presets()) {
    if (p.term_only && !term) continue;
    const ContractWeights w =
        contract_weights(b, layout, preset_contract(p.name, reduce), sizes, placed);
    if (same_weights(got, w.weight, tol)) out.push_back(p.name);
  }
  if (!out.empty()) return out;
  // Single component changes: of the truth, then of every preset (the first level that matches).
  const std::vector<std::string>& changes = single_component_changes();
  // Every preset's variations cost a pass each over the tokens: only for batches of modest size.
  const bool all_presets = b.num_response_tokens() <= (1 << 20);
  for (const auto& p : contract_presets()) {
    if (std::string(p.name) != "truth" && !all_presets) break;
    if (p.term_only && !term) continue;
    const Contract base = preset_contract(p.name, reduce);
    for (const std::string& change : changes) {
      const Contract c = parse_contract(contract_components(base) + "," + change, reduce);
      if (c == base) continue;
      const ContractWeights w = contract_weights(b, layout, c, sizes, placed);
      if (same_weights(got, w.weight, tol))
        out.push_back(fmt::format("{} with {}", p.name, change));
    }
    if (!out.empty()) break;
  }
  return out;
}

}  // namespace lossguard::oracle
