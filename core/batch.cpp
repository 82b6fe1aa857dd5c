// Batch validation (SPEC §1): every rule names the file, the sample, the field and the values.
#include "core/batch.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "core/errors.h"

namespace lossguard {

const char* sample_kind_name(SampleKind kind) {
  switch (kind) {
    case SampleKind::kRl:
      return "rl";
    case SampleKind::kSft:
      return "sft";
    case SampleKind::kEmpty:
      return "empty";
  }
  return "?";
}

int64_t Batch::mask_sum(int64_t i) const {
  return count_mask_ones(loss_mask.data() + response_offsets[i],
                         response_offsets[i + 1] - response_offsets[i]);
}

int64_t Batch::num_effective_tokens() const {
  return count_mask_ones(loss_mask.data(), num_response_tokens());
}

SampleClass Batch::classify(int64_t i, int64_t mask_sum) const {
  SampleClass c;
  const int64_t t = total_lengths[i], r = response_lengths[i];
  c.why_empty = t == 0          ? NoTokenReason::kTZero
                : r == 0        ? NoTokenReason::kEmptyResponse
                : mask_sum == 0 ? NoTokenReason::kFullyMasked
                                : NoTokenReason::kNone;
  c.kind = mask_sum == 0 ? SampleKind::kEmpty : r == t ? SampleKind::kSft : SampleKind::kRl;
  c.sft = r == t && t > 0;
  c.sft_not_preshifted = c.sft && loss_mask[response_offsets[i + 1] - 1] != 0;
  return c;
}

std::string SampleClass::notes() const {
  std::string s = why_empty == NoTokenReason::kTZero           ? "T = 0"
                  : why_empty == NoTokenReason::kEmptyResponse ? "empty response"
                  : why_empty == NoTokenReason::kFullyMasked   ? "fully masked"
                                                               : "";
  if (sft)
    s += std::string(s.empty() ? "" : ", ") +
         (sft_not_preshifted ? "SFT, mask not pre-shifted" : "SFT");
  return s;
}

std::string Batch::describe_sample(int64_t i) const {
  const SampleOrigin& o = origins[i];
  if (files.size() == 1) return fmt::format("{}: sample {}", files[o.file_index], o.index_in_file);
  return fmt::format("{}: sample {} (global sample {})", files[o.file_index], o.index_in_file, i);
}

Batch Batch::subset(const std::vector<int64_t>& picked) const {
  Batch out;
  out.files = files;
  out.loss_mask_given = loss_mask_given;
  out.metadata = metadata;
  out.token_offsets.push_back(0);
  out.response_offsets.push_back(0);
  int64_t rows = 0;
  for (int64_t i : picked) {
    LG_CHECK(i >= 0 && i < num_samples(), "subset: sample {} of {}", i, num_samples());
    rows += response_lengths[i];
  }
  const int64_t v = vocab_size();
  if (logits) out.logits = HostArray::zeros(logits->dtype, {rows, v});
  for (const auto& [name, a] : per_token) out.per_token[name] = HostArray::zeros(a.dtype, {rows});
  int64_t row = 0;
  for (int64_t i : picked) {
    const int64_t t = total_lengths[i], r = response_lengths[i], r0 = response_offsets[i];
    out.origins.push_back(origins[i]);
    out.total_lengths.push_back(t);
    out.response_lengths.push_back(r);
    if (!tokens.empty())
      out.tokens.insert(out.tokens.end(), tokens.begin() + token_offsets[i],
                        tokens.begin() + token_offsets[i] + t);
    out.token_offsets.push_back(out.token_offsets.back() + t);
    out.response_offsets.push_back(out.response_offsets.back() + r);
    out.loss_mask.insert(out.loss_mask.end(), loss_mask.begin() + r0, loss_mask.begin() + r0 + r);
    if (logits && r > 0) {
      const std::size_t row_bytes = static_cast<std::size_t>(v) * dtype_size_bytes(logits->dtype);
      std::memcpy(out.logits->mutable_data() + row * row_bytes, logits->data + r0 * row_bytes,
                  static_cast<std::size_t>(r) * row_bytes);
    }
    for (const auto& [name, a] : per_token) {
      const std::size_t e = dtype_size_bytes(a.dtype);
      if (r > 0)
        std::memcpy(out.per_token[name].mutable_data() + row * e, a.data + r0 * e,
                    static_cast<std::size_t>(r) * e);
    }
    if (!padded_total_lengths.empty()) out.padded_total_lengths.push_back(padded_total_lengths[i]);
    if (!sample_denoms.empty()) out.sample_denoms.push_back(sample_denoms[i]);
    if (!removed.empty()) out.removed.push_back(removed[i]);
    row += r;
  }
  return out;
}

namespace {

bool is_integer_dtype(DType d) { return !dtype_is_float(d); }

void require_1d(const std::string& file, int64_t sample, const char* field, const HostArray& a) {
  if (a.shape.size() != 1) {
    throw_input_error("{}: sample {}: field '{}' must be 1-D, has shape {}", file, sample, field,
                      a.shape_string());
  }
}

}  // namespace

void BatchBuilder::begin_file(const std::string& path) {
  batch_.files.push_back(path);
  if (batch_.token_offsets.empty()) {
    batch_.token_offsets.push_back(0);
    batch_.response_offsets.push_back(0);
  }
}

void BatchBuilder::fail_sample(int64_t index_in_file, const std::string& what) const {
  throw InputError(fmt::format("{}: sample {}: {}", batch_.files.back(), index_in_file, what));
}

void BatchBuilder::mark_partial(const std::string& field, const std::string& reason) {
  partial_.emplace(field, reason);  // the first reason is kept
}

void BatchBuilder::add_steps(std::vector<BatchStep> steps) {
  const int64_t first = batch_.steps.empty() ? 0 : batch_.steps.back().step + 1;
  for (auto& s : steps) {
    s.step += first;
    batch_.steps.push_back(std::move(s));
  }
}

void BatchBuilder::add_metadata(const std::string& key, const nlohmann::json& value) {
  batch_.metadata[key] = value;
}

namespace {
std::string format_bytes(uint64_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? fmt::format("{} B", n) : fmt::format("{:.1f} {}", v, units[u]);
}
}  // namespace

uint64_t memory_budget_bytes() {
  if (const char* env = std::getenv("LOSSGUARD_MEMORY_LIMIT"); env != nullptr && *env != '\0') {
    return std::strtoull(env, nullptr, 10);
  }
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemAvailable:") return kib * 1024;
    meminfo.ignore(64, '\n');
  }
  return 0;  // unknown: no limit
}

