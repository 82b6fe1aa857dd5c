// Batch findings (SPEC §1, §2): non-finite values with coordinates, T = 0, SFT masks not
// pre-shifted.
#include "oracle/findings.h"

#include <fmt/format.h>

#include <cmath>

#include "oracle/denominators.h"

namespace lossguard::oracle {

namespace {

int64_t sample_of_row(const Batch& b, int64_t row) {
  auto it = std::upper_bound(b.response_offsets.begin(), b.response_offsets.end(), row);
  return static_cast<int64_t>(it - b.response_offsets.begin()) - 1;
}

void scan_non_finite(const Batch& b, const std::string& field, const HostArray& a, int64_t cols,
                     std::size_t max_reported, std::vector<Finding>& out) {
  if (!dtype_is_float(a.dtype)) return;
  int64_t count = 0;
  const int64_t n = a.numel();
  for (int64_t k = 0; k < n; ++k) {
    const double v = a.get_f64(k);
    if (std::isfinite(v)) continue;
    if (static_cast<std::size_t>(count++) >= max_reported) continue;
    const int64_t row = k / cols, col = k % cols;
    const int64_t s = sample_of_row(b, row);
    const int64_t j = row - b.response_offsets[s];
    Finding f{"non_finite",
              "",
              {{"field", field},
               {"sample", s},
               {"response_index", j},
               {"value", std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf")}}};
    if (cols > 1) {
      f.detail["vocab_index"] = col;
      f.message = fmt::format("{}: {}[{}, {}] = {}", b.describe_sample(s), field, j, col, v);
    } else {
      f.message = fmt::format("{}: {}[{}] = {}", b.describe_sample(s), field, j, v);
    }
    out.push_back(std::move(f));
  }
  if (static_cast<std::size_t>(count) > max_reported) {
    out.push_back(
        {"non_finite",
         fmt::format("{}: {} non-finite values in all ({} shown)", field, count, max_reported),
         {{"field", field}, {"count", count}}});
  }
}

}  // namespace

SampleNote classify_sample(const Batch& b, int64_t i, int64_t m) {
  SampleNote n;
  const int64_t t = b.total_lengths[i], r = b.response_lengths[i];
  n.cls = t == 0   ? SampleClass::kTZero
          : r == 0 ? SampleClass::kEmptyResponse
          : m == 0 ? SampleClass::kFullyMasked
                   : SampleClass::kRl;
  n.sft = r == t && t > 0;
  n.sft_not_preshifted = n.sft && b.loss_mask[b.response_offsets[i + 1] - 1] != 0;
  return n;
}

std::string SampleNote::text() const {
  std::string s = cls == SampleClass::kTZero           ? "T = 0"
                  : cls == SampleClass::kEmptyResponse ? "empty response"
                  : cls == SampleClass::kFullyMasked   ? "fully masked"
                                                       : "";
  if (sft)
    s += std::string(s.empty() ? "" : ", ") +
         (sft_not_preshifted ? "SFT, mask not pre-shifted" : "SFT");
  return s;
}

std::vector<Finding> legacy_slicing_findings(const Batch& b) {
  std::vector<int64_t> empty_r;
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    if (classify_sample(b, i, 0).cls == SampleClass::kEmptyResponse) empty_r.push_back(i);
  }
  if (empty_r.empty()) return {};
  const int64_t i = empty_r.front();
  return {{"legacy_response_slicing",
           fmt::format("legacy response slicing: targets taken as tokens[-R:] give {} with R = 0 "
                       "all T = {} tokens as "
                       "targets for its 0 logits rows (samples with R = 0: {})",
                       b.describe_sample(i), b.total_lengths[i], format_index_list(empty_r)),
           {{"samples", empty_r}}}};
}

std::vector<Finding> batch_findings(const Batch& b, std::size_t max_reported) {
  std::vector<Finding> out;
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    const SampleNote note = classify_sample(b, i, b.mask_sum(i));
    if (note.cls == SampleClass::kTZero) {
      out.push_back(
          {"zero_length_sample",
           fmt::format("{}: T = 0 (an empty sample; it counts 0 tokens)", b.describe_sample(i)),
           {{"sample", i}}});
    } else if (note.sft_not_preshifted) {
      out.push_back(
          {"sft_mask_not_preshifted",
           fmt::format(
               "{}: SFT mask not pre-shifted: its last entry is 1, counted at CP=1 but never owned "
               "at CP>1 (SPEC §2)",
               b.describe_sample(i)),
           {{"sample", i}}});
    }
  }
  if (b.logits) scan_non_finite(b, "logits", *b.logits, b.vocab_size(), max_reported, out);
  for (const auto& [name, a] : b.per_token) scan_non_finite(b, name, a, 1, max_reported, out);
  return out;
}

}  // namespace lossguard::oracle
