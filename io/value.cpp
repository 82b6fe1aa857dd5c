// Value helpers: lookup, names for messages, and a destructor that never recurses (hostile pickles
// can nest containers a million deep).
#include "io/value.h"

namespace lossguard::io {

const Value* Value::get(std::string_view key) const {
  if (kind != Kind::kDict) return nullptr;
  for (const auto& [k, v] : entries) {
    if (k && k->kind == Kind::kString && k->s == key) return v.get();
  }
  return nullptr;
}

std::string Value::type_name() const {
  switch (kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kBigInt:
      return "int (over 64 bits)";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kBytes:
      return "bytes";
    case Kind::kList:
      return "list";
    case Kind::kTuple:
      return "tuple";
    case Kind::kDict:
      return "dict";
    case Kind::kTensor:
      return is_parameter ? "nn.Parameter" : "tensor";
    case Kind::kStorage:
      return "storage";
    case Kind::kGlobal:
      return "global " + s;
    case Kind::kOpaque:
      return "opaque object " + s;
  }
  return "?";
}

Value::~Value() {
  // Tear down children iteratively: steal the grandchildren of every child about to die.
  std::vector<ValuePtr> pending;
  pending.reserve(items.size() + 2 * entries.size());
  for (auto& p : items) pending.push_back(std::move(p));
  for (auto& [k, v] : entries) {
    pending.push_back(std::move(k));
    pending.push_back(std::move(v));
  }
  while (!pending.empty()) {
    ValuePtr p = std::move(pending.back());
    pending.pop_back();
    if (p && p.use_count() == 1) {
      for (auto& c : p->items) pending.push_back(std::move(c));
      for (auto& [k, v] : p->entries) {
        pending.push_back(std::move(k));
        pending.push_back(std::move(v));
      }
      p->items.clear();
      p->entries.clear();
    }
  }
}

}  // namespace lossguard::io
