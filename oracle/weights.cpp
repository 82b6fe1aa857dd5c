// Effective token weights (SPEC §9). A contract's weight for a token of sample i, owned by CP rank
// c in micro-batch k of DP rank d, is
//   w_t = m_t · scale · 1/max(D, 1) · (1/max(d_i, 1) if sample = mean) / (|G| if grad = mean:G)
// where D is the contract's count (none / micro-batch / rank / all-reduced over a group).
#include "oracle/weights.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <optional>
#include <thread>

#include "core/errors.h"
#include "oracle/cp_shard.h"
#include "oracle/placement.h"

namespace lossguard::oracle {

ObjectiveSizes resolve_sizes(const Batch& b, ObjectiveSizes z) {
  if (z.global_batch_size <= 0) z.global_batch_size = std::max<int64_t>(b.num_samples(), 1);
  if (z.l_norm <= 0) {
    int64_t max_r = 1;
    for (int64_t r : b.response_lengths) max_r = std::max(max_r, r);
    z.l_norm = static_cast<double>(max_r);
  }
  return z;
}

std::vector<double> true_weights(const Batch& b, Reduction reduce, const ObjectiveSizes& sizes_in) {
  const ObjectiveSizes z = resolve_sizes(b, sizes_in);
  const int64_t s = b.num_samples();
  std::vector<int64_t> m(static_cast<std::size_t>(s));
  int64_t n = 0, nonzero = 0;
  for (int64_t i = 0; i < s; ++i) {
    m[i] = b.mask_sum(i);
    n += m[i];
    nonzero += m[i] > 0;
  }
  const double batch = static_cast<double>(z.global_batch_size);
  std::vector<double> w(static_cast<std::size_t>(b.num_response_tokens()), 0.0);
  for (int64_t i = 0; i < s; ++i) {
    if (m[i] == 0) continue;
    double c = 0.0;
    switch (reduce) {
      case Reduction::kPerToken:
      case Reduction::kTokenMean:
        c = 1.0 / static_cast<double>(std::max<int64_t>(n, 1));
        break;
      case Reduction::kSampleMean:
        c = 1.0 / (batch * std::max(b.sample_denom(i, m[i]), 1.0));  // d_i, SPEC §3
        break;
      case Reduction::kSeqMeanTokenSum:
        c = 1.0 / batch;
        break;
      case Reduction::kSeqMeanTokenMean:
        c = 1.0 / (static_cast<double>(nonzero) * static_cast<double>(m[i]));
        break;
      case Reduction::kSeqMeanTokenSumNorm:  // Dr.GRPO: B·L_norm (verl agg_loss, TRL dr_grpo)
        c = 1.0 / (batch * z.l_norm);
        break;
    }
    for (int64_t row = b.response_offsets[i]; row < b.response_offsets[i + 1]; ++row) {
      w[row] = b.loss_mask[row] ? c : 0.0;
    }
  }
  return w;
}

namespace {

// Marks the owner (static CP rank) of every mask index of sample i, trained by a sub-group of
// `cp_size` ranks starting at static rank `base`. `stream_offset` is the sample's start in the
// sub-group's concatenated stream and `part_length` the all-gather part length (all-gather only).
void mark_owners(const Batch& b, int64_t i, const StepLayout& layout, int64_t cp_size, int64_t base,
                 int64_t stream_offset, int64_t part_length, std::vector<int16_t>& owner) {
  const int64_t t = b.total_lengths[i], r = b.response_lengths[i], p = t - r;
  const int64_t first = b.response_offsets[i];
  if (cp_size ==
      1) {  // an unsharded rank holds the whole sample (SFT index T-1 too: counted at CP = 1)
    for (int64_t j = 0; j < r; ++j) owner[first + j] = static_cast<int16_t>(base);
    return;
  }
  if (layout.cp_layout == CpLayout::kAllgather) {
    // The owner holds the stream position of the predicting logit: P-1+j (RL), j (SFT, j < T-1).
    const bool sft = r == t;
    for (int64_t j = 0; j < r; ++j) {
      const int64_t pos = sft ? j : p - 1 + j;
      if (sft && j >= t - 1) continue;
      owner[first + j] = static_cast<int16_t>(base + (stream_offset + pos) / part_length);
    }
    return;
  }
  const int64_t cs = chunk_size(t, cp_size, layout.shard, b.padded_total_length(i));
  for (int64_t rank = 0; rank < cp_size; ++rank) {
    for (const IndexRange& range : owned_mask_ranges(t, r, cp_size, rank, cs)) {
      for (int64_t j = range.begin; j < range.end; ++j)
        owner[first + j] = static_cast<int16_t>(base + rank);
    }
  }
}

int64_t group_size(ReduceGroup g, const StepLayout& l) {
  switch (g) {
    case ReduceGroup::kDpCp:
      return l.dp * l.cp;
    case ReduceGroup::kDp:
      return l.dp;
    case ReduceGroup::kCp:
      return l.cp;
    case ReduceGroup::kWorld:
      return l.dp * l.cp * l.tp;
  }
  return 1;
}

}  // namespace

PlacedTokens place_tokens(const Batch& b, const StepLayout& layout) {
  const int64_t s = b.num_samples(), cp = layout.cp;
  if (cp < 1 || cp > 32767) throw_input_error("CP size {} is out of range", cp);
  PlacedTokens out;
  out.place.sample_microbatch.assign(static_cast<std::size_t>(s), -1);
  out.place.sample_group.assign(static_cast<std::size_t>(s), -1);
  out.place.owner.assign(static_cast<std::size_t>(b.num_response_tokens()), -1);
  const auto num_mb = static_cast<int64_t>(layout.microbatches.size());
  for (int64_t k = 0; k < num_mb; ++k) {
    const MicroBatch& mb = layout.microbatches[k];
    if (mb.dummy) continue;
    const int64_t cs = mb.cp_size;
    if (cs < 1 || cp % cs != 0 || static_cast<int64_t>(mb.groups.size()) > cp / cs) {
      throw_input_error(
          "DP rank {} micro-batch {}: CP size {} with {} sub-groups does not fit a CP "
          "group of {}",
          mb.dp_rank, mb.index, cs, mb.groups.size(), cp);
    }
    for (std::size_t g = 0; g < mb.groups.size(); ++g) {
      const int64_t base = static_cast<int64_t>(g) * cs;
      int64_t stream = 0, part = 1;
      if (layout.cp_layout == CpLayout::kAllgather) {
        int64_t total = 0;
        for (int64_t i : mb.groups[g]) total += (i >= 0 && i < s) ? b.total_lengths[i] : 0;
        const int64_t unit = cs * layout.tp * std::max<int64_t>(layout.allgather_pad, 1);
        part = std::max<int64_t>((total + unit - 1) / unit * unit / cs, 1);
      }
      for (int64_t i : mb.groups[g]) {
        if (i < 0 || i >= s) {
          throw_input_error(
              "DP rank {} micro-batch {} names sample {}, but the step has {} samples", mb.dp_rank,
              mb.index, i, s);
        }
        if (out.place.sample_microbatch[i] >= 0) {
          const MicroBatch& at = layout.microbatches[out.place.sample_microbatch[i]];
          out.problems.push_back(
              &at == &mb
                  ? fmt::format(
                        "sample {} is placed twice: DP rank {} micro-batch {} trains it on CP "
                        "sub-groups {} and {} (CP ranks {}-{} and {}-{})",
                        i, mb.dp_rank, mb.index, out.place.sample_group[i], g,
                        out.place.sample_group[i] * cs, out.place.sample_group[i] * cs + cs - 1,
                        base, base + cs - 1)
                  : fmt::format(
                        "sample {} is placed twice: DP rank {} micro-batch {} and DP rank {} "
                        "micro-batch {}",
                        i, at.dp_rank, at.index, mb.dp_rank, mb.index));
          stream += b.total_lengths[i];
          continue;
        }
        out.place.sample_microbatch[i] = static_cast<int32_t>(k);
        out.place.sample_group[i] = static_cast<int32_t>(g);
        mark_owners(b, i, layout, cs, base, stream, part, out.place.owner);
        stream += b.total_lengths[i];
      }
    }
  }
  for (int64_t i = 0; i < s; ++i) {
    if (out.place.sample_microbatch[i] < 0)
      out.problems.push_back(fmt::format("sample {} is placed nowhere", i));
  }
  return out;
}

ContractWeights contract_weights(const Batch& b, const StepLayout& layout, const Contract& contract,
                                 const ObjectiveSizes& sizes_in, const PlacedTokens* given) {
  const ObjectiveSizes z = resolve_sizes(b, sizes_in);
  const int64_t s = b.num_samples(), cp = layout.cp;
  ContractWeights out;
  if (given != nullptr) {
    out.place = given->place;
    out.problems = given->problems;
  } else {
    PlacedTokens placed = place_tokens(b, layout);
    out.place = std::move(placed.place);
    out.problems = std::move(placed.problems);
  }
  const auto num_mb = static_cast<int64_t>(layout.microbatches.size());

  std::vector<int64_t> m(static_cast<std::size_t>(s));
  int64_t nonzero = 0;
  for (int64_t i = 0; i < s; ++i) {
    m[i] = b.mask_sum(i);
    nonzero += m[i] > 0;
  }
  // What the contract counts: the batch's own mask, or (count-of=main) the main term's.
  const std::vector<uint8_t>& counted =
      contract.count_of_main && sizes_in.main_mask != nullptr ? *sizes_in.main_mask : b.loss_mask;
  LG_CHECK(counted.size() == b.loss_mask.size(), "main mask of {} tokens for {}", counted.size(),
           b.loss_mask.size());
  std::vector<int64_t> counted_sum = m;
  if (&counted != &b.loss_mask) {
    for (int64_t i = 0; i < s; ++i) {
      counted_sum[i] = 0;
      for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t)
        counted_sum[i] += counted[t];
    }
  }

