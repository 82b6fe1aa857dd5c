// The tree every dump format is read into (a pickle, a JSON document, a safetensors file):
// Python-like values plus tensors and opaque objects, so one converter turns any of them into a
// Batch.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/array.h"

namespace lossguard::io {

struct Value;
using ValuePtr = std::shared_ptr<Value>;

struct Value {
  enum class Kind {
    kNone,
    kBool,
    kInt,
    kBigInt,
    kFloat,
    kString,
    kBytes,
    kList,
    kTuple,
    kDict,
    kTensor,
    kStorage,
    kGlobal,
    kOpaque
  };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  double f = 0.0;
  std::string s;  // string, bytes, big int (hex, little-endian two's complement), global or opaque
                  // type name
  std::vector<ValuePtr> items;                         // list, tuple
  std::vector<std::pair<ValuePtr, ValuePtr>> entries;  // dict, insertion order
  HostArray array;                                     // tensor, storage (1-D)
  bool is_parameter = false;                           // tensor came from nn.Parameter
  uint32_t depth = 0;                                  // container nesting below this value

  Value() = default;
  Value(const Value&) = default;
  ~Value();

  static ValuePtr none() { return std::make_shared<Value>(); }
  static ValuePtr make_bool(bool v) {
    auto p = std::make_shared<Value>();
    p->kind = Kind::kBool;
    p->b = v;
    return p;
  }
  static ValuePtr make_int(int64_t v) {
    auto p = std::make_shared<Value>();
    p->kind = Kind::kInt;
    p->i = v;
    return p;
  }
  static ValuePtr make_float(double v) {
    auto p = std::make_shared<Value>();
    p->kind = Kind::kFloat;
    p->f = v;
    return p;
  }
  static ValuePtr make_string(std::string v, Kind k = Kind::kString) {
    auto p = std::make_shared<Value>();
    p->kind = k;
    p->s = std::move(v);
    return p;
  }
  static ValuePtr make_list(Kind k = Kind::kList) {
    auto p = std::make_shared<Value>();
    p->kind = k;
    return p;
  }
  static ValuePtr make_dict() {
    auto p = std::make_shared<Value>();
    p->kind = Kind::kDict;
    return p;
  }
  static ValuePtr make_tensor(HostArray a) {
    auto p = std::make_shared<Value>();
    p->kind = Kind::kTensor;
    p->array = std::move(a);
    return p;
  }

  bool is_dict() const { return kind == Kind::kDict; }
  bool is_sequence() const { return kind == Kind::kList || kind == Kind::kTuple; }
  bool is_number() const {
    return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool;
  }
  const Value* get(std::string_view key) const;  // dict entry with a string key, or nullptr
  std::string type_name() const;                 // "int", "list", "tensor", "opaque os.system", ...
};

}  // namespace lossguard::io
