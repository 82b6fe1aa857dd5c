// Restricted unpickler: a stack machine over the pickle opcodes of protocols 2-5 that builds Values
// and calls nothing. See io/pickle.h for the allow-list policy.
#include "io/pickle.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <array>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "core/errors.h"

namespace lossguard::io {

using Kind = Value::Kind;

bool is_dangerous_global(std::string_view module, std::string_view name) {
  static const std::array<std::string_view, 40> kModules = {
      "os",        "posix",      "nt",       "subprocess",
      "sys",       "shutil",     "socket",   "importlib",
      "ctypes",    "runpy",      "code",     "codeop",
      "pty",       "webbrowser", "commands", "multiprocessing",
      "threading", "signal",     "pickle",   "_pickle",
      "marshal",   "types",      "platform", "asyncio",
      "tempfile",  "io",         "pathlib",  "glob",
      "urllib",    "http",       "ftplib",   "smtplib",
      "telnetlib", "pdb",        "timeit",   "cProfile",
      "profile",   "trace",      "dill",     "_posixsubprocess"};
  for (std::string_view m : kModules) {
    if (module == m ||
        (module.size() > m.size() && module.substr(0, m.size()) == m && module[m.size()] == '.')) {
      return true;
    }
  }
  if (module == "builtins" || module == "__builtin__") {
    static const std::array<std::string_view, 19> kNames = {
        "eval",       "exec", "execfile", "compile",    "getattr", "setattr", "delattr",
        "__import__", "open", "input",    "breakpoint", "globals", "locals",  "vars",
        "apply",      "file", "reload",   "exit",       "quit"};
    for (std::string_view n : kNames) {
      if (name == n) return true;
    }
  }
  if (module == "operator" && (name == "attrgetter" || name == "methodcaller")) return true;
  if (module == "functools") return true;
  if (module == "torch.hub" || module.substr(0, 9) == "torch.jit" ||
      module.substr(0, 9) == "torch.ops")
    return true;
  if ((module == "torch" || module == "numpy") && (name == "load" || name == "save")) return true;
  if (module.substr(0, 5) == "numpy" && name == "runstring") return true;
  return false;
}

namespace {

class Unpickler {
 public:
  Unpickler(std::string_view bytes, const std::string& what, const PersistentLoad& pl,
            const UnpickleLimits& lim)
      : in_(bytes), what_(what), persistent_load_(pl), limits_(lim) {}

  // Memo references let a pickle build reference cycles, which shared_ptr cannot free. Every
  // container is kept here; those not reachable from the result (all of them after an error) are
  // emptied at the end.
  ~Unpickler() {
    for (auto& c : containers_) {
      if (!reachable_.count(c.get())) {
        c->items.clear();
        c->entries.clear();
      }
    }
  }

  ValuePtr run() {
    ValuePtr result = run_opcodes();
    check_acyclic(result);
    return result;
  }

 private:
  // Marks what the result reaches, and refuses a result that contains a cycle (no batch has one).
  void check_acyclic(const ValuePtr& root) {
    std::unordered_map<const Value*, int> state;  // 1: on the path, 2: done
    std::vector<std::pair<const Value*, std::size_t>> path = {{root.get(), 0}};
    state[root.get()] = 1;
    auto children = [](const Value* v) { return v->items.size() + 2 * v->entries.size(); };
    auto child = [](const Value* v, std::size_t k) -> const Value* {
      if (k < v->items.size()) return v->items[k].get();
      k -= v->items.size();
      return k % 2 == 0 ? v->entries[k / 2].first.get() : v->entries[k / 2].second.get();
    };
    while (!path.empty()) {
      auto& [v, next] = path.back();
      if (next == children(v)) {
        state[v] = 2;
        reachable_.insert(v);
        path.pop_back();
        continue;
      }
      const Value* c = child(v, next++);
      if (c == nullptr || !(c->is_sequence() || c->is_dict())) continue;
      const int s = state[c];
      if (s == 1) {
        reachable_.clear();
        throw InputError(fmt::format(
            "{}: malformed pickle: a container contains itself (a reference cycle)", what_));
      }
      if (s == 0) {
        state[c] = 1;
        path.emplace_back(c, 0);
      }
    }
  }

