// Reading dumps of any supported format into one validated global Batch, and writing batches.
#pragma once
#include <map>
#include <string>
#include <vector>

#include "core/batch.h"
#include "io/value.h"

namespace lossguard::io {

enum class DumpFormat { kSafetensors, kTorchSave, kJson };
const char* dump_format_name(DumpFormat f);

// `--field NAME=KEY`: read the batch-model field NAME from the dump's key KEY.
struct FieldMap {
  std::map<std::string, std::string> keys;
  void add(const std::string&
               spec);  // "loss_mask=mask"; throws InputError on a bad spec or unknown NAME
};
const std::vector<std::string>& batch_field_names();  // the NAMEs --field accepts

struct FieldInfo {
  std::string name;   // "tokens", "samples[*].loss_mask"
  std::string dtype;  // "int64", "list[int]", "str", ...
  std::string shape;  // "[1234]", "[S, var]", ""
};

struct Dump {
  std::string path;
  DumpFormat format = DumpFormat::kJson;
  ValuePtr tree;
  std::vector<FieldInfo> fields;
};

// Directories stand for their dump files (*.safetensors, *.pt, *.pth, *.json) in name order.
std::vector<std::string> expand_dump_paths(const std::vector<std::string>& paths);
DumpFormat detect_format(const std::string& path);  // by content first, then extension
Dump read_dump(const std::string& path);
// Validates and concatenates the dumps, in order, into one global batch.
Batch build_batch(const std::vector<Dump>& dumps, const FieldMap& fields, LoadNeeds needs = {});

// Writers, chosen by the extension of `path` (.safetensors, .pt, .json).
void write_batch(const Batch& batch, const std::string& path);

// JSON text <-> Value (numbers: ints stay ints).
ValuePtr json_to_value(const std::string& text, const std::string& what);

}  // namespace lossguard::io