  // 1. Each rank's count per micro-batch as the contract counts it.
  out.count.assign(static_cast<std::size_t>(num_mb * cp), 0);
  std::vector<int64_t> owned;
  for (int64_t k = 0; k < num_mb; ++k) {
    const MicroBatch& mb = layout.microbatches[k];
    if (mb.dummy) continue;
    const int64_t cs = mb.cp_size;
    for (std::size_t g = 0; g < mb.groups.size(); ++g) {
      const int64_t base = static_cast<int64_t>(g) * cs;
      for (int64_t i : mb.groups[g]) {
        // placed twice: counted where first (its owners are that sub-group's ranks only)
        if (out.place.sample_microbatch[i] != k || out.place.sample_group[i] != int32_t(g))
          continue;
        const bool clamp = contract.clamp == ClampRule::kPerSample ||
                           (contract.clamp == ClampRule::kAtCp1 && cs == 1);
        auto clamped = [&](int64_t x) { return clamp ? std::max<int64_t>(x, 1) : x; };
        int64_t* row = &out.count[static_cast<std::size_t>(k * cp + base)];
        switch (contract.count) {
          case CountRule::kCpLocal: {
            owned.assign(static_cast<std::size_t>(cs), 0);
            for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
              const int16_t o = out.place.owner[t];
              if (o >= 0 && counted[t]) ++owned[o - base];
            }
            for (int64_t r = 0; r < cs; ++r) row[r] += clamped(owned[r]);
            break;
          }
          case CountRule::kFullSample:
            for (int64_t r = 0; r < cs; ++r) row[r] += clamped(counted_sum[i]);
            break;
          case CountRule::kSamples:
            for (int64_t r = 0; r < cs; ++r) row[r] += 1;
            break;
        }
      }
    }
  }
  for (int64_t x : out.count) out.global_count += x;

  // 2. The denominator D of every (micro-batch, CP rank).
  std::vector<int64_t> rank_total(static_cast<std::size_t>(layout.dp * cp), 0);
  for (int64_t k = 0; k < num_mb; ++k) {
    const int64_t d = layout.microbatches[k].dp_rank;
    if (d < 0 || d >= layout.dp)
      throw_input_error("micro-batch on DP rank {}, but DP is {}", d, layout.dp);
    for (int64_t c = 0; c < cp; ++c) rank_total[d * cp + c] += out.count[k * cp + c];
  }
  std::vector<int64_t> over_dp(static_cast<std::size_t>(cp), 0),
      over_cp(static_cast<std::size_t>(layout.dp), 0);
  int64_t all = 0;
  for (int64_t d = 0; d < layout.dp; ++d) {
    for (int64_t c = 0; c < cp; ++c) {
      over_dp[c] += rank_total[d * cp + c];
      over_cp[d] += rank_total[d * cp + c];
      all += rank_total[d * cp + c];
    }
  }
  // norm=generation:S: micro-batch index / S names its generation batch; counted over every rank.
  std::vector<int64_t> generation_total;
  if (contract.norm == NormRule::kGeneration) {
    for (int64_t k = 0; k < num_mb; ++k) {
      const auto g = static_cast<std::size_t>(layout.microbatches[k].index / contract.generation);
      if (generation_total.size() <= g) generation_total.resize(g + 1, 0);
      for (int64_t c = 0; c < cp; ++c) generation_total[g] += out.count[k * cp + c];
    }
  }
  auto denominator = [&](int64_t k, int64_t c) -> int64_t {
    const int64_t d = layout.microbatches[k].dp_rank;
    switch (contract.norm) {
      case NormRule::kGeneration:
        return generation_total[static_cast<std::size_t>(layout.microbatches[k].index /
                                                         contract.generation)];
      case NormRule::kNone:
        return 1;
      case NormRule::kMicrobatch:
        return out.count[k * cp + c];
      case NormRule::kRank:
        return rank_total[d * cp + c];
      case NormRule::kGlobal:
        switch (contract.norm_group) {
          case ReduceGroup::kDpCp:
            return all;
          case ReduceGroup::kDp:
            return over_dp[c];
          case ReduceGroup::kCp:
            return over_cp[d];
          case ReduceGroup::kWorld:
            return all * layout.tp;
        }
    }
    return 1;
  };

  // 3. The weights.
  const std::vector<int64_t> rank_microbatches = layout.microbatches_per_rank();
  const double grad_div = contract.grad == GradRule::kMean
                              ? static_cast<double>(group_size(contract.grad_group, layout))
                              : 1.0;
  out.weight.assign(static_cast<std::size_t>(b.num_response_tokens()), 0.0);
  std::vector<double> factor(static_cast<std::size_t>(cp));
  for (int64_t k = 0; k < num_mb; ++k) {
    const MicroBatch& mb = layout.microbatches[k];
    if (mb.dummy) continue;
    ScaleSizes sz;
    sz.cp = cp;
    sz.dp = layout.dp;
    sz.tp = layout.tp;
    sz.microbatches = rank_microbatches[mb.dp_rank];
    sz.batch = z.global_batch_size;
    sz.batch_nonzero = std::max<int64_t>(nonzero, 1);
    sz.l_norm = z.l_norm;
    for (const auto& group : mb.groups) {
      for (int64_t i : group) {
        if (i >= 0 && i < s) {
          sz.microbatch_max_response = std::max(sz.microbatch_max_response, b.response_lengths[i]);
        }
      }
    }
    const double scale = scale_value(contract.scale, sz);
    for (int64_t c = 0; c < cp; ++c) {
      factor[c] = scale / static_cast<double>(std::max<int64_t>(denominator(k, c), 1)) / grad_div;
    }
    for (std::size_t g = 0; g < mb.groups.size(); ++g) {
      for (int64_t i : mb.groups[g]) {
        if (out.place.sample_microbatch[i] != k || out.place.sample_group[i] != int32_t(g))
          continue;  // placed twice: counted where first placed
        const double per_sample = contract.sample == SampleRule::kMean
                                      ? 1.0 / std::max(b.sample_denom(i, m[i]), 1.0)
                                      : 1.0;
        for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
          const int16_t o = out.place.owner[t];
          if (o >= 0 && b.loss_mask[t]) out.weight[t] = factor[o] * per_sample;
        }
      }
    }
  }
  return out;
}

