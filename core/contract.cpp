// Contract presets and the key=value syntax (SPEC §9). Each preset's source is in
// docs/contracts-sources.md.
#include "core/contract.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <iterator>
#include <limits>

#include "core/errors.h"

namespace lossguard {

// Long: the preset table, one entry per real trainer with the source it was read from.
const std::vector<ContractPreset>& contract_presets() {
  static const std::vector<ContractPreset> kPresets = {
      {"truth", "the objective itself: every token weighted as --reduce says",
       "docs/semantics.md §9"},
      {"megatron-per-token",
       "Megatron-LM with calculate_per_token_loss: local sums, grads summed over DP×CP, divided by "
       "the "
       "count all-reduced over DP×CP",
       "megatron/core/pipeline_parallel/schedules.py forward_step_calc_loss; "
       "megatron/core/distributed/finalize_model_grads.py"},
      {"megatron-mean",
       "Megatron-LM's 3-tuple loss without per-token loss: each micro-batch's CP shard divided by "
       "its "
       "own count, ÷ num_microbatches, DDP mean over DP×CP",
       "megatron/core/pipeline_parallel/schedules.py forward_step_calc_loss"},
      {"relax-legacy",
       "Relax before PR #285: per-token loss with each sample counted max(m, 1) at CP = 1",
       "Relax relax/.../cp_utils.py before PR #285"},
      {"relax", "Relax after PR #285 (per-token: megatron-per-token; else sample means × dp·cp/B)",
       "Relax relax/.../cp_utils.py, loss.py"},
      {"slime",
       "slime's loss_function: per-token, every CP rank counts full samples (clamped) and "
       "multiplies by "
       "cp; else sample means × dp·cp/B",
       "THUDM/slime slime/backends/megatron_utils/loss.py, cp_utils.py"},
      {"hf-ga",
       "Hugging Face Trainer without loss kwargs: a mean per micro-batch, ÷ accumulation steps, "
       "DDP "
       "mean over DP (the 2024 gradient-accumulation bug)",
       "transformers Trainer.training_step; transformers #34191"},
      {"hf-num-items",
       "Hugging Face Trainer with num_items_in_batch counted per rank over its accumulation window",
       "transformers Trainer.get_batch_samples, compute_loss"},
      {"hf-num-items-across-devices",
       "Hugging Face Trainer with average_tokens_across_devices: the count gathered over DP, loss "
       "× "
       "dp, DDP mean",
       "transformers Trainer.get_batch_samples, training_step"},
      {"verl-token-mean-legacy",
       "verl's older dp_actor: token-mean per micro-batch, ÷ gradient accumulation, DDP mean",
       "volcengine/verl verl/workers/actor/dp_actor.py, core_algos.agg_loss"},
      {"verl-token-mean",
       "verl with the global token count: all-reduced over DP, loss × dp, DDP mean",
       "volcengine/verl verl/trainer/ppo/core_algos.py agg_loss (global_batch_info)"},
      {"megatron-2tuple",
       "Megatron-core 0.16 with a 2-tuple loss_func dividing by its count all-reduced over CP: "
       "× cp ÷ M, DDP mean over DP×CP (a mean per micro-batch, CP-independent)",
       "megatron-core 0.16.1 pipeline_parallel/schedules.py:268-269; "
       "distributed/distributed_data_parallel.py:284-287"},
      {"megatron-2tuple-per-token-flag",
       "the misconfiguration: a 2-tuple loss_func under calculate_per_token_loss=True (no count "
       "reaches finalize, DDP factor 1): megatron-2tuple × dp·cp",
       "megatron-core 0.16.1 schedules.py:251, 268-269; finalize_model_grads.py:493-497; "
       "distributed_data_parallel.py:254-259"},
      {"megatron-mean-0.12",
       "Megatron-core 0.12: the 3-tuple without per-token loss divided by the CP shard's count, × "
       "cp "
       "÷ M, DDP mean over DP×CP (0.13 dropped the × cp; 0.15 clamped the count)",
       "megatron-core 0.12.3 pipeline_parallel/schedules.py:290-292"},
      {"megatron-per-token-0.12",
       "Megatron-core 0.12 with calculate_per_token_loss: the count all-reduced over DP only while "
       "gradients are summed over DP×CP",
       "megatron-core 0.12.3 distributed/finalize_model_grads.py:327"},
      {"verl-seq-mean-token-sum",
       "verl 0.9 loss_agg_mode seq-mean-token-sum: token sums ÷ global_batch_size, × dp, FSDP mean",
       "verl 0.9.1 trainer/ppo/core_algos.py:1181-1188 agg_loss"},
      {"verl-seq-mean-token-mean",
       "verl 0.8-0.9 seq-mean-token-mean (and the sapo policy loss, which forces it; gspo too up "
       "to verl 0.9.0): each sample's "
       "token mean ÷ global_batch_size counting every sample, fully masked ones too (lossguard's "
       "sample-mean), × dp, FSDP mean",
       "verl 0.9.1 trainer/ppo/core_algos.py:1194-1202, 1688-1689 (sapo); 0.9.0 :1604-1605 (gspo)"},
      {"verl-seq-mean-token-sum-norm",
       "verl 0.9 seq-mean-token-sum-norm with loss_scale_factor (--l-norm): token sums ÷ "
       "(global_batch_size · loss_scale_factor), × dp, FSDP mean",
       "verl 0.9.1 trainer/ppo/core_algos.py:1189-1193"},
      {"verl-seq-mean-token-sum-norm-v1",
       "verl 0.9's default v1 trainer, seq-mean-token-sum-norm without loss_scale_factor: the norm "
       "is each micro-batch's padded width (its longest response), not split-invariant",
       "verl 0.9.1 workers/utils/losses.py:91; trainer/ppo/core_algos.py:1189-1193"},
      {"verl-geo-mean",
       "verl 0.9 geo_mean (GMPO) policy loss: a mean over the micro-batch's samples of their token "
       "means, no ÷ M, no × dp: FSDP mean only",
       "verl 0.9.1 trainer/ppo/core_algos.py:1983-1984, 2000"},
      {"trl-grpo",
       "TRL GRPOTrainer loss_type grpo and sapo: each completion's token mean, averaged over the "
       "micro-batch's completions, ÷ M, DDP mean (exact sample-mean when micro-batches are equal)",
       "trl 1.16.0 trainer/grpo_trainer.py:3153-3157"},
      {"trl-bnpo",
       "TRL GRPOTrainer loss_type bnpo: a token mean per micro-batch on each rank, ÷ M, DDP mean "
       "(the hf-ga shape)",
       "trl 1.16.0 trainer/grpo_trainer.py:3158-3162"},
      {"trl-dr-grpo",
       "TRL GRPOTrainer loss_type dr_grpo: token sums ÷ (completions · max_completion_length) per "
       "micro-batch, ÷ M, DDP mean (--l-norm = max_completion_length)",
       "trl 1.16.0 trainer/grpo_trainer.py:3163-3167"},
      {"trl-dapo",
       "TRL GRPOTrainer loss_type dapo, cispo, vespo with steps_per_generation = M: token sums ÷ "
       "the "
       "count gathered over every rank, × dp, DDP mean; with steps_per_generation S != M the count "
       "is the generation batch's: trl-dapo,norm=generation:S,scale=dp*S*1/M",
       "trl 1.16.0 trainer/grpo_trainer.py:2497-2498, 3168-3174"},
      {"trl-luspo",
       "TRL GRPOTrainer loss_type luspo: each completion's token sum, averaged over the "
       "micro-batch's completions, ÷ M, DDP mean",
       "trl 1.16.0 trainer/grpo_trainer.py:3175-3182"},
      // Loss terms besides the main one (SPEC §11: --term NAME:REDUCE:COEF:MASK --contract NAME=C).
      {"megatron-mtp",
       "Megatron-core 0.16 MTP loss without per-token loss (term roll:J, coef "
       "mtp_loss_scaling_factor/mtp_num_layers): each CP shard's sum ÷ its own rolled-mask count, "
       "÷ M, DDP mean over DP×CP (Megatron does not clamp: a shard with no MTP token is NaN)",
       "megatron-core 0.16.1 models/gpt/gpt_model.py:611-661; "
       "transformer/multi_token_prediction.py:158-161, 243-252",
       true},
      {"megatron-mtp-per-token",
       "Megatron-core 0.16 MTP loss with calculate_per_token_loss: local sums, grads summed over "
       "DP×CP, divided by the MAIN loss's global count (the shifted mask holds fewer tokens)",
       "megatron-core 0.16.1 models/gpt/gpt_model.py:655-657; "
       "distributed/finalize_model_grads.py:484-497",
       true},
      {"megatron-aux",
       "Megatron-core 0.16 MoE load-balancing aux loss without per-token loss (term over every "
       "token: SFT / pre-training dumps, mask all): full micro-batch count, × cp ÷ M, DDP mean",
       "megatron-core 0.16.1 transformer/moe/moe_utils.py:129-132; router.py:287-293; "
       "pipeline_parallel/schedules.py:289-292",
       true},
      {"megatron-aux-per-token",
       "Megatron-core 0.16 MoE aux / z-loss with calculate_per_token_loss: divided by the main "
       "loss's global count and 1/(tp·cp) too small (Megatron-LM #1652, fixed after 0.16 by "
       "#5047)",
       "megatron-core 0.16.1 pipeline_parallel/schedules.py:289-292; "
       "distributed/finalize_model_grads.py:484-497",
       true},
      {"trl-grpo-entropy",
       "TRL GRPOTrainer's entropy bonus (entropy_coef): a token mean per micro-batch, ÷ M, DDP "
       "mean, for every loss_type (dapo's policy term uses the global count)",
       "trl 1.16.0 trainer/grpo_trainer.py:3192-3211", true},
  };
  return kPresets;
}

namespace {

bool per_token_objective(Reduction r) {
  return r == Reduction::kPerToken || r == Reduction::kTokenMean;
}

ScaleFactor parse_scale(const std::string& text) {
  ScaleFactor s;
  std::size_t pos = 0;
  if (text.empty()) throw_input_error("--contract: scale is empty");
  while (pos <= text.size()) {
    const std::size_t star = text.find('*', pos);
    std::string term = text.substr(pos, star == std::string::npos ? std::string::npos : star - pos);
    int sign = 1;
    if (term.rfind("1/", 0) == 0) {
      sign = -1;
      term = term.substr(2);
    }
    if (term == "cp")
      s.cp += sign;
    else if (term == "dp")
      s.dp += sign;
    else if (term == "tp")
      s.tp += sign;
    else if (term == "M")
      s.m += sign;
    else if (term == "B")
      s.b += sign;
    else if (term == "Bnz")
      s.bnz += sign;
    else if (term == "Lmb")
      s.lmb += sign;
    else if (term == "L")
      s.l += sign;
    else {
      char* end = nullptr;
      const double v = std::strtod(term.c_str(), &end);
      if (term.empty() || end != term.c_str() + term.size() || !(v > 0) || !std::isfinite(v)) {
        throw_input_error(
            "--contract: scale term '{}' is not cp, dp, tp, M, B, Bnz, L, Lmb, a positive number, "
            "or "
            "1/ one of them",
            term);
      }
      s.number *= sign > 0 ? v : 1.0 / v;
    }
    if (star == std::string::npos) break;
    pos = star + 1;
  }
  return s;
}

ScaleFactor times(ScaleFactor a, const ScaleFactor& b) {
  a.number *= b.number;
  a.cp += b.cp, a.dp += b.dp, a.tp += b.tp, a.m += b.m, a.b += b.b, a.bnz += b.bnz, a.l += b.l;
  a.lmb += b.lmb;
  return a;
}

template <typename E>
E parse_component(const std::string& key, const std::string& value) {
  E out;
  if (!parse_mode(value, &out)) {
    throw_input_error("--contract: {}={} is not one of {}", key, value, mode_choices<E>());
  }
  return out;
}

// "global:dp" -> (kGlobal, kDp); "mean:dp-cp" -> (kMean, kDpCp).
std::pair<std::string, ReduceGroup> split_group(const std::string& key, const std::string& value) {
  const std::size_t colon = value.find(':');
  if (colon == std::string::npos) return {value, ReduceGroup::kDpCp};
  return {value.substr(0, colon), parse_component<ReduceGroup>(key, value.substr(colon + 1))};
}

void apply(Contract& c, const std::string& key, const std::string& value) {
  if (key == "count") {
    c.count = parse_component<CountRule>(key, value);
  } else if (key == "clamp") {
    c.clamp = parse_component<ClampRule>(key, value);
  } else if (key == "norm" && value.rfind("generation", 0) == 0) {
    const std::size_t colon = value.find(':');
    char* end = nullptr;
    const std::string s = colon == std::string::npos ? "" : value.substr(colon + 1);
    const long long n = s.empty() ? 0 : std::strtoll(s.c_str(), &end, 10);
    if (value.substr(0, colon) != "generation" || s.empty() || *end != '\0' || n < 1 ||
        n > (1 << 20)) {
      throw_input_error(
          "--contract: norm={} must be generation:S with S the micro-batches of a generation "
          "batch (1 to 1048576)",
          value);
    }
    c.norm = NormRule::kGeneration;
    c.generation = n;
  } else if (key == "norm") {
    auto [rule, group] = split_group(key, value);
    c.norm = parse_component<NormRule>(key, rule);
    if (c.norm == NormRule::kGlobal && value.find(':') == std::string::npos) {
      throw_input_error(
          "--contract: norm=global needs its group: global:dp-cp, global:dp, "
          "global:cp or global:world");
    }
    c.norm_group = group;
  } else if (key == "sample") {
    c.sample = parse_component<SampleRule>(key, value);
  } else if (key == "scale") {
    c.scale = parse_scale(value);
  } else if (key == "grad") {
    auto [rule, group] = split_group(key, value);
    c.grad = parse_component<GradRule>(key, rule);
    if (c.grad == GradRule::kMean && value.find(':') == std::string::npos) {
      throw_input_error(
          "--contract: grad=mean needs its group: mean:dp-cp, mean:dp, mean:cp or "
          "mean:world");
    }
    c.grad_group = group;
  } else if (key == "count-of") {
    if (value != "term" && value != "main")
      throw_input_error("--contract: count-of={} is not term or main", value);
    c.count_of_main = value == "main";
  } else if (key == "policy") {  // SPEC §3's counting policies, as count components
    const auto p = parse_component<Policy>(key, value);
    if (p == Policy::kLegacy) c.clamp = ClampRule::kAtCp1;
    if (p == Policy::kSlime) {
      c.count = CountRule::kFullSample;
      c.clamp = ClampRule::kPerSample;
      c.scale = times(c.scale, parse_scale("cp"));
    }
  } else {
    throw_input_error("--contract: unknown component '{}' ({})", key,
                      contract_component_keys_text());
  }
}

}  // namespace

// Long: the presets' contracts, one branch per preset name: a table of key=value texts.
Contract preset_contract(const std::string& name, Reduction reduce) {
  const bool per_token = per_token_objective(reduce);
  std::string spec;
  if (name == "truth") {
    switch (reduce) {
      case Reduction::kPerToken:
      case Reduction::kTokenMean:
        spec = "norm=global:dp-cp";
        break;
      case Reduction::kSampleMean:
        spec = "sample=mean,scale=1/B";
        break;
      case Reduction::kSeqMeanTokenSum:
        spec = "scale=1/B";
        break;
      case Reduction::kSeqMeanTokenMean:
        spec = "sample=mean,scale=1/Bnz";
        break;
      case Reduction::kSeqMeanTokenSumNorm:
        spec = "scale=1/B*1/L";
        break;
    }
  } else if (name == "megatron-per-token") {
    spec = "norm=global:dp-cp,grad=sum";
  } else if (name == "megatron-mean") {
    spec = "norm=microbatch,scale=1/M,grad=mean:dp-cp";
  } else if (name == "relax-legacy") {
    spec = per_token ? "clamp=at-cp1,norm=global:dp-cp,grad=sum"
                     : "sample=mean,scale=dp*cp*1/B,grad=mean:dp-cp";
  } else if (name == "relax") {
    spec = per_token ? "norm=global:dp-cp,grad=sum" : "sample=mean,scale=dp*cp*1/B,grad=mean:dp-cp";
  } else if (name == "slime") {
    spec = per_token ? "count=full-sample,clamp=per-sample,norm=global:dp-cp,scale=cp,grad=sum"
                     : "sample=mean,scale=dp*cp*1/B,grad=mean:dp-cp";
  } else if (name == "hf-ga" || name == "verl-token-mean-legacy") {
    spec = "norm=microbatch,scale=1/M,grad=mean:dp";
  } else if (name == "hf-num-items") {
    spec = "norm=rank,grad=mean:dp";
  } else if (name == "hf-num-items-across-devices" || name == "verl-token-mean" ||
             name == "trl-dapo") {
    spec = "norm=global:dp,scale=dp,grad=mean:dp";
  } else if (name == "megatron-2tuple") {
    spec = "count=full-sample,norm=microbatch,scale=cp*1/M,grad=mean:dp-cp";
  } else if (name == "megatron-2tuple-per-token-flag") {
    spec = "count=full-sample,norm=microbatch,scale=cp*1/M,grad=sum";
  } else if (name == "megatron-mean-0.12") {
    spec = "norm=microbatch,scale=cp*1/M,grad=mean:dp-cp";
  } else if (name == "megatron-per-token-0.12") {
    spec = "norm=global:dp,grad=sum";
  } else if (name == "verl-seq-mean-token-sum") {
    spec = "scale=dp*1/B,grad=mean:dp";
  } else if (name == "verl-seq-mean-token-mean") {
    spec = "sample=mean,scale=dp*1/B,grad=mean:dp";
  } else if (name == "verl-seq-mean-token-sum-norm") {
    spec = "scale=dp*1/B*1/L,grad=mean:dp";
  } else if (name == "verl-seq-mean-token-sum-norm-v1") {
    spec = "scale=dp*1/B*1/Lmb,grad=mean:dp";
  } else if (name == "verl-geo-mean") {
    spec = "count=samples,norm=microbatch,sample=mean,grad=mean:dp";
  } else if (name == "trl-grpo") {
    spec = "count=samples,norm=microbatch,sample=mean,scale=1/M,grad=mean:dp";
  } else if (name == "trl-bnpo") {
    spec = "norm=microbatch,scale=1/M,grad=mean:dp";
  } else if (name == "trl-dr-grpo") {
    spec = "count=samples,norm=microbatch,scale=1/L*1/M,grad=mean:dp";
  } else if (name == "trl-luspo") {
    spec = "count=samples,norm=microbatch,scale=1/M,grad=mean:dp";
  } else if (name == "megatron-mtp") {
    spec = "norm=microbatch,scale=1/M,grad=mean:dp-cp";
  } else if (name == "megatron-mtp-per-token") {
    spec = "count-of=main,norm=global:dp-cp,grad=sum";
  } else if (name == "megatron-aux") {
    spec = "count=full-sample,norm=microbatch,scale=cp*1/M,grad=mean:dp-cp";
  } else if (name == "megatron-aux-per-token") {
    spec = "count-of=main,norm=global:dp-cp,scale=1/tp*1/cp,grad=sum";
  } else if (name == "trl-grpo-entropy") {
    spec = "norm=microbatch,scale=1/M,grad=mean:dp";
  } else {
    std::string names;
    for (const auto& p : contract_presets())
      names += std::string(names.empty() ? "" : ", ") + p.name;
    throw_input_error("--contract: unknown preset '{}' (presets: {}; or key=value components)",
                      name, names);
  }
  Contract c = parse_contract(spec, reduce);
  c.preset = name;
  c.equal_microbatches = name.rfind("trl-", 0) == 0;  // TRL's GRPOTrainer layouts
  return c;
}

Contract parse_contract(const std::string& text, Reduction reduce) {
  Contract c;
  std::size_t pos = 0;
  bool first = true, overridden = false;
  while (pos <= text.size()) {
    const std::size_t comma = text.find(',', pos);
    const std::string item =
        text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    const std::size_t eq = item.find('=');
    if (eq == std::string::npos) {
      if (!first)
        throw_input_error(
            "--contract: '{}' is not key=value (only the first item may name a preset)", item);
      c = preset_contract(item, reduce);
    } else {
      apply(c, item.substr(0, eq), item.substr(eq + 1));
      overridden = true;
    }
    first = false;
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  if (overridden) c.preset.clear();  // a preset with overrides is no longer that preset
  if (c.norm == NormRule::kGeneration) c.equal_microbatches = true;  // TRL's generation batches
  // A compensation factor a trainer can apply: a float32 normal number. Outside that range the
  // trainer's own arithmetic overflows or flushes to zero (`check` computes inf or 0 gradients),
  // so `weights`, reasoning in float64, must not call it a plain uniform scale.
  const double lo = std::numeric_limits<float>::min(), hi = std::numeric_limits<float>::max();
  if (!(c.scale.number >= lo && c.scale.number <= hi)) {
    throw_input_error(
        "--contract '{}': the scale's numbers multiply to {}, outside the float32 range a trainer "
        "can apply ({:g} to {:g})",
        text, c.scale.number, lo, hi);
  }
  return c;
}

bool is_contract_component_key(const std::string& key) {
  for (const char* k : kContractComponentKeys) {
    if (key == k) return true;
  }
  return false;
}

std::string contract_component_keys_text() {
  std::string out;
  const std::size_t n = std::size(kContractComponentKeys);
  for (std::size_t i = 0; i < n; ++i) {
    out += (i == 0 ? "" : i + 1 == n ? " or " : ", ") + std::string(kContractComponentKeys[i]);
  }
  return out;
}

std::string scale_text(const ScaleFactor& s) {
  std::string out;
  auto add = [&](int exponent, const char* name) {
    for (int k = 0; k < std::abs(exponent); ++k) {
      out += (out.empty() ? "" : "*") + std::string(exponent < 0 ? "1/" : "") + name;
    }
  };
  if (s.number != 1.0) out = fmt::format("{}", s.number);  // shortest text that reads back
  add(s.dp, "dp");
  add(s.cp, "cp");
  add(s.tp, "tp");
  add(s.m, "M");
  add(s.b, "B");
  add(s.bnz, "Bnz");
  add(s.lmb, "Lmb");
  add(s.l, "L");
  return out.empty() ? "1" : out;
}

std::string norm_text(const Contract& c) {
  if (c.norm == NormRule::kGlobal) return fmt::format("global:{}", mode_name(c.norm_group));
  if (c.norm == NormRule::kGeneration) return fmt::format("generation:{}", c.generation);
  return std::string(mode_name(c.norm));
}

std::string contract_components(const Contract& c) {
  const std::string norm = norm_text(c);
  const std::string grad = c.grad == GradRule::kMean
                               ? fmt::format("mean:{}", mode_name(c.grad_group))
                               : std::string(mode_name(c.grad));
  return fmt::format("count={},clamp={},norm={},sample={},scale={},grad={}{}", mode_name(c.count),
                     mode_name(c.clamp), norm, mode_name(c.sample), scale_text(c.scale), grad,
                     c.count_of_main ? ",count-of=main" : "");
}

double scale_value(const ScaleFactor& s, const ScaleSizes& z) {
  auto p = [](double base, int e) { return std::pow(base, e); };
  const double v = s.number * p(static_cast<double>(z.cp), s.cp) *
                   p(static_cast<double>(z.dp), s.dp) * p(static_cast<double>(z.tp), s.tp) *
                   p(static_cast<double>(z.microbatches), s.m) *
                   p(static_cast<double>(z.batch), s.b) *
                   p(static_cast<double>(z.batch_nonzero), s.bnz) * p(z.l_norm, s.l) *
                   p(static_cast<double>(std::max<int64_t>(z.microbatch_max_response, 1)), s.lmb);
  // As parse_contract's check of the literal numbers, on the value the symbols give on this layout
  // (scale=1e38*M at M = 8 is 8e38: a trainer's float32 overflows; 1e-37*1/M at M = 1024 flushes
  // to 0), so that a scale no trainer can apply is never weighed as a plain uniform scale.
  const double lo = std::numeric_limits<float>::min(), hi = std::numeric_limits<float>::max();
  if (!(v >= lo && v <= hi)) {
    throw ScaleRangeError(fmt::format(
        "--contract: scale={} is {:g} on the layout DP {} CP {} TP {} M {} B {}, outside the "
        "float32 range a trainer can apply ({:g} to {:g})",
        scale_text(s), v, z.dp, z.cp, z.tp, z.microbatches, z.batch, lo, hi));
  }
  return v;
}

const std::vector<std::string>& single_component_changes() {
  static const std::vector<std::string> kChanges = [] {
    std::vector<std::string> out;
    for (CountRule r : all_modes<CountRule>()) out.push_back(fmt::format("count={}", mode_name(r)));
    for (ClampRule r : all_modes<ClampRule>()) out.push_back(fmt::format("clamp={}", mode_name(r)));
    for (NormRule r : all_modes<NormRule>()) {
      if (r == NormRule::kGeneration) continue;  // generation:S needs its S
      if (r != NormRule::kGlobal) {
        out.push_back(fmt::format("norm={}", mode_name(r)));
        continue;
      }
      for (ReduceGroup g : all_modes<ReduceGroup>())
        out.push_back(fmt::format("norm=global:{}", mode_name(g)));
    }
    for (SampleRule r : all_modes<SampleRule>())
      out.push_back(fmt::format("sample={}", mode_name(r)));
    for (GradRule r : all_modes<GradRule>()) {
      if (r != GradRule::kMean) {
        out.push_back(fmt::format("grad={}", mode_name(r)));
        continue;
      }
      for (ReduceGroup g : all_modes<ReduceGroup>())
        out.push_back(fmt::format("grad=mean:{}", mode_name(g)));
    }
    for (const char* f : {"1", "cp", "1/cp", "dp", "1/dp", "1/M", "M"})
      out.push_back(fmt::format("scale={}", f));
    return out;
  }();
  return kChanges;
}

}  // namespace lossguard