void BatchBuilder::append_float_rows(const std::string& field, const HostArray& src,
                                     int64_t index_in_file) {
  if (!dtype_is_float(src.dtype)) {
    // Integer-valued per-token fields (a list of ints in a JSON dump) are taken as float64.
    if (field == "logits")
      fail_sample(index_in_file, fmt::format("field 'logits' has dtype {}, must be a float dtype",
                                             dtype_name(src.dtype)));
  }
  const bool is_logits = field == "logits";
  if (is_logits && borrowed_logits_) {  // a second source: the first is copied after all
    const HostArray first = *borrowed_logits_;
    borrowed_logits_.reset();
    logits_bytes_.resize(first.size_bytes());
    if (first.size_bytes() > 0) std::memcpy(logits_bytes_.data(), first.data, first.size_bytes());
  }
  if (is_logits) {
    // The logits are staged and then copied into the batch: twice their size at the peak.
    const uint64_t need = 2 * (static_cast<uint64_t>(logits_bytes_.size()) + src.size_bytes());
    const uint64_t budget = memory_budget_bytes();
    if (budget > 0 && need > budget) {
      throw_input_error(
          "{}: field 'logits': {} rows of {} x {} need {} of memory but only {} are available "
          "(MemAvailable, or $LOSSGUARD_MEMORY_LIMIT); count and replay do not load the logits",
          batch_.files.back(), logits_rows_ + src.shape[0], src.shape[1], dtype_name(src.dtype),
          format_bytes(need), format_bytes(budget));
    }
  }
  std::vector<std::byte>& bytes = is_logits ? logits_bytes_ : per_token_bytes_[field];
  DType target;
  if (is_logits) {
    if (!logits_dtype_) logits_dtype_ = src.dtype;
    target = *logits_dtype_;
  } else {
    auto it = per_token_dtype_.find(field);
    if (it == per_token_dtype_.end()) {
      it = per_token_dtype_.emplace(field, dtype_is_float(src.dtype) ? src.dtype : DType::kFloat64)
               .first;
    }
    target = it->second;
  }
  const std::size_t old = bytes.size();
  if (src.dtype == target) {
    bytes.resize(old + src.size_bytes());
    if (src.size_bytes() > 0) std::memcpy(bytes.data() + old, src.data, src.size_bytes());
    return;
  }
  // Mixed dtypes across dumps: convert through float64 into the first dump's dtype.
  std::vector<double> values(static_cast<std::size_t>(src.numel()));
  for (int64_t k = 0; k < src.numel(); ++k) values[k] = src.get_f64(k);
  HostArray converted = HostArray::from_f64(target, {src.numel()}, values);
  bytes.resize(old + converted.size_bytes());
  if (converted.size_bytes() > 0)
    std::memcpy(bytes.data() + old, converted.data, converted.size_bytes());
}

