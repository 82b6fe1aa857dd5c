// Format detection, the Value tree -> Batch conversion (packed, per-sample and Relax/slime
// layouts), field mapping, and writers.
#include "io/dump.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "core/errors.h"
#include "io/safetensors.h"
#include "io/torch_zip.h"

namespace lossguard::io {

namespace fs = std::filesystem;
using Kind = Value::Kind;

const char* dump_format_name(DumpFormat f) {
  switch (f) {
    case DumpFormat::kSafetensors:
      return "safetensors";
    case DumpFormat::kTorchSave:
      return "torch.save";
    case DumpFormat::kJson:
      return "json";
  }
  return "?";
}

namespace {

// A batch field and the keys it is read from. Two of those keys in one dict are the same field
// twice (an input error naming both), except where `distinct` says the keys hold different
// quantities a dump may carry side by side (slime keeps the inference engine's rollout_log_probs
// beside the trainer's old_log_probs): then the first listed wins.
struct FieldSpec {
  const char* name;
  std::vector<const char*> aliases;
  bool distinct = false;
};
const std::vector<FieldSpec>& field_specs() {
  static const std::vector<FieldSpec> kSpecs = {
      {"samples", {"samples"}},
      {"tokens", {"tokens", "input_ids"}},
      {"total_length", {"total_length", "total_lengths"}},
      {"response_length", {"response_length", "response_lengths"}},
      {"loss_mask", {"loss_mask", "loss_masks"}},
      {"logits", {"logits"}},
      {"log_probs", {"log_probs"}},
      {"old_log_probs", {"old_log_probs", "rollout_log_probs"}, true},
      {"ref_log_probs", {"ref_log_probs"}},
      {"advantages", {"advantages"}},
      {"token_loss", {"token_loss"}},
      // Per-sample values (SPEC §1), under the names slime and Relax use.
      {"padded_total_length",
       {"padded_total_length", "padded_total_lengths", "maybe_padded_total_lengths"}},
      {"sample_denom",
       {"sample_denom", "sample_denoms", "rollout_mask_sums", "sample_index_mask_sums"}},
      {"removed", {"removed", "remove_sample", "remove_samples"}},
  };
  return kSpecs;
}

bool is_field_key(const std::string& key, const FieldMap& map) {
  for (const auto& [name, k] : map.keys) {
    if (k == key) return true;
  }
  for (const auto& spec : field_specs()) {
    for (const char* a : spec.aliases) {
      if (key == a) return true;
    }
  }
  return false;
}

// Finds a batch-model field in a dict: the --field override if given, else the alias present (two
// present: an input error naming both, `where` first).
const Value* find_field(const Value& dict, const std::string& name, const FieldMap& map,
                        std::string* key_used, const std::string& where = "") {
  if (auto it = map.keys.find(name); it != map.keys.end()) {
    *key_used = it->second;
    return dict.get(it->second);
  }
  for (const auto& spec : field_specs()) {
    if (name != spec.name) continue;
    const Value* found = nullptr;
    for (const char* a : spec.aliases) {
      const Value* v = dict.get(a);
      if (v == nullptr) continue;
      if (found == nullptr) {
        found = v;
        *key_used = a;
        if (spec.distinct) break;
      } else {
        throw_input_error(
            "{}{}keys '{}' and '{}' are both the batch field '{}': keep one, or choose with "
            "--field {}=KEY",
            where, where.empty() ? "" : " ", *key_used, a, name, name);
      }
    }
    if (found != nullptr) return found;
  }
  *key_used = name;
  return nullptr;
}

std::string opaque_hint(const Value& v) {
  if (v.kind == Kind::kOpaque || v.kind == Kind::kGlobal) {
    return fmt::format(
        "holds a pickled object of type {} that lossguard cannot read: it never runs pickled code, "
        "so only tensors, lists and numbers are understood (save the field as a torch tensor or a "
        "list)",
        v.s);
  }
  return fmt::format("holds a {}, expected a tensor, a list of numbers or a number", v.type_name());
}

// A tensor, a (nested) list of numbers, or a number, as a HostArray. `where` prefixes messages.
HostArray to_array(const Value& v, const std::string& where) {
  if (v.kind == Kind::kTensor) return v.array;
  if (v.is_number()) {
    if (v.kind == Kind::kFloat) return HostArray::from_f64(DType::kFloat64, {}, {v.f});
    return HostArray::from_i64(DType::kInt64, {}, {v.kind == Kind::kBool ? v.b : v.i});
  }
  if (!v.is_sequence()) throw_input_error("{} {}", where, opaque_hint(v));
  bool nested = !v.items.empty() && v.items[0]->is_sequence();
  std::vector<double> fvals;
  std::vector<int64_t> ivals;
  bool any_float = false;
  int64_t cols = -1;
  auto take_scalar = [&](const Value& x, int64_t row, int64_t col) {
    if (x.kind == Kind::kFloat) {
      any_float = true;
      fvals.push_back(x.f);
      ivals.push_back(0);
    } else if (x.kind == Kind::kInt || x.kind == Kind::kBool) {
      const int64_t i = x.kind == Kind::kBool ? x.b : x.i;
      fvals.push_back(static_cast<double>(i));
      ivals.push_back(i);
    } else if (x.kind == Kind::kTensor && x.array.numel() == 1) {
      if (dtype_is_float(x.array.dtype)) any_float = true;
      fvals.push_back(x.array.get_f64(0));
      ivals.push_back(x.array.get_i64(0));
    } else if (row >= 0) {
      throw_input_error("{}[{}][{}] {}", where, row, col,
                        x.kind == Kind::kBigInt ? "is an integer over 64 bits" : opaque_hint(x));
    } else {
      throw_input_error("{}[{}] {}", where, col,
                        x.kind == Kind::kBigInt ? "is an integer over 64 bits" : opaque_hint(x));
    }
  };
  if (!nested) {
    for (std::size_t j = 0; j < v.items.size(); ++j)
      take_scalar(*v.items[j], -1, static_cast<int64_t>(j));
    const auto n = static_cast<int64_t>(v.items.size());
    return any_float ? HostArray::from_f64(DType::kFloat64, {n}, fvals)
                     : HostArray::from_i64(DType::kInt64, {n}, ivals);
  }
  for (std::size_t r = 0; r < v.items.size(); ++r) {
    const Value& row = *v.items[r];
    if (!row.is_sequence())
      throw_input_error("{}[{}] is a {}, expected a list (a row)", where, r, row.type_name());
    if (cols >= 0 && static_cast<int64_t>(row.items.size()) != cols) {
      throw_input_error("{}[{}] has {} entries but row 0 has {} (ragged rows)", where, r,
                        row.items.size(), cols);
    }
    cols = static_cast<int64_t>(row.items.size());
    for (std::size_t c = 0; c < row.items.size(); ++c)
      take_scalar(*row.items[c], static_cast<int64_t>(r), static_cast<int64_t>(c));
  }
  const auto rows = static_cast<int64_t>(v.items.size());
  return any_float ? HostArray::from_f64(DType::kFloat64, {rows, cols}, fvals)
                   : HostArray::from_i64(DType::kInt64, {rows, cols}, ivals);
}

// A packed field given as a list of per-sample arrays (how slime and Relax hold rollout_data:
// {"tokens": [tensor, ...], "loss_masks": [tensor, ...]}): the arrays concatenated along their
// first dimension, in their own dtype when they share one (bf16 log-probs stay bf16). Anything else
// goes to to_array.
HostArray to_packed_array(const Value& v, const std::string& where) {
  const bool per_sample = v.is_sequence() && !v.items.empty() &&
                          std::any_of(v.items.begin(), v.items.end(), [](const ValuePtr& x) {
                            return x->kind == Kind::kTensor && !x->array.shape.empty();
                          });
  if (!per_sample) return to_array(v, where);
  std::vector<HostArray> parts;
  parts.reserve(v.items.size());
  for (std::size_t k = 0; k < v.items.size(); ++k) {
    parts.push_back(to_array(*v.items[k], fmt::format("{}[{}]", where, k)));
    const HostArray& p = parts.back();
    if (p.shape.empty()) {
      throw_input_error(
          "{}[{}] is a scalar among per-sample arrays (sample {} needs a list or a 1-D tensor)",
          where, k, k);
    }
    const HostArray& first = parts.front();
    if (p.shape.size() != first.shape.size() ||
        !std::equal(p.shape.begin() + 1, p.shape.end(), first.shape.begin() + 1)) {
      if (!(p.numel() == 0 && p.shape.size() == 1)) {  // an empty response's [] fits any row shape
        throw_input_error(
            "{}[{}] has shape {} but {}[0] has {}: per-sample arrays must agree past their first "
            "dimension",
            where, k, p.shape_string(), where, first.shape_string());
      }
    }
  }
  // The row shape: from the first part with rows of that shape.
  std::vector<int64_t> row_shape;
  for (const HostArray& p : parts) {
    if (!(p.numel() == 0 && p.shape.size() == 1)) {
      row_shape.assign(p.shape.begin() + 1, p.shape.end());
      break;
    }
  }
  int64_t rows = 0;
  bool same_dtype = true;
  for (const HostArray& p : parts) {
    if (p.numel() == 0) continue;
    rows += p.shape[0];
    same_dtype &= p.dtype == parts.front().dtype;
  }
  DType dtype = parts.front().dtype;
  if (!same_dtype) {
    bool any_float = false;
    for (const HostArray& p : parts) any_float |= dtype_is_float(p.dtype);
    dtype = any_float ? DType::kFloat64 : DType::kInt64;
  }
  std::vector<int64_t> shape = {rows};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  HostArray out = HostArray::zeros(dtype, shape);
  std::size_t offset = 0;
  for (const HostArray& p : parts) {
    if (p.numel() == 0) continue;
    if (p.dtype == dtype) {
      std::memcpy(out.mutable_data() + offset, p.data, p.size_bytes());
    } else if (dtype == DType::kFloat64) {
      p.copy_f64(0, p.numel(), reinterpret_cast<double*>(out.mutable_data() + offset));
    } else {
      p.copy_i64(0, p.numel(), reinterpret_cast<int64_t*>(out.mutable_data() + offset));
    }
    offset += static_cast<std::size_t>(p.numel()) * dtype_size_bytes(dtype);
  }
  return out;
}

int64_t to_length(const Value& v, const std::string& where) {
  if (v.kind == Kind::kInt) return v.i;
  if (v.kind == Kind::kTensor && v.array.numel() == 1 && !dtype_is_float(v.array.dtype))
    return v.array.get_i64(0);
  if (v.is_sequence() && v.items.size() == 1) return to_length(*v.items[0], where);
  throw_input_error("{} is a {}, expected an integer length", where, v.type_name());
}

double to_scalar(const Value& v, const std::string& where) {
  if (v.kind == Kind::kInt) return static_cast<double>(v.i);
  if (v.kind == Kind::kBool) return v.b ? 1.0 : 0.0;
  if (v.kind == Kind::kFloat) return v.f;
  if (v.kind == Kind::kTensor && v.array.numel() == 1) return v.array.get_f64(0);
  if (v.is_sequence() && v.items.size() == 1) return to_scalar(*v.items[0], where);
  throw_input_error("{} is a {}, expected a number", where, v.type_name());
}

nlohmann::json to_metadata(const Value& v) {
  switch (v.kind) {
    case Kind::kNone:
      return nullptr;
    case Kind::kBool:
      return v.b;
    case Kind::kInt:
      return v.i;
    case Kind::kFloat:
      return v.f;
    case Kind::kString:
    case Kind::kBigInt:
      return v.s;
    default:
      return v.type_name();
  }
}

void add_samples(BatchBuilder& builder, const Value& samples, const std::string& path,
                 const FieldMap& map) {
  for (std::size_t i = 0; i < samples.items.size(); ++i) {
    const Value& s = *samples.items[i];
    const std::string where_sample = fmt::format("{}: sample {}:", path, i);
    if (!s.is_dict())
      throw_input_error("{} is a {}, expected a dict of fields", where_sample, s.type_name());
    std::string key;
    std::deque<HostArray> keep;
    SampleFields f;
    auto array_field = [&](const std::string& name) -> const HostArray* {
      const Value* v = find_field(s, name, map, &key, where_sample);
      if (v == nullptr || v->kind == Kind::kNone) return nullptr;
      keep.push_back(to_array(*v, fmt::format("{} field '{}'", where_sample, key)));
      return &keep.back();
    };
    f.tokens = array_field("tokens");
    if (f.tokens == nullptr) {
      throw_input_error(
          "{} field 'tokens' is missing (keys: {}); map another key with --field tokens=KEY",
          where_sample, [&] {
            std::vector<std::string> k;
            for (auto& e : s.entries) k.push_back(e.first->s);
            return fmt::format("{}", fmt::join(k, ", "));
          }());
    }
    if (const Value* v = find_field(s, "response_length", map, &key, where_sample)) {
      f.response_length = to_length(*v, fmt::format("{} field '{}'", where_sample, key));
    }
    if (const Value* v = find_field(s, "total_length", map, &key, where_sample)) {
      f.total_length = to_length(*v, fmt::format("{} field '{}'", where_sample, key));
    }
    if (const Value* v = find_field(s, "padded_total_length", map, &key, where_sample);
        v != nullptr && v->kind != Kind::kNone) {
      f.padded_total_length = to_length(*v, fmt::format("{} field '{}'", where_sample, key));
    }
    if (const Value* v = find_field(s, "sample_denom", map, &key, where_sample);
        v != nullptr && v->kind != Kind::kNone) {
      f.sample_denom = to_scalar(*v, fmt::format("{} field '{}'", where_sample, key));
    }
    if (const Value* v = find_field(s, "removed", map, &key, where_sample);
        v != nullptr && v->kind != Kind::kNone) {
      f.removed = to_scalar(*v, fmt::format("{} field '{}'", where_sample, key)) != 0.0;
    }
    f.loss_mask = array_field("loss_mask");
    f.logits = array_field("logits");
    for (const std::string& name : per_token_field_names()) {
      if (const HostArray* a = array_field(name)) f.per_token[name] = a;
    }
    builder.add_sample(static_cast<int64_t>(i), f);
  }
}

std::vector<int64_t> to_int_list(const Value& v, const std::string& where) {
  const HostArray a = to_array(v, where);
  if (a.shape.size() > 1)
    throw_input_error("{} has shape {}, expected a list of integers", where, a.shape_string());
  if (dtype_is_float(a.dtype)) {
    for (int64_t k = 0; k < a.numel(); ++k) {
      const double x = a.get_f64(k);
      if (x != static_cast<double>(static_cast<int64_t>(x)))
        throw_input_error("{}[{}] = {} is not an integer", where, k, x);
    }
  }
  std::vector<int64_t> out(static_cast<std::size_t>(a.numel()));
  for (int64_t k = 0; k < a.numel(); ++k) out[k] = a.get_i64(k);
  return out;
}

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

void add_tree(BatchBuilder& builder, const Value& root, const std::string& path,
              const FieldMap& map) {
  std::string key;
  if (root.is_sequence()) {
    add_samples(builder, root, path, map);
    return;
  }
  if (!root.is_dict())
    throw_input_error("{}: top level is a {}, expected a dict or a list of samples", path,
                      root.type_name());
  for (const auto& [k, v] : root.entries) {
    if (k->kind != Kind::kString || is_field_key(k->s, map)) continue;
    if (v->is_dict() && (k->s == "__metadata__" || k->s == "metadata")) {
      for (const auto& [mk, mv] : v->entries) {
        if (mk->kind == Kind::kString) builder.add_metadata(mk->s, to_metadata(*mv));
      }
    } else if (!v->is_sequence() && !v->is_dict() && v->kind != Kind::kTensor) {
      builder.add_metadata(k->s, to_metadata(*v));
    }
  }
  if (const Value* samples = find_field(root, "samples", map, &key, path + ":")) {
    if (!samples->is_sequence())
      throw_input_error("{}: field '{}' is a {}, expected a list of samples", path, key,
                        samples->type_name());
    const int64_t first = builder.num_samples();
    add_samples(builder, *samples, path, map);
    builder.add_steps(slime_format2_steps(root, *samples, path, first));
    return;
  }
  // slime's per-rank train dump: {"rollout_id", "rank", "rollout_data": {packed fields}}.
  if (const Value* data = root.get("rollout_data");
      data != nullptr && data->is_dict() &&
      find_field(root, "tokens", map, &key, path + ":") == nullptr) {
    add_tree(builder, *data, path, map);
    return;
  }
  if (find_field(root, "tokens", map, &key, path + ":") == nullptr) {
    std::vector<std::string> keys;
    for (const auto& e : root.entries)
      keys.push_back(e.first->kind == Kind::kString ? e.first->s : e.first->type_name());
    throw_input_error(
        "{}: no batch found: expected a 'samples' list or packed 'tokens', 'total_lengths' and "
        "'response_lengths' (top-level keys: {}); --field NAME=KEY maps other names",
        path, fmt::join(keys, ", "));
  }
  std::deque<HostArray> keep;
  PackedFields f;
  auto array_field = [&](const std::string& name) -> const HostArray* {
    const Value* v = find_field(root, name, map, &key, path + ":");
    if (v == nullptr || v->kind == Kind::kNone) return nullptr;
    keep.push_back(to_packed_array(*v, fmt::format("{}: field '{}'", path, key)));
    return &keep.back();
  };
  f.tokens = array_field("tokens");
  f.total_lengths = array_field("total_length");
  f.response_lengths = array_field("response_length");
  f.loss_masks = array_field("loss_mask");
  f.logits = array_field("logits");
  for (const std::string& name : per_token_field_names()) {
    if (const HostArray* a = array_field(name)) f.per_token[name] = a;
  }
  f.padded_total_lengths = array_field("padded_total_length");
  f.sample_denoms = array_field("sample_denom");
  f.removed = array_field("removed");
  builder.add_packed(f);
}

std::string describe_dtype(const Value& v) {
  if (v.kind == Kind::kTensor) return std::string(dtype_name(v.array.dtype));
  if (v.is_sequence()) {
    if (v.items.empty()) return v.kind == Kind::kList ? "list" : "tuple";
    return fmt::format("{}[{}]", v.kind == Kind::kList ? "list" : "tuple",
                       describe_dtype(*v.items[0]));
  }
  return v.type_name();
}

std::string describe_shape(const Value& v) {
  if (v.kind == Kind::kTensor) return v.array.shape_string();
  if (v.is_sequence()) {
    if (!v.items.empty() && v.items[0]->is_sequence())
      return fmt::format("[{}, {}]", v.items.size(), v.items[0]->items.size());
    return fmt::format("[{}]", v.items.size());
  }
  return "";
}

std::vector<FieldInfo> describe_fields(const Value& root) {
  std::vector<FieldInfo> out;
  auto describe_samples = [&](const Value& samples, const std::string& prefix) {
    // One row per key of the samples, with the shape taken over all samples ("var" when lengths
    // differ).
    std::vector<std::string> order;
    std::map<std::string, std::pair<std::string, std::string>> seen;
    for (const auto& s : samples.items) {
      if (!s->is_dict()) continue;
      for (const auto& [k, v] : s->entries) {
        if (k->kind != Kind::kString) continue;
        const std::string shape = describe_shape(*v);
        auto it = seen.find(k->s);
        if (it == seen.end()) {
          order.push_back(k->s);
          seen[k->s] = {describe_dtype(*v), shape};
        } else if (it->second.second != shape) {
          it->second.second = "var";
        }
      }
    }
    for (const auto& k : order) {
      const auto& [dtype, shape] = seen[k];
      out.push_back(
          {prefix + "[*]." + k, dtype,
           shape.empty()
               ? ""
               : fmt::format("[{}, {}]", samples.items.size(),
                             shape == "var" ? "var" : shape.substr(1, shape.size() - 2))});
    }
  };
  if (root.is_sequence()) {
    describe_samples(root, "");
    return out;
  }
  for (const auto& [k, v] : root.entries) {
    const std::string name = k->kind == Kind::kString ? k->s : k->type_name();
    if (v->is_sequence() && !v->items.empty() && v->items[0]->is_dict()) {
      out.push_back({name, "list[dict]", fmt::format("[{}]", v->items.size())});
      describe_samples(*v, name);
    } else {
      out.push_back({name, describe_dtype(*v), describe_shape(*v)});
    }
  }
  return out;
}

ValuePtr from_json(const nlohmann::json& j, const std::string& what, std::size_t depth) {
  if (depth > 1000) throw_input_error("{}: JSON nested deeper than 1000 levels", what);
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return Value::none();
    case nlohmann::json::value_t::boolean:
      return Value::make_bool(j.get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Value::make_int(j.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      const auto u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX))
        return Value::make_string(std::to_string(u), Kind::kBigInt);
      return Value::make_int(static_cast<int64_t>(u));
    }
    case nlohmann::json::value_t::number_float:
      return Value::make_float(j.get<double>());
    case nlohmann::json::value_t::string:
      return Value::make_string(j.get<std::string>());
    case nlohmann::json::value_t::array: {
      auto l = Value::make_list();
      l->items.reserve(j.size());
      for (const auto& x : j) l->items.push_back(from_json(x, what, depth + 1));
      return l;
    }
    case nlohmann::json::value_t::object: {
      auto d = Value::make_dict();
      for (auto it = j.begin(); it != j.end(); ++it)
        d->entries.emplace_back(Value::make_string(it.key()),
                                from_json(it.value(), what, depth + 1));
      return d;
    }
    default:
      throw_input_error("{}: unsupported JSON value", what);
  }
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw_input_error("{}: cannot open: {}", path, std::strerror(errno));
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

}  // namespace

