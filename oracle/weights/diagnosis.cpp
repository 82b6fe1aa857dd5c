// The diagnosis of weights against the truth (SPEC §9 "Diagnosis"): their spans, the ladder from
// exact to mixed, the shard table and the one-line summary, from per-token vectors or from a
// contract's owner runs (summarize_weights).
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "oracle/count/token_placement.h"
#include "oracle/weights/weights.h"
#include "oracle/weights/weights_detail.h"

namespace lossguard::oracle {

using namespace weights_detail;

namespace {

// Equal within a relative tolerance; a non-finite value equals nothing (inf - inf is no
// difference to a relative test: |inf - 1| <= tol * inf holds, and a gate must not pass it).
bool same(double a, double b, double tol = kWeightRelTol) {
  if (!std::isfinite(a) || !std::isfinite(b)) return false;
  return std::fabs(a - b) <= tol * std::max(std::fabs(a), std::fabs(b));
}

}  // namespace

namespace weights_detail {

bool same_weights(const std::vector<double>& a, const std::vector<double>& b, double tol) {
  for (std::size_t t = 0; t < a.size(); ++t) {
    if (!same(a[t], b[t], tol)) return false;
  }
  return true;
}

}  // namespace weights_detail

namespace {

// Consecutive tokens of one sample sharing (w, w*) and their owner: the unit the diagnosis and the
// shard table read. Tokens with w = w* = 0 (masked, unweighted) are in no span.
struct WeightSpan {
  int64_t sample = 0, token = 0, tokens = 0;  // token: the first one's index in [sum R]
  double got = 0.0, want = 0.0;
  int16_t owner = -1;
};

// The spans of per-token vectors, walked anew on each call (a measured weight vector may hold a
// span per token: tens of millions, not to be stored). each(f) calls f(span) in token order until
// f returns false.
struct TokenSpans {
  const Batch& b;
  const std::vector<double>& got;
  const std::vector<double>& want;
  const TokenPlace& place;
  template <class F>
  void each(F&& f) const {
    for (int64_t i = 0; i < b.num_samples(); ++i) {
      WeightSpan cur;
      bool open = false;
      for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
        if (got[t] == 0.0 && want[t] == 0.0) continue;  // in no span; the next may continue it
        const int16_t o = place.owner.empty() ? int16_t{-1} : place.owner[t];
        if (open && cur.got == got[t] && cur.want == want[t] && cur.owner == o) {
          ++cur.tokens;
          continue;
        }
        if (open && !f(static_cast<const WeightSpan&>(cur))) return;
        cur.sample = i;
        cur.token = t;
        cur.tokens = 1;
        cur.got = got[t];
        cur.want = want[t];
        cur.owner = o;
        open = true;
      }
      if (open && !f(static_cast<const WeightSpan&>(cur))) return;
    }
  }
};

// Spans kept in a vector (from owner runs: a few per sample).
struct StoredSpans {
  const std::vector<WeightSpan>& spans;
  template <class F>
  void each(F&& f) const {
    for (const WeightSpan& sp : spans) {
      if (!f(sp)) return;
    }
  }
};

TokenCoord coord_of_span(const Batch& b, const WeightSpan& sp,
                         const std::vector<int32_t>& sample_microbatch, const StepLayout& l) {
  TokenCoord c;
  c.sample = sp.sample;
  c.response_index = sp.token - b.response_offsets[sp.sample];
  const int32_t k = sample_microbatch.empty() ? -1 : sample_microbatch[sp.sample];
  if (k >= 0) {
    c.dp_rank = l.microbatches[k].dp_rank;
    c.microbatch = l.microbatches[k].index;
  }
  c.cp_rank = sp.owner;
  c.got = sp.got;
  c.want = sp.want;
  c.ratio = sp.want != 0.0 ? sp.got / sp.want : 0.0;
  return c;
}

std::string scale_problem(double scale) {
  if (!(scale > 0.0) || !std::isfinite(scale)) return "not a positive finite factor";
  if (scale < kHiddenScaleMin) {
    return fmt::format(
        "too small for Adam to hide: gradients ×{:.3g} are Adam with eps ×{:.3g} (eps/s), which "
        "shrinks or stops the update (hidden only for 2^-10 <= s <= 2^64; docs/semantics.md §9)",
        scale, 1.0 / scale);
  }
  if (scale > kHiddenScaleMax) {
    return fmt::format(
        "too large for a trainer's arithmetic: losses and gradients ×{:.3g} overflow float16 and "
        "leave float32/bfloat16 a few powers of ten from inf (hidden only for 2^-10 <= s <= 2^64; "
        "docs/semantics.md §9)",
        scale);
  }
  return {};
}

// Long: the diagnosis ladder in SPEC §9's order (non-finite, masked, uniform, per-rank,
// per-micro-batch, per-CP-shard, per-sample, mixed); each rung is tried only when the ones before
// fail, over the same spans.
template <class Spans>
WeightDiagnosis diagnose_spans(const Batch& b, const Spans& spans,
                               const std::vector<int32_t>& sample_microbatch, const StepLayout& l,
                               int64_t true_count, int64_t contract_count, double tol,
                               ScaleContext ctx) {
  WeightDiagnosis dg;
  if (ctx.global_tokens == 0) ctx.global_tokens = true_count;
  const int64_t s = b.num_samples();
  // Non-finite weights first: every later test is a comparison, and comparisons with inf or NaN
  // answer whatever their form happens to give.
  spans.each([&](const WeightSpan& sp) {
    if (std::isfinite(sp.got) && std::isfinite(sp.want)) return true;
    if (dg.non_finite == 0) dg.worst = coord_of_span(b, sp, sample_microbatch, l);
    dg.non_finite += sp.tokens;
    return true;
  });
  if (dg.non_finite > 0) {
    dg.kind = "non-finite";
    dg.min_ratio = dg.max_ratio = NAN;
    return dg;
  }
  double worst_log = -1.0;
  bool first = true;
  double r0 = 1.0;
  bool uniform = true;
  spans.each([&](const WeightSpan& sp) {
    if (sp.want == 0.0) {  // w != 0 here: a masked token that carries weight
      if (dg.masked_weighted == 0) dg.worst = coord_of_span(b, sp, sample_microbatch, l);
      dg.masked_weighted += sp.tokens;
      return true;
    }
    dg.tokens += sp.tokens;
    const double r = sp.got / sp.want;
    if (!same(r, 1.0, tol)) dg.mismatched += sp.tokens;
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
      dg.worst = coord_of_span(b, sp, sample_microbatch, l);
    }
    return true;
  });
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
  if (uniform && r0 < 0.0) {
    dg.kind = "negative-scale";  // the optimizer climbs the loss: no optimizer hides a sign
    dg.scale = r0;
    return dg;
  }
  if (uniform) {
    // Nc = sum_i max(d_i, 1), counted only here: the one rung that names a ratio by it (a pass over
    // the masks, not on every diagnosis I5 makes)
    if (ctx.clamped_tokens == 0) {
      for (int64_t i = 0; i < b.num_samples(); ++i) {
        int64_t d = 0;
        for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t)
          d += b.loss_mask[t];
        ctx.clamped_tokens += std::max<int64_t>(d, 1);
      }
    }
    dg.kind = "uniform-scale";
    dg.scale = r0;
    dg.scale_problem = scale_problem(r0);
    const ScaleName name = name_scale(r0, l, ctx, tol);
    dg.named = name.text();
    dg.layout_dependent = name.layout_dependent;
    dg.same_step = name.same_step;
    dg.declared = name.declared;
    if (!dg.layout_dependent && dg.declared.empty() && contract_count > 0 &&
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
    return sample_microbatch.empty() ? -1 : sample_microbatch[i];
  };
  const int64_t num_mb = static_cast<int64_t>(l.microbatches.size());
  // Each CP rank's effective tokens of each micro-batch (the per-CP-shard formula's own count).
  auto shard_tokens = [&] {
    std::vector<double> out(static_cast<std::size_t>(num_mb * cp), 0.0);
    spans.each([&](const WeightSpan& sp) {
      const int64_t k = mb_of(sp.sample);
      if (k >= 0 && sp.owner >= 0 && sp.owner < cp && sp.want != 0.0)
        out[k * cp + sp.owner] += sp.tokens;
      return true;
    });
    return out;
  };
  // Whether r is constant within every unit key(sample, owner); on success the worst token's
  // unit size.
  auto constant_within = [&](const char* kind, int64_t count, auto key) {
    std::vector<double> ratio(static_cast<std::size_t>(count), NAN);
    std::vector<int64_t> tokens(static_cast<std::size_t>(count), 0);
    bool constant = true;
    spans.each([&](const WeightSpan& sp) {
      const int64_t k = key(sp.sample, sp.owner);
      if (k < 0) return constant = false;
      const double r = sp.got / sp.want;
      if (std::isnan(ratio[k])) {
        ratio[k] = r;
      } else if (!same(ratio[k], r, tol)) {
        return constant = false;
      }
      tokens[k] += sp.tokens;
      return true;
    });
    if (!constant) return false;
    dg.kind = kind;
    const int64_t k = key(dg.worst.sample, static_cast<int16_t>(dg.worst.cp_rank));
    dg.worst.unit_tokens = k >= 0 ? tokens[k] : 0;
    const UnitFactor f = name_unit_factor(
        b, sample_microbatch,
        std::string(kind) == "per-cp-shard" ? shard_tokens() : std::vector<double>{}, l, kind,
        ratio, k, ctx, tol);
    dg.factor = f.formula;
    dg.advice = f.advice;
    return true;
  };
  if (constant_within("per-rank", l.dp, [&](int64_t i, int16_t) {
        const int64_t k = mb_of(i);
        return k < 0 ? int64_t{-1} : l.microbatches[k].dp_rank;
      })) {
    return dg;
  }
  if (constant_within("per-microbatch", num_mb, [&](int64_t i, int16_t) { return mb_of(i); })) {
    return dg;
  }
  if (constant_within("per-cp-shard", num_mb * cp, [&](int64_t i, int16_t o) {
        const int64_t k = mb_of(i);
        return k < 0 || o < 0 ? int64_t{-1} : k * cp + o;
      })) {
    return dg;
  }
  if (constant_within("per-sample", s, [&](int64_t i, int16_t) { return i; })) return dg;
  dg.kind = "mixed";
  return dg;
}

