// Denominators and invariants I1-I4 (SPEC §3).
#include "oracle/count/denominators.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>

#include "core/errors.h"
#include "core/format.h"
#include "oracle/count/token_placement.h"

namespace lossguard::oracle {

OwnedCounts count_owned_tokens(const Batch& b, const std::vector<int64_t>& cp_sizes,
                               const ShardLayout& layout, const std::vector<int64_t>* samples) {
  OwnedCounts out;
  out.cp_sizes = cp_sizes;
  if (samples != nullptr) {
    out.samples = *samples;
  } else {
    out.samples.resize(static_cast<std::size_t>(b.num_samples()));
    for (int64_t i = 0; i < b.num_samples(); ++i) out.samples[i] = i;
  }
  const std::size_t n = out.samples.size();
  out.mask_sums.resize(n);
  out.per_rank.resize(cp_sizes.size());
  for (std::size_t c = 0; c < cp_sizes.size(); ++c) {
    if (cp_sizes[c] < 1) throw_input_error("--cp sizes must be >= 1, got {}", cp_sizes[c]);
    out.per_rank[c].assign(n * static_cast<std::size_t>(cp_sizes[c]), 0);
  }
  // Per sample: one pass over the mask into prefix sums (a few hundred bytes, in L1), then every CP
  // size's owned ranges by two lookups each.
  std::vector<int64_t> prefix;
  for (std::size_t k = 0; k < n; ++k) {
    const int64_t i = out.samples[k];
    const int64_t t = b.total_lengths[i], r = b.response_lengths[i];
    const uint8_t* m = b.loss_mask.data() + b.response_offsets[i];
    prefix.resize(static_cast<std::size_t>(r) + 1);
    int64_t acc = 0;
    prefix[0] = 0;
    for (int64_t j = 0; j < r; ++j) prefix[j + 1] = (acc += m[j]);
    out.mask_sums[k] = acc;
    for (std::size_t c = 0; c < cp_sizes.size(); ++c) {
      const int64_t cp = cp_sizes[c];
      int64_t* dst = out.per_rank[c].data() + k * static_cast<std::size_t>(cp);
      if (cp == 1) {
        dst[0] = acc;
        continue;
      }
      const int64_t cs = chunk_size(t, cp, layout, b.padded_total_length(i));
      for (int64_t rank = 0; rank < cp; ++rank) {
        int64_t owned = 0;
        for (const IndexRange& ir : owned_mask_ranges(t, r, cp, rank, cs)) {
          if (ir.size() > 0) owned += prefix[ir.end] - prefix[ir.begin];
        }
        dst[rank] = owned;
      }
    }
  }
  return out;
}

OwnedCounts count_owned_tokens(const Batch& b, const std::vector<StepLayout>& layouts,
                               std::vector<std::string>* problems) {
  OwnedCounts out;
  const int64_t s = b.num_samples();
  out.samples.resize(static_cast<std::size_t>(s));
  out.mask_sums.resize(static_cast<std::size_t>(s));
  for (int64_t i = 0; i < s; ++i) {
    out.samples[i] = i;
    out.mask_sums[i] = b.mask_sum(i);
  }
  for (const StepLayout& layout : layouts) {
    const int64_t cp = layout.cp;
    out.cp_sizes.push_back(cp);
    std::vector<int64_t> per_rank(static_cast<std::size_t>(s * cp), 0);
    PlacedTokens placed = place_tokens(b, layout);
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
        const int16_t o = placed.place.owner[t];
        if (o >= 0 && b.loss_mask[t]) ++per_rank[static_cast<std::size_t>(i * cp + o)];
      }
    }
    out.per_rank.push_back(std::move(per_rank));
    if (problems != nullptr) {
      for (auto& p : placed.problems) {
        if (std::find(problems->begin(), problems->end(), p) == problems->end())
          problems->push_back(std::move(p));
      }
    }
  }
  return out;
}

int64_t policy_rank_count(Policy policy, int64_t owned, int64_t mask_sum, int64_t cp) {
  switch (policy) {
    case Policy::kFixed:
      return owned;
    case Policy::kLegacy:
      return cp == 1 ? std::max<int64_t>(mask_sum, 1) : owned;  // Relax before PR #285
    case Policy::kSlime:
      return std::max<int64_t>(mask_sum, 1);  // every CP rank counts the full sample
  }
  return owned;
}