namespace {

// Equal within a relative tolerance; a non-finite value equals nothing (inf - inf is no
// difference to a relative test: |inf - 1| <= tol * inf holds, and a gate must not pass it).
bool same(double a, double b, double tol = kWeightRelTol) {
  if (!std::isfinite(a) || !std::isfinite(b)) return false;
  return std::fabs(a - b) <= tol * std::max(std::fabs(a), std::fabs(b));
}

bool same_weights(const std::vector<double>& a, const std::vector<double>& b, double tol) {
  for (std::size_t t = 0; t < a.size(); ++t) {
    if (!same(a[t], b[t], tol)) return false;
  }
  return true;
}

TokenCoord coord_of(const Batch& b, int64_t i, int64_t t, const TokenPlace& place,
                    const StepLayout& l, double got, double want) {
  TokenCoord c;
  c.sample = i;
  c.response_index = t - b.response_offsets[i];
  const int32_t k = place.sample_microbatch.empty() ? -1 : place.sample_microbatch[i];
  if (k >= 0) {
    c.dp_rank = l.microbatches[k].dp_rank;
    c.microbatch = l.microbatches[k].index;
  }
  c.cp_rank = place.owner.empty() ? -1 : place.owner[t];
  c.got = got;
  c.want = want;
  c.ratio = want != 0.0 ? got / want : 0.0;
  return c;
}

// A simple product of the layout's sizes equal to r: "1/cp", "dp*cp", "1/M" (ties: all names).
std::string name_factor(double r, const StepLayout& l, double tol) {
  const std::vector<int64_t> per_rank = l.microbatches_per_rank();
  const int64_t m = per_rank.empty() ? 0 : *std::max_element(per_rank.begin(), per_rank.end());
  struct Base {
    const char* name;
    double value;
  };
  const Base bases[] = {{"cp", static_cast<double>(l.cp)},
                        {"dp", static_cast<double>(l.dp)},
                        {"tp", static_cast<double>(l.tp)},
                        {"M", static_cast<double>(m)}};
  std::vector<std::string> best;
  int best_cost = 99;
  for (int a = -2; a <= 2; ++a) {
    for (int bb = -2; bb <= 2; ++bb) {
      for (int c = -1; c <= 1; ++c) {
        for (int d = -2; d <= 2; ++d) {
          const int e[4] = {a, bb, c, d};
          double v = 1.0;
          int cost = 0;
          for (int k = 0; k < 4; ++k) {
            if (e[k] != 0 && bases[k].value == 1.0) cost += 99;  // a size of 1 names nothing
            v *= std::pow(bases[k].value, e[k]);
            cost += std::abs(e[k]);
          }
          if (cost == 0 || cost > best_cost || !same(v, r, tol)) continue;
          std::string num, den;
          for (int k = 0; k < 4; ++k) {
            for (int x = 0; x < std::abs(e[k]); ++x) {
              std::string& part = e[k] > 0 ? num : den;
              part += (part.empty() ? "" : "*") + std::string(bases[k].name);
            }
          }
          const std::string name =
              (num.empty() ? "1" : num) +
              (den.empty()
                   ? ""
                   : "/" + (std::count(den.begin(), den.end(), '*') ? "(" + den + ")" : den));
          if (cost < best_cost) best.clear();
          best_cost = cost;
          best.push_back(name);
        }
      }
    }
  }
  std::string out;
  for (const auto& n : best) out += (out.empty() ? "" : " or ") + n;
  return out;
}

}  // namespace