template <class Spans>
std::vector<ShardRatio> shard_ratios_of_spans(const Spans& spans,
                                              const std::vector<int32_t>& sample_microbatch,
                                              const StepLayout& l) {
  std::vector<ShardRatio> out(l.microbatches.size() * static_cast<std::size_t>(l.cp));
  spans.each([&](const WeightSpan& sp) {
    const int32_t k = sample_microbatch[sp.sample];
    if (k < 0 || sp.owner < 0) return true;
    ShardRatio& sr = out[static_cast<std::size_t>(k) * l.cp + sp.owner];
    if (sp.want == 0.0) {
      sr.masked_weighted += sp.tokens;  // w != 0: spans leave out w = w* = 0
      return true;
    }
    const double r = sp.got / sp.want;
    sr.min_ratio = sr.tokens == 0 ? r : std::min(sr.min_ratio, r);
    sr.max_ratio = sr.tokens == 0 ? r : std::max(sr.max_ratio, r);
    sr.tokens += sp.tokens;
    return true;
  });
  return out;
}

}  // namespace

WeightDiagnosis diagnose_weights(const Batch& b, const std::vector<double>& got,
                                 const std::vector<double>& want, const TokenPlace& place,
                                 const StepLayout& l, int64_t true_count, int64_t contract_count,
                                 double tol, const ScaleContext& scale) {
  return diagnose_spans(b, TokenSpans{b, got, want, place}, place.sample_microbatch, l, true_count,
                        contract_count, tol, scale);
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
  if (kind == "negative-scale") {
    return fmt::format(
        "uniform scale ×{:.6g}: every weight has the wrong sign: the optimizer climbs the loss "
        "(gradient ascent) on all {} effective tokens",
        scale, tokens);
  }
  if (kind == "uniform-scale") {
    // 1/tp: the count (or the mean) spans the tensor-parallel replicas, which hold the same
    // tokens: TP ranks counted as data-parallel ranks (SPEC §10; transformers #39674's shape).
    const bool tp_named = (" or " + named + " or ").find(" or 1/tp or ") != std::string::npos;
    const std::string replicas =
        !tp_named ? std::string()
                  : fmt::format(
                        " ({}tensor-parallel replicas counted as data-parallel ranks, a count "
                        "or mean over the whole world)",
                        named == "1/tp" ? "" : "if 1/tp, ");
    if (layout_dependent) {
      return fmt::format(
          "uniform scale ×{:.6g} = {}{}: {}; a scale the layout sets is not hidden by Adam "
          "(clipping, weight decay and the logged loss see it: docs/semantics.md §9){}",
          scale, named, replicas, same_step, scale_problem.empty() ? "" : "; " + scale_problem);
    }
    if (!declared.empty()) {
      return fmt::format(
          "uniform scale ×{:.6g} = the trainer's declared {}{}: every token's weight is off by "
          "that constant{}",
          scale, declared, named.empty() ? "" : fmt::format(" (also {})", named),
          scale_problem.empty() ? "" : "; " + scale_problem);
    }
    return fmt::format(
        "uniform scale ×{:.6g}{}{}: every token's weight is off by the same factor{}", scale,
        named.empty() ? "" : fmt::format(" = {}", named), replicas,
        scale_problem.empty() ? "" : "; " + scale_problem);
  }
  std::string unit = kind == "per-rank"         ? "per-DP-rank"
                     : kind == "per-microbatch" ? "per-micro-batch"
                     : kind == "per-cp-shard"   ? "per-CP-shard"
                     : kind == "per-sample"     ? "per-sample"
                                                : "mixed";
  return fmt::format(
      "{} normalisation: weights range {:.3g}× to {:.3g}× of the truth on {} of {} tokens; worst: "
      "{}, {:.6g}× ({} token(s) in that unit){}",
      unit, min_ratio, max_ratio, mismatched, tokens, where(), worst.ratio, worst.unit_tokens,
      factor.empty() ? "" : fmt::format("; w/w* = {} in every unit", factor));
}

