// What a ratio r = w / w* equals, in the trainer's terms (SPEC §9 "Diagnosis"): a uniform scale as
// a product of the layout's sizes (and whether the layout moves it: the founding bug), and a ratio
// that is constant per DP rank, micro-batch, CP shard or sample as one formula over that unit's own
// counts ("1/n: divided by its own 24 tokens, then by N = 240"). Plain arithmetic over the batch's
// masks and the placement; the diagnosis (diagnosis.cpp) picks the unit the ratio is constant in.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/batch.h"
#include "core/layout.h"
#include "core/modes.h"

namespace lossguard::oracle {

// What a ratio may be named by besides the layout: the step's sizes, the objective (for the
// sentence that says what to divide by), the constant scales the trainer declares (a loss
// coefficient: where one equals a layout product, it decides), and where its loss is computed.
struct ScaleContext {
  int64_t pp = 1;             // pipeline stages (StepLayout has no PP: weights do not move)
  int64_t global_batch = 0;   // B in samples; 0: unknown
  int64_t global_tokens = 0;  // N, the objective's effective tokens; 0: unknown
  // Nc = sum_i max(d_i, 1): the count with each sample clamped at 1 (slime's clamp_min); 0:
  // unknown. N/Nc is a constant of the batch: (N/Nc)/cp names slime's missing ×cp on a batch with
  // empty samples.
  int64_t clamped_tokens = 0;
  Reduction reduce = Reduction::kPerToken;
  bool reduce_known = false;  // the objective is known: the sentence names its divisor
  std::vector<std::pair<std::string, double>> declared;  // "loss_scale" -> 0.5
  std::string loss_site;  // "megatron/core/...: loss_func" (capture metadata loss_site)
};

// A uniform scale named as a product of sizes.
struct ScaleName {
  std::vector<std::string> products;  // the cheapest products equal to r: "1/cp", "dp*cp", "1/B"
  bool layout_dependent = false;      // some product holds cp, dp, tp, pp or M
  std::string declared;               // the declared scale equal to r: "loss_scale = 0.5"
  // "the same step at CP = 1 applies ×2 this update" for the first layout-dependent product.
  std::string same_step;
  std::string text() const;  // products joined by " or "
};

// r named over cp, dp, tp, pp, M (the layout: the update moves with them) and B, N, N/Nc (the
// step's: the same under every layout). A size of 1 names nothing. Cheapest products first (at most
// four factors), every product of that cost listed.
ScaleName name_scale(double r, const StepLayout& layout, const ScaleContext& ctx, double tol);

// A ratio constant within each unit of a diagnosis kind (per-rank, per-microbatch, per-cp-shard,
// per-sample), named as one formula over the unit's own counts and the step's sizes.
struct UnitFactor {
  std::string formula;  // "1/n", "N/(M*n)"; "" when no formula of at most four factors fits
  std::string advice;   // for the worst unit: "micro-batch 0 of DP rank 0 is divided by ..."
};

// unit_ratio[u]: the ratio of unit u (NaN: the unit holds no effective token); units as the
// diagnosis numbers them: DP rank, index into layout.microbatches, micro-batch * cp + CP rank, or
// sample. worst: the unit of the worst token. sample_microbatch [S]: each sample's micro-batch (-1:
// none); shard_tokens [microbatches * cp]: each CP rank's effective tokens of each micro-batch
// (needed for per-cp-shard only).
UnitFactor name_unit_factor(const Batch& batch, const std::vector<int32_t>& sample_microbatch,
                            const std::vector<double>& shard_tokens, const StepLayout& layout,
                            const std::string& kind, const std::vector<double>& unit_ratio,
                            int64_t worst, const ScaleContext& ctx, double tol);

}  // namespace lossguard::oracle