namespace {

// A sample's loss mask as 0/1 bytes, any other value as 2 (the caller names it).
void narrow_sample_mask(const HostArray& m, int64_t r, uint8_t* dst) {
  if (m.dtype == DType::kBool || m.dtype == DType::kUInt8 || m.dtype == DType::kInt8) {
    std::memcpy(dst, m.data, static_cast<std::size_t>(r));
  } else if (dtype_is_float(m.dtype)) {
    for (int64_t j = 0; j < r; ++j) {
      const double v = m.get_f64(j);
      dst[j] = v == 1.0 ? 1 : (v == 0.0 ? 0 : 2);
    }
  } else {
    thread_local std::vector<int64_t> buf;
    buf.resize(static_cast<std::size_t>(r));
    m.copy_i64(0, r, buf.data());
    for (int64_t j = 0; j < r; ++j) dst[j] = buf[j] == 0 ? 0 : (buf[j] == 1 ? 1 : 2);
  }
}

}  // namespace

// One check per field of a sample, in the order SPEC §1 lists them (lengths, loss mask, logits,
// per-token fields), each with its own error naming the file, the sample and the field; each field
// is appended once checked, and the lengths and per-sample values last.
void BatchBuilder::add_sample(int64_t idx, const SampleFields& f) {
  LG_CHECK(!batch_.files.empty(), "begin_file before add_sample");
  if (f.tokens == nullptr) fail_sample(idx, "field 'tokens' is missing");
  require_1d(batch_.files.back(), idx, "tokens", *f.tokens);
  if (!is_integer_dtype(f.tokens->dtype)) {
    fail_sample(idx, fmt::format("field 'tokens' has dtype {}, must be an integer dtype",
                                 dtype_name(f.tokens->dtype)));
  }
  const int64_t num_tokens = f.tokens->numel();
  if (!f.response_length) fail_sample(idx, "field 'response_length' is missing");
  const int64_t r = *f.response_length;
  const int64_t t = f.total_length.value_or(num_tokens);
  if (t < 0) fail_sample(idx, fmt::format("total_length = {} is negative", t));
  if (r < 0) fail_sample(idx, fmt::format("response_length = {} is negative", r));
  if (t != num_tokens) {
    fail_sample(idx,
                fmt::format("total_length = {} disagrees with len(tokens) = {}", t, num_tokens));
  }
  if (r > t)
    fail_sample(idx, fmt::format("response_length R = {} exceeds total_length T = {}", r, t));

  append_sample_mask(idx, f.loss_mask, r);
  const int64_t rows_before = batch_.response_offsets.back();
  add_sample_logits(idx, f.logits, r, rows_before);
  add_sample_per_token(idx, f.per_token, r, rows_before);

  batch_.origins.push_back({static_cast<int>(batch_.files.size()) - 1, idx});
  batch_.total_lengths.push_back(t);
  batch_.response_lengths.push_back(r);
  if (needs_.tokens) {
    const std::size_t tok_start = batch_.tokens.size();
    batch_.tokens.resize(tok_start + static_cast<std::size_t>(t));
    f.tokens->copy_i64(0, t, batch_.tokens.data() + tok_start);
  }
  batch_.token_offsets.push_back(batch_.token_offsets.back() + t);
  batch_.response_offsets.push_back(rows_before + r);
  set_sample_values(batch_.num_samples() - 1, idx, f.padded_total_length, f.sample_denom,
                    f.removed);
}

void BatchBuilder::append_sample_mask(int64_t idx, const HostArray* mask, int64_t r) {
  const std::size_t mask_start = batch_.loss_mask.size();
  if (mask == nullptr) {
    batch_.loss_mask.resize(mask_start + r, 1);
    return;
  }
  require_1d(batch_.files.back(), idx, "loss_mask", *mask);
  if (mask->numel() != r) {
    fail_sample(idx,
                fmt::format("len(loss_mask) = {} but response_length R = {}", mask->numel(), r));
  }
  any_mask_ = true;
  batch_.loss_mask.resize(mask_start + r);
  uint8_t* dst = batch_.loss_mask.data() + mask_start;
  narrow_sample_mask(*mask, r, dst);
  uint8_t bad = 0;
  for (int64_t j = 0; j < r; ++j) bad |= dst[j] & 0xfe;
  if (bad != 0) {
    for (int64_t j = 0; j < r; ++j) {
      const double v = mask->get_f64(j);
      if (v != 0.0 && v != 1.0)
        fail_sample(idx, fmt::format("loss_mask[{}] = {} (must be 0 or 1)", j, v));
    }
  }
}