  ValuePtr run_opcodes() {
    while (true) {
      if (pos_ >= in_.size()) fail("ends before the STOP opcode (truncated pickle)");
      op_pos_ = pos_;
      op_ = static_cast<uint8_t>(in_[pos_++]);
      if (op_ == '.') break;
      step();
    }
    if (stack_.size() != 1 || !marks_.empty())
      fail(fmt::format("STOP with {} values on the stack", stack_.size()));
    return stack_.back();
  }

  [[noreturn]] void fail(const std::string& why) const {
    throw InputError(fmt::format("{}: malformed pickle at byte {} (opcode 0x{:02x}): {}", what_,
                                 op_pos_, op_, why));
  }

  std::string_view take(std::size_t n) {
    if (n > in_.size() - pos_)
      fail(fmt::format("needs {} bytes, {} left (truncated pickle)", n, in_.size() - pos_));
    std::string_view s = in_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  uint64_t uint_le(std::size_t n) {
    std::string_view s = take(n);
    uint64_t v = 0;
    for (std::size_t k = 0; k < n; ++k)
      v |= static_cast<uint64_t>(static_cast<uint8_t>(s[k])) << (8 * k);
    return v;
  }
  std::string_view line() {
    std::size_t end = in_.find('\n', pos_);
    if (end == std::string_view::npos) fail("text argument has no newline (truncated pickle)");
    std::string_view s = in_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return s;
  }
  std::size_t checked_length(uint64_t n) {
    if (n > limits_.max_string_bytes)
      fail(fmt::format("a string or bytes object of {} bytes exceeds the limit of {}", n,
                       limits_.max_string_bytes));
    return static_cast<std::size_t>(n);
  }

  ValuePtr pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back()))
      fail("stack underflow");
    ValuePtr v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  ValuePtr& top() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() <= marks_.back()))
      fail("stack underflow");
    return stack_.back();
  }
  std::vector<ValuePtr> pop_mark() {
    if (marks_.empty()) fail("no MARK on the stack");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    std::vector<ValuePtr> items(std::make_move_iterator(stack_.begin() + m),
                                std::make_move_iterator(stack_.end()));
    stack_.resize(m);
    return items;
  }
  void push(ValuePtr v) {
    if (++created_ > limits_.max_items) fail(fmt::format("more than {} values", limits_.max_items));
    // Every container, the first time it is pushed (not "use_count() == 1": the LIST, DICT and
    // FROZENSET opcodes push a container their own local still holds, and a LIST that DUP and
    // APPEND then put inside itself leaked).
    if ((v->is_sequence() || v->is_dict()) && registered_.insert(v.get()).second)
      containers_.push_back(v);
    stack_.push_back(std::move(v));
  }
  void note_child(Value& parent, const ValuePtr& child) {
    const std::size_t d = child ? child->depth + 1 : 1;
    if (d > parent.depth) parent.depth = static_cast<uint32_t>(d);
    if (parent.depth > limits_.max_depth)
      fail(fmt::format("containers nested deeper than {}", limits_.max_depth));
  }
  ValuePtr make_tuple(std::vector<ValuePtr> items) {
    auto t = Value::make_list(Kind::kTuple);
    for (auto& x : items) note_child(*t, x);
    t->items = std::move(items);
    return t;
  }
  void memo_put(uint64_t key) {
    if (stack_.empty()) fail("PUT on an empty stack");
    memo_[key] = stack_.back();
  }
  void memo_get(uint64_t key) {
    auto it = memo_.find(key);
    if (it == memo_.end()) fail(fmt::format("memo key {} was never stored", key));
    push(it->second);
  }
  void append_to(const ValuePtr& list, std::vector<ValuePtr> items) {
    if (list->kind == Kind::kList) {
      for (auto& x : items) {
        note_child(*list, x);
        list->items.push_back(std::move(x));
      }
    } else if (list->kind != Kind::kOpaque) {
      fail(fmt::format("APPEND to a {}", list->type_name()));
    }
  }
  void setitems(const ValuePtr& dict, std::vector<ValuePtr> kv) {
    if (kv.size() % 2 != 0) fail("SETITEMS with an odd number of values");
    if (dict->kind == Kind::kOpaque) return;
    if (dict->kind != Kind::kDict) fail(fmt::format("SETITEM on a {}", dict->type_name()));
    for (std::size_t k = 0; k < kv.size(); k += 2) {
      note_child(*dict, kv[k + 1]);
      // A later value for an equal string key replaces the earlier one, as in Python.
      bool replaced = false;
      if (kv[k]->kind == Kind::kString) {
        for (auto& e : dict->entries) {
          if (e.first->kind == Kind::kString && e.first->s == kv[k]->s) {
            e.second = kv[k + 1];
            replaced = true;
            break;
          }
        }
      }
      if (!replaced) dict->entries.emplace_back(std::move(kv[k]), std::move(kv[k + 1]));
    }
  }
  ValuePtr make_global(std::string module, std::string name) {
    if (is_dangerous_global(module, name)) {
      throw InputError(
          fmt::format("{}: refused: the pickle names the global {}.{}, which can execute code; "
                      "nothing was executed",
                      what_, module, name));
    }
    return Value::make_string(module + "." + name, Kind::kGlobal);
  }

  ValuePtr call(const ValuePtr& callable, const ValuePtr& args);
  ValuePtr rebuild_tensor(const std::vector<ValuePtr>& a, bool has_requires_grad);
  void step();

  std::string_view in_;
  const std::string& what_;
  const PersistentLoad& persistent_load_;
  UnpickleLimits limits_;
  std::size_t pos_ = 0, op_pos_ = 0, created_ = 0;
  uint8_t op_ = 0;
  std::vector<ValuePtr> stack_;
  std::vector<std::size_t> marks_;
  std::unordered_map<uint64_t, ValuePtr> memo_;
  std::vector<ValuePtr> containers_;
  std::unordered_set<const Value*> registered_;  // the containers in containers_
  std::unordered_set<const Value*> reachable_;
};