void FieldMap::add(const std::string& spec) {
  const auto eq = spec.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == spec.size()) {
    throw_input_error("--field '{}': expected NAME=KEY, for example --field loss_mask=mask", spec);
  }
  const std::string name = spec.substr(0, eq);
  const auto& names = batch_field_names();
  if (std::find(names.begin(), names.end(), name) == names.end()) {
    throw_input_error("--field '{}': unknown field '{}' (one of: {})", spec, name,
                      fmt::join(names, ", "));
  }
  keys[name] = spec.substr(eq + 1);
}

const std::vector<std::string>& batch_field_names() {
  static const std::vector<std::string> kNames = [] {
    std::vector<std::string> n;
    for (const auto& s : field_specs()) n.push_back(s.name);
    return n;
  }();
  return kNames;
}

std::vector<std::string> expand_dump_paths(const std::vector<std::string>& paths) {
  std::vector<std::string> out;
  for (const auto& p : paths) {
    std::error_code ec;
    if (fs::is_directory(p, ec)) {
      std::vector<std::string> files;
      for (const auto& e : fs::directory_iterator(p, ec)) {
        const std::string ext = e.path().extension().string();
        if (e.is_regular_file() &&
            (ext == ".safetensors" || ext == ".pt" || ext == ".pth" || ext == ".json")) {
          files.push_back(e.path().string());
        }
      }
      std::sort(files.begin(), files.end());
      if (files.empty())
        throw_input_error("{}: directory holds no dump files (*.safetensors, *.pt, *.pth, *.json)",
                          p);
      out.insert(out.end(), files.begin(), files.end());
    } else if (!fs::exists(p, ec)) {
      throw_input_error("{}: no such file or directory", p);
    } else {
      out.push_back(p);
    }
  }
  return out;
}