std::vector<ShardRatio> shard_ratios(const Batch& b, const std::vector<double>& got,
                                     const std::vector<double>& want, const TokenPlace& place,
                                     const StepLayout& l) {
  return shard_ratios_of_spans(TokenSpans{b, got, want, place}, place.sample_microbatch, l);
}

namespace {

// The spans of a contract's weights on a layout against the truth (one weight per sample on its
// mask-1 tokens), from its owner runs: per run or gap, its mask-1 tokens.
std::vector<WeightSpan> spans_of_layout(const Batch& b, const LayoutWeights& w,
                                        const std::vector<double>& truth_per_sample) {
  std::vector<WeightSpan> out;
  std::vector<OwnedRun> scratch;
  std::vector<ValueRun> runs;
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    const int64_t off = b.response_offsets[i], len = b.response_lengths[i];
    const double want = truth_per_sample[i];
    const uint8_t* mask = b.loss_mask.data() + off;
    auto emit = [&](int64_t x, int64_t y, double got, int16_t owner) {
      int64_t first = -1, n = 0;
      for (int64_t t = x; t < y; ++t) {
        if (mask[t] != 0 && first < 0) first = t;
        n += mask[t] != 0;
      }
      if (n == 0 || (got == 0.0 && want == 0.0)) return;
      out.push_back({i, off + first, n, got, want, owner});
    };
    value_runs(b, i, w, scratch, runs);
    int64_t x = 0;
    for (const ValueRun& r : runs) {
      if (r.begin > x) emit(x, r.begin, 0.0, -1);  // owned by no rank: no weight
      emit(r.begin, r.end, r.value, r.owner);
      x = r.end;
    }
    if (x < len) emit(x, len, 0.0, -1);
  }
  return out;
}

