// Split invariance (I5, SPEC §9): a contract's weights on every variation of the layout (DP,
// micro-batches, CP) compared run by run with those on the given one; `weights`'s verdict.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <future>
#include <optional>
#include <thread>

#include "core/errors.h"
#include "oracle/count/placement.h"
#include "oracle/count/token_placement.h"
#include "oracle/weights/weights.h"
#include "oracle/weights/weights_detail.h"

namespace lossguard::oracle {

using namespace weights_detail;

namespace {

// Every sample's value runs, kept: the base layout's are walked once per variation.
struct CachedRuns {
  std::vector<ValueRun> runs;
  std::vector<int64_t> first;  // [S + 1] sample i's runs are runs[first[i], first[i + 1])
};
CachedRuns cache_runs(const Batch& b, const LayoutWeights& w) {
  CachedRuns out;
  out.first.reserve(static_cast<std::size_t>(b.num_samples()) + 1);
  std::vector<OwnedRun> scratch;
  std::vector<ValueRun> one;
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    out.first.push_back(static_cast<int64_t>(out.runs.size()));
    value_runs(b, i, w, scratch, one);
    out.runs.insert(out.runs.end(), one.begin(), one.end());
  }
  out.first.push_back(static_cast<int64_t>(out.runs.size()));
  return out;
}

// The largest relative difference between the weights `ref` and `got` of one batch, token by
// token as a per-token comparison would find it (the first token of the greatest difference), and
// that token's coordinates on got's layout. -1: none differs.
double max_weight_difference(const Batch& b, const CachedRuns& ref, const LayoutWeights& got,
                             TokenCoord& worst_at) {
  double worst = -1.0;
  std::vector<OwnedRun> scratch;
  std::vector<ValueRun> rg;
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    const int64_t len = b.response_lengths[i];
    if (len == 0) continue;
    const ValueRun* ra_begin = ref.runs.data() + ref.first[i];
    const std::size_t ra_size = static_cast<std::size_t>(ref.first[i + 1] - ref.first[i]);
    struct View {
      const ValueRun* p;
      std::size_t n;
      std::size_t size() const { return n; }
      const ValueRun& operator[](std::size_t k) const { return p[k]; }
    } ra{ra_begin, ra_size};
    value_runs(b, i, got, scratch, rg);
    const uint8_t* mask = b.loss_mask.data() + b.response_offsets[i];
    std::size_t ka = 0, kg = 0;
    for (int64_t x = 0; x < len;) {
      // The value each side gives at x, and where that stops holding.
      while (ka < ra.size() && ra[ka].end <= x) ++ka;
      while (kg < rg.size() && rg[kg].end <= x) ++kg;
      int64_t y = len;
      double a = 0.0, c = 0.0;
      int16_t owner = -1;
      if (ka < ra.size()) {
        if (ra[ka].begin <= x) {
          a = ra[ka].value;
          y = std::min(y, ra[ka].end);
        } else {
          y = std::min(y, ra[ka].begin);
        }
      }
      if (kg < rg.size()) {
        if (rg[kg].begin <= x) {
          c = rg[kg].value;
          owner = rg[kg].owner;
          y = std::min(y, rg[kg].end);
        } else {
          y = std::min(y, rg[kg].begin);
        }
      }
      if (!(a == c && std::isfinite(a))) {
        int64_t t = x;
        while (t < y && mask[t] == 0) ++t;  // mask-0 tokens weigh 0 on both sides
        if (t < y) {
          const double rel = std::isfinite(a) && std::isfinite(c)
                                 ? std::fabs(a - c) / std::max(std::fabs(a), std::fabs(c))
                                 : INFINITY;  // an infinite or NaN weight differs from anything
          if (rel > worst) {
            worst = rel;
            TokenCoord coord;
            coord.sample = i;
            coord.response_index = t;
            const int32_t k = got.placed().slot[i].microbatch;
            if (k >= 0) {
              coord.dp_rank = got.layout->microbatches[k].dp_rank;
              coord.microbatch = got.layout->microbatches[k].index;
            }
            coord.cp_rank = owner;
            coord.got = c;
            coord.want = a;
            coord.ratio = a != 0.0 ? c / a : 0.0;
            worst_at = coord;
          }
        }
      }
      x = y;
    }
  }
  return worst;
}

}  // namespace

