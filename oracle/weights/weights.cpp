// Effective token weights (SPEC §9). A contract's weight for a token of sample i, owned by CP rank
// c in micro-batch k of DP rank d, is
//   w_t = m_t · scale · 1/max(D, 1) · (1/max(d_i, 1) if sample = mean) / (|G| if grad = mean:G)
// where D is the contract's count (none / micro-batch / rank / all-reduced over a group).
#include "oracle/weights/weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "core/errors.h"
#include "oracle/count/cp_shard.h"
#include "oracle/count/placement.h"

namespace lossguard::oracle {

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

// A run of one sample's mask indices [begin, end) (sample-relative) owned by one static CP rank.
struct OwnedRun {
  int64_t begin = 0, end = 0;
  int16_t owner = -1;
};

// Where a sample is trained on a layout: its micro-batch and CP sub-group, and what its owners
// follow from (the sub-group's size and first static rank; the all-gather stream offset and part).
struct SampleSlot {
  int32_t microbatch = -1, group = -1;
  int64_t cp_size = 1, base = 0, stream_offset = 0, part_length = 1;
};
struct PlacedSamples {
  std::vector<SampleSlot> slot;  // [S]; microbatch -1: placed nowhere
  std::vector<std::string> problems;
};

// Appends a run field by field: a braced temporary is built on the stack and copied back in
// halves, a store-forwarding stall that was the single hottest instruction of `weights` with I5.
inline void add_run(std::vector<OwnedRun>& out, int64_t begin, int64_t end, int64_t owner) {
  OwnedRun& r = out.emplace_back();
  r.begin = begin;
  r.end = end;
  r.owner = static_cast<int16_t>(owner);
}

// The owner runs of sample i's mask indices, in index order (SPEC §2: the zig-zag or all-gather
// cut). Indices no rank owns (SFT index T-1 under CP > 1) lie in no run.
void owned_runs(const Batch& b, int64_t i, const StepLayout& layout, const SampleSlot& at,
                std::vector<OwnedRun>& out) {
  out.clear();
  const int64_t t = b.total_lengths[i], r = b.response_lengths[i], p = t - r;
  const int64_t cp_size = at.cp_size, base = at.base;
  if (cp_size == 1) {  // an unsharded rank holds the whole sample (SFT index T-1 too)
    if (r > 0) add_run(out, 0, r, base);
    return;
  }
  if (layout.cp_layout == CpLayout::kAllgather) {
    // The owner holds the stream position of the predicting logit: P-1+j (RL), j (SFT, j < T-1).
    const bool sft = r == t;
    const int64_t n = sft ? std::min(r, t - 1) : r, shift = sft ? 0 : p - 1;
    for (int64_t j = 0; j < n;) {
      const int64_t q = (at.stream_offset + shift + j) / at.part_length;
      const int64_t next = std::min(n, (q + 1) * at.part_length - at.stream_offset - shift);
      add_run(out, j, next, base + q);
      j = next;
    }
    return;
  }
  // Chunk c of the 2·cp zig-zag chunks belongs to rank c (c < cp) or 2·cp-1-c: walking the
  // chunks in order gives the runs in index order (owned_mask_ranges, chunk by chunk).
  const int64_t cs = chunk_size(t, cp_size, layout.shard, b.padded_total_length(i));
  const bool sft = r == t;
  for (int64_t c = 0; c < 2 * cp_size; ++c) {
    // owned_mask_ranges' arithmetic for this one chunk: logit positions [lo, hi), predicting
    // response indices lo+1-P .. hi-P (RL) or predictor indices lo .. hi-1 (SFT).
    const int64_t lo = std::max(c * cs, p - 1), hi = std::min((c + 1) * cs, t - 1);
    if (lo >= hi) continue;
    const int64_t rank = c < cp_size ? c : 2 * cp_size - 1 - c;
    const int64_t shift = sft ? 0 : 1 - p;
    add_run(out, lo + shift, hi + shift, base + rank);
  }
}

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

// Which micro-batch and CP sub-group holds each sample (a sample placed twice is kept where first
// placed, and named in problems). Throws InputError when the layout cannot hold the batch.
PlacedSamples place_sample_slots(const Batch& b, const StepLayout& layout) {
  const int64_t s = b.num_samples(), cp = layout.cp;
  if (cp < 1 || cp > 32767) throw_input_error("CP size {} is out of range", cp);
  PlacedSamples out;
  out.slot.assign(static_cast<std::size_t>(s), SampleSlot{});
  const auto num_mb = static_cast<int64_t>(layout.microbatches.size());
  for (int64_t k = 0; k < num_mb; ++k) {
    const MicroBatch& mb = layout.microbatches[k];
    if (mb.dummy) continue;
    const int64_t cs = mb.cp_size;
    if (cs < 1 || cp % cs != 0 || static_cast<int64_t>(mb.groups.size()) > cp / cs) {
      throw_input_error(
          "DP rank {} micro-batch {}: CP size {} with {} sub-groups does not fit a CP "
          "group of {}",
          mb.dp_rank, mb.index, cs, mb.groups.size(), cp);
    }
    for (std::size_t g = 0; g < mb.groups.size(); ++g) {
      const int64_t base = static_cast<int64_t>(g) * cs;
      int64_t stream = 0, part = 1;
      if (layout.cp_layout == CpLayout::kAllgather) {
        int64_t total = 0;
        for (int64_t i : mb.groups[g]) total += (i >= 0 && i < s) ? b.total_lengths[i] : 0;
        const int64_t unit = cs * layout.tp * std::max<int64_t>(layout.allgather_pad, 1);
        part = std::max<int64_t>((total + unit - 1) / unit * unit / cs, 1);
      }
      for (int64_t i : mb.groups[g]) {
        if (i < 0 || i >= s) {
          throw_input_error(
              "DP rank {} micro-batch {} names sample {}, but the step has {} samples", mb.dp_rank,
              mb.index, i, s);
        }
        SampleSlot& at = out.slot[i];
        if (at.microbatch >= 0) {
          const MicroBatch& first = layout.microbatches[at.microbatch];
          out.problems.push_back(
              &first == &mb
                  ? fmt::format(
                        "sample {} is placed twice: DP rank {} micro-batch {} trains it on CP "
                        "sub-groups {} and {} (CP ranks {}-{} and {}-{})",
                        i, mb.dp_rank, mb.index, at.group, g, at.group * cs, at.group * cs + cs - 1,
                        base, base + cs - 1)
                  : fmt::format(
                        "sample {} is placed twice: DP rank {} micro-batch {} and DP rank {} "
                        "micro-batch {}",
                        i, first.dp_rank, first.index, mb.dp_rank, mb.index));
          stream += b.total_lengths[i];
          continue;
        }
        at = SampleSlot{static_cast<int32_t>(k), static_cast<int32_t>(g), cs, base, stream, part};
        stream += b.total_lengths[i];
      }
    }
  }
  for (int64_t i = 0; i < s; ++i) {
    if (out.slot[i].microbatch < 0)
      out.problems.push_back(fmt::format("sample {} is placed nowhere", i));
  }
  return out;
}

// The counted mask's CP-local counts of every sample on each of its zig-zag owners, per CP size:
// they depend on the sample, the CP size and the padding, not on where the sample sits, so the ten
// layouts I5 weighs share four of them instead of reading every mask byte ten times. Filled on
// first use under a lock (variations run on threads); index i·cs + owner.
struct OwnedCounts {
  std::mutex mu;
  std::map<int64_t, std::shared_ptr<const std::vector<int64_t>>> by_cp_size;
  std::optional<ShardLayout> shard;  // the geometry they were counted under
};

// What a contract reads of a batch's masks, once per batch and contract: each sample's effective
// tokens (its own mask), and the mask it counts (its own, or main's for count-of=main) with its
// sums per sample.
struct TermMasks {
  std::vector<int64_t> own_sum;                                          // [S]
  std::vector<int64_t> counted_sum;                                      // [S]
  const std::vector<uint8_t>* counted = nullptr;                         // [sum R]
  std::shared_ptr<OwnedCounts> owned = std::make_shared<OwnedCounts>();  // shared by copies
};

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

// A contract on a layout, before it is spread over tokens: a token of sample i owned by static CP
// rank c in micro-batch k weighs factor[k * cp + c] · per_sample[i] when its mask is 1.
struct ContractFactors {
  std::vector<int64_t> count;  // as ContractWeights::count
  int64_t global_count = 0;
  std::vector<double> factor;      // [num_mb * cp]
  std::vector<double> per_sample;  // [S]
};

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
// `weights` (bench/weights_bench.sh).
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

namespace {

// Every token's owner from the samples' slots.
PlacedTokens place_tokens_of(const Batch& b, const StepLayout& layout,
                             const PlacedSamples& samples) {
  const int64_t s = b.num_samples();
  PlacedTokens out;
  out.problems = samples.problems;
  out.place.sample_microbatch.assign(static_cast<std::size_t>(s), -1);
  out.place.sample_group.assign(static_cast<std::size_t>(s), -1);
  out.place.owner.assign(static_cast<std::size_t>(b.num_response_tokens()), -1);
  std::vector<OwnedRun> runs;
  for (int64_t i = 0; i < s; ++i) {
    const SampleSlot& at = samples.slot[i];
    if (at.microbatch < 0) continue;
    out.place.sample_microbatch[i] = at.microbatch;
    out.place.sample_group[i] = at.group;
    owned_runs(b, i, layout, at, runs);
    int16_t* owner = out.place.owner.data() + b.response_offsets[i];
    for (const OwnedRun& run : runs) std::fill(owner + run.begin, owner + run.end, run.owner);
  }
  return out;
}

}  // namespace

PlacedTokens place_tokens(const Batch& b, const StepLayout& layout) {
  return place_tokens_of(b, layout, place_sample_slots(b, layout));
}

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

namespace {

// Equal within a relative tolerance; a non-finite value equals nothing (inf - inf is no
// difference to a relative test: |inf - 1| <= tol * inf holds, and a gate must not pass it).
bool same(double a, double b, double tol = kWeightRelTol) {
  if (!std::isfinite(a) || !std::isfinite(b)) return false;
  return std::fabs(a - b) <= tol * std::max(std::fabs(a), std::fabs(b));
}

bool same_weights(const std::vector<double>& a, const std::vector<double>& b, double tol) {
  for (std::size_t t = 0; t < a.size(); ++t) {
    if (!same(a[t], b[t], tol)) return false;
  }
  return true;
}

}  // namespace

namespace {

// Consecutive tokens of one sample sharing (w, w*) and their owner: the unit the diagnosis and the
// shard table read. Tokens with w = w* = 0 (masked, unweighted) are in no span.
struct WeightSpan {
  int64_t sample = 0, token = 0, tokens = 0;  // token: the first one's index in [sum R]
  double got = 0.0, want = 0.0;
  int16_t owner = -1;
};

// The spans of per-token vectors, walked anew on each call (a measured weight vector may hold a
// span per token: tens of millions, not to be stored). each(f) calls f(span) in token order until
// f returns false.
struct TokenSpans {
  const Batch& b;
  const std::vector<double>& got;
  const std::vector<double>& want;
  const TokenPlace& place;
  template <class F>
  void each(F&& f) const {
    for (int64_t i = 0; i < b.num_samples(); ++i) {
      WeightSpan cur;
      bool open = false;
      for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
        if (got[t] == 0.0 && want[t] == 0.0) continue;  // in no span; the next may continue it
        const int16_t o = place.owner.empty() ? int16_t{-1} : place.owner[t];
        if (open && cur.got == got[t] && cur.want == want[t] && cur.owner == o) {
          ++cur.tokens;
          continue;
        }
        if (open && !f(static_cast<const WeightSpan&>(cur))) return;
        cur.sample = i;
        cur.token = t;
        cur.tokens = 1;
        cur.got = got[t];
        cur.want = want[t];
        cur.owner = o;
        open = true;
      }
      if (open && !f(static_cast<const WeightSpan&>(cur))) return;
    }
  }
};

// Spans kept in a vector (from owner runs: a few per sample).
struct StoredSpans {
  const std::vector<WeightSpan>& spans;
  template <class F>
  void each(F&& f) const {
    for (const WeightSpan& sp : spans) {
      if (!f(sp)) return;
    }
  }
};

TokenCoord coord_of_span(const Batch& b, const WeightSpan& sp,
                         const std::vector<int32_t>& sample_microbatch, const StepLayout& l) {
  TokenCoord c;
  c.sample = sp.sample;
  c.response_index = sp.token - b.response_offsets[sp.sample];
  const int32_t k = sample_microbatch.empty() ? -1 : sample_microbatch[sp.sample];
  if (k >= 0) {
    c.dp_rank = l.microbatches[k].dp_rank;
    c.microbatch = l.microbatches[k].index;
  }
  c.cp_rank = sp.owner;
  c.got = sp.got;
  c.want = sp.want;
  c.ratio = sp.want != 0.0 ? sp.got / sp.want : 0.0;
  return c;
}

std::string scale_problem(double scale) {
  if (!(scale > 0.0) || !std::isfinite(scale)) return "not a positive finite factor";
  if (scale < kHiddenScaleMin) {
    return fmt::format(
        "too small for Adam to hide: gradients ×{:.3g} are Adam with eps ×{:.3g} (eps/s), which "
        "shrinks or stops the update (hidden only for 2^-10 <= s <= 2^64; docs/semantics.md §9)",
        scale, 1.0 / scale);
  }
  if (scale > kHiddenScaleMax) {
    return fmt::format(
        "too large for a trainer's arithmetic: losses and gradients ×{:.3g} overflow float16 and "
        "leave float32/bfloat16 a few powers of ten from inf (hidden only for 2^-10 <= s <= 2^64; "
        "docs/semantics.md §9)",
        scale);
  }
  return {};
}

// Long: the diagnosis ladder in SPEC §9's order (non-finite, masked, uniform, per-rank,
// per-micro-batch, per-CP-shard, per-sample, mixed); each rung is tried only when the ones before
// fail, over the same spans.
template <class Spans>
WeightDiagnosis diagnose_spans(const Batch& b, const Spans& spans,
                               const std::vector<int32_t>& sample_microbatch, const StepLayout& l,
                               int64_t true_count, int64_t contract_count, double tol,
                               ScaleContext ctx) {
  WeightDiagnosis dg;
  if (ctx.global_tokens == 0) ctx.global_tokens = true_count;
  const int64_t s = b.num_samples();
  // Non-finite weights first: every later test is a comparison, and comparisons with inf or NaN
  // answer whatever their form happens to give.
  spans.each([&](const WeightSpan& sp) {
    if (std::isfinite(sp.got) && std::isfinite(sp.want)) return true;
    if (dg.non_finite == 0) dg.worst = coord_of_span(b, sp, sample_microbatch, l);
    dg.non_finite += sp.tokens;
    return true;
  });
  if (dg.non_finite > 0) {
    dg.kind = "non-finite";
    dg.min_ratio = dg.max_ratio = NAN;
    return dg;
  }
  double worst_log = -1.0;
  bool first = true;
  double r0 = 1.0;
  bool uniform = true;
  spans.each([&](const WeightSpan& sp) {
    if (sp.want == 0.0) {  // w != 0 here: a masked token that carries weight
      if (dg.masked_weighted == 0) dg.worst = coord_of_span(b, sp, sample_microbatch, l);
      dg.masked_weighted += sp.tokens;
      return true;
    }
    dg.tokens += sp.tokens;
    const double r = sp.got / sp.want;
    if (!same(r, 1.0, tol)) dg.mismatched += sp.tokens;
    if (first) {
      r0 = r;
      dg.min_ratio = dg.max_ratio = r;
      first = false;
    }
    uniform &= same(r, r0, tol);
    dg.min_ratio = std::min(dg.min_ratio, r);
    dg.max_ratio = std::max(dg.max_ratio, r);
    const double lg = r > 0 ? std::fabs(std::log(r)) : INFINITY;
    if (dg.masked_weighted == 0 && lg > worst_log) {
      worst_log = lg;
      dg.worst = coord_of_span(b, sp, sample_microbatch, l);
    }
    return true;
  });
  if (dg.masked_weighted > 0) {
    dg.kind = "masked-weight";
    return dg;
  }
  if (dg.mismatched == 0) {
    dg.kind = "exact";
    return dg;
  }
  if (uniform && r0 == 0.0) {
    dg.kind = "zero";  // not a scale Adam hides: no gradient reaches the parameters at all
    dg.scale = 0.0;
    return dg;
  }
  if (uniform && r0 < 0.0) {
    dg.kind = "negative-scale";  // the optimizer climbs the loss: no optimizer hides a sign
    dg.scale = r0;
    return dg;
  }
  if (uniform) {
    // Nc = sum_i max(d_i, 1), counted only here: the one rung that names a ratio by it (a pass over
    // the masks, not on every diagnosis I5 makes)
    if (ctx.clamped_tokens == 0) {
      for (int64_t i = 0; i < b.num_samples(); ++i) {
        int64_t d = 0;
        for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t)
          d += b.loss_mask[t];
        ctx.clamped_tokens += std::max<int64_t>(d, 1);
      }
    }
    dg.kind = "uniform-scale";
    dg.scale = r0;
    dg.scale_problem = scale_problem(r0);
    const ScaleName name = name_scale(r0, l, ctx, tol);
    dg.named = name.text();
    dg.layout_dependent = name.layout_dependent;
    dg.same_step = name.same_step;
    dg.declared = name.declared;
    if (!dg.layout_dependent && dg.declared.empty() && contract_count > 0 &&
        same(r0, static_cast<double>(true_count) / static_cast<double>(contract_count), tol)) {
      dg.named =
          fmt::format("N/N' = {}/{}: the contract counts {} token(s) where the objective has {}",
                      true_count, contract_count, contract_count, true_count);
    }
    return dg;
  }
  // The coarsest unit within which the ratio is constant.
  const int64_t cp = l.cp;
  auto mb_of = [&](int64_t i) -> int64_t {
    return sample_microbatch.empty() ? -1 : sample_microbatch[i];
  };
  const int64_t num_mb = static_cast<int64_t>(l.microbatches.size());
  // Each CP rank's effective tokens of each micro-batch (the per-CP-shard formula's own count).
  auto shard_tokens = [&] {
    std::vector<double> out(static_cast<std::size_t>(num_mb * cp), 0.0);
    spans.each([&](const WeightSpan& sp) {
      const int64_t k = mb_of(sp.sample);
      if (k >= 0 && sp.owner >= 0 && sp.owner < cp && sp.want != 0.0)
        out[k * cp + sp.owner] += sp.tokens;
      return true;
    });
    return out;
  };
  // Whether r is constant within every unit key(sample, owner); on success the worst token's
  // unit size.
  auto constant_within = [&](const char* kind, int64_t count, auto key) {
    std::vector<double> ratio(static_cast<std::size_t>(count), NAN);
    std::vector<int64_t> tokens(static_cast<std::size_t>(count), 0);
    bool constant = true;
    spans.each([&](const WeightSpan& sp) {
      const int64_t k = key(sp.sample, sp.owner);
      if (k < 0) return constant = false;
      const double r = sp.got / sp.want;
      if (std::isnan(ratio[k])) {
        ratio[k] = r;
      } else if (!same(ratio[k], r, tol)) {
        return constant = false;
      }
      tokens[k] += sp.tokens;
      return true;
    });
    if (!constant) return false;
    dg.kind = kind;
    const int64_t k = key(dg.worst.sample, static_cast<int16_t>(dg.worst.cp_rank));
    dg.worst.unit_tokens = k >= 0 ? tokens[k] : 0;
    const UnitFactor f = name_unit_factor(
        b, sample_microbatch,
        std::string(kind) == "per-cp-shard" ? shard_tokens() : std::vector<double>{}, l, kind,
        ratio, k, ctx, tol);
    dg.factor = f.formula;
    dg.advice = f.advice;
    return true;
  };
  if (constant_within("per-rank", l.dp, [&](int64_t i, int16_t) {
        const int64_t k = mb_of(i);
        return k < 0 ? int64_t{-1} : l.microbatches[k].dp_rank;
      })) {
    return dg;
  }
  if (constant_within("per-microbatch", num_mb, [&](int64_t i, int16_t) { return mb_of(i); })) {
    return dg;
  }
  if (constant_within("per-cp-shard", num_mb * cp, [&](int64_t i, int16_t o) {
        const int64_t k = mb_of(i);
        return k < 0 || o < 0 ? int64_t{-1} : k * cp + o;
      })) {
    return dg;
  }
  if (constant_within("per-sample", s, [&](int64_t i, int16_t) { return i; })) return dg;
  dg.kind = "mixed";
  return dg;
}