void BatchBuilder::add_sample_logits(int64_t idx, const HostArray* logits, int64_t r,
                                     int64_t rows_before) {
  // An empty response may state its zero logits rows as a plain empty list (JSON "logits": []).
  const bool no_rows =
      logits != nullptr && r == 0 && logits->shape.size() == 1 && logits->shape[0] == 0;
  if (logits != nullptr && !no_rows) {
    const HostArray& l = *logits;
    if (l.shape.size() != 2)
      fail_sample(idx, fmt::format("logits must be 2-D [R, V], has shape {}", l.shape_string()));
    if (l.shape[0] != r)
      fail_sample(idx,
                  fmt::format("logits.shape[0] = {} but response_length R = {}", l.shape[0], r));
    if (vocab_size_ >= 0 && l.shape[1] != vocab_size_) {
      fail_sample(idx, fmt::format("logits vocabulary size {} differs from earlier samples' {}",
                                   l.shape[1], vocab_size_));
    }
    if (logits_rows_ != rows_before)
      fail_sample(idx, "has logits but an earlier sample with a response has none");
    vocab_size_ = l.shape[1];
    if (needs_.logits) append_float_rows("logits", l, idx);
    logits_rows_ += r;
  } else if (vocab_size_ >= 0 && r > 0) {
    fail_sample(idx, "field 'logits' is missing (earlier samples have it)");
  }
}

void BatchBuilder::add_sample_per_token(int64_t idx,
                                        const std::map<std::string, const HostArray*>& per_token,
                                        int64_t r, int64_t rows_before) {
  for (const auto& [name, arr] : per_token) {
    if (arr == nullptr || partial_.count(name)) continue;
    require_1d(batch_.files.back(), idx, name.c_str(), *arr);
    if (arr->numel() != r) {
      fail_sample(idx,
                  fmt::format("len({}) = {} but response_length R = {}", name, arr->numel(), r));
    }
    if (per_token_rows_[name] != rows_before) {
      mark_partial(name,
                   fmt::format("{} sample {} has it but an earlier sample with a response has not",
                               batch_.files.back(), idx));
      continue;
    }
    if (needs_.per_token) append_float_rows(name, *arr, idx);
    per_token_rows_[name] += r;
  }
  for (const auto& [name, rows] : per_token_rows_) {
    if (r > 0 && rows == rows_before && !per_token.count(name) && !partial_.count(name)) {
      mark_partial(name, fmt::format("{} sample {} lacks it (earlier samples have it)",
                                     batch_.files.back(), idx));
    }
  }
}

void BatchBuilder::set_sample_values(int64_t global, int64_t idx, std::optional<int64_t> padded,
                                     std::optional<double> denom, std::optional<bool> removed) {
  const auto n = static_cast<std::size_t>(global) + 1;
  if (padded) {
    const int64_t t = batch_.total_lengths[global];
    if (*padded < t) {
      fail_sample(idx,
                  fmt::format("padded_total_length = {} is below total_length T = {}", *padded, t));
    }
    batch_.padded_total_lengths.resize(n, 0);
    batch_.padded_total_lengths[global] = *padded;
  }
  if (denom) {
    if (!(*denom >= 0.0) || !std::isfinite(*denom))
      fail_sample(idx, fmt::format("sample_denom = {} must be a finite number >= 0", *denom));
    batch_.sample_denoms.resize(n, -1.0);
    batch_.sample_denoms[global] = *denom;
  }
  if (removed && *removed) {
    batch_.removed.resize(n, 0);
    batch_.removed[global] = 1;
    // slime zeroes a removed sample's loss mask: it counts 0 everywhere (SPEC §3).
    std::fill(batch_.loss_mask.begin() + batch_.response_offsets[global],
              batch_.loss_mask.begin() + batch_.response_offsets[global + 1], uint8_t{0});
    any_mask_ = true;
  }
}

