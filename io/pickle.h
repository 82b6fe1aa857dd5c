// A restricted unpickler (protocols 2-5): builds a Value tree and never calls Python code. Only an
// allow-list of globals is understood (OrderedDict, torch's tensor/parameter rebuilders, storage
// types); any other call becomes an opaque value, and a global that could run code is refused by
// name.
#pragma once
#include <functional>
#include <string>
#include <string_view>

#include "io/value.h"

namespace lossguard::io {

struct UnpickleLimits {
  std::size_t max_depth = 1000;             // nesting of containers
  std::size_t max_string_bytes = 1u << 30;  // one string or bytes object
  std::size_t max_items = 1u << 28;         // values created
};

// `persistent_load` turns a persistent id (torch.save's storage tuples) into a value.
using PersistentLoad = std::function<ValuePtr(const ValuePtr& pid)>;

// Throws InputError (naming `what`, the byte offset and the opcode) on malformed or hostile input.
ValuePtr unpickle(std::string_view bytes, const std::string& what,
                  const PersistentLoad& persistent_load, const UnpickleLimits& limits = {});

// True for globals whose call could execute code or touch the system (os.system, builtins.eval,
// ...).
bool is_dangerous_global(std::string_view module, std::string_view name);

// Minimal pickler (protocol 2) used by `gen` to write torch.save-compatible archives: dicts with
// string keys, lists, ints, floats, strings, None, bools and tensors (as persistent ids, see
// torch_zip.h).
struct PickleWriter {
  std::string out;
  void proto();
  void stop() { out.push_back('.'); }
  void none() { out.push_back('N'); }
  void boolean(bool v) { out.push_back(v ? '\x88' : '\x89'); }
  void integer(int64_t v);
  void floating(double v);
  void string(std::string_view s);
  void global(std::string_view module, std::string_view name);
  void mark() { out.push_back('('); }
  void empty_dict() { out.push_back('}'); }
  void empty_list() { out.push_back(']'); }
  void setitems() { out.push_back('u'); }
  void appends() { out.push_back('e'); }
  void tuple() { out.push_back('t'); }
  void reduce() { out.push_back('R'); }
  void binpersid() { out.push_back('Q'); }
};

}  // namespace lossguard::io