WeightDiagnosis diagnose_weights(const Batch& b, const std::vector<double>& got,
                                 const std::vector<double>& want, const TokenPlace& place,
                                 const StepLayout& l, int64_t true_count, int64_t contract_count,
                                 double tol) {
  WeightDiagnosis dg;
  const int64_t s = b.num_samples();
  double worst_log = -1.0;
  bool first = true;
  double r0 = 1.0;
  bool uniform = true;
  // Non-finite weights first: every later test is a comparison, and comparisons with inf or NaN
  // answer whatever their form happens to give.
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
      if (std::isfinite(got[t]) && std::isfinite(want[t])) continue;
      if (dg.non_finite++ == 0) dg.worst = coord_of(b, i, t, place, l, got[t], want[t]);
    }
  }
  if (dg.non_finite > 0) {
    dg.kind = "non-finite";
    dg.min_ratio = dg.max_ratio = NAN;
    return dg;
  }
  for (int64_t i = 0; i < s; ++i) {
    for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
      if (want[t] == 0.0) {
        if (got[t] != 0.0) {
          if (dg.masked_weighted++ == 0) dg.worst = coord_of(b, i, t, place, l, got[t], want[t]);
        }
        continue;
      }
      ++dg.tokens;
      const double r = got[t] / want[t];
      if (!same(r, 1.0, tol)) ++dg.mismatched;
      if (first) {
        r0 = r;
        dg.min_ratio = dg.max_ratio = r;
        first = false;
      }
      uniform &= same(r, r0, tol);
      dg.min_ratio = std::min(dg.min_ratio, r);
      dg.max_ratio = std::max(dg.max_ratio, r);
      const double lg = r > 0 ? std::fabs(std::log(r)) : INFINITY;
      if (dg.masked_weighted == 0 && lg > worst_log) {
        worst_log = lg;
        dg.worst = coord_of(b, i, t, place, l, got[t], want[t]);
      }
    }
  }
  if (dg.masked_weighted > 0) {
    dg.kind = "masked-weight";
    return dg;
  }
  if (dg.mismatched == 0) {
    dg.kind = "exact";
    return dg;
  }
  if (uniform && r0 == 0.0) {
    dg.kind = "zero";  // not a scale Adam hides: no gradient reaches the parameters at all
    dg.scale = 0.0;
    return dg;
  }
  if (uniform) {
    dg.kind = "uniform-scale";
    dg.scale = r0;
    dg.named = name_factor(r0, l, tol);
    if (dg.named.empty() && contract_count > 0 &&
        same(r0, static_cast<double>(true_count) / static_cast<double>(contract_count), tol)) {
      dg.named =
          fmt::format("N/N' = {}/{}: the contract counts {} token(s) where the objective has {}",
                      true_count, contract_count, contract_count, true_count);
    }
    return dg;
  }
  // The coarsest unit within which the ratio is constant.
  const int64_t cp = l.cp;
  auto mb_of = [&](int64_t i) -> int64_t {
    return place.sample_microbatch.empty() ? -1 : place.sample_microbatch[i];
  };
  const int64_t num_mb = static_cast<int64_t>(l.microbatches.size());
  // Whether r is constant within every unit key(i, t); on success the worst token's unit size.
  auto constant_within = [&](const char* kind, int64_t count, auto key) {
    std::vector<double> ratio(static_cast<std::size_t>(count), NAN);
    std::vector<int64_t> tokens(static_cast<std::size_t>(count), 0);
    for (int64_t i = 0; i < s; ++i) {
      for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
        if (want[t] == 0.0) continue;
        const int64_t k = key(i, t);
        if (k < 0) return false;
        const double r = got[t] / want[t];
        if (std::isnan(ratio[k])) {
          ratio[k] = r;
        } else if (!same(ratio[k], r, tol)) {
          return false;
        }
        ++tokens[k];
      }
    }
    dg.kind = kind;
    const int64_t k =
        key(dg.worst.sample, b.response_offsets[dg.worst.sample] + dg.worst.response_index);
    dg.worst.unit_tokens = k >= 0 ? tokens[k] : 0;
    return true;
  };
  if (constant_within("per-rank", l.dp, [&](int64_t i, int64_t) {
        const int64_t k = mb_of(i);
        return k < 0 ? int64_t{-1} : l.microbatches[k].dp_rank;
      })) {
    return dg;
  }
  if (constant_within("per-microbatch", num_mb, [&](int64_t i, int64_t) { return mb_of(i); })) {
    return dg;
  }
  if (constant_within("per-cp-shard", num_mb * cp, [&](int64_t i, int64_t t) {
        const int64_t k = mb_of(i);
        const int64_t o = place.owner.empty() ? -1 : place.owner[t];
        return k < 0 || o < 0 ? int64_t{-1} : k * cp + o;
      })) {
    return dg;
  }
  if (constant_within("per-sample", s, [&](int64_t i, int64_t) { return i; })) return dg;
  dg.kind = "mixed";
  return dg;
}