ValuePtr Unpickler::rebuild_tensor(const std::vector<ValuePtr>& a, bool) {
  // _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, backward_hooks[,
  // metadata])
  if (a.size() < 4) fail(fmt::format("_rebuild_tensor with {} arguments", a.size()));
  auto as_int = [this](const ValuePtr& v, const char* what, const void*) -> int64_t {
    if (!v || (v->kind != Kind::kInt && v->kind != Kind::kBool)) {
      fail(fmt::format("_rebuild_tensor: {} is a {}, expected an int", what,
                       v ? v->type_name() : "null"));
    }
    return v->kind == Kind::kBool ? v->b : v->i;
  };
  const ValuePtr& storage = a[0];
  if (!storage || storage->kind != Kind::kStorage)
    fail(fmt::format("_rebuild_tensor of a {}, not a storage",
                     storage ? storage->type_name() : "null"));
  if (!a[2]->is_sequence() || !a[3]->is_sequence())
    fail("_rebuild_tensor: size and stride must be tuples");
  const int64_t offset = as_int(a[1], "storage_offset", this);
  std::vector<int64_t> size, stride;
  for (const auto& x : a[2]->items) size.push_back(as_int(x, "size", this));
  for (const auto& x : a[3]->items) stride.push_back(as_int(x, "stride", this));
  if (size.size() != stride.size())
    fail(fmt::format("_rebuild_tensor: {} sizes but {} strides", size.size(), stride.size()));
  const HostArray& st = storage->array;
  const int64_t storage_numel = st.numel();
  int64_t numel = 1, max_index = offset;
  bool contiguous = true;
  int64_t expected = 1;
  for (std::size_t d = size.size(); d-- > 0;) {
    if (size[d] < 0 || stride[d] < 0)
      fail(fmt::format("_rebuild_tensor: negative size or stride in dimension {}", d));
    if (size[d] > (int64_t{1} << 40))
      fail(fmt::format("_rebuild_tensor: size {} too large", size[d]));
    numel *= size[d];
    if (numel > (int64_t{1} << 40)) fail("_rebuild_tensor: too many elements");
    if (size[d] != 1 && stride[d] != expected) contiguous = false;
    expected *= size[d];
  }
  if (offset < 0) fail(fmt::format("_rebuild_tensor: negative storage offset {}", offset));
  if (numel > 0) {
    for (std::size_t d = 0; d < size.size(); ++d) max_index += (size[d] - 1) * stride[d];
    if (max_index >= storage_numel) {
      fail(fmt::format(
          "tensor of size [{}] stride [{}] offset {} reads element {} of a storage of {} elements",
          fmt::join(size, ", "), fmt::join(stride, ", "), offset, max_index, storage_numel));
    }
  }
  HostArray out;
  out.dtype = st.dtype;
  out.shape = size;
  const std::size_t es = dtype_size_bytes(st.dtype);
  if (contiguous || numel == 0) {
    out.owner = st.owner;
    out.data = st.data + static_cast<std::size_t>(offset) * es;
  } else {
    out = HostArray::zeros(st.dtype, size);
    std::vector<int64_t> idx(size.size(), 0);
    for (int64_t k = 0; k < numel; ++k) {
      int64_t src = offset;
      for (std::size_t d = 0; d < size.size(); ++d) src += idx[d] * stride[d];
      std::memcpy(out.mutable_data() + static_cast<std::size_t>(k) * es,
                  st.data + static_cast<std::size_t>(src) * es, es);
      for (std::size_t d = size.size(); d-- > 0;) {
        if (++idx[d] < size[d]) break;
        idx[d] = 0;
      }
    }
  }
  return Value::make_tensor(std::move(out));
}