namespace {

// A packed index field (tokens, total_lengths, response_lengths): present, 1-D, integer.
const HostArray& packed_index_field(const std::string& file, const HostArray* a, const char* name) {
  if (a == nullptr) throw_input_error("{}: packed batch: field '{}' is missing", file, name);
  if (a->shape.size() != 1)
    throw_input_error("{}: field '{}' must be 1-D, has shape {}", file, name, a->shape_string());
  if (dtype_is_float(a->dtype))
    throw_input_error("{}: field '{}' has dtype {}, must be an integer dtype", file, name,
                      dtype_name(a->dtype));
  return *a;
}

struct PackedSums {
  int64_t tokens = 0;     // sum T
  int64_t responses = 0;  // sum R
};

// Checks every sample's lengths and their sums before anything is sliced.
PackedSums check_packed_lengths(const std::string& file, const HostArray& tl, const HostArray& rl) {
  const int64_t s = tl.numel();
  if (rl.numel() != s) {
    throw_input_error("{}: len(total_lengths) = {} but len(response_lengths) = {}", file, s,
                      rl.numel());
  }
  PackedSums sums;
  for (int64_t i = 0; i < s; ++i) {
    const int64_t t = tl.get_i64(i), r = rl.get_i64(i);
    if (t < 0) throw_input_error("{}: sample {}: total_length = {} is negative", file, i, t);
    if (r < 0) throw_input_error("{}: sample {}: response_length = {} is negative", file, i, r);
    if (r > t)
      throw_input_error("{}: sample {}: response_length R = {} exceeds total_length T = {}", file,
                        i, r, t);
    if (t > (int64_t{1} << 40))
      throw_input_error("{}: sample {}: total_length = {} is implausibly large", file, i, t);
    sums.tokens += t;
    if (sums.tokens > (int64_t{1} << 62))
      throw_input_error("{}: sum(total_lengths) exceeds 2^62 by sample {}", file, i);
    sums.responses += r;
  }
  return sums;
}

// A per-response-token field (absent is fine) must have sum(response_lengths) rows.
void check_packed_rows(const std::string& file, const HostArray* a, const char* name,
                       int64_t sum_r) {
  if (a == nullptr) return;
  if (a->shape.empty() || a->shape[0] != sum_r) {
    throw_input_error("{}: field '{}' has shape {}, but sum(response_lengths) = {} rows are needed",
                      file, name, a->shape_string(), sum_r);
  }
}

// A packed loss mask as 0/1 bytes, any other value as 2 (the caller names it).
void narrow_packed_mask(const HostArray& m, int64_t sum_r, uint8_t* dst) {
  if (m.dtype == DType::kBool || m.dtype == DType::kUInt8 || m.dtype == DType::kInt8) {
    if (sum_r > 0) std::memcpy(dst, m.data, static_cast<std::size_t>(sum_r));  // else both null
  } else if ((m.dtype == DType::kInt64 &&
              reinterpret_cast<uintptr_t>(m.data) % alignof(int64_t) == 0) ||
             (m.dtype == DType::kInt32 &&
              reinterpret_cast<uintptr_t>(m.data) % alignof(int32_t) == 0)) {
    // The common integer masks, read in their own width (no float conversion).
    auto narrow = [&](const auto* src) {
      for (int64_t j = 0; j < sum_r; ++j) dst[j] = src[j] == 1 ? 1 : (src[j] == 0 ? 0 : 2);
    };
    if (m.dtype == DType::kInt64)
      narrow(reinterpret_cast<const int64_t*>(m.data));
    else
      narrow(reinterpret_cast<const int32_t*>(m.data));
  } else {
    std::vector<double> buf(static_cast<std::size_t>(std::min<int64_t>(sum_r, 1 << 16)));
    for (int64_t j0 = 0; j0 < sum_r; j0 += static_cast<int64_t>(buf.size())) {
      const int64_t n = std::min<int64_t>(sum_r - j0, static_cast<int64_t>(buf.size()));
      m.copy_f64(j0, n, buf.data());
      for (int64_t j = 0; j < n; ++j) dst[j0 + j] = buf[j] == 1.0 ? 1 : (buf[j] == 0.0 ? 0 : 2);
    }
  }
}

}  // namespace

