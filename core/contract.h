// A normalisation contract (SPEC §9): how a trainer turns per-token losses into the gradient the
// optimizer applies, as six components, and the presets that name real trainers. Shared vocabulary:
// the oracle predicts weights from it, the candidates train under it, the CLI parses it.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/modes.h"

namespace lossguard {

// What a rank counts for a micro-batch.
enum class CountRule { kCpLocal, kFullSample, kSamples };
template <>
struct ModeNames<CountRule> {
  static constexpr std::pair<CountRule, const char*> kTable[] = {
      {CountRule::kCpLocal, "cp-local"},
      {CountRule::kFullSample, "full-sample"},
      {CountRule::kSamples, "samples"}};
};

// When each sample's count is taken as max(count_i, 1).
enum class ClampRule { kNone, kPerSample, kAtCp1 };
template <>
struct ModeNames<ClampRule> {
  static constexpr std::pair<ClampRule, const char*> kTable[] = {
      {ClampRule::kNone, "none"},
      {ClampRule::kPerSample, "per-sample"},
      {ClampRule::kAtCp1, "at-cp1"}};
};

// The denominator D a rank divides its micro-batch's summed loss by. `generation:S`: the count of
// the generation batch the micro-batch belongs to — S consecutive micro-batches of every rank
// (micro-batch k is in batch k / S), summed over all DP×CP ranks (TRL's GRPOTrainer counts
// num_items_in_batch over its generation batch of steps_per_generation micro-batches:
// grpo_trainer.py:2497, 1.16.0). Within one step: S >= M gives the step's count (a generation batch
// spanning steps is not visible in one).
enum class NormRule { kNone, kMicrobatch, kRank, kGlobal, kGeneration };
template <>
struct ModeNames<NormRule> {
  static constexpr std::pair<NormRule, const char*> kTable[] = {
      {NormRule::kNone, "none"},
      {NormRule::kMicrobatch, "microbatch"},
      {NormRule::kRank, "rank"},
      {NormRule::kGlobal, "global"},
      {NormRule::kGeneration, "generation"}};
};

// The process group a count is all-reduced over, or a gradient averaged over. `world` includes the
// TP ranks, whose counts are identical copies (summing them multiplies by tp).
enum class ReduceGroup { kDpCp, kDp, kCp, kWorld };
template <>
struct ModeNames<ReduceGroup> {
  static constexpr std::pair<ReduceGroup, const char*> kTable[] = {{ReduceGroup::kDpCp, "dp-cp"},
                                                                   {ReduceGroup::kDp, "dp"},
                                                                   {ReduceGroup::kCp, "cp"},
                                                                   {ReduceGroup::kWorld, "world"}};
};

// Whether each sample's sum is divided by max(d_i, 1) first (the sample-mean family).
enum class SampleRule { kNone, kMean };
template <>
struct ModeNames<SampleRule> {
  static constexpr std::pair<SampleRule, const char*> kTable[] = {{SampleRule::kNone, "none"},
                                                                  {SampleRule::kMean, "mean"}};
};

// What happens to gradients after they are summed over the DP×CP replicas.
enum class GradRule { kSum, kMean };
template <>
struct ModeNames<GradRule> {
  static constexpr std::pair<GradRule, const char*> kTable[] = {{GradRule::kSum, "sum"},
                                                                {GradRule::kMean, "mean"}};
};

// A compensation factor: a number times powers of the layout's sizes. `Bnz` is the number of
// samples with effective tokens (B' of seq-mean-token-mean), `L` the reduction's L_norm, `Lmb` the
// micro-batch's longest response (the padded width verl's v1 trainer divides by when no
// loss_scale_factor is set: workers/utils/losses.py:91, core_algos.py:1189-1193, verl 0.9.1).
struct ScaleFactor {
  double number = 1.0;
  int cp = 0, dp = 0, tp = 0, m = 0, b = 0, bnz = 0, l = 0, lmb = 0;  // exponents
  bool operator==(const ScaleFactor&) const = default;
};

struct Contract {
  CountRule count = CountRule::kCpLocal;
  ClampRule clamp = ClampRule::kNone;
  NormRule norm = NormRule::kNone;
  ReduceGroup norm_group = ReduceGroup::kDpCp;  // norm = global:G
  int64_t generation = 0;                       // norm = generation:S, S >= 1
  SampleRule sample = SampleRule::kNone;
  ScaleFactor scale;
  GradRule grad = GradRule::kSum;
  ReduceGroup grad_group = ReduceGroup::kDpCp;  // grad = mean:G
  // count-of=main: a loss term (SPEC §11) counted under the main term's mask, not its own (Megatron
  // divides every term by the main loss's token count: finalize_model_grads.py:484-497, 0.16.1).
  bool count_of_main = false;
  std::string preset;  // the preset it came from; empty for key=value
  // The trainer builds only layouts whose DP x M micro-batches hold the same number of samples
  // (TRL: a generation batch of per_device_train_batch_size x dp x steps_per_generation
  // completions, cut evenly): I5 varies only such layouts. Set by the TRL presets and
  // norm=generation:S; kept through overrides; not a weighing component (not compared).
  bool equal_microbatches = false;
  bool operator==(const Contract& o) const {
    return count == o.count && clamp == o.clamp && norm == o.norm &&
           (norm != NormRule::kGlobal || norm_group == o.norm_group) &&
           (norm != NormRule::kGeneration || generation == o.generation) && sample == o.sample &&
           scale == o.scale && grad == o.grad &&
           (grad != GradRule::kMean || grad_group == o.grad_group) &&
           count_of_main == o.count_of_main;
  }
};

// A preset: its name, what it models and where that code is (shown by --help and in reports).
struct ContractPreset {
  const char* name;
  const char* models;
  const char* source;
  bool term_only = false;  // a loss term's contract (SPEC §11): not offered for the main term
};
const std::vector<ContractPreset>& contract_presets();

// The preset `name` for the objective `reduce` (a preset may follow the trainer's own
// per-token-loss switch, which the reduction implies). Throws InputError for an unknown name.
Contract preset_contract(const std::string& name, Reduction reduce);

// "megatron-per-token" or "count=cp-local,norm=global:dp,scale=cp*1/M,grad=mean:dp" (components
// left out keep their defaults: count=cp-local, clamp=none, norm=none, sample=none, scale=1,
// grad=sum). A preset name may be followed by overrides: "megatron-per-token,norm=global:dp".
// Throws InputError naming the bad component.
Contract parse_contract(const std::string& text, Reduction reduce);

// The keys of a contract's key=value components, in --help's order: none of them is a term name,
// whatever order the components come in (--contract policy=legacy,norm=global:dp-cp is main's).
inline constexpr const char* kContractComponentKeys[] = {"count", "clamp", "norm",     "sample",
                                                         "scale", "grad",  "count-of", "policy"};
bool is_contract_component_key(const std::string& key);
std::string contract_component_keys_text();  // "count, clamp, ..., count-of or policy"

// Every contract one component away from another, as the key=value text parse_contract appends:
// each value of each component's name table (norm=global:G and grad=mean:G over every group;
// norm=generation:S, which needs S, excluded) and the scale factors cp, dp, M and their inverses.
// `matching_presets` names a measured contract by them.
const std::vector<std::string>& single_component_changes();

// The components as key=value text (every component, defaults included).
std::string contract_components(const Contract& c);
std::string scale_text(const ScaleFactor& s);  // "dp*cp*1/B", "1"
std::string norm_text(const Contract& c);      // "global:dp-cp", "generation:4", "microbatch"

// The batch sizes that scale factors refer to.
struct ScaleSizes {
  int64_t cp = 1, dp = 1, tp = 1, microbatches = 1, batch = 1, batch_nonzero = 1;
  double l_norm = 1.0;
  int64_t microbatch_max_response = 1;  // Lmb: of the micro-batch being weighed (at least 1)
};
double scale_value(const ScaleFactor& s, const ScaleSizes& sizes);

}  // namespace lossguard
