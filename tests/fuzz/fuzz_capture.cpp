// libFuzzer target: audit (SPEC §10) on structure-aware captures. Each input builds a small valid
// step — a batch, a DP x CP layout (static or dynamic CP, zig-zag or all-gather), and one capture
// per loss rank whose token_weight is what a correct trainer records — then applies one mutation:
// a value (a weight scaled, inf, NaN, a grad_scale, a loss), a shape (a weight dropped or added),
// metadata (rank, world, reduce, global_batch_size), the layout (a sample held by two CP
// sub-groups, a micro-batch marked dummy). Half the steps also carry a declared loss term (SPEC
// §11: a KL-like term over the loss mask, shift:1, roll:1 or all, with a coefficient), recorded
// as a correct trainer records it; mutations of the term: a term weight off or not finite, the
// declaration lost, a term hook missing on a rank, a term record of the wrong length. Besides
// ASan and UBSan, it traps when audit passes a step with something planted wrong, or fails the
// unmutated correct step.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "core/batch.h"
#include "core/contract.h"
#include "core/errors.h"
#include "core/rank_capture.h"
#include "core/term.h"
#include "oracle/audit/audit.h"
#include "oracle/count/placement.h"
#include "oracle/count/token_placement.h"
#include "oracle/weights/weights.h"