std::string WeightDiagnosis::summary() const {
  auto where = [&] {
    std::string w = fmt::format("sample {} response index {}", worst.sample, worst.response_index);
    if (worst.dp_rank >= 0)
      w += fmt::format(" (DP rank {} micro-batch {}", worst.dp_rank, worst.microbatch);
    if (worst.dp_rank >= 0)
      w += worst.cp_rank >= 0 ? fmt::format(" CP rank {})", worst.cp_rank)
                              : ", owned by no CP rank)";
    return w;
  };
  if (kind == "exact" && tokens == 0) return "no effective tokens in this step: nothing to weigh";
  if (kind == "exact")
    return fmt::format("exact: every one of {} tokens weighted as the objective says", tokens);
  if (kind == "not-run") return "not diagnosed: the layout does not give each token one weight";
  if (kind == "non-finite") {
    return fmt::format(
        "non-finite weights: {} token(s) have w or w* = inf or NaN; first: {}, w = {} (w* = {})",
        non_finite, where(), worst.got, worst.want);
  }
  if (kind == "zero") {
    return fmt::format(
        "every weight is 0: the trainer applies no gradient for any of {} effective tokens",
        tokens);
  }
  if (kind == "masked-weight") {
    return fmt::format(
        "masked tokens carry weight: {} token(s) with mask 0 have w != 0; first: {}, w = {:.6g}",
        masked_weighted, where(), worst.got);
  }
  if (kind == "uniform-scale") {
    return fmt::format("uniform scale ×{:.6g}{}: every token's weight is off by the same factor",
                       scale, named.empty() ? "" : fmt::format(" = {}", named));
  }
  std::string unit = kind == "per-rank"         ? "per-DP-rank"
                     : kind == "per-microbatch" ? "per-micro-batch"
                     : kind == "per-cp-shard"   ? "per-CP-shard"
                     : kind == "per-sample"     ? "per-sample"
                                                : "mixed";
  return fmt::format(
      "{} normalisation: weights range {:.3g}× to {:.3g}× of the truth on {} of {} tokens; worst: "
      "{}, {:.6g}× ({} token(s) in that unit)",
      unit, min_ratio, max_ratio, mismatched, tokens, where(), worst.ratio, worst.unit_tokens);
}