// The packed twin of add_sample: one check per packed field (lengths, offsets, mask, per-token
// fields, logits), each with its own error, then one append per field.
void BatchBuilder::add_packed(const PackedFields& f) {
  LG_CHECK(!batch_.files.empty(), "begin_file before add_packed");
  const std::string& file = batch_.files.back();
  const HostArray& tokens = packed_index_field(file, f.tokens, "tokens");
  const HostArray& tl = packed_index_field(file, f.total_lengths, "total_lengths");
  const HostArray& rl = packed_index_field(file, f.response_lengths, "response_lengths");
  const PackedSums sums = check_packed_lengths(file, tl, rl);
  const int64_t sum_t = sums.tokens, sum_r = sums.responses;
  if (tokens.numel() != sum_t) {
    throw_input_error("{}: len(tokens) = {} disagrees with sum(total_lengths) = {}", file,
                      tokens.numel(), sum_t);
  }
  check_packed_rows(file, f.loss_masks, "loss_masks", sum_r);
  check_packed_rows(file, f.logits, "logits", sum_r);
  const std::map<std::string, const HostArray*> per_token = packed_per_token(f.per_token, sum_r);
  if (f.loss_masks && f.loss_masks->shape.size() != 1) {
    throw_input_error("{}: field 'loss_masks' must be 1-D, has shape {}", file,
                      f.loss_masks->shape_string());
  }
  const int64_t rows_before = batch_.response_offsets.back();
  check_packed_against_earlier(f.logits, per_token, rows_before, sum_r);

  // Bulk append: the lengths are known to add up, so every per-sample rule left is the mask
  // values'.
  const std::size_t s0 = batch_.total_lengths.size();
  append_packed_lengths(tl, rl, tokens, sum_t);
  append_packed_mask(f.loss_masks, s0, sum_r, rows_before);
  set_packed_sample_values(f, tl.numel(), s0);
  append_packed_rows(f.logits, per_token, sum_r);
}

std::map<std::string, const HostArray*> BatchBuilder::packed_per_token(
    const std::map<std::string, const HostArray*>& fields, int64_t sum_r) {
  const std::string& file = batch_.files.back();
  // A per-token field of another length is dropped with the reason, failing only a command that
  // needs it: a per-rank dump of a CP > 1 run holds each CP rank's own tokens' values there.
  std::map<std::string, const HostArray*> per_token;
  for (const auto& [name, a] : fields) {
    if (a == nullptr) continue;
    if (a->shape.size() == 1 && a->shape[0] != sum_r) {
      mark_partial(name, fmt::format("{} has {} values but sum(response_lengths) = {}: a CP-local "
                                     "shard (one CP rank's tokens, as per-rank dumps of a CP > 1 "
                                     "run hold them) or a malformed field",
                                     file, a->shape[0], sum_r));
      continue;
    }
    check_packed_rows(file, a, name.c_str(), sum_r);
    per_token[name] = a;
  }
  return per_token;
}

void BatchBuilder::check_packed_against_earlier(
    const HostArray* logits, const std::map<std::string, const HostArray*>& per_token,
    int64_t rows_before, int64_t sum_r) {
  const std::string& file = batch_.files.back();
  if (logits_rows_ != rows_before && logits != nullptr)
    throw_input_error("{}: has logits but earlier dumps have none", file);
  if (vocab_size_ >= 0 && logits == nullptr && sum_r > 0)
    throw_input_error("{}: field 'logits' is missing (earlier dumps have it)", file);
  for (const auto& [name, rows] : per_token_rows_) {
    if (sum_r > 0 && !per_token.count(name) && !partial_.count(name))
      mark_partial(name, fmt::format("{} lacks it (earlier dumps have it)", file));
  }
  for (const auto& [name, a] : per_token) {
    if (a == nullptr) continue;
    if (a->shape.size() != 1)
      throw_input_error("{}: field '{}' must be 1-D, has shape {}", file, name, a->shape_string());
    if (per_token_rows_[name] != rows_before && !partial_.count(name))
      mark_partial(name, fmt::format("{} has it but earlier dumps have not", file));
  }
  if (logits != nullptr) {
    const HostArray& l = *logits;
    if (l.shape.size() != 2)
      throw_input_error("{}: logits must be 2-D [sum R, V], has shape {}", file, l.shape_string());
    if (!dtype_is_float(l.dtype))
      throw_input_error("{}: field 'logits' has dtype {}, must be a float dtype", file,
                        dtype_name(l.dtype));
    if (vocab_size_ >= 0 && l.shape[1] != vocab_size_) {
      throw_input_error("{}: logits vocabulary size {} differs from earlier dumps' {}", file,
                        l.shape[1], vocab_size_);
    }
  }
}

void BatchBuilder::append_packed_lengths(const HostArray& tl, const HostArray& rl,
                                         const HostArray& tokens, int64_t sum_t) {
  const int64_t s = tl.numel();
  const int file_index = static_cast<int>(batch_.files.size()) - 1;
  for (int64_t i = 0; i < s; ++i) batch_.origins.push_back({file_index, i});
  const std::size_t s0 = batch_.total_lengths.size();
  batch_.total_lengths.resize(s0 + static_cast<std::size_t>(s));
  batch_.response_lengths.resize(s0 + static_cast<std::size_t>(s));
  tl.copy_i64(0, s, batch_.total_lengths.data() + s0);
  rl.copy_i64(0, s, batch_.response_lengths.data() + s0);
  for (int64_t i = 0; i < s; ++i) {
    batch_.token_offsets.push_back(batch_.token_offsets.back() + batch_.total_lengths[s0 + i]);
    batch_.response_offsets.push_back(batch_.response_offsets.back() +
                                      batch_.response_lengths[s0 + i]);
  }
  if (needs_.tokens) {
    const std::size_t t0 = batch_.tokens.size();
    batch_.tokens.resize(t0 + static_cast<std::size_t>(sum_t));
    if (sum_t > 0) tokens.copy_i64(0, sum_t, batch_.tokens.data() + t0);
  }
}