DumpFormat detect_format(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw_input_error("{}: no such file or directory", path);
  std::ifstream f(path, std::ios::binary);
  if (!f) throw_input_error("{}: cannot open: {}", path, std::strerror(errno));
  char head[9] = {};
  f.read(head, 9);
  const auto n = f.gcount();
  // safetensors first, by its structure: an 8-byte little-endian header length that fits the file,
  // then '{'. Its first byte is the length's low byte and may be anything, 0x80 (a pickle's PROTO)
  // included, so the pickle test must come after this one.
  if (n >= 9 && head[8] == '{') {
    uint64_t header_len = 0;
    for (int k = 7; k >= 0; --k) header_len = (header_len << 8) | static_cast<uint8_t>(head[k]);
    const auto size = fs::file_size(path, ec);
    if (!ec && header_len >= 2 && header_len <= size - 8) return DumpFormat::kSafetensors;
  }
  if (n >= 4 && std::string_view(head, 4) == std::string_view("PK\x03\x04", 4))
    return DumpFormat::kTorchSave;
  if (n >= 1 && static_cast<uint8_t>(head[0]) == 0x80)
    return DumpFormat::kTorchSave;  // legacy: reported there
  const std::string ext = fs::path(path).extension().string();
  if (ext == ".safetensors") return DumpFormat::kSafetensors;
  if (ext == ".pt" || ext == ".pth") return DumpFormat::kTorchSave;
  if (ext == ".json") return DumpFormat::kJson;
  if (n >= 9 && head[8] == '{') return DumpFormat::kSafetensors;
  for (std::streamsize k = 0; k < n; ++k) {
    if (head[k] == '{' || head[k] == '[') return DumpFormat::kJson;
    if (!std::isspace(static_cast<unsigned char>(head[k]))) break;
  }
  throw_input_error("{}: unknown dump format (expected .safetensors, .pt or .json)", path);
}

