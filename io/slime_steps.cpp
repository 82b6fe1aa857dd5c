// slime's format-2 train dumps: the optimizer steps and the trainer's DP x micro-batch layout they
// record (io/dump_values.h).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/errors.h"
#include "io/dump_values.h"

namespace lossguard::io::dump_detail {

using Kind = Value::Kind;

// slime's format-2 train dump (`format_version: 2`): `samples` in rollout order and `dp_shards`,
// one schedule per DP rank: `partition` (or `rollout_positions`), the global rollout positions of
// the rank's samples in execution order; `num_microbatches[s]` per rank in step s;
// `micro_batch_indices`, one flat list over all steps of runs of rank-local indices into
// `partition`. Step s of rank r is micro-batches [sum(nmb[:s]), sum(nmb[:s+1])). `first` is the
// batch index of samples[0].
// Long: slime's format-2 layout read and checked field by field (dp_shards, partition, micro-batch
// counts), each error naming the dump and the field.
std::vector<BatchStep> slime_format2_steps(const Value& root, const Value& samples,
                                           const std::string& path, int64_t first) {
  const Value* shards = root.get("dp_shards");
  if (shards == nullptr || shards->kind == Kind::kNone) return {};
  if (!shards->is_sequence())
    throw_input_error("{}: field 'dp_shards' is a {}, expected a list of per-DP-rank schedules",
                      path, shards->type_name());
  // rollout position -> batch index
  std::map<int64_t, int64_t> by_position, by_sample_index;
  for (std::size_t k = 0; k < samples.items.size(); ++k) {
    const Value& s = *samples.items[k];
    const auto index = first + static_cast<int64_t>(k);
    const Value* pos = s.is_dict() ? s.get("rollout_position") : nullptr;
    const int64_t p =
        pos != nullptr && pos->kind != Kind::kNone
            ? to_length(*pos, fmt::format("{}: sample {} field 'rollout_position'", path, k))
            : static_cast<int64_t>(k);
    if (!by_position.emplace(p, index).second)
      throw_input_error("{}: samples {} and {} have the same rollout_position {}", path,
                        by_position[p] - first, k, p);
    if (const Value* si = s.is_dict() ? s.get("sample_index") : nullptr;
        si && si->kind != Kind::kNone)
      by_sample_index.emplace(
          to_length(*si, fmt::format("{}: sample {} field 'sample_index'", path, k)), index);
  }
  std::vector<BatchStep> steps;
  std::size_t num_steps = 0;
  for (std::size_t r = 0; r < shards->items.size(); ++r) {
    const Value& shard = *shards->items[r];
    const std::string where = fmt::format("{}: dp_shards[{}]", path, r);
    if (!shard.is_dict())
      throw_input_error("{} is a {}, expected a dict", where, shard.type_name());
    auto field = [&](const char* name) -> const Value* {
      const Value* v = shard.get(name);
      return v != nullptr && v->kind != Kind::kNone ? v : nullptr;
    };
    int64_t dp_rank = static_cast<int64_t>(r);
    if (const Value* d = field("data_parallel_rank"))
      dp_rank = to_length(*d, where + " field 'data_parallel_rank'");
    if (dp_rank < 0 || dp_rank >= static_cast<int64_t>(shards->items.size())) {
      throw_input_error("{}: data_parallel_rank {} is outside [0, {}) for {} shards", where,
                        dp_rank, shards->items.size(), shards->items.size());
    }
    // The rank's samples as batch indices, in its execution order.
    std::vector<int64_t> local;
    const char* position_key = field("partition") ? "partition" : "rollout_positions";
    if (const Value* part = field(position_key)) {
      for (int64_t p : to_int_list(*part, fmt::format("{} field '{}'", where, position_key))) {
        auto it = by_position.find(p);
        if (it == by_position.end())
          throw_input_error("{} field '{}' names rollout position {}, which no sample has", where,
                            position_key, p);
        local.push_back(it->second);
      }
    } else if (const Value* si = field("sample_indices")) {
      for (int64_t x : to_int_list(*si, where + " field 'sample_indices'")) {
        auto it = by_sample_index.find(x);
        if (it == by_sample_index.end())
          throw_input_error("{} field 'sample_indices' names sample_index {}, which no sample has",
                            where, x);
        local.push_back(it->second);
      }
    } else {
      throw_input_error("{} has neither 'partition', 'rollout_positions' nor 'sample_indices'",
                        where);
    }
    const Value* mbi = field("micro_batch_indices");
    if (mbi == nullptr || !mbi->is_sequence())
      throw_input_error("{}: field 'micro_batch_indices' is missing or not a list", where);
    std::vector<int64_t> nmb;
    if (const Value* n = field("num_microbatches"))
      nmb = to_int_list(*n, where + " field 'num_microbatches'");
    else
      nmb = {static_cast<int64_t>(mbi->items.size())};  // one step
    std::vector<int64_t> gbs;
    if (const Value* g = field("global_batch_sizes"))
      gbs = to_int_list(*g, where + " field 'global_batch_sizes'");
    if (!gbs.empty() && gbs.size() != nmb.size())
      throw_input_error("{}: {} global_batch_sizes but {} num_microbatches: one of each per step",
                        where, gbs.size(), nmb.size());
    if (r == 0) {
      num_steps = nmb.size();
      steps.resize(num_steps);
      for (std::size_t s = 0; s < num_steps; ++s) {
        steps[s].step = static_cast<int64_t>(s);
        steps[s].global_batch_size = gbs.empty() ? 0 : gbs[s];
        steps[s].source = "the dump's dp_shards (slime format 2)";
      }
    } else if (nmb.size() != num_steps) {
      throw_input_error("{}: {} steps, but dp_shards[0] has {}", where, nmb.size(), num_steps);
    }
    int64_t total = 0;
    for (int64_t n : nmb) {
      if (n < 0) throw_input_error("{}: num_microbatches has a negative entry {}", where, n);
      total += n;
    }
    if (total != static_cast<int64_t>(mbi->items.size())) {
      throw_input_error("{}: sum(num_microbatches) = {} but micro_batch_indices has {} entries",
                        where, total, mbi->items.size());
    }
    std::size_t k = 0;
    for (std::size_t s = 0; s < num_steps; ++s) {
      BatchStep& step = steps[s];
      if (static_cast<int64_t>(step.placement.size()) <= dp_rank)
        step.placement.resize(dp_rank + 1);
      auto& rank_mbs = step.placement[dp_rank];
      if (!rank_mbs.empty())
        throw_input_error("{}: data_parallel_rank {} appears twice in dp_shards", where, dp_rank);
      for (int64_t m = 0; m < nmb[s]; ++m, ++k) {
        const std::string what = fmt::format("{} micro_batch_indices[{}]", where, k);
        std::vector<int64_t> mb;
        for (int64_t li : to_int_list(*mbi->items[k], what)) {
          if (li < 0 || li >= static_cast<int64_t>(local.size()))
            throw_input_error("{} has local index {}, but the rank holds {} samples", what, li,
                              local.size());
          mb.push_back(local[li]);
          step.samples.push_back(local[li]);
        }
        rank_mbs.push_back(std::move(mb));
      }
    }
  }
  for (auto& step : steps) {
    std::sort(step.samples.begin(), step.samples.end());
    step.samples.erase(std::unique(step.samples.begin(), step.samples.end()), step.samples.end());
    for (std::size_t d = 0; d < step.placement.size(); ++d) {
      if (step.placement[d].empty() && num_steps > 0)
        throw_input_error("{}: dp_shards has no schedule for data_parallel_rank {}", path, d);
    }
  }
  return steps;
}

}  // namespace lossguard::io::dump_detail