void BatchBuilder::append_packed_mask(const HostArray* mask, std::size_t s0, int64_t sum_r,
                                      int64_t rows_before) {
  const std::size_t m0 = batch_.loss_mask.size();
  batch_.loss_mask.resize(m0 + static_cast<std::size_t>(sum_r), 1);
  if (mask == nullptr) return;  // all ones
  any_mask_ = true;
  const HostArray& m = *mask;
  uint8_t* dst = batch_.loss_mask.data() + m0;
  narrow_packed_mask(m, sum_r, dst);
  uint8_t bad = 0;
  for (int64_t j = 0; j < sum_r; ++j) bad |= dst[j] & 0xfe;
  if (bad == 0) return;
  // The first value that is neither 0 nor 1, named by its sample within the dump (the dump's s
  // samples are appended from s0 on).
  const auto s = static_cast<int64_t>(batch_.total_lengths.size() - s0);
  for (int64_t j = 0; j < sum_r; ++j) {
    const double v = m.get_f64(j);
    if (v == 0.0 || v == 1.0) continue;
    const auto it = std::upper_bound(batch_.response_offsets.end() - s - 1,
                                     batch_.response_offsets.end(), rows_before + j);
    const int64_t sample = static_cast<int64_t>(it - (batch_.response_offsets.end() - s - 1)) - 1;
    const int64_t start =
        batch_.response_offsets[s0 + static_cast<std::size_t>(sample)] - rows_before;
    throw_input_error("{}: sample {}: loss_mask[{}] = {} (must be 0 or 1)", batch_.files.back(),
                      sample, j - start, v);
  }
}

void BatchBuilder::set_packed_sample_values(const PackedFields& f, int64_t s, std::size_t s0) {
  const std::string& file = batch_.files.back();
  auto per_sample = [&](const HostArray* a, const char* name) {
    if (a != nullptr && (a->shape.size() != 1 || a->numel() != s)) {
      throw_input_error("{}: field '{}' has shape {}, but the dump has {} samples", file, name,
                        a->shape_string(), s);
    }
    return a;
  };
  const HostArray* padded = per_sample(f.padded_total_lengths, "padded_total_lengths");
  const HostArray* denoms = per_sample(f.sample_denoms, "sample_denoms");
  const HostArray* removed = per_sample(f.removed, "removed");
  if (padded != nullptr && dtype_is_float(padded->dtype))
    throw_input_error("{}: field 'padded_total_lengths' has dtype {}, must be an integer dtype",
                      file, dtype_name(padded->dtype));
  for (int64_t i = 0; i < s && (padded || denoms || removed); ++i) {
    set_sample_values(static_cast<int64_t>(s0) + i, i,
                      padded ? std::optional<int64_t>(padded->get_i64(i)) : std::nullopt,
                      denoms ? std::optional<double>(denoms->get_f64(i)) : std::nullopt,
                      removed ? std::optional<bool>(removed->get_f64(i) != 0.0) : std::nullopt);
  }
}

void BatchBuilder::append_packed_rows(const HostArray* logits,
                                      const std::map<std::string, const HostArray*>& per_token,
                                      int64_t sum_r) {
  if (logits != nullptr) {
    vocab_size_ = logits->shape[1];
    if (needs_.logits && logits_rows_ == 0 && logits_bytes_.empty() && !logits_dtype_) {
      borrowed_logits_ = *logits;  // zero copy
      logits_dtype_ = logits->dtype;
    } else if (needs_.logits) {
      append_float_rows("logits", *logits, 0);
    }
    logits_rows_ += sum_r;
  }
  for (const auto& [name, a] : per_token) {
    if (a == nullptr || partial_.count(name)) continue;
    if (needs_.per_token) append_float_rows(name, *a, 0);
    per_token_rows_[name] += sum_r;
  }
}