namespace {

using namespace lossguard;

struct Step {
  Batch batch;
  StepLayout layout;
  std::vector<RankCapture> captures;
  bool with_term = false;
};

Step build_step(FuzzedDataProvider& in, Reduction reduce) {
  Step s;
  BatchBuilder b;
  b.begin_file("fuzz");
  const int samples = in.ConsumeIntegralInRange(1, 8);
  std::vector<HostArray> keep;
  keep.reserve(static_cast<std::size_t>(samples) * 2);
  for (int i = 0; i < samples; ++i) {
    const int64_t t = in.ConsumeIntegralInRange<int64_t>(1, 24);
    const int64_t r = in.ConsumeIntegralInRange<int64_t>(0, t);
    keep.push_back(HostArray::from_i64(DType::kInt64, {t}, std::vector<int64_t>(t, 3)));
    SampleFields f;
    f.tokens = &keep.back();
    f.response_length = r;
    std::vector<int64_t> mask(static_cast<std::size_t>(r));
    for (auto& m : mask) m = in.ConsumeIntegralInRange(0, 3) != 0;
    // An SFT sample's mask pre-shifted (SPEC §1): its last entry predicts nothing and no CP rank
    // owns it, so a correct trainer gives it no loss.
    if (r == t && r > 0) mask.back() = 0;
    keep.push_back(HostArray::from_i64(DType::kInt64, {r}, mask));
    f.loss_mask = &keep.back();
    b.add_sample(i, f);
  }
  s.batch = b.finish();
  const int64_t dp = in.ConsumeIntegralInRange<int64_t>(1, 3);
  const int64_t cp = int64_t{1} << in.ConsumeIntegralInRange(0, 2);
  const int64_t m = in.ConsumeIntegralInRange<int64_t>(1, 3);
  const Placement p = oracle::place_samples(samples, dp, m, Split::kContiguous);
  if (cp > 1 && in.ConsumeBool()) {
    s.layout = oracle::dynamic_cp_layout(s.batch.total_lengths, p, cp,
                                         in.ConsumeIntegralInRange<int64_t>(1, 30));
  } else {
    s.layout = static_layout(p, cp, 1, {});
  }
  s.layout.cp_layout =
      in.ConsumeIntegralInRange(0, 4) == 0 ? CpLayout::kAllgather : CpLayout::kZigzag;
  // (audit models the all-gather stream padded to 128 x cp x tp, the default, like this layout)
  // What a correct trainer records: each loss rank's owned tokens in local order, weighted w*.
  const std::vector<double> truth = oracle::true_weights(s.batch, reduce, {});
  const oracle::PlacedTokens placed = oracle::place_tokens(s.batch, s.layout);
  // A declared term, weighed as a correct trainer weighs it: coef x its own objective's w*.
  Term term;
  term.name = "kl";
  term.reduce = reduce;
  s.with_term = in.ConsumeBool();
  std::vector<double> term_truth;
  if (s.with_term) {
    const double coefs[] = {0.1, 1.0, 2.5, -0.01};
    term.coef = coefs[in.ConsumeIntegralInRange(0, 3)];
    const char* masks[] = {"loss", "shift:1", "roll:1", "all"};
    term.mask = parse_term_mask(masks[in.ConsumeIntegralInRange(0, 3)], "fuzz");
    term_truth =
        oracle::true_weights(with_mask(s.batch, term_mask(s.batch, term.mask)), reduce, {});
    for (double& w : term_truth) w *= term.coef;
  }
  for (int64_t d = 0; d < dp; ++d) {
    for (int64_t c = 0; c < cp; ++c) {
      RankCapture rc;
      rc.file = "rank" + std::to_string(d * cp + c);
      rc.rank = d * cp + c;
      rc.world_size = dp * cp;
      rc.cp = cp;
      rc.dp = dp;
      rc.cp_rank = c;
      rc.dp_rank = d;
      rc.cp_layout = s.layout.cp_layout;
      rc.reduce = std::string(mode_name(reduce));
      if (s.with_term) rc.terms.push_back(term);
      for (const MicroBatch& mb : s.layout.microbatches) {
        if (mb.dp_rank != d) continue;
        CapturedMicroBatch cm;
        cm.index = mb.index;
        cm.cp_size = mb.cp_size;
        const auto g = static_cast<std::size_t>(c / mb.cp_size);
        if (g < mb.groups.size()) {
          for (int64_t i : mb.groups[g]) {
            cm.sample_indices.push_back(i);
            cm.total_lengths.push_back(s.batch.total_lengths[i]);
            cm.response_lengths.push_back(s.batch.response_lengths[i]);
            for (int64_t k = 0; k < s.batch.total_lengths[i]; ++k) cm.tokens.push_back(3);
            for (int64_t t = s.batch.response_offsets[i]; t < s.batch.response_offsets[i + 1];
                 ++t) {
              cm.loss_masks.push_back(s.batch.loss_mask[t]);
              if (placed.place.owner[t] != c) continue;
              cm.token_weight.push_back(truth[t]);
              if (s.with_term) cm.terms["kl"].token_weight.push_back(term_truth[t]);
            }
          }
        }
        // a rank that owns nothing still hooks the term (an empty record), as the recorder writes
        if (s.with_term) cm.terms["kl"];
        rc.microbatches.push_back(std::move(cm));
      }
      s.captures.push_back(std::move(rc));
    }
  }
  return s;
}

// Whether the audit passed: no check failed and the weights are exact (a uniform scale is a pass
// only without --strict-scale, which is what `strict` mirrors).
// LOSSGUARD_FUZZ_VERBOSE=1 prints why (to replay a crash input by hand).
bool audit_passes(const std::vector<RankCapture>& captures, bool strict, bool match = false) {
  const bool verbose = std::getenv("LOSSGUARD_FUZZ_VERBOSE") != nullptr;
  oracle::AuditOptions opt;
  opt.strict_scale = strict;
  opt.match_presets = match;  // the preset search is most of the time; exercised 1 input in 64
  try {
    for (const auto& step : oracle::audit_captures(captures, opt).steps) {
      if (verbose && !step.failed) {
        for (const auto& c : step.checks)
          std::fprintf(stderr, "  (pass) %s: %s\n", c.name.c_str(), c.detail.c_str());
      }
      if (!step.failed) continue;
      if (verbose) {
        for (const auto& c : step.checks)
          std::fprintf(stderr, "  %s: %s\n", c.name.c_str(), c.detail.c_str());
        std::fprintf(stderr, "  diagnosis: %s\n", step.summary.c_str());
      }
      return false;
    }
    return true;
  } catch (const InputError& e) {
    if (verbose) std::fprintf(stderr, "  input error: %s\n", e.what());
    return false;
  } catch (const UnverifiedError& e) {
    if (verbose) std::fprintf(stderr, "  unverified: %s\n", e.what());
    return false;
  }
}

// A (rank, micro-batch, position) with an effective token's weight, if any: of the main term, or
// of the term `kl`.
double* first_weight(std::vector<RankCapture>& captures, FuzzedDataProvider& in,
                     bool of_term = false) {
  std::vector<double*> all;
  for (auto& c : captures) {
    for (auto& mb : c.microbatches) {
      if (of_term && !mb.terms.count("kl")) continue;
      for (double& w : of_term ? mb.terms["kl"].token_weight : mb.token_weight) {
        if (w != 0.0) all.push_back(&w);
      }
    }
  }
  if (all.empty()) return nullptr;
  return all[in.ConsumeIntegralInRange<std::size_t>(0, all.size() - 1)];
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const Reduction reduce = in.ConsumeBool() ? Reduction::kPerToken : Reduction::kSampleMean;
  Step s;
  try {
    s = build_step(in, reduce);
  } catch (const InputError&) {
    return 0;  // a layout that cannot hold the batch
  }
  // The correct step passes (strictly: its weights are exact).
  if (!audit_passes(s.captures, true)) __builtin_trap();

  const int mutation = in.ConsumeIntegralInRange(0, 16);
  std::vector<RankCapture> c = s.captures;
  bool planted_wrong = true;  // the mutation makes the step wrong: audit must not pass it
  bool strict = false;        // judged as with --strict-scale (a lone token's error is a "scale")
  switch (mutation) {
    case 0: {  // one weight off by a relative error the float32 tolerance (1e-5) must see
      double* w = first_weight(c, in);
      if (w == nullptr) return 0;
      *w *= 1.0 + in.ConsumeFloatingPointInRange(1e-3, 10.0) * (in.ConsumeBool() ? 1 : -0.09);
      strict = true;
      break;
    }
    case 1: {  // a non-finite weight
      double* w = first_weight(c, in);
      if (w == nullptr) return 0;
      const double bad[] = {INFINITY, -INFINITY, NAN, 1e300 * 1e300};
      *w = bad[in.ConsumeIntegralInRange(0, 3)];
      break;
    }
    case 2: {  // a grad_scale: non-finite or zero always wrong; another number wrong strictly
      const double bad[] = {INFINITY, NAN, 0.0, 2.0, 0.5};
      const int k = in.ConsumeIntegralInRange(0, 4);
      for (auto& r : c) r.grad_scale = bad[k];
      if (first_weight(c, in) == nullptr && k >= 2) return 0;  // nothing weighted to scale
      if (k >= 3 && audit_passes(c, true)) __builtin_trap();   // a scale fails --strict-scale
      planted_wrong = k < 3;
      break;
    }
    case 3: {  // a micro-batch loss or a token loss that is not finite
      auto& r = c[in.ConsumeIntegralInRange<std::size_t>(0, c.size() - 1)];
      if (r.microbatches.empty() || r.microbatches.front().token_weight.empty()) return 0;
      auto& mb = r.microbatches.front();
      mb.token_loss = std::vector<double>(mb.token_weight.size(), 1.0);
      double sum = 0.0;
      for (double w : mb.token_weight) sum += w;
      mb.loss = sum;
      if (in.ConsumeBool()) {
        mb.loss = INFINITY;
      } else {
        (*mb.token_loss)[0] = in.ConsumeBool() ? INFINITY : NAN;
      }
      break;
    }
    case 4: {  // a weight dropped or added: the shape no longer fits the rank's tokens
      auto& r = c[in.ConsumeIntegralInRange<std::size_t>(0, c.size() - 1)];
      if (r.microbatches.empty()) return 0;
      auto& w = r.microbatches.front().token_weight;
      if (in.ConsumeBool() && !w.empty()) {
        w.pop_back();
      } else {
        w.push_back(0.0);
      }
      break;
    }
    case 5: {  // metadata that contradicts itself or another rank
      auto& r = c[in.ConsumeIntegralInRange<std::size_t>(0, c.size() - 1)];
      switch (in.ConsumeIntegralInRange(0, 3)) {
        case 0:
          r.rank = r.world_size + in.ConsumeIntegralInRange<int64_t>(0, 100);
          break;
        case 1:
          r.world_size += 1;
          break;
        case 2:
          if (c.size() < 2) return 0;
          r.reduce = reduce == Reduction::kPerToken ? "sample-mean" : "per-token";
          break;
        default:
          r.global_batch_size = s.batch.num_samples() + in.ConsumeIntegralInRange<int64_t>(1, 4);
          break;
      }
      break;
    }
    case 6: {  // a sample held twice: copied into another CP sub-group or micro-batch
      if (c.size() < 2) return 0;
      auto& a = c[in.ConsumeIntegralInRange<std::size_t>(0, c.size() - 1)];
      auto& b = c[in.ConsumeIntegralInRange<std::size_t>(0, c.size() - 1)];
      if (&a == &b || a.microbatches.empty() || b.microbatches.empty()) return 0;
      auto& from = a.microbatches.front();
      auto& to = b.microbatches.front();
      if (from.sample_indices.empty()) return 0;
      to.sample_indices.push_back(from.sample_indices.front());
      to.total_lengths.push_back(from.total_lengths.front());
      to.response_lengths.push_back(from.response_lengths.front());
      for (int64_t k = 0; k < from.total_lengths.front(); ++k) to.tokens.push_back(3);
      for (int64_t k = 0; k < from.response_lengths.front(); ++k)
        to.loss_masks.push_back(from.loss_masks[static_cast<std::size_t>(k)]);
      // and, at times, weights for whatever it would own there
      const int64_t extra = in.ConsumeIntegralInRange<int64_t>(0, from.response_lengths.front());
      for (int64_t k = 0; k < extra; ++k) to.token_weight.push_back(1.0);
      break;
    }
    case 7: {  // a real micro-batch marked dummy on every CP rank of its DP rank
      auto& r = c[in.ConsumeIntegralInRange<std::size_t>(0, c.size() - 1)];
      if (r.microbatches.empty()) return 0;
      const std::size_t k = in.ConsumeIntegralInRange<std::size_t>(0, r.microbatches.size() - 1);
      int64_t effective = 0;
      for (auto& q : c) {
        if (q.dp_rank != r.dp_rank) continue;
        for (uint8_t m : q.microbatches[k].loss_masks) effective += m;
        q.microbatches[k].dummy = true;
      }
      planted_wrong = effective > 0;
      break;
    }
    case 8: {  // every weight scaled to zero: a trainer that applies no gradient
      bool any = false;
      for (auto& r : c) {
        for (auto& mb : r.microbatches) {
          for (double& w : mb.token_weight) {
            any |= w != 0.0;
            w = 0.0;
          }
        }
      }
      if (!any) return 0;
      break;
    }
    case 9: {  // a capture dropped: a rank missing
      if (c.size() < 2) return 0;
      c.erase(c.begin() + in.ConsumeIntegralInRange<std::size_t>(0, c.size() - 1));
      break;
    }
    case 10: {  // a CP size that does not fit
      auto& r = c[in.ConsumeIntegralInRange<std::size_t>(0, c.size() - 1)];
      if (r.microbatches.empty()) return 0;
      r.microbatches.front().cp_size = in.ConsumeIntegralInRange<int64_t>(-2, 9);
      planted_wrong = r.microbatches.front().cp_size != s.layout.microbatches.front().cp_size;
      if (!planted_wrong) return 0;
      break;
    }
    case 12: {  // one term weight off: the term's balance against main changed
      double* w = first_weight(c, in, true);
      if (w == nullptr) return 0;
      *w *= 1.0 + in.ConsumeFloatingPointInRange(1e-3, 10.0) * (in.ConsumeBool() ? 1 : -0.09);
      break;
    }
    case 13: {  // a non-finite term weight
      double* w = first_weight(c, in, true);
      if (w == nullptr) return 0;
      *w = in.ConsumeBool() ? INFINITY : NAN;
      break;
    }
    case 14: {  // the term's declaration lost while it still weighs something
      if (!s.with_term || first_weight(c, in, true) == nullptr) return 0;
      for (auto& r : c) r.terms.clear();
      break;
    }
    case 15: {  // a rank that owns term tokens did not hook the term: their gradient is dropped
      if (!s.with_term) return 0;
      bool dropped = false;
      for (auto& r : c) {
        for (auto& mb : r.microbatches) {
          auto it = mb.terms.find("kl");
          if (dropped || it == mb.terms.end()) continue;
          const bool weighs =
              std::any_of(it->second.token_weight.begin(), it->second.token_weight.end(),
                          [](double x) { return x != 0.0; });
          if (!weighs) continue;
          mb.terms.erase(it);
          dropped = true;
        }
      }
      if (!dropped) return 0;
      // Dropped from the only micro-batch that hooked it: a declared term no rank hooked is
      // "not run" (SPEC §11), never passed.
      bool still_hooked = false;
      for (auto& r : c) {
        for (auto& mb : r.microbatches) still_hooked |= mb.terms.count("kl") > 0;
      }
      if (!still_hooked) {
        try {
          for (const auto& step : oracle::audit_captures(c, {}).steps) {
            for (const auto& check : step.checks) {
              if (check.name == "kl.weights" && check.ok.has_value()) __builtin_trap();
            }
          }
        } catch (const InputError&) {
        }
        planted_wrong = false;
      }
      break;
    }
    case 16: {  // a term record of the wrong length
      if (!s.with_term) return 0;
      auto& r = c[in.ConsumeIntegralInRange<std::size_t>(0, c.size() - 1)];
      if (r.microbatches.empty()) return 0;
      auto& w = r.microbatches.front().terms["kl"].token_weight;
      if (in.ConsumeBool() && !w.empty()) {
        w.pop_back();
      } else {
        w.push_back(0.0);
      }
      break;
    }
    default: {  // a harmless change: a grad_norm and a decision that agree with the step
      int64_t n = 0;
      for (uint8_t m : s.batch.loss_mask) n += m;
      for (auto& r : c) {
        r.skipped = n == 0;
        r.grad_norm = n == 0 ? 0.0 : 1.5;
      }
      planted_wrong = false;
      break;
    }
  }
  const bool passes = audit_passes(c, strict, in.ConsumeIntegralInRange(0, 63) == 0);
  if (std::getenv("LOSSGUARD_FUZZ_VERBOSE") != nullptr) {
    std::fprintf(stderr, "mutation %d (term: %d): planted wrong %d, audit passes %d\n", mutation,
                 s.with_term ? 1 : 0, planted_wrong ? 1 : 0, passes ? 1 : 0);
  }
  if (planted_wrong && passes) __builtin_trap();
  if (!planted_wrong && !passes && (mutation == 11 || mutation == 15)) __builtin_trap();
  return 0;
}