ValuePtr json_to_value(const std::string& text, const std::string& what) {
  nlohmann::json j;
  // nlohmann keeps the last of two equal keys in an object; a dump whose "loss_mask" appears twice
  // is ambiguous, so it is refused, naming the key and where it is.
  std::vector<std::set<std::string>> keys;  // one set per open object
  std::vector<std::string> path;            // the key that leads to each open object
  std::string pending_key, duplicate;
  nlohmann::json::parser_callback_t on_event = [&](int, nlohmann::json::parse_event_t ev,
                                                   nlohmann::json& v) {
    using E = nlohmann::json::parse_event_t;
    if (ev == E::object_start) {
      keys.emplace_back();
      path.push_back(pending_key);
    } else if (ev == E::object_end && !keys.empty()) {
      keys.pop_back();
      path.pop_back();
    } else if (ev == E::key && !keys.empty()) {
      pending_key = v.get<std::string>();
      if (!keys.back().insert(pending_key).second && duplicate.empty()) {
        std::string at;
        for (const auto& p : path) {
          if (!p.empty()) at += "/" + p;
        }
        duplicate = fmt::format("'{}' (in the object at '{}')", pending_key,
                                at.empty() ? std::string("/") : at);
      }
    } else if (ev == E::array_start) {
      pending_key = "[]";
    }
    return true;
  };
  try {
    j = nlohmann::json::parse(text, on_event);
  } catch (const nlohmann::json::exception& e) {
    throw_input_error("{}: invalid JSON: {}", what, e.what());
  }
  if (!duplicate.empty()) {
    throw_input_error(
        "{}: JSON key {} appears twice in one object (the second would replace the "
        "first)",
        what, duplicate);
  }
  return from_json(j, what, 0);
}

