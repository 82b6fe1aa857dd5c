// `count`'s result: the counts, the sample classes the report lists, and the verdict.
#include "oracle/count/count_result.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

#include "core/errors.h"

namespace lossguard::oracle {

CountSizes count_sizes(std::vector<int64_t> requested) {
  require_sizes_at_least_1("--cp", requested);
  std::sort(requested.begin(), requested.end());
  requested.erase(std::unique(requested.begin(), requested.end()), requested.end());
  CountSizes s;
  s.cp1_requested = !requested.empty() && requested.front() == 1;
  if (!s.cp1_requested) requested.insert(requested.begin(), 1);
  s.cp_sizes = std::move(requested);
  return s;
}

Judgement CountResult::judgement() const {
  return verified() ? Judgement::verified(!ok()) : Judgement::nothing_verified(kNoSamplesReason);
}

bool CountResult::ok() const {
  return std::all_of(invariants.begin(), invariants.end(),
                     [](const InvariantResult& inv) { return inv.ok; });
}

CountResult evaluate_count(const Batch& b, const CountRequest& request) {
  CountResult r;
  r.policy = request.policy;
  r.sizes = request.sizes;
  const std::vector<int64_t>& cps = r.sizes.cp_sizes;
  std::vector<std::string> placement_problems;
  if (!request.step_layouts.empty()) {
    r.counts = count_owned_tokens(b, request.step_layouts, &placement_problems);
  } else {
    r.counts = count_owned_tokens(b, cps, request.layout);
    if (request.placement != nullptr)
      placement_problems = oracle::placement_problems(*request.placement, b.num_samples());
  }
  r.invariants = check_invariants(b, r.counts, r.policy, request.layout, request.placement);
  for (auto& inv : r.invariants) {
    if (inv.name != "I3" || placement_problems.empty()) continue;
    inv.ok = false;
    inv.detail =
        fmt::format("the placement is not a partition: {}", fmt::join(placement_problems, "; "));
  }
  const std::size_t n = r.counts.samples.size();
  r.classes.reserve(n);
  r.straddles.assign(n, 0);
  for (std::size_t k = 0; k < n; ++k) {
    const int64_t i = r.counts.samples[k];
    const SampleClass c = b.classify(i, r.counts.mask_sums[k]);
    if (c.why_empty == NoTokenReason::kEmptyResponse) r.empty.push_back(i);
    if (c.why_empty == NoTokenReason::kFullyMasked) r.fully_masked.push_back(i);
    if (c.sft) r.sft.push_back(i);
    r.classes.push_back(c);
    for (std::size_t c = 0; c < cps.size() && !r.straddles[k]; ++c) {
      int64_t ranks_with_tokens = 0;
      for (int64_t rank = 0; rank < cps[c]; ++rank)
        ranks_with_tokens += r.counts.count(c, k, rank) > 0;
      r.straddles[k] = ranks_with_tokens > 1;
    }
    if (r.straddles[k]) r.straddling.push_back(i);
  }
  for (std::size_t c = 0; c < cps.size(); ++c)
    r.denominators.push_back(global_denominator(r.policy, r.counts, c));
  r.findings = batch_findings(b);
  return r;
}

}  // namespace lossguard::oracle