ValuePtr Unpickler::call(const ValuePtr& callable, const ValuePtr& args) {
  if (callable->kind != Kind::kGlobal) {
    return Value::make_string(callable->kind == Kind::kOpaque ? callable->s : callable->type_name(),
                              Kind::kOpaque);
  }
  const std::string& g = callable->s;
  if (!args->is_sequence())
    fail(fmt::format("call of {} with {} arguments instead of a tuple", g, args->type_name()));
  const auto& a = args->items;
  if (g == "torch._utils._rebuild_tensor_v2" || g == "torch._utils._rebuild_tensor")
    return rebuild_tensor(a, true);
  if (g == "torch._utils._rebuild_parameter" || g == "torch._utils._rebuild_parameter_with_state") {
    if (a.empty() || a[0]->kind != Kind::kTensor) fail("_rebuild_parameter without a tensor");
    auto t = std::make_shared<Value>(*a[0]);
    t->is_parameter = true;
    return t;
  }
  if (g == "torch._tensor._rebuild_from_type_v2" || g == "torch._tensor._rebuild_from_type") {
    if (a.size() < 3) fail("_rebuild_from_type with too few arguments");
    ValuePtr inner = call(a[0], a[2]);
    return inner;
  }
  if (g == "collections.OrderedDict" || g == "builtins.dict") {
    auto d = Value::make_dict();
    if (!a.empty() && a[0]->is_sequence()) {
      for (const auto& kv : a[0]->items) {
        if (kv->is_sequence() && kv->items.size() == 2) setitems(d, {kv->items[0], kv->items[1]});
      }
    }
    return d;
  }
  if (g == "torch.Size" || g == "builtins.tuple" || g == "builtins.list" || g == "builtins.set" ||
      g == "builtins.frozenset" || g == "__builtin__.set") {
    auto l =
        Value::make_list(g == "torch.Size" || g == "builtins.tuple" ? Kind::kTuple : Kind::kList);
    if (!a.empty() && a[0]->is_sequence()) {
      for (const auto& x : a[0]->items) note_child(*l, x);
      l->items = a[0]->items;
    }
    return l;
  }
  if (g == "_codecs.encode" && !a.empty() && a[0]->kind == Kind::kString) {
    // Protocol-2 bytes: encode(str, 'latin1') maps each code point below 256 to one byte.
    std::string bytes;
    const std::string& s = a[0]->s;
    for (std::size_t k = 0; k < s.size(); ++k) {
      const auto c = static_cast<uint8_t>(s[k]);
      if (c < 0x80)
        bytes.push_back(static_cast<char>(c));
      else if ((c & 0xe0) == 0xc0 && k + 1 < s.size()) {
        bytes.push_back(
            static_cast<char>(((c & 0x1f) << 6) | (static_cast<uint8_t>(s[k + 1]) & 0x3f)));
        ++k;
      } else
        fail("_codecs.encode of a string outside latin-1");
    }
    return Value::make_string(std::move(bytes), Kind::kBytes);
  }
  if (g == "builtins.bytearray" || g == "builtins.bytes") {
    if (!a.empty() && a[0]->kind == Kind::kBytes) return Value::make_string(a[0]->s, Kind::kBytes);
  }
  return Value::make_string(g, Kind::kOpaque);
}