Dump read_dump(const std::string& path) {
  Dump d;
  d.path = path;
  d.format = detect_format(path);
  switch (d.format) {
    case DumpFormat::kSafetensors: {
      SafetensorsFile st = read_safetensors(path);
      d.tree = Value::make_dict();
      for (auto& [name, a] : st.tensors)
        d.tree->entries.emplace_back(Value::make_string(name), Value::make_tensor(a));
      if (!st.metadata.empty()) {
        auto meta = Value::make_dict();
        for (auto& [k, v] : st.metadata)
          meta->entries.emplace_back(Value::make_string(k), Value::make_string(v));
        d.tree->entries.emplace_back(Value::make_string("__metadata__"), meta);
      }
      break;
    }
    case DumpFormat::kTorchSave:
      d.tree = read_torch_save(path);
      break;
    case DumpFormat::kJson:
      d.tree = json_to_value(read_text(path), path);
      break;
  }
  d.fields = describe_fields(*d.tree);
  return d;
}

namespace {

// A dump one rank wrote for itself: slime's {"rollout_id", "rank", "rollout_data"} or Relax's
// {"rollout_id", "rank", "samples"} (not slime's format 2, which one rank writes for all).
bool is_per_rank_dump(const Dump& d) {
  if (!d.tree->is_dict() || d.tree->get("rank") == nullptr) return false;
  const Value* data = d.tree->get("rollout_data");
  if (data != nullptr && data->is_dict()) return true;
  const Value* samples = d.tree->get("samples");
  return samples != nullptr && samples->is_sequence() && d.tree->get("dp_shards") == nullptr &&
         d.tree->get("format_version") == nullptr;
}

bool has_rollout_data(const Dump& d) {
  const Value* data = d.tree->get("rollout_data");
  return data != nullptr && data->is_dict();
}

// The first difference between two dumps' samples, or "" when they hold the same samples.
std::string replica_difference(const Batch& a, const Batch& b) {
  if (a.num_samples() != b.num_samples())
    return fmt::format("{} samples against {}", b.num_samples(), a.num_samples());
  for (int64_t i = 0; i < a.num_samples(); ++i) {
    const bool same =
        a.total_lengths[i] == b.total_lengths[i] &&
        a.response_lengths[i] == b.response_lengths[i] &&
        std::equal(a.tokens.begin() + a.token_offsets[i], a.tokens.begin() + a.token_offsets[i + 1],
                   b.tokens.begin() + b.token_offsets[i]) &&
        std::equal(a.loss_mask.begin() + a.response_offsets[i],
                   a.loss_mask.begin() + a.response_offsets[i + 1],
                   b.loss_mask.begin() + b.response_offsets[i]);
    if (!same) return fmt::format("sample {} differs (tokens, lengths or loss mask)", i);
  }
  return "";
}

int64_t dump_rank(const Dump& d) {
  const Value* r = d.tree->get("rank");
  return r != nullptr && r->kind == Kind::kInt ? r->i : 0;
}

// The response rows CP rank `c` of `cp` holds for a sample, in the order its CP-local tensors hold
// them: slime's slice_log_prob_with_cp keeps the logits of chunk c, then of chunk 2cp-1-c, each
// clipped to the response's logit range [P-1, T-1); logit q is response index q+1-P (an SFT
// sample's indices are the logit positions themselves).
std::vector<int64_t> cp_local_rows(int64_t t, int64_t r, int64_t cp, int64_t c) {
  std::vector<int64_t> rows;
  const int64_t p = t - r, cs = (t + 2 * cp - 1) / (2 * cp);
  for (const int64_t chunk : {c, 2 * cp - 1 - c}) {
    const int64_t lo = std::max(chunk * cs, p == 0 ? int64_t{0} : p - 1);
    const int64_t hi = std::min((chunk + 1) * cs, t - 1);
    for (int64_t q = lo; q < hi; ++q) rows.push_back(p == 0 ? q : q + 1 - p);
  }
  return rows;
}

// One DP rank's per-rank dumps (the lowest rank first) hold CP-local per-token fields: each rank
// its own tokens' values. Rebuilds the full [sum R] field when the members' lengths fit a
// TP x CP split of the group (tried with TP = 1 first); returns the reason when none fits.
std::optional<HostArray> reassemble_cp_local(const std::vector<const Dump*>& members,
                                             const Batch& samples, const std::string& name,
                                             const FieldMap& map, std::string* why) {
  std::vector<HostArray> local;               // per member, the field's values concatenated
  std::vector<std::vector<int64_t>> lengths;  // per member, per sample, when given as a list
  for (const Dump* d : members) {
    const Value* data = d->tree->get("rollout_data");
    std::string key;
    const Value* v = find_field(*data, name, map, &key, d->path + ":");
    if (v == nullptr || v->kind == Kind::kNone) {
      *why = fmt::format("{} lacks it", d->path);
      return std::nullopt;
    }
    local.push_back(to_packed_array(*v, fmt::format("{}: field '{}'", d->path, key)));
    std::vector<int64_t> per_sample;
    if (v->is_sequence())
      for (const auto& x : v->items)
        per_sample.push_back(x->kind == Kind::kTensor ? x->array.numel()
                                                      : static_cast<int64_t>(x->items.size()));
    lengths.push_back(std::move(per_sample));
  }
  const auto g = static_cast<int64_t>(members.size());
  const int64_t s = samples.num_samples(), rows = samples.num_response_tokens();
  for (int64_t tp = 1; tp <= g; ++tp) {
    if (g % tp != 0) continue;
    const int64_t cp = g / tp;
    bool fits = true;
    for (int64_t m = 0; m < g && fits; ++m) {
      const int64_t c = m / tp;
      int64_t total = 0;
      for (int64_t i = 0; i < s && fits; ++i) {
        const int64_t n = static_cast<int64_t>(
            cp == 1 ? samples.response_lengths[i]
                    : cp_local_rows(samples.total_lengths[i], samples.response_lengths[i], cp, c)
                          .size());
        if (!lengths[m].empty() &&
            (static_cast<int64_t>(lengths[m].size()) != s || lengths[m][i] != n))
          fits = false;
        total += n;
      }
      fits = fits && local[m].shape.size() == 1 && local[m].shape[0] == total;
    }
    if (!fits) continue;
    // Rows no rank holds (an SFT sample's last: no logit predicts it) stay 0.
    std::vector<double> full(static_cast<std::size_t>(rows), 0.0);
    for (int64_t m = 0; m < g; m += tp) {  // TP rank 0 of each CP rank
      const int64_t c = m / tp;
      int64_t k = 0;
      for (int64_t i = 0; i < s; ++i) {
        const int64_t t = samples.total_lengths[i], r = samples.response_lengths[i];
        std::vector<int64_t> idx;
        if (cp == 1) {
          for (int64_t j = 0; j < r; ++j) idx.push_back(j);
        } else {
          idx = cp_local_rows(t, r, cp, c);
        }
        for (int64_t j : idx) full[samples.response_offsets[i] + j] = local[m].get_f64(k++);
      }
    }
    // TP replicas must agree with their TP rank 0.
    for (int64_t m = 0; m < g; ++m) {
      if (m % tp == 0) continue;
      for (int64_t k = 0; k < local[m].numel(); ++k) {
        if (local[m].get_f64(k) != local[m - m % tp].get_f64(k)) {
          *why = fmt::format("{} and {} (TP replicas at TP {}) disagree at value {}",
                             members[m]->path, members[m - m % tp]->path, tp, k);
          return std::nullopt;
        }
      }
    }
    const DType dt = dtype_is_float(local[0].dtype) ? local[0].dtype : DType::kFloat64;
    return HostArray::from_f64(dt, {rows}, full);
  }
  *why = fmt::format("the {} dumps' lengths fit no TP x CP split of them", g);
  return std::nullopt;
}

}  // namespace