template <class Spans>
std::vector<ShardRatio> shard_ratios_of_spans(const Spans& spans,
                                              const std::vector<int32_t>& sample_microbatch,
                                              const StepLayout& l) {
  std::vector<ShardRatio> out(l.microbatches.size() * static_cast<std::size_t>(l.cp));
  spans.each([&](const WeightSpan& sp) {
    const int32_t k = sample_microbatch[sp.sample];
    if (k < 0 || sp.owner < 0) return true;
    ShardRatio& sr = out[static_cast<std::size_t>(k) * l.cp + sp.owner];
    if (sp.want == 0.0) {
      sr.masked_weighted += sp.tokens;  // w != 0: spans leave out w = w* = 0
      return true;
    }
    const double r = sp.got / sp.want;
    sr.min_ratio = sr.tokens == 0 ? r : std::min(sr.min_ratio, r);
    sr.max_ratio = sr.tokens == 0 ? r : std::max(sr.max_ratio, r);
    sr.tokens += sp.tokens;
    return true;
  });
  return out;
}

}  // namespace

WeightDiagnosis diagnose_weights(const Batch& b, const std::vector<double>& got,
                                 const std::vector<double>& want, const TokenPlace& place,
                                 const StepLayout& l, int64_t true_count, int64_t contract_count,
                                 double tol, const ScaleContext& scale) {
  return diagnose_spans(b, TokenSpans{b, got, want, place}, place.sample_microbatch, l, true_count,
                        contract_count, tol, scale);
}