// Long: one case per pickle opcode, as CPython's own load loop (Modules/_pickle.c): the opcode
// table reads whole.
void Unpickler::step() {
  switch (op_) {
    case 0x80: {  // PROTO
      const uint64_t p = uint_le(1);
      if (p < 2 || p > 5)
        fail(fmt::format("pickle protocol {} (lossguard reads protocols 2 to 5)", p));
      return;
    }
    case 0x95:
      take(8);
      return;  // FRAME: framing is only a read-ahead hint
    case '(':
      marks_.push_back(stack_.size());
      return;
    case '0':
      pop();
      return;
    case '1':
      pop_mark();
      return;
    case '2':
      push(top());
      return;
    case 'N':
      push(Value::none());
      return;
    case 0x88:
      push(Value::make_bool(true));
      return;
    case 0x89:
      push(Value::make_bool(false));
      return;
    case 'J':
      push(Value::make_int(static_cast<int32_t>(uint_le(4))));
      return;
    case 'K':
      push(Value::make_int(static_cast<int64_t>(uint_le(1))));
      return;
    case 'M':
      push(Value::make_int(static_cast<int64_t>(uint_le(2))));
      return;
    case 'I':
    case 'L': {
      std::string s(line());
      if (!s.empty() && s.back() == 'L') s.pop_back();
      if (s == "01" && op_ == 'I') {
        push(Value::make_bool(true));
        return;
      }
      if (s == "00" && op_ == 'I') {
        push(Value::make_bool(false));
        return;
      }
      try {
        std::size_t used = 0;
        const long long v = std::stoll(s, &used);
        if (used != s.size()) fail(fmt::format("bad integer literal '{}'", s));
        push(Value::make_int(v));
      } catch (const std::out_of_range&) {
        push(Value::make_string(s, Kind::kBigInt));
      } catch (const std::invalid_argument&) {
        fail(fmt::format("bad integer literal '{}'", s));
      }
      return;
    }
    case 0x8a:
    case 0x8b: {  // LONG1, LONG4: little-endian two's complement
      const std::size_t n = checked_length(uint_le(op_ == 0x8a ? 1 : 4));
      std::string_view b = take(n);
      if (n == 0) {
        push(Value::make_int(0));
        return;
      }
      if (n <= 8) {
        uint64_t v = 0;
        for (std::size_t k = 0; k < n; ++k)
          v |= static_cast<uint64_t>(static_cast<uint8_t>(b[k])) << (8 * k);
        if (n < 8 && (static_cast<uint8_t>(b[n - 1]) & 0x80)) v |= ~uint64_t{0} << (8 * n);
        push(Value::make_int(static_cast<int64_t>(v)));
      } else {
        std::string hex;
        for (std::size_t k = n; k-- > 0;) hex += fmt::format("{:02x}", static_cast<uint8_t>(b[k]));
        push(Value::make_string("0x" + hex, Kind::kBigInt));
      }
      return;
    }
    case 'F': {
      std::string s(line());
      try {
        push(Value::make_float(std::stod(s)));
      } catch (const std::exception&) {
        fail(fmt::format("bad float literal '{}'", s));
      }
      return;
    }
    case 'G': {
      std::string_view b = take(8);
      uint64_t bits = 0;
      for (int k = 0; k < 8; ++k) bits = (bits << 8) | static_cast<uint8_t>(b[k]);
      double d;
      std::memcpy(&d, &bits, 8);
      push(Value::make_float(d));
      return;
    }
    case 'T':
      push(Value::make_string(std::string(take(checked_length(uint_le(4))))));
      return;
    case 'U':
      push(Value::make_string(std::string(take(uint_le(1)))));
      return;
    case 'X':
      push(Value::make_string(std::string(take(checked_length(uint_le(4))))));
      return;
    case 0x8c:
      push(Value::make_string(std::string(take(uint_le(1)))));
      return;
    case 0x8d:
      push(Value::make_string(std::string(take(checked_length(uint_le(8))))));
      return;
    case 'B':
      push(Value::make_string(std::string(take(checked_length(uint_le(4)))), Kind::kBytes));
      return;
    case 'C':
      push(Value::make_string(std::string(take(uint_le(1))), Kind::kBytes));
      return;
    case 0x8e:
    case 0x96:
      push(Value::make_string(std::string(take(checked_length(uint_le(8)))), Kind::kBytes));
      return;
    case 'S': {
      std::string s(line());
      if (s.size() >= 2 && (s.front() == '\'' || s.front() == '"') && s.back() == s.front())
        s = s.substr(1, s.size() - 2);
      push(Value::make_string(s));
      return;
    }
    case 'V':
      push(Value::make_string(std::string(line())));
      return;
    case ']':
      push(Value::make_list());
      return;
    case ')':
      push(Value::make_list(Kind::kTuple));
      return;
    case '}':
      push(Value::make_dict());
      return;
    case 0x8f:
      push(Value::make_list());
      return;  // EMPTY_SET, read as a list
    case 'l': {
      auto l = Value::make_list();
      append_to(l, pop_mark());
      push(l);
      return;
    }
    case 't':
      push(make_tuple(pop_mark()));
      return;
    case 0x85: {
      auto a = pop();
      push(make_tuple({a}));
      return;
    }
    case 0x86: {
      auto b = pop();
      auto a = pop();
      push(make_tuple({a, b}));
      return;
    }
    case 0x87: {
      auto c = pop();
      auto b = pop();
      auto a = pop();
      push(make_tuple({a, b, c}));
      return;
    }
    case 0x91: {
      auto l = Value::make_list();
      append_to(l, pop_mark());
      push(l);
      return;
    }  // FROZENSET
    case 'd': {
      auto d = Value::make_dict();
      setitems(d, pop_mark());
      push(d);
      return;
    }
    case 'a': {
      auto v = pop();
      append_to(top(), {v});
      return;
    }
    case 'e':
    case 0x90: {
      auto items = pop_mark();
      append_to(top(), std::move(items));
      return;
    }
    case 's': {
      auto v = pop();
      auto k = pop();
      setitems(top(), {k, v});
      return;
    }
    case 'u': {
      auto kv = pop_mark();
      setitems(top(), std::move(kv));
      return;
    }
    case 'p': {
      std::string s(line());
      try {
        memo_put(std::stoull(s));
      } catch (const std::exception&) {
        fail("bad PUT key");
      }
      return;
    }
    case 'q':
      memo_put(uint_le(1));
      return;
    case 'r':
      memo_put(uint_le(4));
      return;
    case 0x94:
      memo_put(memo_.size());
      return;
    case 'g': {
      std::string s(line());
      try {
        memo_get(std::stoull(s));
      } catch (const InputError&) {
        throw;
      } catch (const std::exception&) {
        fail("bad GET key");
      }
      return;
    }
    case 'h':
      memo_get(uint_le(1));
      return;
    case 'j':
      memo_get(uint_le(4));
      return;
    case 'c': {
      std::string module(line());
      std::string name(line());
      push(make_global(std::move(module), std::move(name)));
      return;
    }
    case 0x93: {
      auto name = pop();
      auto module = pop();
      if (module->kind != Kind::kString || name->kind != Kind::kString)
        fail("STACK_GLOBAL needs two strings");
      push(make_global(module->s, name->s));
      return;
    }
    case 'R': {
      auto args = pop();
      auto fn = pop();
      push(call(fn, args));
      return;
    }
    case 0x81: {  // NEWOBJ cls.__new__(cls, *args): never called, kept opaque
      pop();
      auto cls = pop();
      push(Value::make_string(cls->kind == Kind::kGlobal ? cls->s : cls->type_name(),
                              Kind::kOpaque));
      return;
    }
    case 0x92: {  // NEWOBJ_EX
      pop();
      pop();
      auto cls = pop();
      push(Value::make_string(cls->kind == Kind::kGlobal ? cls->s : cls->type_name(),
                              Kind::kOpaque));
      return;
    }
    case 'b':
      pop();
      top();
      return;  // BUILD: state is ignored; __setstate__ is never called
    case 'Q': {
      auto pid = pop();
      if (!persistent_load_) fail("persistent id in a pickle outside a torch.save archive");
      push(persistent_load_(pid));
      return;
    }
    case 'P': {
      auto pid = Value::make_string(std::string(line()));
      if (!persistent_load_) fail("persistent id in a pickle outside a torch.save archive");
      push(persistent_load_(pid));
      return;
    }
    case 'i':
    case 'o':
      fail("INST/OBJ opcodes (protocol 0/1 object construction) are not supported");
    case 0x82:
    case 0x83:
    case 0x84:
      fail("extension registry opcodes (EXT1/2/4) are not supported");
    case 0x97:
    case 0x98:
      fail("out-of-band buffers (protocol 5 NEXT_BUFFER) are not supported");
    default:
      fail("unknown opcode");
  }
}

}  // namespace