std::vector<InvarianceResult> check_split_invariance(const Batch& b, const StepLayout& base,
                                                     const Contract& contract,
                                                     const ObjectiveSizes& sizes, Split split,
                                                     const std::vector<double>& truth,
                                                     Variations vary,
                                                     const ContractWeights* base_weights) {
  TermInvariance term{&b, &contract, sizes, &truth, base_weights};
  return std::move(check_split_invariance_terms({term}, base, split, vary).front());
}

namespace {

// I5's reference for one term: its base layout's weights against the truth.
struct InvarianceReference {
  ContractWeights computed;
  const ContractWeights* weights = nullptr;
  int64_t true_count = 0;
  WeightDiagnosis diagnosis;
};

std::vector<InvarianceReference> invariance_references(const std::vector<TermInvariance>& terms,
                                                       const StepLayout& base) {
  std::vector<InvarianceReference> refs(terms.size());
  for (std::size_t k = 0; k < terms.size(); ++k) {
    const TermInvariance& t = terms[k];
    for (uint8_t m : t.batch->loss_mask) refs[k].true_count += m;
    if (t.base_diagnosis != nullptr) {
      refs[k].diagnosis = *t.base_diagnosis;
      continue;
    }
    if (t.base_weights == nullptr) {
      refs[k].computed = contract_weights(*t.batch, base, *t.contract, t.sizes);
      refs[k].weights = &refs[k].computed;
    } else {
      refs[k].weights = t.base_weights;
    }
    refs[k].diagnosis =
        t.truth_per_sample != nullptr
            ? summarize_weights(*t.batch, base, *t.contract, t.sizes, *t.truth_per_sample,
                                refs[k].true_count)
                  .diagnosis
            : diagnose_weights(*t.batch, refs[k].weights->weight, *t.truth, refs[k].weights->place,
                               base, refs[k].true_count, refs[k].weights->global_count);
  }
  return refs;
}

// One variation of the base layout: its DP, micro-batches per rank and CP.
struct InvarianceVariant {
  int64_t dp, m, cp;
  std::string label;
};

std::vector<InvarianceVariant> invariance_variants(const StepLayout& base, Variations vary) {
  const int64_t base_m = base.dp > 0 ? base.num_microbatches(0) : 1;
  std::vector<InvarianceVariant> variants;
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
  return variants;
}

// Only layouts the trainer can produce are compared (reported as skipped otherwise, with this
// reason; empty: compared): none that leaves a micro-batch without samples, and for a trainer that
// cuts equal micro-batches (TRL), none where DP x M does not divide the batch, nor
// (norm=generation:S) where M is not a multiple of S: the generation batch would reach into
// another optimizer step, which the dump does not hold.
std::string variant_skip_reason(const std::vector<TermInvariance>& terms, int64_t n,
                                const InvarianceVariant& v) {
  const int64_t cells = v.dp * v.m;
  if (cells > n) {
    return fmt::format("leaves micro-batches empty ({} samples over DP {} x {} micro-batches)", n,
                       v.dp, v.m);
  }
  for (const TermInvariance& t : terms) {
    if (t.contract->equal_microbatches && n % cells != 0) {
      return fmt::format(
          "a layout the trainer never builds: DP {} x {} micro-batches does not divide the {} "
          "samples into equal micro-batches",
          v.dp, v.m, n);
    }
    if (t.contract->norm == NormRule::kGeneration && v.m % t.contract->generation != 0) {
      return fmt::format(
          "a layout the trainer never builds within one step: {} micro-batches is not a "
          "multiple of the generation batch's S = {}",
          v.m, t.contract->generation);
    }
  }
  return {};
}

// The variation's static layout, with the base layout's TP, sharding and CP layout.
StepLayout variant_layout(int64_t num_samples, const StepLayout& base, const InvarianceVariant& v,
                          Split split) {
  StepLayout l =
      static_layout(place_samples(num_samples, v.dp, v.m, split), v.cp, base.tp, base.shard);
  l.cp_layout = base.cp_layout;
  l.allgather_pad = base.allgather_pad;
  return l;
}

// I5 as one plan: the terms' references and base layout's weights as runs (the same factors as
// base_weights), computed once and read by every variation.
class InvariancePlan {
 public:
  InvariancePlan(const std::vector<TermInvariance>& terms, const StepLayout& base, Split split)
      : terms_(terms),
        b0_(*terms.front().batch),
        base_(base),
        split_(split),
        refs_(invariance_references(terms, base)) {
    for (const TermInvariance& t : terms)
      masks_.push_back(term_masks(*t.batch, *t.contract, t.sizes));
    for (std::size_t k = 0; k < terms.size(); ++k)
      base_runs_.push_back(
          cache_runs(*terms[k].batch, layout_weights(*terms[k].batch, base, *terms[k].contract,
                                                     terms[k].sizes, masks_[k], nullptr)));
  }