std::string WeightDiagnosis::summary() const {
  auto where = [&] {
    std::string w = fmt::format("sample {} response index {}", worst.sample, worst.response_index);
    if (worst.dp_rank >= 0)
      w += fmt::format(" (DP rank {} micro-batch {}", worst.dp_rank, worst.microbatch);
    if (worst.dp_rank >= 0)
      w += worst.cp_rank >= 0 ? fmt::format(" CP rank {})", worst.cp_rank)
                              : ", owned by no CP rank)";
    return w;
  };
  if (kind == "exact" && tokens == 0) return "no effective tokens in this step: nothing to weigh";
  if (kind == "exact")
    return fmt::format("exact: every one of {} tokens weighted as the objective says", tokens);
  if (kind == "not-run") return "not diagnosed: the layout does not give each token one weight";
  if (kind == "non-finite") {
    return fmt::format(
        "non-finite weights: {} token(s) have w or w* = inf or NaN; first: {}, w = {} (w* = {})",
        non_finite, where(), worst.got, worst.want);
  }
  if (kind == "zero") {
    return fmt::format(
        "every weight is 0: the trainer applies no gradient for any of {} effective tokens",
        tokens);
  }
  if (kind == "masked-weight") {
    return fmt::format(
        "masked tokens carry weight: {} token(s) with mask 0 have w != 0; first: {}, w = {:.6g}",
        masked_weighted, where(), worst.got);
  }
  if (kind == "negative-scale") {
    return fmt::format(
        "uniform scale ×{:.6g}: every weight has the wrong sign: the optimizer climbs the loss "
        "(gradient ascent) on all {} effective tokens",
        scale, tokens);
  }
  if (kind == "uniform-scale") {
    // 1/tp: the count (or the mean) spans the tensor-parallel replicas, which hold the same
    // tokens: TP ranks counted as data-parallel ranks (SPEC §10; transformers #39674's shape).
    const bool tp_named = (" or " + named + " or ").find(" or 1/tp or ") != std::string::npos;
    const std::string replicas =
        !tp_named ? std::string()
                  : fmt::format(
                        " ({}tensor-parallel replicas counted as data-parallel ranks, a count "
                        "or mean over the whole world)",
                        named == "1/tp" ? "" : "if 1/tp, ");
    if (layout_dependent) {
      return fmt::format(
          "uniform scale ×{:.6g} = {}{}: {}; a scale the layout sets is not hidden by Adam "
          "(clipping, weight decay and the logged loss see it: docs/semantics.md §9){}",
          scale, named, replicas, same_step, scale_problem.empty() ? "" : "; " + scale_problem);
    }
    if (!declared.empty()) {
      return fmt::format(
          "uniform scale ×{:.6g} = the trainer's declared {}{}: every token's weight is off by "
          "that constant{}",
          scale, declared, named.empty() ? "" : fmt::format(" (also {})", named),
          scale_problem.empty() ? "" : "; " + scale_problem);
    }
    return fmt::format(
        "uniform scale ×{:.6g}{}{}: every token's weight is off by the same factor{}", scale,
        named.empty() ? "" : fmt::format(" = {}", named), replicas,
        scale_problem.empty() ? "" : "; " + scale_problem);
  }
  std::string unit = kind == "per-rank"         ? "per-DP-rank"
                     : kind == "per-microbatch" ? "per-micro-batch"
                     : kind == "per-cp-shard"   ? "per-CP-shard"
                     : kind == "per-sample"     ? "per-sample"
                                                : "mixed";
  return fmt::format(
      "{} normalisation: weights range {:.3g}× to {:.3g}× of the truth on {} of {} tokens; worst: "
      "{}, {:.6g}× ({} token(s) in that unit){}",
      unit, min_ratio, max_ratio, mismatched, tokens, where(), worst.ratio, worst.unit_tokens,
      factor.empty() ? "" : fmt::format("; w/w* = {} in every unit", factor));
}

