// The batch written back as a dump: packed safetensors, or JSON with one object per sample.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/errors.h"
#include "io/dump.h"
#include "io/safetensors.h"
#include "io/torch_zip.h"

namespace lossguard::io {

namespace fs = std::filesystem;

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