Batch build_batch(const std::vector<Dump>& dumps, const FieldMap& fields, LoadNeeds needs) {
  // Per-rank train dumps (slime's {"rollout_id", "rank", "rollout_data"}, Relax's {"rollout_id",
  // "rank", "samples"}): every TP and CP rank of a DP rank (every pipeline stage too) writes the
  // same samples. The lowest rank's dump of
  // each set stands for it; the others must hold exactly the same samples.
  std::vector<const Dump*> kept;
  std::vector<Batch> kept_samples;
  std::vector<std::vector<const Dump*>> groups;  // per kept dump: it and its replicas
  std::vector<std::string> replicas;
  for (const auto& d : dumps) {
    if (!is_per_rank_dump(d)) {
      kept.push_back(&d);
      kept_samples.emplace_back();
      groups.push_back({&d});
      continue;
    }
    BatchBuilder one(LoadNeeds{true, false, false});
    one.begin_file(d.path);
    add_tree(one, *d.tree, d.path, fields);
    Batch b = one.finish();
    bool replica = false;
    for (std::size_t k = 0; k < kept.size() && !replica; ++k) {
      if (!is_per_rank_dump(*kept[k]) || kept_samples[k].num_samples() == 0) continue;
      if (kept_samples[k].tokens != b.tokens) continue;  // another DP rank's samples
      const std::string diff = replica_difference(kept_samples[k], b);
      if (!diff.empty()) {
        throw_input_error("{} and {} hold the same tokens but {}: ranks of one DP rank disagree",
                          kept[k]->path, d.path, diff);
      }
      replicas.push_back(fmt::format("{} = {}", d.path, kept[k]->path));
      groups[k].push_back(&d);
      replica = true;
    }
    if (!replica) {
      kept.push_back(&d);
      kept_samples.push_back(std::move(b));
      groups.push_back({&d});
    }
  }
  BatchBuilder builder(needs);
  std::vector<std::string> reassembled;
  for (std::size_t k = 0; k < kept.size(); ++k) {
    const Dump* d = kept[k];
    builder.begin_file(d->path);
    if (!is_per_rank_dump(*d) || !has_rollout_data(*d) || groups[k].size() < 2 ||
        !needs.per_token) {
      add_tree(builder, *d->tree, d->path, fields);
      continue;
    }
    // CP-local per-token fields of one DP rank's dumps, rebuilt to full length (lowest rank first).
    auto members = groups[k];
    std::stable_sort(members.begin(), members.end(),
                     [](const Dump* a, const Dump* b) { return dump_rank(*a) < dump_rank(*b); });
    auto data = std::make_shared<Value>(*d->tree->get("rollout_data"));
    for (const std::string& name : per_token_field_names()) {
      std::string key;
      if (find_field(*data, name, fields, &key) == nullptr) continue;
      std::string why;
      if (auto full = reassemble_cp_local(members, kept_samples[k], name, fields, &why)) {
        for (auto& [ek, ev] : data->entries)
          if (ek->kind == Kind::kString && ek->s == key) ev = Value::make_tensor(*full);
        reassembled.push_back(fmt::format("{} ({} ranks)", key, members.size()));
      }
    }
    auto root = std::make_shared<Value>(*d->tree);
    for (auto& [ek, ev] : root->entries)
      if (ek->kind == Kind::kString && ek->s == "rollout_data") ev = data;
    add_tree(builder, *root, d->path, fields);
  }
  if (!reassembled.empty())
    builder.add_metadata("lossguard.cp_local_fields_reassembled", reassembled);
  if (!replicas.empty()) {
    builder.add_metadata("lossguard.replica_dumps", replicas);
  }
  return builder.finish();
}

