// Audit capture reader: every field checked against the layout SPEC §10 gives it.
#include "io/capture.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <map>
#include <thread>

#include "core/errors.h"
#include "core/printable.h"
#include "io/input_files.h"
#include "io/safetensors.h"

namespace lossguard::io {

namespace fs = std::filesystem;

namespace {

struct Reader {
  const std::string& path;
  const SafetensorsFile& file;
  std::map<std::string, const HostArray*> by_name;

  const HostArray* find(const std::string& name) const {
    auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : it->second;
  }
  const HostArray& need(const std::string& name) const {
    const HostArray* a = find(name);
    if (a == nullptr) throw_input_error("{}: capture lacks the tensor '{}'", path, name);
    return *a;
  }
  void expect_ints(const std::string& name, const HostArray& a) const {
    if (dtype_is_float(a.dtype)) {
      throw_input_error("{}: '{}' must be an integer tensor, is {}", path, name,
                        dtype_name(a.dtype));
    }
  }
  int64_t scalar_int(const std::string& name) const {
    const HostArray& a = need(name);
    expect_ints(name, a);
    if (a.numel() != 1)
      throw_input_error("{}: '{}' must be a scalar, has shape {}", path, name, a.shape_string());
    return a.get_i64(0);
  }
  std::optional<int64_t> opt_int(const std::string& name) const {
    return find(name) ? std::optional<int64_t>(scalar_int(name)) : std::nullopt;
  }
  std::optional<double> opt_float(const std::string& name) const {
    const HostArray* a = find(name);
    if (a == nullptr) return std::nullopt;
    if (a->numel() != 1)
      throw_input_error("{}: '{}' must be a scalar, has shape {}", path, name, a->shape_string());
    return a->get_f64(0);
  }
  std::vector<int64_t> ints(const std::string& name, std::optional<int64_t> length = {}) const {
    const HostArray& a = need(name);
    expect_ints(name, a);
    if (a.shape.size() != 1)
      throw_input_error("{}: '{}' must be 1-D, has shape {}", path, name, a.shape_string());
    if (length && a.numel() != *length) {
      throw_input_error("{}: '{}' has {} entries, expected {}", path, name, a.numel(), *length);
    }
    std::vector<int64_t> v(static_cast<std::size_t>(a.numel()));
    a.copy_i64(0, a.numel(), v.data());
    return v;
  }
  std::vector<double> floats(const std::string& name, std::optional<int64_t> length = {}) const {
    const HostArray& a = need(name);
    if (a.shape.size() != 1)
      throw_input_error("{}: '{}' must be 1-D, has shape {}", path, name, a.shape_string());
    if (length && a.numel() != *length) {
      throw_input_error("{}: '{}' has {} entries, expected {}", path, name, a.numel(), *length);
    }
    std::vector<double> v(static_cast<std::size_t>(a.numel()));
    a.copy_f64(0, a.numel(), v.data());
    return v;
  }
  const std::string& meta(const std::string& key) const {
    auto it = file.metadata.find(key);
    if (it == file.metadata.end()) throw_input_error("{}: capture metadata lacks '{}'", path, key);
    return it->second;
  }
  int64_t meta_int(const std::string& key, std::optional<int64_t> fallback = {}) const {
    auto it = file.metadata.find(key);
    if (it == file.metadata.end()) {
      if (fallback) return *fallback;
      throw_input_error("{}: capture metadata lacks '{}'", path, key);
    }
    try {
      std::size_t used = 0;
      const int64_t v = std::stoll(it->second, &used);
      if (used == it->second.size()) return v;
    } catch (const std::exception&) {
    }
    throw_input_error("{}: metadata '{}' = '{}' is not an integer", path, key, it->second);
  }
};

// The terms metadata declares (SPEC §11): `terms` = "kl,mtp", each with term.NAME.reduce (default:
// the capture's reduce), term.NAME.coef (default 1) and term.NAME.mask (default loss).
std::vector<Term> declared_terms(const std::string& path,
                                 const std::map<std::string, std::string>& metadata,
                                 const std::string& reduce) {
  std::vector<Term> out;
  auto get = [&](const std::string& key) -> const std::string* {
    auto it = metadata.find(key);
    return it == metadata.end() ? nullptr : &it->second;
  };
  if (const std::string* names = get("terms"); names != nullptr && !names->empty()) {
    std::size_t pos = 0;
    while (pos <= names->size()) {
      const std::size_t comma = names->find(',', pos);
      Term t;
      t.name = names->substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
      const std::string what = fmt::format("{}: metadata terms: term '{}'", path, t.name);
      if (!valid_term_name(t.name) || t.name == kMainTerm) {
        throw_input_error(
            "{} is not a term name ([a-z][a-z0-9_-]*, not main or a contract component)", what);
      }
      for (const auto& have : out) {
        if (have.name == t.name) throw_input_error("{} is declared twice", what);
      }
      const std::string key = "term." + t.name + ".";
      const std::string* r = get(key + "reduce");
      const std::string& rtext = r != nullptr ? *r : reduce;
      if (!rtext.empty() && !parse_reduction(rtext, &t.reduce)) {
        throw_input_error("{}: metadata {}reduce = '{}' is not {}", path, key, rtext,
                          mode_choices<Reduction>());
      }
      if (const std::string* coef = get(key + "coef"))
        t.coef = parse_term_coef(*coef, fmt::format("{}: metadata {}coef", path, key));
      if (const std::string* mask = get(key + "mask"))
        t.mask = parse_term_mask(*mask, fmt::format("{}: metadata {}mask", path, key));
      out.push_back(std::move(t));
      if (comma == std::string::npos) break;
      pos = comma + 1;
    }
  }
  // A term.NAME.* key of an undeclared term is a typo or a lost declaration: say so.
  for (const auto& [key, value] : metadata) {
    if (key.rfind("term.", 0) != 0) continue;
    const std::size_t dot = key.find('.', 5);
    const std::string name = key.substr(5, dot == std::string::npos ? dot : dot - 5);
    const std::string field = dot == std::string::npos ? "" : key.substr(dot + 1);
    const bool declared =
        std::any_of(out.begin(), out.end(), [&](const Term& t) { return t.name == name; });
    if (!declared) {
      throw_input_error("{}: metadata '{}' names term '{}', which metadata terms does not declare",
                        path, key, name);
    }
    if (field != "reduce" && field != "coef" && field != "mask") {
      throw_input_error("{}: metadata '{}': a term has reduce, coef and mask", path, key);
    }
  }
  return out;
}

// mb.{k}.term.NAME.* of one micro-batch: token_weight (required once any record of the term is
// there), token_loss, num_tokens, mask. `owned`: the main token_weight's length (the same tokens).
void read_terms(const Reader& r, const std::string& prefix, int64_t k, int64_t owned, int64_t sum_r,
                CapturedMicroBatch& mb) {
  const std::string head = prefix + "term.";
  for (auto it = r.by_name.lower_bound(head);
       it != r.by_name.end() && it->first.rfind(head, 0) == 0; ++it) {
    const std::string rest = it->first.substr(head.size());
    const std::size_t dot = rest.find('.');
    const std::string name = rest.substr(0, dot);
    const std::string field = dot == std::string::npos ? "" : rest.substr(dot + 1);
    if (!valid_term_name(name) || name == kMainTerm) {
      throw_input_error("{}: tensor '{}': '{}' is not a term name", r.path, it->first, name);
    }
    if (field != "token_weight" && field != "token_loss" && field != "num_tokens" &&
        field != "mask") {
      throw_input_error(
          "{}: tensor '{}': a term records token_weight, token_loss, num_tokens and mask", r.path,
          it->first);
    }
    if (mb.terms.count(name)) continue;  // read with its first record
    const std::string p = head + name + ".";
    if (!r.find(p + "token_weight")) {
      throw_input_error("{}: micro-batch {} has '{}' but no '{}token_weight'", r.path, k, it->first,
                        p);
    }
    CapturedTerm t;
    t.token_weight = r.floats(p + "token_weight");
    if (static_cast<int64_t>(t.token_weight.size()) != owned) {
      throw_input_error(
          "{}: term {}: '{}token_weight' has {} entries but the micro-batch's token_weight has {} "
          "(a term is hooked over the same owned tokens)",
          r.path, name, p, t.token_weight.size(), owned);
    }
    if (r.find(p + "token_loss")) t.token_loss = r.floats(p + "token_loss", owned);
    t.num_tokens = r.opt_int(p + "num_tokens");
    if (r.find(p + "mask")) {
      const std::vector<int64_t> m = r.ints(p + "mask", sum_r);
      t.mask.emplace(m.size());
      for (std::size_t j = 0; j < m.size(); ++j) {
        if (m[j] != 0 && m[j] != 1) {
          throw_input_error("{}: term {}: '{}mask'[{}] = {} is not 0 or 1", r.path, name, p, j,
                            m[j]);
        }
        (*t.mask)[j] = static_cast<uint8_t>(m[j]);
      }
    }
    mb.terms.emplace(name, std::move(t));
  }
}

// The records SPEC §10 and §11 name: anything else (a misspelled `skiped`) is reported, never
// silently ignored.
bool known_step_record(const std::string& name) {
  for (const char* k : {"grad_scale", "num_tokens_reduced", "skipped", "scheduler_stepped",
                        "grad_norm", "global_batch_size", "l_norm", "metrics.values"}) {
    if (name == k) return true;
  }
  return false;
}

bool known_microbatch_record(const std::string& field) {
  for (const char* k :
       {"sample_indices", "total_lengths", "response_lengths", "tokens", "loss_masks", "cp_size",
        "num_tokens", "loss", "dummy", "token_weight", "token_loss", "sample_denoms"}) {
    if (field == k) return true;
  }
  if (field.rfind("term.", 0) != 0) return false;
  const std::size_t dot = field.rfind('.');
  const std::string leaf = field.substr(dot + 1);
  return dot > 5 &&
         (leaf == "token_weight" || leaf == "token_loss" || leaf == "mask" || leaf == "num_tokens");
}

// The rank's place: step, rank, the TP/PP/CP/DP sizes and coordinates, and the claimed world,
// bounded before anything multiplies or loops over it.
void read_coordinates(const Reader& r, RankCapture& c) {
  const std::string& path = c.file;
  c.step = r.meta_int("step");
  c.rank = r.meta_int("rank");
  c.world_size = r.meta_int("world_size");
  c.tp = r.meta_int("tp", 1);
  c.pp = r.meta_int("pp", 1);
  c.cp = r.meta_int("cp", 1);
  c.dp = r.meta_int("dp", 1);
  c.tp_rank = r.meta_int("tp_rank", 0);
  c.pp_rank = r.meta_int("pp_rank", 0);
  c.cp_rank = r.meta_int("cp_rank", 0);
  c.dp_rank = r.meta_int("dp_rank", 0);
  if (c.tp < 1 || c.pp < 1 || c.cp < 1 || c.dp < 1 || c.tp_rank < 0 || c.tp_rank >= c.tp ||
      c.pp_rank < 0 || c.pp_rank >= c.pp || c.cp_rank < 0 || c.cp_rank >= c.cp || c.dp_rank < 0 ||
      c.dp_rank >= c.dp) {
    throw_input_error(
        "{}: rank {} has coordinates tp {}/{} pp {}/{} cp {}/{} dp {}/{} that do not fit", path,
        c.rank, c.tp_rank, c.tp, c.pp_rank, c.pp, c.cp_rank, c.cp, c.dp_rank, c.dp);
  }
  // A claimed world is bounded before anything multiplies or loops over it (the product of four
  // sizes near 2^40 overflows int64); whether the captures given fill it is audit's check.
  constexpr int64_t kMaxWorld = int64_t{1} << 40;
  const auto world = static_cast<__int128>(c.tp) * c.pp * c.cp * c.dp;
  if (c.world_size < 1 || c.world_size > kMaxWorld || world > kMaxWorld) {
    throw_input_error(
        "{}: metadata claims world_size {} (tp {} pp {} cp {} dp {}); at most 2^40 ranks are "
        "modelled",
        path, c.world_size, c.tp, c.pp, c.cp, c.dp);
  }
}

// Micro-batch k's records (mb.{k}.*), each length checked against the samples it holds.
CapturedMicroBatch read_microbatch(const Reader& r, RankCapture& c, int64_t k) {
  const std::string& path = c.file;
  const std::string p = "mb." + std::to_string(k) + ".";
  CapturedMicroBatch mb;
  mb.index = k;
  mb.sample_indices = r.ints(p + "sample_indices");
  const auto n = static_cast<int64_t>(mb.sample_indices.size());
  mb.total_lengths = r.ints(p + "total_lengths", n);
  mb.response_lengths = r.ints(p + "response_lengths", n);
  int64_t sum_t = 0, sum_r = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (mb.total_lengths[i] < 0 || mb.response_lengths[i] < 0 ||
        mb.response_lengths[i] > mb.total_lengths[i]) {
      throw_input_error(
          "{}: micro-batch {} sample {} (global index {}): response length {} and total length "
          "{} do not fit",
          path, k, i, mb.sample_indices[i], mb.response_lengths[i], mb.total_lengths[i]);
    }
    sum_t += mb.total_lengths[i];
    sum_r += mb.response_lengths[i];
  }
  mb.tokens = r.ints(p + "tokens", sum_t);
  const std::vector<int64_t> masks = r.ints(p + "loss_masks", sum_r);
  mb.loss_masks.resize(masks.size());
  for (std::size_t t = 0; t < masks.size(); ++t) {
    if (masks[t] != 0 && masks[t] != 1) {
      throw_input_error("{}: micro-batch {}: loss_masks[{}] = {} is not 0 or 1", path, k, t,
                        masks[t]);
    }
    mb.loss_masks[t] = static_cast<uint8_t>(masks[t]);
  }
  mb.cp_size = r.find(p + "cp_size") ? r.scalar_int(p + "cp_size") : c.cp;
  mb.dummy = r.find(p + "dummy") ? r.scalar_int(p + "dummy") != 0 : false;
  mb.num_tokens = r.opt_int(p + "num_tokens");
  mb.loss = r.opt_float(p + "loss");
  mb.token_weight = r.floats(p + "token_weight");
  if (k == 0) c.dtype = r.need(p + "token_weight").dtype;
  if (r.find(p + "token_loss")) {
    mb.token_loss = r.floats(p + "token_loss", static_cast<int64_t>(mb.token_weight.size()));
  }
  if (r.find(p + "sample_denoms")) mb.sample_denoms = r.floats(p + "sample_denoms", n);
  read_terms(r, p, k, static_cast<int64_t>(mb.token_weight.size()), sum_r, mb);
  return mb;
}

// Every tensor is a record this format names: a micro-batch beyond num_microbatches (or a typo)
// would otherwise be dropped without a word; a name the format does not have is kept to report.
void classify_records(const SafetensorsFile& file, int64_t num_mb, RankCapture& c) {
  const std::string& path = c.file;
  for (const auto& [name, array] : file.tensors) {
    if (name.rfind("mb.", 0) == 0) {
      const std::size_t dot = name.find('.', 3);
      const std::string index = name.substr(3, dot == std::string::npos ? dot : dot - 3);
      const bool digits =
          !index.empty() && index.size() < 10 &&
          std::all_of(index.begin(), index.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
      if (!digits || std::stoll(index) >= num_mb) {
        throw_input_error(
            "{}: tensor '{}' names micro-batch '{}' but metadata num_microbatches = {} "
            "(micro-batches "
            "0..{})",
            path, name, index, num_mb, num_mb - 1);
      }
      if (!known_microbatch_record(dot == std::string::npos ? "" : name.substr(dot + 1)))
        c.unknown_records.push_back(name);
    } else if (!known_step_record(name)) {
      c.unknown_records.push_back(name);
    }
  }
}

// The step's records: the scale, count, decision, scheduler, norm and metrics.
void read_step_records(const Reader& r, RankCapture& c) {
  const std::string& path = c.file;
  const HostArray& scale = r.need("grad_scale");
  if (scale.numel() != 1) throw_input_error("{}: 'grad_scale' must be a scalar", path);
  c.grad_scale = scale.get_f64(0);
  c.num_tokens_reduced = r.opt_int("num_tokens_reduced");
  c.global_batch_size = r.opt_int("global_batch_size");
  c.l_norm = r.opt_float("l_norm");
  if (c.l_norm && !(*c.l_norm >= 1.0 && *c.l_norm <= 1e12)) {
    throw_input_error("{}: l_norm = {} is not a length in tokens (1 to 1e12)", path, *c.l_norm);
  }
  if (auto s = r.opt_int("skipped")) c.skipped = *s != 0;
  if (auto s = r.opt_int("scheduler_stepped")) c.scheduler_stepped = *s != 0;
  c.grad_norm = r.opt_float("grad_norm");
  if (r.find("metrics.values")) c.metrics_values = r.floats("metrics.values");
}

// Metadata `declared_scales`: "name=value,..." (finite, non-zero values; names without '=' or ',').
std::vector<std::pair<std::string, double>> parse_declared_scales(const std::string& path,
                                                                  const std::string& text) {
  std::vector<std::pair<std::string, double>> out;
  std::size_t pos = 0;
  while (pos < text.size()) {
    std::size_t comma = text.find(',', pos);
    if (comma == std::string::npos) comma = text.size();
    const std::string item = text.substr(pos, comma - pos);
    const std::size_t eq = item.find('=');
    double v = 0.0;
    const char* first = eq == std::string::npos ? nullptr : item.c_str() + eq + 1;
    char* end = nullptr;
    if (first != nullptr) v = std::strtod(first, &end);
    if (eq == std::string::npos || eq == 0 || end == first || *end != '\0' || !std::isfinite(v) ||
        v == 0.0) {
      throw_input_error(
          "{}: metadata declared_scales = '{}': item '{}' is not NAME=VALUE with a finite, "
          "non-zero number",
          path, printable(text), printable(item));
    }
    out.emplace_back(item.substr(0, eq), v);
    pos = comma + 1;
  }
  return out;
}

}  // namespace

// The capture format's fields (SPEC §10) read and checked in order, each error naming the file
// and the field.
RankCapture read_capture(const std::string& path) {
  const SafetensorsFile file = read_safetensors(path);
  Reader r{path, file, {}};
  for (const auto& [name, array] : file.tensors) r.by_name[name] = &array;
  const auto schema = file.metadata.find("lossguard.schema");
  if (schema == file.metadata.end() || schema->second != kCaptureSchema) {
    throw_input_error("{}: not an audit capture (metadata lossguard.schema = '{}', expected '{}')",
                      path, schema == file.metadata.end() ? "" : schema->second, kCaptureSchema);
  }
  RankCapture c;
  c.file = path;
  read_coordinates(r, c);
  if (auto it = file.metadata.find("cp_layout");
      it != file.metadata.end() && !parse_mode(it->second, &c.cp_layout)) {
    throw_input_error("{}: metadata cp_layout = '{}' is not {}", path, it->second,
                      mode_choices<CpLayout>());
  }
  if (auto it = file.metadata.find("reduce"); it != file.metadata.end()) c.reduce = it->second;
  if (auto it = file.metadata.find("trainer"); it != file.metadata.end()) c.trainer = it->second;
  if (auto it = file.metadata.find("global_batch_unit"); it != file.metadata.end()) {
    if (it->second != "samples" && it->second != "rollouts") {
      throw_input_error("{}: metadata global_batch_unit = '{}' is not samples or rollouts", path,
                        it->second);
    }
    c.global_batch_unit = it->second;
  }
  if (auto it = file.metadata.find("loss_site"); it != file.metadata.end())
    c.loss_site = it->second;
  if (auto it = file.metadata.find("declared_scales"); it != file.metadata.end()) {
    c.declared_scales = parse_declared_scales(path, it->second);
  }
  c.terms = declared_terms(path, file.metadata, c.reduce);
  if (auto it = file.metadata.find("metrics.keys");
      it != file.metadata.end() && !it->second.empty()) {
    std::size_t pos = 0;
    while (pos <= it->second.size()) {
      const std::size_t comma = it->second.find(',', pos);
      c.metrics_keys.push_back(
          it->second.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos));
      if (comma == std::string::npos) break;
      pos = comma + 1;
    }
  }
  const int64_t num_mb = r.meta_int("num_microbatches", std::nullopt);
  if (num_mb < 0) throw_input_error("{}: num_microbatches = {}", path, num_mb);
  for (int64_t k = 0; k < num_mb; ++k) c.microbatches.push_back(read_microbatch(r, c, k));
  if (auto it = file.metadata.find("dtype"); it != file.metadata.end()) {
    if (!parse_dtype(it->second, &c.dtype) || !dtype_is_float(c.dtype)) {
      throw_input_error(
          "{}: metadata dtype = '{}' is not a float dtype (bfloat16, float16, "
          "float32, float64)",
          path, it->second);
    }
  }
  classify_records(file, num_mb, c);
  read_step_records(r, c);
  return c;
}

std::vector<RankCapture> read_captures(const std::vector<std::string>& paths) {
  static const InputFileKind kCaptures{{".safetensors"}, true, "captures (*.safetensors)"};
  const std::vector<std::string> files = expand_input_paths(paths, kCaptures);
  // Files are independent: read on every core (a 16k-GPU job writes thousands per step), each
  // into its own slot; the first failing file in path order is the one reported, as a sequential
  // read would.
  std::vector<RankCapture> out(files.size());
  std::vector<std::exception_ptr> failed(files.size());
  std::atomic<std::size_t> next{0};
  auto work = [&] {
    for (std::size_t k = next++; k < files.size(); k = next++) {
      try {
        out[k] = read_capture(files[k]);
      } catch (...) {
        failed[k] = std::current_exception();
      }
    }
  };
  const std::size_t threads = std::min<std::size_t>(
      std::max(1u, std::thread::hardware_concurrency()), files.size() < 64 ? 1 : 8);
  std::vector<std::thread> pool;
  for (std::size_t t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  for (const auto& e : failed) {
    if (e) std::rethrow_exception(e);
  }
  return out;
}

}  // namespace lossguard::io