Batch BatchBuilder::finish() {
  if (batch_.token_offsets.empty()) {
    batch_.token_offsets.push_back(0);
    batch_.response_offsets.push_back(0);
  }
  batch_.loss_mask_given = any_mask_;
  for (const BatchStep& st : batch_.steps) {
    for (int64_t i : st.samples) {
      LG_CHECK(i >= 0 && i < batch_.num_samples(), "step {} names sample {} of {}", st.step, i,
               batch_.num_samples());
    }
  }
  const auto s = static_cast<std::size_t>(batch_.num_samples());
  if (!batch_.padded_total_lengths.empty()) batch_.padded_total_lengths.resize(s, 0);
  if (!batch_.sample_denoms.empty()) batch_.sample_denoms.resize(s, -1.0);
  if (!batch_.removed.empty()) batch_.removed.resize(s, 0);
  const int64_t rows = batch_.num_response_tokens();
  if (borrowed_logits_ && needs_.logits) {
    LG_CHECK(borrowed_logits_->shape[0] == rows, "borrowed logits rows {} vs {}",
             borrowed_logits_->shape[0], rows);
    batch_.logits = std::move(*borrowed_logits_);
    borrowed_logits_.reset();
  } else if (logits_dtype_ && needs_.logits) {
    HostArray a = HostArray::zeros(*logits_dtype_, {rows, vocab_size_});
    LG_CHECK(a.size_bytes() == logits_bytes_.size(), "logits bytes {} vs {}", logits_bytes_.size(),
             a.size_bytes());
    if (!logits_bytes_.empty())
      std::memcpy(a.mutable_data(), logits_bytes_.data(), logits_bytes_.size());
    batch_.logits = std::move(a);
    logits_bytes_ = {};
  }
  // A field some dumps have and others lack is dropped: it fails only a command that needs it
  // (loss_input names the dumps), never a count.
  for (const auto& [name, covered] : per_token_rows_) {
    if (!partial_.count(name) && covered != rows && covered > 0) {
      mark_partial(
          name,
          fmt::format("the samples after the last that has it lack it ({} of {} response tokens)",
                      covered, rows));
    }
  }
  for (const auto& [name, reason] : partial_) {
    per_token_bytes_.erase(name);
    per_token_rows_.erase(name);
    batch_.metadata["lossguard.partial_fields"][name] = reason;
  }
  for (const auto& [name, covered] : per_token_rows_) {
    if (covered != rows) {
      throw_input_error(
          "field '{}' covers {} response tokens of {}: the samples after the last that has it lack "
          "it",
          name, covered, rows);
    }
  }
  for (auto& [name, bytes] : per_token_bytes_) {
    if (per_token_rows_[name] != rows) {
      throw_input_error(
          "field '{}' covers {} response tokens of {}: the samples after the last that has it lack "
          "it",
          name, per_token_rows_[name], rows);
    }
    HostArray a = HostArray::zeros(per_token_dtype_[name], {rows});
    if (!bytes.empty()) std::memcpy(a.mutable_data(), bytes.data(), bytes.size());
    batch_.per_token[name] = std::move(a);
  }
  if (vocab_size_ >= 0 && logits_rows_ != rows) {
    throw_input_error(
        "logits cover {} response tokens of {}: the samples after the last that has them lack them",
        logits_rows_, rows);
  }
  return std::move(batch_);
}

const std::vector<Reduction>& all_reductions() {
  static const std::vector<Reduction> kAll = all_modes<Reduction>();
  return kAll;
}

LossInput loss_input(const Batch& b, LossKind loss) {
  auto need = [&](const char* field) {
    const auto& partial = b.metadata.contains("lossguard.partial_fields")
                              ? b.metadata["lossguard.partial_fields"]
                              : nlohmann::json::object();
    if (!b.per_token.count(field) && partial.contains(field)) {
      throw_input_error("--loss {} needs the per-token field '{}', which only some dumps have: {}",
                        loss_kind_name(loss), field, partial[field].get<std::string>());
    }
    if (!b.per_token.count(field)) {
      throw_input_error("--loss {} needs the per-token field '{}', which the dump lacks",
                        loss_kind_name(loss), field);
    }
  };
  switch (loss) {
    case LossKind::kNll:
      if (b.logits) return LossInput::kLogits;
      need("log_probs");
      return LossInput::kLogProbs;
    case LossKind::kPpoClip:
      need("log_probs");
      need("old_log_probs");
      need("advantages");
      return LossInput::kLogProbs;
    case LossKind::kGiven:
      need("token_loss");
      return LossInput::kTokenLoss;
  }
  return LossInput::kLogits;
}

const HostArray& loss_input_array(const Batch& b, LossInput which) {
  return which == LossInput::kLogits     ? *b.logits
         : which == LossInput::kLogProbs ? b.per_token.at("log_probs")
                                         : b.per_token.at("token_loss");
}

}  // namespace lossguard
