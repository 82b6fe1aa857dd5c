// CP-local per-token fields of per-rank dumps reassembled into the batch's [sum R] field, on
// core's zig-zag chunk arithmetic (io/dump_values.h).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/modes.h"
#include "io/dump_values.h"

namespace lossguard::io::dump_detail {

using Kind = Value::Kind;

// The response rows CP rank `c` of `cp` holds for a sample, in the order its CP-local tensors hold
// them: slime's slice_log_prob_with_cp keeps the logits of chunk c, then of chunk 2cp-1-c, each
// clipped to the response's logit range [P-1, T-1); logit q is response index q+1-P (an SFT
// sample's indices are the logit positions themselves).
std::vector<int64_t> cp_local_rows(int64_t t, int64_t r, int64_t cp, int64_t c) {
  std::vector<int64_t> rows;
  const int64_t p = t - r, cs = chunk_size(t, cp, ShardLayout{});  // unpadded: ceil(T / 2cp)
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

}  // namespace lossguard::io::dump_detail
