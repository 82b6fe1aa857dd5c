// Token placement on a step layout (SPEC §2): each sample's slot (micro-batch, CP sub-group), its
// owner runs, and every token's owner.
#include "oracle/count/token_placement.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/errors.h"

namespace lossguard::oracle {

namespace {

// Appends a run field by field: a braced temporary is built on the stack and copied back in
// halves, a store-forwarding stall that was the single hottest instruction of `weights` with I5.
inline void add_run(std::vector<OwnedRun>& out, int64_t begin, int64_t end, int64_t owner) {
  OwnedRun& r = out.emplace_back();
  r.begin = begin;
  r.end = end;
  r.owner = static_cast<int16_t>(owner);
}

}  // namespace

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

PlacedTokens place_tokens(const Batch& b, const StepLayout& layout) {
  return place_tokens_of(b, layout, place_sample_slots(b, layout));
}

}  // namespace lossguard::oracle
