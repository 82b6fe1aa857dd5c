// The batch model of SPEC §1: samples of prompt+response tokens with loss masks and optional
// per-token fields, packed, and the builder that validates what a dump states before it becomes
// one.
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/array.h"
#include "core/layout.h"
#include "core/modes.h"

namespace lossguard {

enum class SampleKind { kRl, kSft, kEmpty };  // empty: no effective token (R = 0 or fully masked)
const char* sample_kind_name(SampleKind kind);
// Why a sample has no effective token (kind empty), most basic first.
enum class NoTokenReason { kNone, kTZero, kEmptyResponse, kFullyMasked };

// The one classification of a sample that every report uses (SPEC §1): its kind, why it has no
// effective token, and whether it is an SFT sample (R = T) whose mask is pre-shifted.
struct SampleClass {
  SampleKind kind = SampleKind::kRl;
  NoTokenReason why_empty = NoTokenReason::kNone;  // kNone exactly when kind is not kEmpty
  bool sft = false;                                // R = T > 0, whatever its mask
  // Its last mask entry is 1: counted at CP = 1, never owned at CP > 1.
  bool sft_not_preshifted = false;
  // "T = 0", "empty response", "fully masked", "SFT", "SFT, mask not pre-shifted", joined by ", ".
  std::string notes() const;
};

// Optional per-response-token float fields, by canonical name (SPEC §1).
inline const std::vector<std::string>& per_token_field_names() {
  static const std::vector<std::string> kNames = {"log_probs", "old_log_probs", "ref_log_probs",
                                                  "advantages", "token_loss"};
  return kNames;
}

struct SampleOrigin {
  int file_index = 0;         // into Batch::files
  int64_t index_in_file = 0;  // the sample's index inside that dump
};

// One optimizer step of a dump that holds several, with the trainer's own layout where the dump
// records it (SPEC §1 "Steps and layout"; slime's format-2 train dumps).
struct BatchStep {
  int64_t step = 0;              // as the dump numbers it
  std::vector<int64_t> samples;  // the step's global sample indices, ascending
  Placement placement;           // [dp][micro-batch] -> global sample indices; empty: none recorded
  int64_t global_batch_size = 0;  // as the dump states it (slime: rollouts over all DP ranks)
  std::string source;             // where the layout came from, for reports
};

struct Batch {
  std::vector<std::string> files;         // the dumps, in the order given
  std::vector<SampleOrigin> origins;      // [S]
  std::vector<int64_t> total_lengths;     // [S] T
  std::vector<int64_t> response_lengths;  // [S] R
  std::vector<int64_t> token_offsets;     // [S+1] into tokens
  std::vector<int64_t> response_offsets;  // [S+1] into loss_mask, logits rows and per-token fields
  std::vector<int64_t> tokens;            // [sum T]; empty when loaded without LoadNeeds::tokens
  std::vector<uint8_t> loss_mask;         // [sum R], 0/1; all ones where the dump had none
  bool loss_mask_given = false;           // false when no dump stated a loss mask
  std::optional<HostArray> logits;        // [sum R, V]
  std::map<std::string, HostArray> per_token;  // each [sum R]
  // Per-sample values a dump may state (SPEC §1); each is empty when no sample states it, else [S]
  // with 0 (padded length), -1 (denominator) or 0 (removed) where a sample does not.
  std::vector<int64_t> padded_total_lengths;  // the length the trainer padded to before CP sharding
  std::vector<double> sample_denoms;          // d_i of the sample-mean modes when it is not m_i
  std::vector<uint8_t> removed;               // the trainer dropped the sample: its mask is zeroed
  std::vector<BatchStep> steps;  // empty: the whole batch is one step with no recorded layout
  nlohmann::json metadata = nlohmann::json::object();  // batch-level metadata, per SPEC §1