  // One variation: its placement once; per term, its weights against the base layout's (as runs)
  // and, when they differ, token by token against the truth. Empty: a layout that cannot hold the
  // batch. Called from several threads at once.
  std::vector<InvarianceResult> evaluate(const InvarianceVariant& v) const {
    if (std::string why = variant_skip_reason(terms_, b0_.num_samples(), v); !why.empty()) {
      std::vector<InvarianceResult> out(terms_.size());
      for (InvarianceResult& res : out) {
        res.layout = {{"dp", v.dp}, {"cp", v.cp}, {"microbatches", v.m}};
        res.label = v.label;
        res.skipped = why;
        res.against_truth.kind = "not-run";
      }
      return out;
    }
    const StepLayout l = variant_layout(b0_.num_samples(), base_, v, split_);
    PlacedSamples slots;
    try {
      slots = place_sample_slots(b0_, l);
    } catch (const InputError&) {
      return {};  // a layout that cannot hold the batch (bshd, a short max length)
    }
    std::optional<PlacedTokens> placed;  // per token, only to diagnose a break
    std::vector<InvarianceResult> out;
    for (std::size_t k = 0; k < terms_.size(); ++k) {
      const TermInvariance& t = terms_[k];
      const Batch& b = *t.batch;
      InvarianceResult res;
      res.layout = {{"dp", v.dp}, {"cp", v.cp}, {"microbatches", v.m}};
      res.label = v.label;
      LayoutWeights w;
      try {
        w = layout_weights(b, l, *t.contract, t.sizes, masks_[k], &slots);
      } catch (const ScaleRangeError&) {
        throw;  // the contract's fault on every layout: exit 2, not a layout left out
      } catch (const InputError&) {
        return {};
      }
      const double worst = max_weight_difference(b, base_runs_[k], w, res.worst);
      res.max_rel_diff = std::max(worst, 0.0);
      res.ok = res.max_rel_diff <= kWeightRelTol;  // false for inf
      if (res.ok) {
        res.against_truth = refs_[k].diagnosis;
      } else if (t.diagnose_every_break && t.truth_per_sample != nullptr) {
        res.against_truth = diagnose_layout_weights(b, w, *t.truth_per_sample, refs_[k].true_count);
      } else if (t.diagnose_every_break) {
        if (!placed) placed = place_tokens(b0_, l);
        const ContractWeights cw = contract_weights(b, l, *t.contract, t.sizes, &*placed);
        res.against_truth = diagnose_weights(b, cw.weight, *t.truth, cw.place, l,
                                             refs_[k].true_count, cw.global_count);
      } else {
        res.against_truth.kind = "not-run";  // the first break is diagnosed later
      }
      out.push_back(std::move(res));
    }
    return out;
  }