std::vector<int32_t> sample_microbatches(const PlacedSamples& placed) {
  std::vector<int32_t> out(placed.slot.size());
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = placed.slot[i].microbatch;
  return out;
}

}  // namespace

namespace weights_detail {

WeightDiagnosis diagnose_layout_weights(const Batch& b, const LayoutWeights& w,
                                        const std::vector<double>& truth_per_sample,
                                        int64_t true_count) {
  return diagnose_spans(b, StoredSpans{spans_of_layout(b, w, truth_per_sample)},
                        sample_microbatches(w.placed()), *w.layout, true_count,
                        w.factors.global_count, kWeightRelTol, ScaleContext{});
}

}  // namespace weights_detail

WeightsSummary summarize_weights(const Batch& b, const StepLayout& l, const Contract& contract,
                                 const ObjectiveSizes& sizes,
                                 const std::vector<double>& truth_per_sample, int64_t true_count,
                                 const ScaleContext& scale) {
  const TermMasks masks = term_masks(b, contract, sizes);
  const LayoutWeights w = layout_weights(b, l, contract, sizes, masks, nullptr);
  const std::vector<WeightSpan> spans = spans_of_layout(b, w, truth_per_sample);
  const std::vector<int32_t> mbs = sample_microbatches(w.placed());
  WeightsSummary out;
  out.diagnosis = diagnose_spans(b, StoredSpans{spans}, mbs, l, true_count, w.factors.global_count,
                                 kWeightRelTol, scale);
  out.shards = shard_ratios_of_spans(StoredSpans{spans}, mbs, l);
  out.global_count = w.factors.global_count;
  out.problems = w.placed().problems;
  return out;
}

}  // namespace lossguard::oracle