  int64_t num_samples() const { return static_cast<int64_t>(total_lengths.size()); }
  int64_t num_response_tokens() const {
    return response_offsets.empty() ? 0 : response_offsets.back();
  }
  int64_t prompt_length(int64_t i) const { return total_lengths[i] - response_lengths[i]; }
  int64_t mask_sum(int64_t i) const;
  int64_t num_effective_tokens() const;  // response tokens whose loss mask is 1, all samples
  SampleClass classify(int64_t i, int64_t mask_sum) const;  // mask_sum: mask_sum(i)
  SampleKind kind(int64_t i) const { return classify(i, mask_sum(i)).kind; }
  SampleKind kind(int64_t i, int64_t mask_sum) const { return classify(i, mask_sum).kind; }
  int64_t vocab_size() const { return logits ? logits->shape[1] : 0; }
  // The padded length sample i states, or 0.
  int64_t padded_total_length(int64_t i) const {
    return padded_total_lengths.empty() ? 0 : padded_total_lengths[i];
  }
  // d_i of SPEC §3: the sample's own denominator if it states one, else m_i.
  double sample_denom(int64_t i, int64_t mask_sum) const {
    return sample_denoms.empty() || sample_denoms[i] < 0 ? static_cast<double>(mask_sum)
                                                         : sample_denoms[i];
  }
  bool is_removed(int64_t i) const { return !removed.empty() && removed[i] != 0; }
  // "file.pt sample 3" (the index within its own dump) for messages.
  std::string describe_sample(int64_t i) const;
  // A batch of the given samples, in that order, with every field (steps dropped). Sample i of the
  // result is samples[i] of this batch; its origin still names its dump.
  Batch subset(const std::vector<int64_t>& samples) const;
};

// What one dump states about one sample, before validation. Arrays are 1-D except logits [R, V].
struct SampleFields {
  const HostArray* tokens = nullptr;       // required
  std::optional<int64_t> total_length;     // when the dump states T separately
  std::optional<int64_t> response_length;  // required
  const HostArray* loss_mask = nullptr;    // absent: all ones
  const HostArray* logits = nullptr;
  std::map<std::string, const HostArray*> per_token;
  std::optional<int64_t> padded_total_length;
  std::optional<double> sample_denom;
  std::optional<bool> removed;
};

// What a packed dump states (SPEC §8 safetensors layout).
struct PackedFields {
  const HostArray* tokens = nullptr;            // [sum T]
  const HostArray* total_lengths = nullptr;     // [S]
  const HostArray* response_lengths = nullptr;  // [S]
  const HostArray* loss_masks = nullptr;        // [sum R], optional
  const HostArray* logits = nullptr;            // [sum R, V], optional
  std::map<std::string, const HostArray*> per_token;
  const HostArray* padded_total_lengths = nullptr;  // [S], optional
  const HostArray* sample_denoms = nullptr;         // [S], optional
  const HostArray* removed = nullptr;               // [S], optional
};

// Memory lossguard may use for batch data: $LOSSGUARD_MEMORY_LIMIT (bytes) if set, else
// MemAvailable from /proc/meminfo, else 0 (unknown: no limit).
uint64_t memory_budget_bytes();

// Which data a command needs. Everything is always validated; what is not needed is not copied
// (counting a 10M-token dump needs the masks, not 140 MB of token ids or gigabytes of logits).
struct LoadNeeds {
  bool tokens = true;
  bool logits = true;
  bool per_token = true;
};

// Which input the loss reads: nll uses logits when the batch has them, else log_probs. Throws
// InputError naming the missing fields.
LossInput loss_input(const Batch& batch, LossKind loss);
// The array a loss of that input is computed from and differentiated with respect to: the logits,
// log_probs or token_loss.
const HostArray& loss_input_array(const Batch& batch, LossInput which);

// Validates and appends samples, one dump after another, into one global batch. Every violation of
// SPEC §1 throws InputError naming the file, the sample (index within its dump), the field and
// values.
class BatchBuilder {
 public:
  explicit BatchBuilder(LoadNeeds needs = {}) : needs_(needs) {}
  void begin_file(const std::string& path);
  void add_sample(int64_t index_in_file, const SampleFields& fields);
  void add_packed(const PackedFields& fields);
  void add_metadata(const std::string& key, const nlohmann::json& value);
  // Steps with global sample indices (the dump's layout, SPEC §1); validated by finish().
  void add_steps(std::vector<BatchStep> steps);
  int64_t num_samples() const { return batch_.num_samples(); }
  Batch finish();

 private:
  void append_float_rows(const std::string& field, const HostArray& src, int64_t index_in_file);
  [[noreturn]] void fail_sample(int64_t index_in_file, const std::string& what) const;
  void mark_partial(const std::string& field, const std::string& reason);
  // Validates and stores sample `global`'s optional per-sample values (SPEC §1).
  void set_sample_values(int64_t global, int64_t index_in_file, std::optional<int64_t> padded,
                         std::optional<double> denom, std::optional<bool> removed);
  // add_sample's fields after the lengths, each checked then appended; rows_before is the
  // batch's response rows before this sample.
  void append_sample_mask(int64_t index_in_file, const HostArray* mask, int64_t r);
  void add_sample_logits(int64_t index_in_file, const HostArray* logits, int64_t r,
                         int64_t rows_before);
  void add_sample_per_token(int64_t index_in_file,
                            const std::map<std::string, const HostArray*>& per_token, int64_t r,
                            int64_t rows_before);
  // add_packed's checks, in its order: the per-token fields of sum_r rows (others are marked
  // partial), then what the dump must share with earlier dumps (logits, vocabulary, fields).
  std::map<std::string, const HostArray*> packed_per_token(
      const std::map<std::string, const HostArray*>& fields, int64_t sum_r);
  void check_packed_against_earlier(const HostArray* logits,
                                    const std::map<std::string, const HostArray*>& per_token,
                                    int64_t rows_before, int64_t sum_r);
  // add_packed's appends, in its order; s0 is the batch's sample count before the dump.
  void append_packed_lengths(const HostArray& total_lengths, const HostArray& response_lengths,
                             const HostArray& tokens, int64_t sum_t);
  void append_packed_mask(const HostArray* mask, std::size_t s0, int64_t sum_r,
                          int64_t rows_before);
  void set_packed_sample_values(const PackedFields& fields, int64_t s, std::size_t s0);
  void append_packed_rows(const HostArray* logits,
                          const std::map<std::string, const HostArray*>& per_token, int64_t sum_r);

  LoadNeeds needs_;
  Batch batch_;
  bool any_mask_ = false;
  std::vector<std::byte> logits_bytes_;
  // The first dump's packed logits, as they are (memory-mapped): copied only if another dump adds
  // rows, so a dump's logits are never held twice.
  std::optional<HostArray> borrowed_logits_;
  std::map<std::string, std::vector<std::byte>> per_token_bytes_;
  std::map<std::string, DType> per_token_dtype_;
  std::map<std::string, int64_t> per_token_rows_;
  std::map<std::string, std::string> partial_;  // per-token fields some samples lack: dropped
  std::optional<DType> logits_dtype_;
  int64_t vocab_size_ = -1;
  int64_t logits_rows_ = 0;
};

}  // namespace lossguard