  // Term k's diagnosis against the truth on variation v (a term that diagnoses only its first
  // break).
  WeightDiagnosis diagnose_break(std::size_t k, const InvarianceVariant& v) const {
    const TermInvariance& t = terms_[k];
    const StepLayout l = variant_layout(b0_.num_samples(), base_, v, split_);
    const Batch& b = *t.batch;
    if (t.truth_per_sample != nullptr) {
      return summarize_weights(b, l, *t.contract, t.sizes, *t.truth_per_sample, refs_[k].true_count)
          .diagnosis;
    }
    const ContractWeights w = contract_weights(b, l, *t.contract, t.sizes);
    return diagnose_weights(b, w.weight, *t.truth, w.place, l, refs_[k].true_count, w.global_count);
  }

 private:
  const std::vector<TermInvariance>& terms_;
  const Batch& b0_;
  const StepLayout& base_;
  Split split_;
  std::vector<InvarianceReference> refs_;
  std::vector<TermMasks> masks_;
  std::vector<CachedRuns> base_runs_;
};

// Every variation's results, in order. Variations are independent: a few at a time on their own
// threads (each holds a weight vector the size of the batch's response tokens per term).
std::vector<std::vector<InvarianceResult>> evaluate_variants(
    const InvariancePlan& plan, const std::vector<InvarianceVariant>& variants,
    int64_t response_tokens) {
  const std::size_t threads =
      response_tokens < (1 << 16)
          ? 1  // small batches: a thread costs more than the work
          : std::clamp<std::size_t>(std::thread::hardware_concurrency(), 1, 4);
  auto evaluate = [&plan](const InvarianceVariant& v) { return plan.evaluate(v); };
  std::vector<std::vector<InvarianceResult>> results(variants.size());
  for (std::size_t start = 0; start < variants.size(); start += threads) {
    std::vector<std::future<std::vector<InvarianceResult>>> running;
    for (std::size_t k = start; k < std::min(variants.size(), start + threads); ++k) {
      running.push_back(std::async(threads > 1 ? std::launch::async : std::launch::deferred,
                                   evaluate, std::cref(variants[k])));
    }
    for (std::size_t k = 0; k < running.size(); ++k) results[start + k] = running[k].get();
  }
  return results;
}

}  // namespace

// I5 as one plan: every variation placed once, every term weighed on it, threads over variations;
// then each term's results over the variations that hold the batch, and the first break of a term
// that diagnoses only that one.
std::vector<std::vector<InvarianceResult>> check_split_invariance_terms(
    const std::vector<TermInvariance>& terms, const StepLayout& base, Split split,
    Variations vary) {
  if (terms.empty()) return {};
  const Batch& b0 = *terms.front().batch;
  const InvariancePlan plan(terms, base, split);
  const std::vector<InvarianceVariant> variants = invariance_variants(base, vary);
  std::vector<std::vector<InvarianceResult>> results =
      evaluate_variants(plan, variants, b0.num_response_tokens());
  std::vector<std::vector<InvarianceResult>> out(terms.size());
  std::vector<const InvarianceVariant*> variant_of;  // of out[k][j], every k
  for (std::size_t v = 0; v < results.size(); ++v) {
    if (results[v].size() != terms.size()) continue;
    variant_of.push_back(&variants[v]);
    for (std::size_t k = 0; k < terms.size(); ++k) out[k].push_back(std::move(results[v][k]));
  }
  for (std::size_t k = 0; k < terms.size(); ++k) {
    if (terms[k].diagnose_every_break) continue;
    for (std::size_t j = 0; j < out[k].size(); ++j) {
      if (out[k][j].ok) continue;
      out[k][j].against_truth = plan.diagnose_break(k, *variant_of[j]);
      break;
    }
  }
  for (auto& term : out)
    for (InvarianceResult& r : term) r.summary = r.against_truth.summary();
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

}  // namespace lossguard::oracle
