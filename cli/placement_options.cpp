// CP layout and placement options.
#include "cli/placement_options.h"

#include <fmt/format.h>

#include "cli/command.h"
#include "cli/mode_option.h"
#include "core/errors.h"

namespace lossguard::cli {

Policy policy_from_option(const std::string& value) {
  return mode_from_option<Policy>("--policy", value);
}

void add_topology_options(CLI::App& app, TopologySizes& s) {
  app.add_option("--tp", s.tp, "Tensor-parallel size")->capture_default_str();
  app.add_option("--pp", s.pp, "Pipeline-parallel size")->capture_default_str();
  app.add_option("--cp", s.cp, "Context-parallel size")->capture_default_str();
  app.add_option("--dp", s.dp, "Data-parallel size")->capture_default_str();
  app.add_option("--ep", s.ep,
                 "Expert-parallel size of MoE layers (Megatron's expert layout: TP*CP*DP must be a "
                 "multiple of ETP*EP)")
      ->capture_default_str();
  app.add_option("--etp", s.etp, "Expert tensor-parallel size (default: --tp)");
}

ShardLayout LayoutOptions::layout() const {
  ShardLayout l;
  if (max_seq_len > 0 && padded_total_length > 0) {
    throw InputError("--max-seq-len (bshd) and --padded-total-length (thd) exclude each other");
  }
  l.packing = max_seq_len > 0 ? Packing::kBshd : Packing::kThd;
  l.max_seq_len = max_seq_len;
  l.padded_total_length = padded_total_length;
  if (pad_multiple < 0) throw_input_error("--pad-multiple must be >= 1, got {}", pad_multiple);
  if (pad_multiple > 0 && (padded_total_length > 0 || max_seq_len > 0)) {
    throw InputError("--pad-multiple excludes --padded-total-length and --max-seq-len");
  }
  l.pad_multiple = pad_multiple;
  return l;
}

StepLayout CpLayoutOptions::step_layout(const Batch& b, const Placement& placement, int64_t cp,
                                        int64_t tp, const ShardLayout& shard) const {
  const CpLayout kind = mode_from_option<CpLayout>("--cp-layout", cp_layout);
  if (allgather_pad < 1) throw_input_error("--allgather-pad must be >= 1, got {}", allgather_pad);
  StepLayout l = dynamic_cp > 0
                     ? oracle::dynamic_cp_layout(b.total_lengths, placement, cp, dynamic_cp)
                     : static_layout(placement, cp, tp, shard);
  l.tp = tp;
  l.shard = shard;
  l.cp_layout = kind;
  l.allgather_pad = allgather_pad;
  return l;
}

std::string CpLayoutOptions::describe() const {
  std::string s =
      cp_layout == "allgather" ? fmt::format("allgather (pad {})", allgather_pad) : cp_layout;
  if (dynamic_cp > 0) s += fmt::format(", dynamic CP ({} tokens per GPU)", dynamic_cp);
  return s;
}

void add_cp_layout_options(CLI::App& app, CpLayoutOptions& o) {
  app.add_option("--cp-layout", o.cp_layout,
                 "How a micro-batch is cut over CP ranks: zigzag (each sample in 2*cp chunks) or "
                 "allgather (the micro-batch concatenated, padded, cut in cp contiguous parts)")
      ->capture_default_str();
  app.add_option("--allgather-pad", o.allgather_pad,
                 "allgather: the stream is padded to a multiple of cp*tp*this")
      ->check(CLI::Range(int64_t{1}, kMaxCount))
      ->capture_default_str();
  app.add_option("--dynamic-cp", o.dynamic_cp,
                 "Relax's dynamic CP: each micro-batch's CP size is the smallest power of two that "
                 "keeps its longest sample within this many tokens per GPU")
      ->check(CLI::Range(int64_t{1}, kMaxCount));
}

void add_layout_options(CLI::App& app, LayoutOptions& o) {
  app.add_option("--padded-total-length", o.padded_total_length,
                 "thd packing with every sample padded to this length (a multiple of 2*cp); "
                 "default: ceil(T / 2cp) chunks")
      ->check(CLI::Range(int64_t{1}, kMaxCount));
  app.add_option("--max-seq-len", o.max_seq_len, "bshd packing: chunks of ceil(max_seq_len / 2cp)")
      ->check(CLI::Range(int64_t{1}, kMaxCount));
  app.add_option("--pad-multiple", o.pad_multiple,
                 "thd packing with each sample padded to a multiple of K (and of 2*cp), as Relax's "
                 "VL path pads to tp*cp*2; a sample's own padded_total_length field wins")
      ->check(CLI::Range(int64_t{1}, kMaxCount));
}

oracle::Placement PlacementOptions::placement(const Batch& batch, bool dp_shards) const {
  const Split s = mode_from_option<Split>("--split", split);
  if (dp * microbatches > kMaxMicrobatches) {
    throw_input_error(
        "--dp {} x --microbatches {} = {} micro-batches; at most {} are modelled (every one is a "
        "row of the layout)",
        dp, microbatches, dp * microbatches, kMaxMicrobatches);
  }
  if (dp_shards) {
    const auto shards = static_cast<int64_t>(batch.files.size());
    if (dp != 1 && dp != shards)
      throw_input_error("--dp-shards: {} dumps given but --dp {}", shards, dp);
    std::vector<int> shard_of(batch.origins.size());
    for (std::size_t i = 0; i < shard_of.size(); ++i) shard_of[i] = batch.origins[i].file_index;
    return oracle::place_shards(shard_of, shards, microbatches);
  }
  return oracle::place_samples(batch.num_samples(), dp, microbatches, s);
}

void add_placement_options(CLI::App& app, PlacementOptions& o, bool dp_required) {
  auto* d =
      app.add_option("--dp", o.dp, "Data-parallel size: the global batch is split over DP ranks");
  d->check(CLI::Range(int64_t{1}, kMaxDp));
  if (dp_required) d->required();
  app.add_option("--microbatches", o.microbatches, "Micro-batches per DP rank (contiguous)")
      ->check(CLI::Range(int64_t{1}, kMaxDp))
      ->capture_default_str();
  app.add_option("--split", o.split, "How samples go to DP ranks: contiguous or round-robin")
      ->capture_default_str();
}

}  // namespace lossguard::cli