std::vector<ShardRatio> shard_ratios(const Batch& b, const std::vector<double>& got,
                                     const std::vector<double>& want, const TokenPlace& place,
                                     const StepLayout& l) {
  return shard_ratios_of_spans(TokenSpans{b, got, want, place}, place.sample_microbatch, l);
}

namespace {

// A contract's weights on a layout as runs: per sample, its owner runs, each weighing one factor
// on its mask-1 tokens (0 outside every run). The I5 comparison walks these instead of per-token
// vectors: a variation costs a pass over the samples' runs, not over their tokens.
struct LayoutWeights {
  const StepLayout* layout = nullptr;
  PlacedSamples own;                     // when the caller gave no placement
  const PlacedSamples* given = nullptr;  // the caller's (shared by the terms)
  ContractFactors factors;
  const PlacedSamples& placed() const { return given != nullptr ? *given : own; }
};

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

// A weight run of one sample: [begin, end) weighs `value` (owner -1 and 0 between runs).
struct ValueRun {
  int64_t begin = 0, end = 0;
  int16_t owner = -1;
  double value = 0.0;
};

void value_runs(const Batch& b, int64_t i, const LayoutWeights& w, std::vector<OwnedRun>& scratch,
                std::vector<ValueRun>& out) {
  out.clear();
  const SampleSlot& at = w.placed().slot[i];
  if (at.microbatch < 0) return;
  owned_runs(b, i, *w.layout, at, scratch);
  const double* factor =
      w.factors.factor.data() + static_cast<std::size_t>(at.microbatch) * w.layout->cp;
  for (const OwnedRun& r : scratch) {
    ValueRun& v = out.emplace_back();  // field by field: see add_run
    v.begin = r.begin;
    v.end = r.end;
    v.owner = r.owner;
    v.value = factor[r.owner] * w.factors.per_sample[i];
  }
}

// Every sample's value runs, kept: the base layout's are walked once per variation.
struct CachedRuns {
  std::vector<ValueRun> runs;
  std::vector<int64_t> first;  // [S + 1] sample i's runs are runs[first[i], first[i + 1])
};
CachedRuns cache_runs(const Batch& b, const LayoutWeights& w) {
  CachedRuns out;
  out.first.reserve(static_cast<std::size_t>(b.num_samples()) + 1);
  std::vector<OwnedRun> scratch;
  std::vector<ValueRun> one;
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    out.first.push_back(static_cast<int64_t>(out.runs.size()));
    value_runs(b, i, w, scratch, one);
    out.runs.insert(out.runs.end(), one.begin(), one.end());
  }
  out.first.push_back(static_cast<int64_t>(out.runs.size()));
  return out;
}

