// Inside the dump loader (io/dump.cpp), not its API: a Value tree's fields and values as the batch
// model reads them (field names and aliases, arrays, lengths, metadata), slime's format-2 steps,
// and the reassembly of CP-local per-token fields from per-rank dumps.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "core/batch.h"
#include "io/dump.h"
#include "io/value.h"

namespace lossguard::io::dump_detail {

// A batch field and the keys it is read from. Two of those keys in one dict are the same field
// twice (an input error naming both), except where `distinct` says the keys hold different
// quantities a dump may carry side by side (slime keeps the inference engine's rollout_log_probs
// beside the trainer's old_log_probs): then the first listed wins.
struct FieldSpec {
  const char* name;
  std::vector<const char*> aliases;
  bool distinct = false;
};
const std::vector<FieldSpec>& field_specs();
bool is_field_key(const std::string& key, const FieldMap& map);
// Finds a batch-model field in a dict: the --field override if given, else the alias present (two
// present: an input error naming both, unless the spec is `distinct`). `key_used` gets the key.
const Value* find_field(const Value& dict, const std::string& name, const FieldMap& map,
                        std::string* key_used, const std::string& where = "");
std::string opaque_hint(const Value& v);
// A tensor, a (nested) list of numbers, or a number, as a HostArray. `where` prefixes messages.
HostArray to_array(const Value& v, const std::string& where);
// A packed field given as a list of per-sample arrays (how slime and Relax hold rollout_data).
HostArray to_packed_array(const Value& v, const std::string& where);
int64_t to_length(const Value& v, const std::string& where);
double to_scalar(const Value& v, const std::string& where);
nlohmann::json to_metadata(const Value& v);
std::vector<int64_t> to_int_list(const Value& v, const std::string& where);

// slime's format-2 train dump: its optimizer steps with the trainer's DP x micro-batch layout
// (io/slime_steps.cpp). `first` is the batch index of samples[0].
std::vector<BatchStep> slime_format2_steps(const Value& root, const Value& samples,
                                           const std::string& path, int64_t first);

// The response rows CP rank `c` of `cp` holds for a sample of lengths (t, r), in the order its
// CP-local tensors hold them (io/cp_local.cpp).
std::vector<int64_t> cp_local_rows(int64_t t, int64_t r, int64_t cp, int64_t c);
// One DP rank's per-rank dumps (the lowest rank first) hold CP-local per-token fields: the full
// [sum R] field when the members' lengths fit a TP x CP split of the group; else the reason.
std::optional<HostArray> reassemble_cp_local(const std::vector<const Dump*>& members,
                                             const Batch& samples, const std::string& name,
                                             const FieldMap& map, std::string* why);

}  // namespace lossguard::io::dump_detail
