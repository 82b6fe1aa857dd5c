// Sample placement over DP ranks and micro-batches.
#include "oracle/placement.h"

#include "core/errors.h"

namespace lossguard::oracle {

namespace {

std::vector<std::vector<int64_t>> split_contiguous(const std::vector<int64_t>& items,
                                                   int64_t parts) {
  std::vector<std::vector<int64_t>> out(static_cast<std::size_t>(parts));
  const auto n = static_cast<int64_t>(items.size());
  int64_t pos = 0;
  for (int64_t k = 0; k < parts; ++k) {
    const int64_t size = n / parts + (k < n % parts ? 1 : 0);
    out[k].assign(items.begin() + pos, items.begin() + pos + size);
    pos += size;
  }
  return out;
}

}  // namespace

Placement place_samples(int64_t num_samples, int64_t dp, int64_t microbatches, Split split) {
  if (dp < 1) throw_input_error("--dp must be >= 1, got {}", dp);
  if (microbatches < 1) throw_input_error("--microbatches must be >= 1, got {}", microbatches);
  std::vector<int64_t> all(static_cast<std::size_t>(num_samples));
  for (int64_t i = 0; i < num_samples; ++i) all[i] = i;
  std::vector<std::vector<int64_t>> per_rank;
  if (split == Split::kContiguous) {
    per_rank = split_contiguous(all, dp);
  } else {
    per_rank.resize(static_cast<std::size_t>(dp));
    for (int64_t i = 0; i < num_samples; ++i) per_rank[i % dp].push_back(i);
  }
  Placement p;
  for (const auto& samples : per_rank) p.push_back(split_contiguous(samples, microbatches));
  return p;
}

Placement place_shards(const std::vector<int>& shard_of_sample, int64_t num_shards,
                       int64_t microbatches) {
  if (microbatches < 1) throw_input_error("--microbatches must be >= 1, got {}", microbatches);
  std::vector<std::vector<int64_t>> per_rank(static_cast<std::size_t>(num_shards));
  for (std::size_t i = 0; i < shard_of_sample.size(); ++i)
    per_rank[shard_of_sample[i]].push_back(static_cast<int64_t>(i));
  Placement p;
  for (const auto& samples : per_rank) p.push_back(split_contiguous(samples, microbatches));
  return p;
}

}  // namespace lossguard::oracle