// The largest relative difference between the weights `ref` and `got` of one batch, token by
// token as a per-token comparison would find it (the first token of the greatest difference), and
// that token's coordinates on got's layout. -1: none differs.
double max_weight_difference(const Batch& b, const CachedRuns& ref, const LayoutWeights& got,
                             TokenCoord& worst_at) {
  double worst = -1.0;
  std::vector<OwnedRun> scratch;
  std::vector<ValueRun> rg;
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    const int64_t len = b.response_lengths[i];
    if (len == 0) continue;
    const ValueRun* ra_begin = ref.runs.data() + ref.first[i];
    const std::size_t ra_size = static_cast<std::size_t>(ref.first[i + 1] - ref.first[i]);
    struct View {
      const ValueRun* p;
      std::size_t n;
      std::size_t size() const { return n; }
      const ValueRun& operator[](std::size_t k) const { return p[k]; }
    } ra{ra_begin, ra_size};
    value_runs(b, i, got, scratch, rg);
    const uint8_t* mask = b.loss_mask.data() + b.response_offsets[i];
    std::size_t ka = 0, kg = 0;
    for (int64_t x = 0; x < len;) {
      // The value each side gives at x, and where that stops holding.
      while (ka < ra.size() && ra[ka].end <= x) ++ka;
      while (kg < rg.size() && rg[kg].end <= x) ++kg;
      int64_t y = len;
      double a = 0.0, c = 0.0;
      int16_t owner = -1;
      if (ka < ra.size()) {
        if (ra[ka].begin <= x) {
          a = ra[ka].value;
          y = std::min(y, ra[ka].end);
        } else {
          y = std::min(y, ra[ka].begin);
        }
      }
      if (kg < rg.size()) {
        if (rg[kg].begin <= x) {
          c = rg[kg].value;
          owner = rg[kg].owner;
          y = std::min(y, rg[kg].end);
        } else {
          y = std::min(y, rg[kg].begin);
        }
      }
      if (!(a == c && std::isfinite(a))) {
        int64_t t = x;
        while (t < y && mask[t] == 0) ++t;  // mask-0 tokens weigh 0 on both sides
        if (t < y) {
          const double rel = std::isfinite(a) && std::isfinite(c)
                                 ? std::fabs(a - c) / std::max(std::fabs(a), std::fabs(c))
                                 : INFINITY;  // an infinite or NaN weight differs from anything
          if (rel > worst) {
            worst = rel;
            TokenCoord coord;
            coord.sample = i;
            coord.response_index = t;
            const int32_t k = got.placed().slot[i].microbatch;
            if (k >= 0) {
              coord.dp_rank = got.layout->microbatches[k].dp_rank;
              coord.microbatch = got.layout->microbatches[k].index;
            }
            coord.cp_rank = owner;
            coord.got = c;
            coord.want = a;
            coord.ratio = a != 0.0 ? c / a : 0.0;
            worst_at = coord;
          }
        }
      }
      x = y;
    }
  }
  return worst;
}

}  // namespace

