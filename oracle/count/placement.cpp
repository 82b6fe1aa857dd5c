// Sample placement over DP ranks and micro-batches.
#include "oracle/count/placement.h"

#include <fmt/format.h>

#include <algorithm>
#include <climits>

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

std::vector<std::string> placement_problems(const Placement& placement, int64_t num_samples) {
  std::vector<std::string> out;
  std::vector<uint8_t> seen(static_cast<std::size_t>(std::max<int64_t>(num_samples, 0)), 0);
  for (std::size_t d = 0; d < placement.size(); ++d) {
    for (std::size_t k = 0; k < placement[d].size(); ++k) {
      for (int64_t i : placement[d][k]) {
        if (i < 0 || i >= num_samples) {
          out.push_back(
              fmt::format("DP rank {} micro-batch {} names sample {} of {}", d, k, i, num_samples));
        } else if (seen[i]++) {
          out.push_back(
              fmt::format("sample {} is placed twice (DP rank {} micro-batch {} again)", i, d, k));
        }
      }
    }
  }
  for (int64_t i = 0; i < num_samples; ++i) {
    if (!seen[i]) out.push_back(fmt::format("sample {} is placed nowhere", i));
  }
  return out;
}

StepLayout dynamic_cp_layout(const std::vector<int64_t>& total_lengths, const Placement& placement,
                             int64_t static_cp, int64_t max_tokens_per_gpu) {
  if (static_cp < 1 || (static_cp & (static_cp - 1)) != 0)
    throw_input_error("dynamic CP needs a power-of-two CP size, got {}", static_cp);
  if (max_tokens_per_gpu < 1)
    throw_input_error("--dynamic-cp MAX_TOKENS_PER_GPU must be >= 1, got {}", max_tokens_per_gpu);
  StepLayout l;
  l.dp = static_cast<int64_t>(placement.size());
  l.cp = static_cp;
  l.dynamic_cp = true;
  std::size_t num_k = 0;
  for (const auto& rank : placement) num_k = std::max(num_k, rank.size());
  std::vector<int64_t> cp_of(num_k, 1);
  for (std::size_t k = 0; k < num_k; ++k) {
    int64_t need = 1, fewest = INT64_MAX;
    for (const auto& rank : placement) {
      if (k >= rank.size()) continue;
      int64_t max_t = 0;
      for (int64_t i : rank[k]) max_t = std::max(max_t, total_lengths[i]);
      const int64_t parts = (max_t + max_tokens_per_gpu - 1) / max_tokens_per_gpu;
      while (need < parts) need *= 2;  // the MAX over DP of each rank's power of two
      fewest = std::min<int64_t>(fewest, static_cast<int64_t>(rank[k].size()));
    }
    need = std::min(need, static_cp);
    // Every sub-group needs a sample: fewer sub-groups (a larger cp_k) while they outnumber them.
    while (need < static_cp && static_cp / need > std::max<int64_t>(fewest, 1)) need *= 2;
    cp_of[k] = need;
  }
  for (std::size_t d = 0; d < placement.size(); ++d) {
    for (std::size_t k = 0; k < placement[d].size(); ++k) {
      MicroBatch mb;
      mb.dp_rank = static_cast<int64_t>(d);
      mb.index = static_cast<int64_t>(k);
      mb.cp_size = cp_of[k];
      const int64_t groups = static_cp / cp_of[k];
      mb.groups.assign(static_cast<std::size_t>(groups), {});
      std::vector<int64_t> order = placement[d][k];
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return total_lengths[a] > total_lengths[b]; });
      std::vector<int64_t> load(static_cast<std::size_t>(groups), 0);
      for (int64_t i : order) {
        const auto g =
            static_cast<std::size_t>(std::min_element(load.begin(), load.end()) - load.begin());
        mb.groups[g].push_back(i);
        load[g] += total_lengths[i];
      }
      for (auto& g : mb.groups) std::sort(g.begin(), g.end());
      l.microbatches.push_back(std::move(mb));
    }
  }
  return l;
}

Placement pack_by_tokens(const Placement& placement, const std::vector<int64_t>& total_lengths,
                         int64_t max_tokens) {
  Placement out(placement.size());
  for (std::size_t d = 0; d < placement.size(); ++d) {
    int64_t tokens = 0;
    for (const auto& micro : placement[d]) {
      for (int64_t i : micro) {
        const int64_t t = total_lengths[static_cast<std::size_t>(i)];
        if (out[d].empty() || (tokens + t > max_tokens && !out[d].back().empty())) {
          out[d].emplace_back();
          tokens = 0;
        }
        out[d].back().push_back(i);
        tokens += t;
      }
    }
  }
  return out;
}

}  // namespace lossguard::oracle