std::vector<ShardRatio> shard_ratios(const Batch& b, const std::vector<double>& got,
                                     const std::vector<double>& want, const TokenPlace& place,
                                     const StepLayout& l) {
  std::vector<ShardRatio> out(l.microbatches.size() * static_cast<std::size_t>(l.cp));
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    const int32_t k = place.sample_microbatch[i];
    if (k < 0) continue;
    for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
      const int16_t o = place.owner[t];
      if (o < 0) continue;
      ShardRatio& sr = out[static_cast<std::size_t>(k) * l.cp + o];
      if (want[t] == 0.0) {
        sr.masked_weighted += got[t] != 0.0;
        continue;
      }
      const double r = got[t] / want[t];
      sr.min_ratio = sr.tokens == 0 ? r : std::min(sr.min_ratio, r);
      sr.max_ratio = sr.tokens == 0 ? r : std::max(sr.max_ratio, r);
      ++sr.tokens;
    }
  }
  return out;
}

std::vector<InvarianceResult> check_split_invariance(const Batch& b, const StepLayout& base,
                                                     const Contract& contract,
                                                     const ObjectiveSizes& sizes, Split split,
                                                     const std::vector<double>& truth,
                                                     Variations vary,
                                                     const ContractWeights* base_weights) {
  TermInvariance term{&b, &contract, sizes, &truth, base_weights};
  return std::move(check_split_invariance_terms({term}, base, split, vary).front());
}