namespace {

// The spans of a contract's weights on a layout against the truth (one weight per sample on its
// mask-1 tokens), from its owner runs: per run or gap, its mask-1 tokens.
std::vector<WeightSpan> spans_of_layout(const Batch& b, const LayoutWeights& w,
                                        const std::vector<double>& truth_per_sample) {
  std::vector<WeightSpan> out;
  std::vector<OwnedRun> scratch;
  std::vector<ValueRun> runs;
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    const int64_t off = b.response_offsets[i], len = b.response_lengths[i];
    const double want = truth_per_sample[i];
    const uint8_t* mask = b.loss_mask.data() + off;
    auto emit = [&](int64_t x, int64_t y, double got, int16_t owner) {
      int64_t first = -1, n = 0;
      for (int64_t t = x; t < y; ++t) {
        if (mask[t] != 0 && first < 0) first = t;
        n += mask[t] != 0;
      }
      if (n == 0 || (got == 0.0 && want == 0.0)) return;
      out.push_back({i, off + first, n, got, want, owner});
    };
    value_runs(b, i, w, scratch, runs);
    int64_t x = 0;
    for (const ValueRun& r : runs) {
      if (r.begin > x) emit(x, r.begin, 0.0, -1);  // owned by no rank: no weight
      emit(r.begin, r.end, r.value, r.owner);
      x = r.end;
    }
    if (x < len) emit(x, len, 0.0, -1);
  }
  return out;
}

std::vector<int32_t> sample_microbatches(const PlacedSamples& placed) {
  std::vector<int32_t> out(placed.slot.size());
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = placed.slot[i].microbatch;
  return out;
}

WeightDiagnosis diagnose_layout_weights(const Batch& b, const LayoutWeights& w,
                                        const std::vector<double>& truth_per_sample,
                                        int64_t true_count) {
  return diagnose_spans(b, StoredSpans{spans_of_layout(b, w, truth_per_sample)},
                        sample_microbatches(w.placed()), *w.layout, true_count,
                        w.factors.global_count, kWeightRelTol, ScaleContext{});
}

}  // namespace

WeightsSummary summarize_weights(const Batch& b, const StepLayout& l, const Contract& contract,
                                 const ObjectiveSizes& sizes,
                                 const std::vector<double>& truth_per_sample, int64_t true_count,
                                 const ScaleContext& scale) {
  const TermMasks masks = term_masks(b, contract, sizes);
  const LayoutWeights w = layout_weights(b, l, contract, sizes, masks, nullptr);
  const std::vector<WeightSpan> spans = spans_of_layout(b, w, truth_per_sample);
  const std::vector<int32_t> mbs = sample_microbatches(w.placed());
  WeightsSummary out;
  out.diagnosis = diagnose_spans(b, StoredSpans{spans}, mbs, l, true_count, w.factors.global_count,
                                 kWeightRelTol, scale);
  out.shards = shard_ratios_of_spans(StoredSpans{spans}, mbs, l);
  out.global_count = w.factors.global_count;
  out.problems = w.placed().problems;
  return out;
}

std::vector<InvarianceResult> check_split_invariance(const Batch& b, const StepLayout& base,
                                                     const Contract& contract,
                                                     const ObjectiveSizes& sizes, Split split,
                                                     const std::vector<double>& truth,
                                                     Variations vary,
                                                     const ContractWeights* base_weights) {
  TermInvariance term{&b, &contract, sizes, &truth, base_weights};
  return std::move(check_split_invariance_terms({term}, base, split, vary).front());
}

