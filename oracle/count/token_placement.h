// Token placement on a step layout (SPEC §2): which micro-batch and CP sub-group holds each sample,
// and which static CP rank owns each of its response tokens (the zig-zag or all-gather cut, the
// ownership rule, dynamic CP sub-groups). The denominators (count/denominators.h) count by it; the
// effective token weights (oracle/weights/) weigh by it.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/layout.h"

namespace lossguard::oracle {

// Where each token's weight comes from on a layout.
struct TokenPlace {
  std::vector<int32_t> sample_microbatch;  // [S] index into layout.microbatches; -1: not placed
  std::vector<int32_t> sample_group;       // [S] its CP sub-group in that micro-batch
  std::vector<int16_t> owner;  // [sum R] the CP rank (static numbering) that owns it; -1: none
};

// Which micro-batch holds each sample and which CP rank owns each token on a layout (SPEC §2: the
// zig-zag or all-gather cut, the ownership rule, dynamic CP sub-groups). Throws InputError when
// the layout cannot hold the batch (a sample index out of range, a CP size that does not fit).
struct PlacedTokens {
  TokenPlace place;
  std::vector<std::string> problems;  // a sample placed twice (kept where first placed) or nowhere
};
PlacedTokens place_tokens(const Batch& batch, const StepLayout& layout);

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

// Which micro-batch and CP sub-group holds each sample (a sample placed twice is kept where first
// placed, and named in problems). Throws InputError when the layout cannot hold the batch.
PlacedSamples place_sample_slots(const Batch& b, const StepLayout& layout);

// The owner runs of sample i's mask indices, in index order (SPEC §2: the zig-zag or all-gather
// cut). Indices no rank owns (SFT index T-1 under CP > 1) lie in no run.
void owned_runs(const Batch& b, int64_t i, const StepLayout& layout, const SampleSlot& at,
                std::vector<OwnedRun>& out);

// Every token's owner from the samples' slots.
PlacedTokens place_tokens_of(const Batch& b, const StepLayout& layout,
                             const PlacedSamples& samples);

}  // namespace lossguard::oracle