namespace {

std::vector<std::pair<std::string, HostArray>> packed_arrays(const Batch& b) {
  std::vector<std::pair<std::string, HostArray>> t;
  t.emplace_back("tokens", HostArray::from_i64(DType::kInt64,
                                               {static_cast<int64_t>(b.tokens.size())}, b.tokens));
  t.emplace_back("total_lengths",
                 HostArray::from_i64(DType::kInt64, {b.num_samples()}, b.total_lengths));
  t.emplace_back("response_lengths",
                 HostArray::from_i64(DType::kInt64, {b.num_samples()}, b.response_lengths));
  std::vector<int64_t> mask(b.loss_mask.begin(), b.loss_mask.end());
  t.emplace_back("loss_masks", HostArray::from_i64(DType::kInt64, {b.num_response_tokens()}, mask));
  if (b.logits) t.emplace_back("logits", *b.logits);
  for (const auto& [name, a] : b.per_token) t.emplace_back(name, a);
  if (!b.padded_total_lengths.empty()) {
    t.emplace_back("padded_total_lengths",
                   HostArray::from_i64(DType::kInt64, {b.num_samples()}, b.padded_total_lengths));
  }
  if (!b.sample_denoms.empty()) {
    t.emplace_back("sample_denoms",
                   HostArray::from_f64(DType::kFloat64, {b.num_samples()}, b.sample_denoms));
  }
  if (!b.removed.empty()) {
    std::vector<int64_t> removed(b.removed.begin(), b.removed.end());
    t.emplace_back("removed", HostArray::from_i64(DType::kInt64, {b.num_samples()}, removed));
  }
  return t;
}

std::string metadata_text(const nlohmann::json& v) {
  return v.is_string() ? v.get<std::string>() : v.dump();
}

}  // namespace