namespace {

// I5's reference for one term: its base layout's weights against the truth.
struct InvarianceReference {
  ContractWeights computed;
  const ContractWeights* weights = nullptr;
  int64_t true_count = 0;
  WeightDiagnosis diagnosis;
};

std::vector<InvarianceReference> invariance_references(const std::vector<TermInvariance>& terms,
                                                       const StepLayout& base) {
  std::vector<InvarianceReference> refs(terms.size());
  for (std::size_t k = 0; k < terms.size(); ++k) {
    const TermInvariance& t = terms[k];
    for (uint8_t m : t.batch->loss_mask) refs[k].true_count += m;
    if (t.base_diagnosis != nullptr) {
      refs[k].diagnosis = *t.base_diagnosis;
      continue;
    }
    if (t.base_weights == nullptr) {
      refs[k].computed = contract_weights(*t.batch, base, *t.contract, t.sizes);
      refs[k].weights = &refs[k].computed;
    } else {
      refs[k].weights = t.base_weights;
    }
    refs[k].diagnosis =
        t.truth_per_sample != nullptr
            ? summarize_weights(*t.batch, base, *t.contract, t.sizes, *t.truth_per_sample,
                                refs[k].true_count)
                  .diagnosis
            : diagnose_weights(*t.batch, refs[k].weights->weight, *t.truth, refs[k].weights->place,
                               base, refs[k].true_count, refs[k].weights->global_count);
  }
  return refs;
}

// One variation of the base layout: its DP, micro-batches per rank and CP.
struct InvarianceVariant {
  int64_t dp, m, cp;
  std::string label;
};

std::vector<InvarianceVariant> invariance_variants(const StepLayout& base, Variations vary) {
  const int64_t base_m = base.dp > 0 ? base.num_microbatches(0) : 1;
  std::vector<InvarianceVariant> variants;
  for (int64_t x : {1, 2, 4, 8}) {
    if (vary.dp && x != base.dp) variants.push_back({x, base_m, base.cp, fmt::format("DP {}", x)});
  }
  for (int64_t x : {1, 2, 4, 8}) {
    if (vary.microbatches && x != base_m)
      variants.push_back({base.dp, x, base.cp, fmt::format("{} micro-batches", x)});
  }
  for (int64_t x : {1, 2, 4, 8}) {
    if (vary.cp && x != base.cp) variants.push_back({base.dp, base_m, x, fmt::format("CP {}", x)});
  }
  return variants;
}

// Only layouts the trainer can produce are compared (reported as skipped otherwise, with this
// reason; empty: compared): none that leaves a micro-batch without samples, and for a trainer that
// cuts equal micro-batches (TRL), none where DP x M does not divide the batch, nor
// (norm=generation:S) where M is not a multiple of S: the generation batch would reach into
// another optimizer step, which the dump does not hold.
std::string variant_skip_reason(const std::vector<TermInvariance>& terms, int64_t n,
                                const InvarianceVariant& v) {
  const int64_t cells = v.dp * v.m;
  if (cells > n) {
    return fmt::format("leaves micro-batches empty ({} samples over DP {} x {} micro-batches)", n,
                       v.dp, v.m);
  }
  for (const TermInvariance& t : terms) {
    if (t.contract->equal_microbatches && n % cells != 0) {
      return fmt::format(
          "a layout the trainer never builds: DP {} x {} micro-batches does not divide the {} "
          "samples into equal micro-batches",
          v.dp, v.m, n);
    }
    if (t.contract->norm == NormRule::kGeneration && v.m % t.contract->generation != 0) {
      return fmt::format(
          "a layout the trainer never builds within one step: {} micro-batches is not a "
          "multiple of the generation batch's S = {}",
          v.m, t.contract->generation);
    }
  }
  return {};
}

// The variation's static layout, with the base layout's TP, sharding and CP layout.
StepLayout variant_layout(int64_t num_samples, const StepLayout& base, const InvarianceVariant& v,
                          Split split) {
  StepLayout l =
      static_layout(place_samples(num_samples, v.dp, v.m, split), v.cp, base.tp, base.shard);
  l.cp_layout = base.cp_layout;
  l.allgather_pad = base.allgather_pad;
  return l;
}

// I5 as one plan: the terms' references and base layout's weights as runs (the same factors as
// base_weights), computed once and read by every variation.
class InvariancePlan {
 public:
  InvariancePlan(const std::vector<TermInvariance>& terms, const StepLayout& base, Split split)
      : terms_(terms),
        b0_(*terms.front().batch),
        base_(base),
        split_(split),
        refs_(invariance_references(terms, base)) {
    for (const TermInvariance& t : terms)
      masks_.push_back(term_masks(*t.batch, *t.contract, t.sizes));
    for (std::size_t k = 0; k < terms.size(); ++k)
      base_runs_.push_back(
          cache_runs(*terms[k].batch, layout_weights(*terms[k].batch, base, *terms[k].contract,
                                                     terms[k].sizes, masks_[k], nullptr)));
  }