std::vector<std::vector<InvarianceResult>> check_split_invariance_terms(
    const std::vector<TermInvariance>& terms, const StepLayout& base, Split split,
    Variations vary) {
  if (terms.empty()) return {};
  const Batch& b0 = *terms.front().batch;
  struct Reference {
    ContractWeights computed;
    const ContractWeights* weights = nullptr;
    int64_t true_count = 0;
    WeightDiagnosis diagnosis;
  };
  std::vector<Reference> refs(terms.size());
  for (std::size_t k = 0; k < terms.size(); ++k) {
    const TermInvariance& t = terms[k];
    if (t.base_weights == nullptr) {
      refs[k].computed = contract_weights(*t.batch, base, *t.contract, t.sizes);
      refs[k].weights = &refs[k].computed;
    } else {
      refs[k].weights = t.base_weights;
    }
    for (uint8_t m : t.batch->loss_mask) refs[k].true_count += m;
    refs[k].diagnosis =
        diagnose_weights(*t.batch, refs[k].weights->weight, *t.truth, refs[k].weights->place, base,
                         refs[k].true_count, refs[k].weights->global_count);
  }
  const int64_t base_m = base.dp > 0 ? base.num_microbatches(0) : 1;
  struct Variant {
    int64_t dp, m, cp;
    std::string label;
  };
  std::vector<Variant> variants;
  for (int64_t x : {1, 2, 4, 8}) {
    if (vary.dp && x != base.dp) variants.push_back({x, base_m, base.cp, fmt::format("DP {}", x)});
  }
  for (int64_t x : {1, 2, 4, 8}) {
    if (vary.microbatches && x != base_m)
      variants.push_back({base.dp, x, base.cp, fmt::format("{} micro-batches", x)});
  }
  for (int64_t x : {1, 2, 4, 8}) {
    if (vary.cp && x != base.cp) variants.push_back({base.dp, base_m, x, fmt::format("CP {}", x)});
  }
  // One variation: its placement once; per term, its weights against the base layout's and
  // (when they differ) against the truth. Empty: a layout that cannot hold the batch.
  auto evaluate = [&](const Variant& v) -> std::vector<InvarianceResult> {
    StepLayout l =
        static_layout(place_samples(b0.num_samples(), v.dp, v.m, split), v.cp, base.tp, base.shard);
    l.cp_layout = base.cp_layout;
    l.allgather_pad = base.allgather_pad;
    PlacedTokens placed;
    try {
      placed = place_tokens(b0, l);
    } catch (const InputError&) {
      return {};  // a layout that cannot hold the batch (bshd, a short max length)
    }
    std::vector<InvarianceResult> out;
    for (std::size_t k = 0; k < terms.size(); ++k) {
      const Batch& b = *terms[k].batch;
      const ContractWeights& ref = *refs[k].weights;
      InvarianceResult res;
      res.layout = {{"dp", v.dp}, {"cp", v.cp}, {"microbatches", v.m}};
      res.label = v.label;
      ContractWeights w;
      try {
        w = contract_weights(b, l, *terms[k].contract, terms[k].sizes, &placed);
      } catch (const InputError&) {
        return {};
      }
      double worst = -1.0;
      for (int64_t i = 0; i < b.num_samples(); ++i) {
        for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
          const double a = ref.weight[t], c = w.weight[t];
          if (a == c && std::isfinite(a)) continue;
          const double rel = std::isfinite(a) && std::isfinite(c)
                                 ? std::fabs(a - c) / std::max(std::fabs(a), std::fabs(c))
                                 : INFINITY;  // an infinite or NaN weight differs from anything
          if (rel > worst) {
            worst = rel;
            res.worst = coord_of(b, i, t, w.place, l, c, a);
          }
        }
      }
      res.max_rel_diff = std::max(worst, 0.0);
      res.ok = res.max_rel_diff <= kWeightRelTol;  // false for inf
      if (res.ok) {
        res.against_truth = refs[k].diagnosis;
      } else if (terms[k].diagnose_every_break) {
        res.against_truth = diagnose_weights(b, w.weight, *terms[k].truth, w.place, l,
                                             refs[k].true_count, w.global_count);
      } else {
        res.against_truth.kind = "not-run";  // the first break is diagnosed below
      }
      out.push_back(std::move(res));
    }
    return out;
  };
  // Variations are independent: a few at a time on their own threads (each holds a weight vector
  // the size of the batch's response tokens per term).
  const std::size_t threads =
      b0.num_response_tokens() < (1 << 16)
          ? 1  // small batches: a thread costs more than the work
          : std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 4);
  std::vector<std::vector<InvarianceResult>> results(variants.size());
  for (std::size_t start = 0; start < variants.size(); start += threads) {
    std::vector<std::future<std::vector<InvarianceResult>>> running;
    for (std::size_t k = start; k < std::min(variants.size(), start + threads); ++k) {
      running.push_back(std::async(threads > 1 ? std::launch::async : std::launch::deferred,
                                   evaluate, std::cref(variants[k])));
    }
    for (std::size_t k = 0; k < running.size(); ++k) results[start + k] = running[k].get();
  }
  std::vector<std::vector<InvarianceResult>> out(terms.size());
  std::vector<const Variant*> variant_of;  // of out[k][j], every k
  for (std::size_t v = 0; v < results.size(); ++v) {
    if (results[v].size() != terms.size()) continue;
    variant_of.push_back(&variants[v]);
    for (std::size_t k = 0; k < terms.size(); ++k) out[k].push_back(std::move(results[v][k]));
  }
  // The first break of a term that diagnoses only that one.
  for (std::size_t k = 0; k < terms.size(); ++k) {
    if (terms[k].diagnose_every_break) continue;
    for (std::size_t j = 0; j < out[k].size(); ++j) {
      if (out[k][j].ok) continue;
      const Variant& v = *variant_of[j];
      StepLayout l = static_layout(place_samples(b0.num_samples(), v.dp, v.m, split), v.cp, base.tp,
                                   base.shard);
      l.cp_layout = base.cp_layout;
      l.allgather_pad = base.allgather_pad;
      const Batch& b = *terms[k].batch;
      const ContractWeights w = contract_weights(b, l, *terms[k].contract, terms[k].sizes);
      out[k][j].against_truth = diagnose_weights(b, w.weight, *terms[k].truth, w.place, l,
                                                 refs[k].true_count, w.global_count);
      break;
    }
  }
  return out;
}

