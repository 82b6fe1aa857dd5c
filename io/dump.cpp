// Format detection and the Value tree -> Batch conversion (packed, per-sample and Relax/slime
// layouts, per-rank dumps). Field values: io/dump_values.cpp; slime's steps: io/slime_steps.cpp;
// CP-local fields: io/cp_local.cpp; writers: io/dump_writer.cpp.
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
#include "io/dump_values.h"
#include "io/input_files.h"
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

using namespace dump_detail;

namespace {

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
  static const InputFileKind kDumps{{".safetensors", ".pt", ".pth", ".json"},
                                    false,
                                    "dump files (*.safetensors, *.pt, *.pth, *.json)"};
  return expand_input_paths(paths, kDumps);
}

DumpFormat detect_format(const std::string& path) {
  require_regular_file(path);
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
    std::error_code ec;
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

}  // namespace lossguard::io