  // One variation: its placement once; per term, its weights against the base layout's (as runs)
  // and, when they differ, token by token against the truth. Empty: a layout that cannot hold the
  // batch. Called from several threads at once.
  std::vector<InvarianceResult> evaluate(const InvarianceVariant& v) const {
    if (std::string why = variant_skip_reason(terms_, b0_.num_samples(), v); !why.empty()) {
      std::vector<InvarianceResult> out(terms_.size());
      for (InvarianceResult& res : out) {
        res.layout = {{"dp", v.dp}, {"cp", v.cp}, {"microbatches", v.m}};
        res.label = v.label;
        res.skipped = why;
        res.against_truth.kind = "not-run";
      }
      return out;
    }
    const StepLayout l = variant_layout(b0_.num_samples(), base_, v, split_);
    PlacedSamples slots;
    try {
      slots = place_sample_slots(b0_, l);
    } catch (const InputError&) {
      return {};  // a layout that cannot hold the batch (bshd, a short max length)
    }
    std::optional<PlacedTokens> placed;  // per token, only to diagnose a break
    std::vector<InvarianceResult> out;
    for (std::size_t k = 0; k < terms_.size(); ++k) {
      const TermInvariance& t = terms_[k];
      const Batch& b = *t.batch;
      InvarianceResult res;
      res.layout = {{"dp", v.dp}, {"cp", v.cp}, {"microbatches", v.m}};
      res.label = v.label;
      LayoutWeights w;
      try {
        w = layout_weights(b, l, *t.contract, t.sizes, masks_[k], &slots);
      } catch (const ScaleRangeError&) {
        throw;  // the contract's fault on every layout: exit 2, not a layout left out
      } catch (const InputError&) {
        return {};
      }
      const double worst = max_weight_difference(b, base_runs_[k], w, res.worst);
      res.max_rel_diff = std::max(worst, 0.0);
      res.ok = res.max_rel_diff <= kWeightRelTol;  // false for inf
      if (res.ok) {
        res.against_truth = refs_[k].diagnosis;
      } else if (t.diagnose_every_break && t.truth_per_sample != nullptr) {
        res.against_truth = diagnose_layout_weights(b, w, *t.truth_per_sample, refs_[k].true_count);
      } else if (t.diagnose_every_break) {
        if (!placed) placed = place_tokens(b0_, l);
        const ContractWeights cw = contract_weights(b, l, *t.contract, t.sizes, &*placed);
        res.against_truth = diagnose_weights(b, cw.weight, *t.truth, cw.place, l,
                                             refs_[k].true_count, cw.global_count);
      } else {
        res.against_truth.kind = "not-run";  // the first break is diagnosed later
      }
      out.push_back(std::move(res));
    }
    return out;
  }

  // Term k's diagnosis against the truth on variation v (a term that diagnoses only its first
  // break).
  WeightDiagnosis diagnose_break(std::size_t k, const InvarianceVariant& v) const {
    const TermInvariance& t = terms_[k];
    const StepLayout l = variant_layout(b0_.num_samples(), base_, v, split_);
    const Batch& b = *t.batch;
    if (t.truth_per_sample != nullptr) {
      return summarize_weights(b, l, *t.contract, t.sizes, *t.truth_per_sample, refs_[k].true_count)
          .diagnosis;
    }
    const ContractWeights w = contract_weights(b, l, *t.contract, t.sizes);
    return diagnose_weights(b, w.weight, *t.truth, w.place, l, refs_[k].true_count, w.global_count);
  }

 private:
  const std::vector<TermInvariance>& terms_;
  const Batch& b0_;
  const StepLayout& base_;
  Split split_;
  std::vector<InvarianceReference> refs_;
  std::vector<TermMasks> masks_;
  std::vector<CachedRuns> base_runs_;
};

// Every variation's results, in order. Variations are independent: a few at a time on their own
// threads (each holds a weight vector the size of the batch's response tokens per term).
std::vector<std::vector<InvarianceResult>> evaluate_variants(
    const InvariancePlan& plan, const std::vector<InvarianceVariant>& variants,
    int64_t response_tokens) {
  const std::size_t threads =
      response_tokens < (1 << 16)
          ? 1  // small batches: a thread costs more than the work
          : std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 4);
  auto evaluate = [&plan](const InvarianceVariant& v) { return plan.evaluate(v); };
  std::vector<std::vector<InvarianceResult>> results(variants.size());
  for (std::size_t start = 0; start < variants.size(); start += threads) {
    std::vector<std::future<std::vector<InvarianceResult>>> running;
    for (std::size_t k = start; k < std::min(variants.size(), start + threads); ++k) {
      running.push_back(std::async(threads > 1 ? std::launch::async : std::launch::deferred,
                                   evaluate, std::cref(variants[k])));
    }
    for (std::size_t k = 0; k < running.size(); ++k) results[start + k] = running[k].get();
  }
  return results;
}

}  // namespace

// I5 as one plan: every variation placed once, every term weighed on it, threads over variations;
// then each term's results over the variations that hold the batch, and the first break of a term
// that diagnoses only that one.
std::vector<std::vector<InvarianceResult>> check_split_invariance_terms(
    const std::vector<TermInvariance>& terms, const StepLayout& base, Split split,
    Variations vary) {
  if (terms.empty()) return {};
  const Batch& b0 = *terms.front().batch;
  const InvariancePlan plan(terms, base, split);
  const std::vector<InvarianceVariant> variants = invariance_variants(base, vary);
  std::vector<std::vector<InvarianceResult>> results =
      evaluate_variants(plan, variants, b0.num_response_tokens());
  std::vector<std::vector<InvarianceResult>> out(terms.size());
  std::vector<const InvarianceVariant*> variant_of;  // of out[k][j], every k
  for (std::size_t v = 0; v < results.size(); ++v) {
    if (results[v].size() != terms.size()) continue;
    variant_of.push_back(&variants[v]);
    for (std::size_t k = 0; k < terms.size(); ++k) out[k].push_back(std::move(results[v][k]));
  }
  for (std::size_t k = 0; k < terms.size(); ++k) {
    if (terms[k].diagnose_every_break) continue;
    for (std::size_t j = 0; j < out[k].size(); ++j) {
      if (out[k][j].ok) continue;
      out[k][j].against_truth = plan.diagnose_break(k, *variant_of[j]);
      break;
    }
  }
  return out;
}

WeightsVerdict weights_verdict(const WeightDiagnosis& dg, const ContractWeights& w,
                               const std::vector<InvarianceResult>& invariance, bool strict_scale) {
  WeightsVerdict v;
  v.here_fails = dg.fails(strict_scale) || !w.problems.empty();
  for (const auto& r : invariance) {
    if (!r.ok) {
      v.first_break = &r;
      break;
    }
  }
  v.fails = v.here_fails || v.first_break != nullptr;
  return v;
}

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