int64_t effective_sample_count(Policy policy, const OwnedCounts& counts, std::size_t c,
                               std::size_t k) {
  const int64_t cp = counts.cp_sizes[c];
  int64_t sum = 0;
  for (int64_t r = 0; r < cp; ++r)
    sum += policy_rank_count(policy, counts.count(c, k, r), counts.mask_sums[k], cp);
  return policy == Policy::kSlime ? sum / cp : sum;
}

int64_t global_denominator(Policy policy, const OwnedCounts& counts, std::size_t c) {
  const int64_t cp = counts.cp_sizes[c];
  int64_t n = 0;
  for (std::size_t k = 0; k < counts.samples.size(); ++k) {
    for (int64_t r = 0; r < cp; ++r)
      n += policy_rank_count(policy, counts.count(c, k, r), counts.mask_sums[k], cp);
  }
  return n;
}

namespace {

// Groups per-sample differences (keyed by counted index k) into "+1 for each empty sample: 3, 7"
// phrases.
std::string explain_differences(const Batch& b, const OwnedCounts& counts,
                                const std::map<std::size_t, int64_t>& diff) {
  std::map<std::pair<std::string, int64_t>, std::vector<int64_t>> groups;
  for (const auto& [k, d] : diff) {
    const int64_t i = counts.samples[k];
    std::string what;
    if (b.response_lengths[i] == 0)
      what = "empty sample (R = 0)";
    else if (counts.mask_sums[k] == 0)
      what = "fully masked sample";
    else if (b.response_lengths[i] == b.total_lengths[i])
      what = "SFT sample whose last mask entry is 1 (not pre-shifted)";
    else
      what = "sample";
    groups[{what, d}].push_back(i);
  }
  std::vector<std::string> parts;
  for (const auto& [key, idx] : groups) {
    parts.push_back(
        fmt::format("{:+d} for each {}: {}", key.second, key.first, format_index_list(idx)));
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

}  // namespace

namespace {

// N under the policy over every counted sample for CP size c (cp-scaled back under slime).
int64_t effective_total(Policy policy, const OwnedCounts& counts, std::size_t c) {
  int64_t s = 0;
  for (std::size_t k = 0; k < counts.samples.size(); ++k)
    s += effective_sample_count(policy, counts, c, k);
  return s;
}

// I1: the same (effective) denominator for every CP size.
InvariantResult check_i1(const Batch& b, const OwnedCounts& counts, Policy policy, std::size_t c1) {
  const std::size_t n = counts.samples.size();
  InvariantResult r{"I1", "CP-consistency", true, "", nlohmann::json::object()};
  const int64_t n1 = effective_total(policy, counts, c1);
  std::vector<std::string> bad;
  for (std::size_t c = 0; c < counts.cp_sizes.size(); ++c) {
    if (c == c1) continue;
    const int64_t nc = effective_total(policy, counts, c);
    r.data[std::to_string(counts.cp_sizes[c])] = nc;
    if (nc == n1) continue;
    r.ok = false;
    std::map<std::size_t, int64_t> diff;
    for (std::size_t k = 0; k < n; ++k) {
      const int64_t d = effective_sample_count(policy, counts, c1, k) -
                        effective_sample_count(policy, counts, c, k);
      if (d != 0) diff[k] = d;
    }
    bad.push_back(
        fmt::format("N(cp=1) = {} but N(cp={}) = {}{}: {}", n1, counts.cp_sizes[c],
                    policy == Policy::kSlime ? nc * counts.cp_sizes[c] : nc,
                    policy == Policy::kSlime
                        ? fmt::format(" (/{} for the cp-scaled loss = {})", counts.cp_sizes[c], nc)
                        : "",
                    explain_differences(b, counts, diff)));
  }
  r.data["1"] = n1;
  r.detail =
      r.ok ? fmt::format("N = {} for every CP size", n1) : fmt::format("{}", fmt::join(bad, "\n"));
  return r;
}

// I2: every owned response token counted exactly once over the CP group (RL samples, cp > 1).
InvariantResult check_i2(const Batch& b, const OwnedCounts& counts, Policy policy) {
  const std::size_t n = counts.samples.size();
  InvariantResult r{"I2", "Exactly-once", true, "", nlohmann::json::object()};
  std::vector<std::string> bad;
  for (std::size_t c = 0; c < counts.cp_sizes.size(); ++c) {
    if (counts.cp_sizes[c] == 1) continue;
    std::map<std::size_t, int64_t> diff;
    for (std::size_t k = 0; k < n; ++k) {
      const int64_t i = counts.samples[k];
      if (b.response_lengths[i] == b.total_lengths[i]) continue;  // SFT: see the pre-shift finding
      const int64_t d = effective_sample_count(policy, counts, c, k) - counts.mask_sums[k];
      if (d != 0) diff[k] = d;
    }
    if (!diff.empty()) {
      r.ok = false;
      bad.push_back(fmt::format("cp={}: sum over ranks != m_i: {}", counts.cp_sizes[c],
                                explain_differences(b, counts, diff)));
    }
  }
  r.detail = r.ok ? "every RL sample's mask sum is counted exactly once over the CP ranks"
                  : fmt::format("{}", fmt::join(bad, "\n"));
  return r;
}

// I3: the denominator does not depend on the DP / micro-batch split (recounted part by part).
InvariantResult check_i3(const Batch& b, const OwnedCounts& counts, Policy policy,
                         const ShardLayout& layout, const Placement* placement) {
  InvariantResult r{"I3", "Partition invariance", true, "", nlohmann::json::object()};
  if (placement == nullptr) {
    r.detail = "one part (no --dp / --microbatches split given)";
    r.data["parts"] = 1;
  } else {
    std::vector<std::string> bad;
    int64_t parts = 0;
    for (std::size_t c = 0; c < counts.cp_sizes.size(); ++c) {
      int64_t split_total = 0;
      for (const auto& dp_rank : *placement) {
        for (const auto& mb : dp_rank) {
          OwnedCounts part = count_owned_tokens(b, {counts.cp_sizes[c]}, layout, &mb);
          split_total += global_denominator(policy, part, 0);
          if (c == 0) ++parts;
        }
      }
      const int64_t whole = global_denominator(policy, counts, c);
      if (split_total != whole) {
        r.ok = false;
        bad.push_back(fmt::format("cp={}: split N = {} but unsplit N = {}", counts.cp_sizes[c],
                                  split_total, whole));
      }
    }
    r.data["parts"] = parts;
    r.detail = r.ok ? fmt::format(
                          "N over {} DP rank(s) x micro-batches ({} parts) equals the unsplit N "
                          "for every CP size",
                          placement->size(), parts)
                    : fmt::format("{}", fmt::join(bad, "\n"));
  }
  return r;
}

// I4: samples without effective tokens add nothing.
InvariantResult check_i4(const Batch& b, const OwnedCounts& counts, Policy policy) {
  const std::size_t n = counts.samples.size();
  InvariantResult r{"I4", "Empty contributes zero", true, "", nlohmann::json::object()};
  std::vector<std::string> bad;
  for (std::size_t c = 0; c < counts.cp_sizes.size(); ++c) {
    std::map<std::size_t, int64_t> diff;
    for (std::size_t k = 0; k < n; ++k) {
      if (counts.mask_sums[k] != 0) continue;
      const int64_t contributed = effective_sample_count(policy, counts, c, k);
      if (contributed != 0) diff[k] = contributed;
    }
    if (!diff.empty()) {
      r.ok = false;
      bad.push_back(
          fmt::format("cp={}: {}", counts.cp_sizes[c], explain_differences(b, counts, diff)));
    }
  }
  r.detail = r.ok ? "samples without effective tokens add 0 to N"
                  : fmt::format("{}", fmt::join(bad, "\n"));
  return r;
}

}  // namespace

std::vector<InvariantResult> check_invariants(const Batch& b, const OwnedCounts& counts,
                                              Policy policy, const ShardLayout& layout,
                                              const Placement* placement) {
  const auto it1 = std::find(counts.cp_sizes.begin(), counts.cp_sizes.end(), 1);
  LG_CHECK(it1 != counts.cp_sizes.end(), "cp = 1 must be counted");
  const std::size_t c1 = static_cast<std::size_t>(it1 - counts.cp_sizes.begin());
  return {check_i1(b, counts, policy, c1), check_i2(b, counts, policy),
          check_i3(b, counts, policy, layout, placement), check_i4(b, counts, policy)};
}

}  // namespace lossguard::oracle
