// A Value tree's fields and values as the batch model reads them (io/dump_values.h).
#include "io/dump_values.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/errors.h"

namespace lossguard::io::dump_detail {

using Kind = Value::Kind;

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
                        std::string* key_used, const std::string& where) {
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

}  // namespace lossguard::io::dump_detail