WeightsVerdict weights_verdict(const WeightDiagnosis& dg, const ContractWeights& w,
                               const std::vector<InvarianceResult>& invariance, bool strict_scale) {
  WeightsVerdict v;
  v.here_fails = dg.fails(strict_scale) || !w.problems.empty();
  for (const auto& r : invariance) {
    if (!r.ok) {
      v.first_break = &r;
      break;
    }
  }
  v.fails = v.here_fails || v.first_break != nullptr;
  return v;
}

std::vector<std::string> matching_presets(const Batch& b, const StepLayout& layout,
                                          const std::vector<double>& got, Reduction reduce,
                                          const ObjectiveSizes& sizes, double tol,
                                          const PlacedTokens* given) {
  // Every candidate contract places the tokens the same way: once.
  std::optional<PlacedTokens> own;
  if (given == nullptr) own = place_tokens(b, layout);
  const PlacedTokens* placed = given != nullptr ? given : &*own;
  std::vector<std::string> out;
  const bool term = sizes.main_mask != nullptr;  // a loss term's weights: its presets too
  for (const auto& p : contract_presets()) {
    if (p.term_only && !term) continue;
    const ContractWeights w =
        contract_weights(b, layout, preset_contract(p.name, reduce), sizes, placed);
    if (same_weights(got, w.weight, tol)) out.push_back(p.name);
  }
  if (!out.empty()) return out;
  // Single component changes: of the truth, then of every preset (the first level that matches).
  const char* changes[] = {
      "count=cp-local",    "count=full-sample", "count=samples",   "clamp=none",
      "clamp=per-sample",  "clamp=at-cp1",      "norm=none",       "norm=microbatch",
      "norm=rank",         "norm=global:dp",    "norm=global:cp",  "norm=global:world",
      "norm=global:dp-cp", "sample=mean",       "sample=none",     "grad=sum",
      "grad=mean:dp",      "grad=mean:cp",      "grad=mean:dp-cp", "grad=mean:world",
      "scale=1",           "scale=cp",          "scale=1/cp",      "scale=dp",
      "scale=1/dp",        "scale=1/M",         "scale=M"};
  // Every preset's variations cost a pass each over the tokens: only for batches of modest size.
  const bool all_presets = b.num_response_tokens() <= (1 << 20);
  for (const auto& p : contract_presets()) {
    if (std::string(p.name) != "truth" && !all_presets) break;
    if (p.term_only && !term) continue;
    const Contract base = preset_contract(p.name, reduce);
    for (const char* change : changes) {
      const Contract c = parse_contract(contract_components(base) + "," + change, reduce);
      if (c == base) continue;
      const ContractWeights w = contract_weights(b, layout, c, sizes, placed);
      if (same_weights(got, w.weight, tol))
        out.push_back(fmt::format("{} with {}", p.name, change));
    }
    if (!out.empty()) break;
  }
  return out;
}

}  // namespace lossguard::oracle
