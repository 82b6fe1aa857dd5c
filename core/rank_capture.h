// What a trainer recorded on one rank for one step (SPEC §10, the audit capture): the micro-batches
// it computed loss for, each owned token's measured dL/dl_t, and the step's scale, count, decision
// and metrics. io/capture.cpp reads it; oracle/audit/audit.cpp judges it. Optional records are
// optional.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/array.h"
#include "core/modes.h"
#include "core/term.h"

namespace lossguard {

// One loss term's records of one micro-batch (SPEC §11: mb.{k}.term.NAME.*), over the same owned
// tokens in the same local order as the main term's token_weight.
struct CapturedTerm {
  std::vector<double> token_weight;               // [owned]
  std::optional<std::vector<double>> token_loss;  // [owned]
  std::optional<std::vector<uint8_t>> mask;       // [sum R]: a field-mask term's mask
  std::optional<int64_t> num_tokens;
};

struct CapturedMicroBatch {
  int64_t index = 0;                                                     // k, within the rank
  std::vector<int64_t> sample_indices, total_lengths, response_lengths;  // [n_k]
  std::vector<int64_t> tokens;                                           // [sum T]
  std::vector<uint8_t> loss_masks;                                       // [sum R]
  int64_t cp_size = 1;
  bool dummy = false;
  std::optional<int64_t> num_tokens;
  std::optional<double> loss;
  std::vector<double> token_weight;               // [owned], the rank's local order
  std::optional<std::vector<double>> token_loss;  // [owned]
  std::optional<std::vector<double>> sample_denoms;
  std::map<std::string, CapturedTerm> terms;  // by name, every term hooked here but main
};

struct RankCapture {
  std::string file;
  int64_t step = 0, rank = 0, world_size = 1;
  int64_t tp = 1, pp = 1, cp = 1, dp = 1;
  int64_t tp_rank = 0, pp_rank = 0, cp_rank = 0, dp_rank = 0;
  CpLayout cp_layout = CpLayout::kZigzag;
  std::string reduce;   // the objective the trainer claims
  std::string trainer;  // metadata `trainer` (hf, trl, megatron, verl, slime...): its presets first
  // The dtype the trainer computed its per-token loss in (metadata `dtype`; else token_weight's
  // own dtype): sets the loss and weight tolerances. A bf16 loss is written as float32.
  DType dtype = DType::kFloat32;
  std::vector<Term> terms;  // declared in metadata `terms` (main is implicit, never listed)
  std::vector<CapturedMicroBatch> microbatches;
  double grad_scale = 1.0;
  std::optional<int64_t> num_tokens_reduced, global_batch_size;
  // What global_batch_size counts (metadata `global_batch_unit`): "samples", "rollouts" (slime's
  // and Relax's compact rollouts of several samples), or "" (unsaid).
  std::string global_batch_unit;
  std::optional<double> l_norm;  // seq-mean-token-sum-norm's L_norm as the trainer used it
  // Constant scales the trainer declares on its main loss (metadata `declared_scales`,
  // "loss_scale=0.5,..."): where one equals a layout product, it decides (SPEC §9).
  std::vector<std::pair<std::string, double>> declared_scales;
  std::string loss_site;  // metadata `loss_site`: where the trainer computes the loss it hooks
  std::optional<bool> skipped;
  std::optional<bool> scheduler_stepped;  // whether the LR scheduler advanced (SPEC §10)
  std::optional<double> grad_norm;
  std::optional<std::vector<double>> metrics_values;
  std::vector<std::string> metrics_keys;
  std::vector<std::string> unknown_records;  // tensors no part of the format names (typos)
};

}  // namespace lossguard