ValuePtr unpickle(std::string_view bytes, const std::string& what,
                  const PersistentLoad& persistent_load, const UnpickleLimits& limits) {
  Unpickler u(bytes, what, persistent_load, limits);
  return u.run();
}

void PickleWriter::proto() {
  out.push_back('\x80');
  out.push_back('\x02');
}

void PickleWriter::integer(int64_t v) {
  if (v >= 0 && v < 256) {
    out.push_back('K');
    out.push_back(static_cast<char>(v));
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    out.push_back('J');
    const auto u = static_cast<uint32_t>(static_cast<int32_t>(v));
    for (int k = 0; k < 4; ++k) out.push_back(static_cast<char>((u >> (8 * k)) & 0xff));
  } else {
    out.push_back('\x8a');
    out.push_back(8);
    const auto u = static_cast<uint64_t>(v);
    for (int k = 0; k < 8; ++k) out.push_back(static_cast<char>((u >> (8 * k)) & 0xff));
  }
}

void PickleWriter::floating(double v) {
  out.push_back('G');
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  for (int k = 7; k >= 0; --k) out.push_back(static_cast<char>((bits >> (8 * k)) & 0xff));
}

void PickleWriter::string(std::string_view s) {
  out.push_back('X');
  const auto n = static_cast<uint32_t>(s.size());
  for (int k = 0; k < 4; ++k) out.push_back(static_cast<char>((n >> (8 * k)) & 0xff));
  out.append(s);
}

void PickleWriter::global(std::string_view module, std::string_view name) {
  out.push_back('c');
  out.append(module);
  out.push_back('\n');
  out.append(name);
  out.push_back('\n');
}

}  // namespace lossguard::io