void write_batch(const Batch& b, const std::string& path) {
  const std::string ext = fs::path(path).extension().string();
  if (ext == ".safetensors") {
    std::map<std::string, std::string> meta = {{"lossguard.schema", "1"}};
    for (auto it = b.metadata.begin(); it != b.metadata.end(); ++it)
      meta[it.key()] = metadata_text(it.value());
    write_safetensors(path, packed_arrays(b), meta);
  } else if (ext == ".pt" || ext == ".pth") {
    std::vector<TorchSaveEntry> entries;
    for (auto& [name, a] : packed_arrays(b)) entries.push_back({name, Value::make_tensor(a)});
    auto meta = Value::make_dict();
    entries.push_back({"lossguard.schema", Value::make_string("1")});
    for (auto it = b.metadata.begin(); it != b.metadata.end(); ++it) {
      const auto& v = it.value();
      ValuePtr x = v.is_number_integer() ? Value::make_int(v.get<int64_t>())
                   : v.is_number()       ? Value::make_float(v.get<double>())
                   : v.is_boolean()      ? Value::make_bool(v.get<bool>())
                                         : Value::make_string(metadata_text(v));
      entries.push_back({it.key(), x});
    }
    write_torch_save(path, entries);
  } else if (ext == ".json") {
    nlohmann::ordered_json doc;
    doc["lossguard.schema"] = "1";
    for (auto it = b.metadata.begin(); it != b.metadata.end(); ++it) doc[it.key()] = it.value();
    nlohmann::ordered_json samples = nlohmann::ordered_json::array();
    for (int64_t i = 0; i < b.num_samples(); ++i) {
      nlohmann::ordered_json s;
      const int64_t t0 = b.token_offsets[i], r0 = b.response_offsets[i], r = b.response_lengths[i];
      s["tokens"] =
          std::vector<int64_t>(b.tokens.begin() + t0, b.tokens.begin() + t0 + b.total_lengths[i]);
      s["response_length"] = r;
      s["loss_mask"] = std::vector<int>(b.loss_mask.begin() + r0, b.loss_mask.begin() + r0 + r);
      if (b.logits && r > 0) {  // a list cannot say [0, V]; an empty response simply has none
        const int64_t v = b.vocab_size();
        nlohmann::ordered_json rows = nlohmann::ordered_json::array();
        for (int64_t j = 0; j < r; ++j) {
          std::vector<double> row(static_cast<std::size_t>(v));
          for (int64_t c = 0; c < v; ++c) row[c] = b.logits->get_f64((r0 + j) * v + c);
          rows.push_back(row);
        }
        s["logits"] = rows;
      }
      for (const auto& [name, a] : b.per_token) {
        std::vector<double> vals(static_cast<std::size_t>(r));
        for (int64_t j = 0; j < r; ++j) vals[j] = a.get_f64(r0 + j);
        s[name] = vals;
      }
      if (b.padded_total_length(i) > 0) s["padded_total_length"] = b.padded_total_length(i);
      if (!b.sample_denoms.empty() && b.sample_denoms[i] >= 0)
        s["sample_denom"] = b.sample_denoms[i];
      if (b.is_removed(i)) s["removed"] = true;
      samples.push_back(s);
    }
    doc["samples"] = samples;
    std::ofstream f(path, std::ios::trunc);
    if (!f) throw_input_error("{}: cannot write: {}", path, std::strerror(errno));
    f << doc.dump(1) << "\n";
  } else {
    throw_input_error("{}: unknown output format '{}' (use .safetensors, .pt or .json)", path, ext);
  }
}

}  // namespace lossguard::io
