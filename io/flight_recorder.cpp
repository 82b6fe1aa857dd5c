// Flight Recorder dumps: file discovery (directory, prefix, rank from the name), the pickle or JSON
// document into a Value tree, and the tree into FrCalls, every field checked and named on error.
// The fields are c10d's (torch/csrc/distributed/c10d/FlightRecorder.hpp, version "2.10" in torch
// 2.15); older dumps lack some (thread_name, pg_status, is_p2p) and are read without them.
#include "io/flight_recorder.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>
#include <set>
#include <thread>

#include "core/errors.h"
#include "io/dump.h"
#include "io/flat_pickle.h"
#include "io/input_files.h"
#include "io/pickle.h"

namespace lossguard::io {

namespace fs = std::filesystem;
using Kind = Value::Kind;

namespace {

// The number a file name ends in, before an extension a dump may carry.
std::optional<int64_t> rank_of_name(const std::string& basename) {
  std::string stem = basename;
  for (const char* ext : {".json", ".pkl", ".pickle", ".bin"}) {
    const std::string e = ext;
    if (stem.size() > e.size() && stem.compare(stem.size() - e.size(), e.size(), e) == 0) {
      stem.resize(stem.size() - e.size());
      break;
    }
  }
  std::size_t k = stem.size();
  while (k > 0 && std::isdigit(static_cast<unsigned char>(stem[k - 1]))) --k;
  if (k == stem.size() || stem.size() - k > 9) return std::nullopt;
  return std::stoll(stem.substr(k));
}

enum class DumpFormat { kPickle, kJson };

// What a dump's first bytes say it is: a pickle starts with byte 0x80, the JSON form with '{'
// after white space; anything else is refused, naming the file.
DumpFormat dump_format(std::string_view head, const std::string& path) {
  if (!head.empty() && static_cast<unsigned char>(head[0]) == 0x80) return DumpFormat::kPickle;
  std::size_t first = 0;
  while (first < head.size() && std::isspace(static_cast<unsigned char>(head[first]))) ++first;
  if (first < head.size() && head[first] == '{') return DumpFormat::kJson;
  throw_input_error(
      "{}: not a Flight Recorder dump (neither a pickle, which starts with byte 0x80, nor a "
      "JSON object){}",
      path,
      head.empty()
          ? ": the file is empty"
          : fmt::format(": it starts with byte 0x{:02x}", static_cast<unsigned char>(head[0])));
}

// A file's bytes, read once, after its first bytes show it can be a dump: a large file of
// anything else is refused before it is read whole.
std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw_input_error("{}: cannot open: {}", path, std::strerror(errno));
  char head[4096];
  f.read(head, sizeof head);
  const auto got = static_cast<std::size_t>(f.gcount());
  dump_format(std::string_view(head, got), path);
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  std::string bytes;
  if (!ec) bytes.reserve(static_cast<std::size_t>(size));
  bytes.append(head, got);
  char buf[1 << 16];
  while (f.read(buf, sizeof buf) || f.gcount() > 0)
    bytes.append(buf, static_cast<std::size_t>(f.gcount()));
  return bytes;
}

// A non-negative decimal number of at most 18 digits, as pg_status writes its keys (and, in the
// JSON form, its values); nullopt for anything else.
std::optional<int64_t> decimal(std::string_view text) {
  if (text.empty() || text.size() > 18 ||
      !std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  int64_t n = 0;
  for (char c : text) n = n * 10 + (c - '0');
  return n;
}

// How many values a dump's reading may visit: a pickle's memo lets a few bytes reference one
// container many times over (9 levels of 10 references are 10^9 values in under 1 KB), so every
// visit is counted against a budget proportional to the bytes given.
class VisitBudget {
 public:
  VisitBudget(const std::string& path, std::size_t bytes)
      : path_(path), left_(static_cast<int64_t>(bytes) * 32 + (int64_t{1} << 22)), total_(left_) {}
  void take() {
    if (--left_ < 0) {
      throw_input_error(
          "{}: its shared references expand to more than {} values (32 per byte of the file): "
          "not a dump torch writes",
          path_, total_);
    }
  }

 private:
  const std::string& path_;
  int64_t left_, total_;
};

// Field access that names the file, the entry and the field on every error.
// The two trees a dump is read into, behind one interface: FlatPickle's nodes (plain-data pickles,
// the fast path) and the restricted unpickler's or the JSON reader's Values (everything else).
enum class K { kNone, kBool, kInt, kFloat, kString, kList, kDict, kOther };

struct ValueTree {
  VisitBudget* budget = nullptr;
  using Node = const Value*;
  static constexpr Node kMissing = nullptr;
  K kind(Node n) const {
    switch (n->kind) {
      case Kind::kNone:
        return K::kNone;
      case Kind::kBool:
        return K::kBool;
      case Kind::kInt:
        return K::kInt;
      case Kind::kFloat:
        return K::kFloat;
      case Kind::kString:
        return K::kString;
      case Kind::kList:
      case Kind::kTuple:
        return K::kList;
      case Kind::kDict:
        return K::kDict;
      default:
        return K::kOther;
    }
  }
  int64_t integer(Node n) const { return n->kind == Kind::kBool ? n->b : n->i; }
  std::string_view str(Node n) const { return n->s; }
  std::string type_name(Node n) const { return n->type_name(); }
  Node get(Node dict, std::string_view key) const { return dict->get(key); }
  template <class F>
  void items(Node seq, F&& f) const {
    for (const auto& x : seq->items) {
      budget->take();
      f(x.get());
    }
  }
  template <class F>
  void entries(Node dict, F&& f) const {
    for (const auto& [k, v] : dict->entries) {
      budget->take();
      f(k.get(), v.get());
    }
  }
};

struct FlatTree {
  using Node = uint32_t;
  static constexpr Node kMissing = FlatPickle::kEnd;
  const FlatPickle& p;
  VisitBudget* budget = nullptr;
  K kind(Node n) const {
    switch (p.node(n).kind) {
      case FlatPickle::Kind::kNone:
        return K::kNone;
      case FlatPickle::Kind::kBool:
        return K::kBool;
      case FlatPickle::Kind::kInt:
        return K::kInt;
      case FlatPickle::Kind::kFloat:
        return K::kFloat;
      case FlatPickle::Kind::kString:
        return K::kString;
      case FlatPickle::Kind::kList:
      case FlatPickle::Kind::kTuple:
        return K::kList;
      case FlatPickle::Kind::kDict:
        return K::kDict;
    }
    return K::kOther;
  }
  int64_t integer(Node n) const { return p.node(n).i; }
  std::string_view str(Node n) const { return p.node(n).s; }
  std::string type_name(Node n) const {
    static const char* kNames[] = {"None", "bool", "int", "float", "str", "list", "tuple", "dict"};
    return kNames[static_cast<int>(p.node(n).kind)];
  }
  Node get(Node dict, std::string_view key) const { return p.get(dict, key); }
  template <class F>
  void items(Node seq, F&& f) const {
    p.for_each_child(seq, [&](Node c) {
      budget->take();
      f(c);
    });
  }
  template <class F>
  void entries(Node dict, F&& f) const {
    Node key = kMissing;
    p.for_each_child(dict, [&](Node c) {
      budget->take();
      if (key == kMissing) {
        key = c;
      } else {
        f(key, c);
        key = kMissing;
      }
    });
  }
};

// Field access that names the file, the entry and the field on every error.
template <class Tree>
class Reader {
 public:
  using Node = typename Tree::Node;
  Reader(const Tree& t, const std::string& path, std::string where)
      : t_(t), path_(path), where_(std::move(where)) {}
  Reader at(std::string where) const { return Reader(t_, path_, std::move(where)); }
  // "entry <index>", formatted only when an error names it.
  Reader entry(std::size_t index) const {
    Reader r(t_, path_, "entry");
    r.index_ = static_cast<int64_t>(index);
    return r;
  }
  const Tree& tree() const { return t_; }

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw_input_error("{}: {}{}{}: {}", path_, where_,
                      index_ >= 0 ? fmt::format(" {}", index_) : std::string(),
                      field.empty() ? "" : " field '" + field + "'", what);
  }
  Node get(Node dict, const char* key) const { return t_.get(dict, key); }
  // The value of `key`, or kMissing when it is absent or None.
  Node find(Node dict, const char* key) const {
    const Node v = t_.get(dict, key);
    return v == Tree::kMissing || t_.kind(v) == K::kNone ? Tree::kMissing : v;
  }
  Node need(Node dict, const char* key) const {
    const Node v = t_.get(dict, key);
    if (v == Tree::kMissing) fail(key, "missing");
    return v;
  }
  int64_t integer(Node v, const char* field) const {
    if (t_.kind(v) == K::kInt || t_.kind(v) == K::kBool) return t_.integer(v);
    fail(field, fmt::format("expected an integer, found {}", t_.type_name(v)));
  }
  int64_t integer_or(Node dict, const char* key, int64_t fallback) const {
    const Node v = find(dict, key);
    return v == Tree::kMissing ? fallback : integer(v, key);
  }
  std::string_view string(Node v, const char* field) const {
    if (t_.kind(v) != K::kString)
      fail(field, fmt::format("expected a string, found {}", t_.type_name(v)));
    return t_.str(v);
  }
  std::string string_or(Node dict, const char* key, std::string_view fallback) const {
    const Node v = find(dict, key);
    return std::string(v == Tree::kMissing ? fallback : string(v, key));
  }
  bool boolean_or(Node dict, const char* key, bool fallback) const {
    const Node v = find(dict, key);
    if (v == Tree::kMissing) return fallback;
    if (t_.kind(v) == K::kBool || t_.kind(v) == K::kInt) return t_.integer(v) != 0;
    fail(key, fmt::format("expected a bool, found {}", t_.type_name(v)));
  }
  void require(Node v, K kind, const char* field, const char* what) const {
    if (t_.kind(v) != kind)
      fail(field, fmt::format("expected {}, found {}", what, t_.type_name(v)));
  }
  template <class F>
  void sequence(Node v, const char* field, F&& f) const {
    require(v, K::kList, field, "a list");
    t_.items(v, f);
  }
  std::vector<std::vector<int64_t>> sizes(Node dict, const char* key) const {
    std::vector<std::vector<int64_t>> out;
    const Node v = find(dict, key);
    if (v == Tree::kMissing) return out;
    sequence(v, key, [&](Node t) {
      std::vector<int64_t> shape;
      sequence(t, key, [&](Node d) { shape.push_back(integer(d, key)); });
      out.push_back(std::move(shape));
    });
    return out;
  }
  std::vector<std::string> strings(Node dict, const char* key) const {
    std::vector<std::string> out;
    const Node v = find(dict, key);
    if (v == Tree::kMissing) return out;
    sequence(v, key, [&](Node x) { out.emplace_back(string(x, key)); });
    return out;
  }

 private:
  const Tree& t_;
  const std::string& path_;
  std::string where_;
  int64_t index_ = -1;
};

FrState parse_state(std::string_view s) {
  if (s == "scheduled") return FrState::kScheduled;
  if (s == "started") return FrState::kStarted;
  if (s == "completed") return FrState::kCompleted;
  return FrState::kOther;
}

// pg_config's "ranks": "[0, 1, 2]" as c10d writes it, or a list.
template <class Tree>
std::vector<int64_t> parse_ranks(typename Tree::Node v, const Reader<Tree>& r) {
  std::vector<int64_t> out;
  const Tree& t = r.tree();
  if (t.kind(v) == K::kList) {
    t.items(v, [&](typename Tree::Node x) { out.push_back(r.integer(x, "ranks")); });
  } else if (t.kind(v) == K::kString) {
    int64_t cur = -1;
    const std::string_view text = t.str(v);
    for (char c : text) {
      if (std::isdigit(static_cast<unsigned char>(c))) {
        cur = (cur < 0 ? 0 : cur * 10) + (c - '0');
        if (cur > (int64_t{1} << 40)) r.fail("ranks", "a rank beyond 2^40");
      } else {
        if (cur >= 0) out.push_back(cur);
        cur = -1;
        if (c != '[' && c != ']' && c != ',' && c != ' ')
          r.fail("ranks", fmt::format("expected a list of ranks, found '{}'", text.substr(0, 80)));
      }
    }
    if (cur >= 0) out.push_back(cur);
  } else {
    r.fail("ranks", fmt::format("expected a list of ranks, found {}", t.type_name(v)));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

struct ConfigGroup {
  std::vector<int64_t> members;
  std::string desc;
  std::string path;  // the first dump that gave it
};
// Every dump's pg_config merged, and whether some dump held an entry that names no group.
struct Config {
  std::map<std::string, ConfigGroup> groups;
  bool unnamed_entry = false;
};

// Appends a value's content, tagged by kind, to `key`: equal text iff equal content (the interning
// key of signatures and stacks, built without copying the content out of the tree).
template <class Tree>
void append_key(const Tree& t, typename Tree::Node n, std::string& key) {
  if (n == Tree::kMissing) {
    key += '-';
    return;
  }
  switch (t.kind(n)) {
    case K::kInt:
    case K::kBool:
      key += 'i';
      key += std::to_string(t.integer(n));
      key += ';';
      return;
    case K::kString: {
      const std::string_view s = t.str(n);
      key += 's';
      key += std::to_string(s.size());
      key += ':';
      key.append(s.data(), s.size());
      return;
    }
    case K::kList:
      key += '[';
      t.items(n, [&](typename Tree::Node x) { append_key(t, x, key); });
      key += ']';
      return;
    case K::kDict:
      key += '{';
      t.entries(n, [&](typename Tree::Node k, typename Tree::Node v) {
        append_key(t, k, key);
        append_key(t, v, key);
      });
      key += '}';
      return;
    default:
      key += '?';
      key += t.type_name(n);
      key += ';';
      return;
  }
}

// Long: every field of a dump and of each entry, checked and named on error, in the dump's order.
template <class Tree>
FrRankDump convert(const Tree& t, typename Tree::Node root, const std::string& path, int64_t rank,
                   FrJobBuilder& b, Config& config) {
  using Node = typename Tree::Node;
  const Reader<Tree> top(t, path, "the dump");
  top.require(root, K::kDict, "", "a dict");
  FrRankDump d;
  d.rank = rank;
  d.path = path;
  d.version = std::string(top.string(top.need(root, "version"), "version"));
  if (d.version.rfind("2.", 0) != 0) {
    top.fail("version", fmt::format("'{}' is not a Flight Recorder dump version lossguard reads "
                                    "(2.x: torch 2.6 to 2.15)",
                                    d.version));
  }
  d.comm_lib_version = top.string_or(root, "comm_lib_version", "");
  if (const Node pg = top.find(root, "pg_config"); pg != Tree::kMissing) {
    top.require(pg, K::kDict, "pg_config", "a dict");
    t.entries(pg, [&](Node k, Node v) {
      const std::string key(t.kind(k) == K::kString ? t.str(k) : std::string_view());
      const Reader<Tree> r = top.at(fmt::format("pg_config['{}']", key));
      r.require(v, K::kDict, "", "a dict");
      const std::string name = r.string_or(v, "name", key);
      // Gloo's recorder (torch 2.15) writes one pg_config entry named "" whose ranks are those of
      // some group this rank joined, not the default group's: it names no group, so it is skipped.
      if (name.empty()) {
        config.unnamed_entry = true;
        return;
      }
      ConfigGroup g{parse_ranks(r.need(v, "ranks"), r), r.string_or(v, "desc", ""), path};
      auto [it, fresh] = config.groups.try_emplace(name, g);
      if (!fresh && it->second.members != g.members) {
        r.fail("ranks", fmt::format("group '{}' has members [{}] here but [{}] in {}: the dumps "
                                    "are not from one job",
                                    name, fmt::join(g.members, ", "),
                                    fmt::join(it->second.members, ", "), it->second.path));
      }
    });
  }
  if (const Node st = top.find(root, "pg_status"); st != Tree::kMissing) {
    top.require(st, K::kDict, "pg_status", "a dict");
    t.entries(st, [&](Node k, Node v) {
      const std::string key(t.kind(k) == K::kString ? t.str(k) : std::string_view());
      const Reader<Tree> r = top.at(fmt::format("pg_status['{}']", key));
      r.require(v, K::kDict, "", "a dict");
      const auto id = decimal(key);
      if (!id || *id >= (int64_t{1} << 30)) return;  // not a pg_id: nothing to tie it to a call
      // The JSON form writes the number as a string ("3", "-1"), the pickle as an integer.
      const Node x = r.find(v, "last_completed_collective");
      int64_t completed = -1;
      if (x != Tree::kMissing && t.kind(x) != K::kString) {
        completed = r.integer(x, "last_completed_collective");
      } else if (x != Tree::kMissing) {
        const std::string_view text = t.str(x);
        const auto n = decimal(!text.empty() && text.front() == '-' ? text.substr(1) : text);
        if (!n) {
          r.fail("last_completed_collective",
                 fmt::format("expected an integer, found '{}'", text.substr(0, 40)));
        }
        completed = !text.empty() && text.front() == '-' ? -*n : *n;
      }
      FrRankDump::GroupStatus s{static_cast<int32_t>(*id), completed};
      d.pg_status.push_back(s);
    });
  }
  const Node entries = top.need(root, "entries");
  std::size_t k = 0;
  std::string key;  // reused: an entry's signature or stack key
  top.sequence(entries, "entries", [&](Node e) {
    const Reader<Tree> r = top.entry(k);
    r.require(e, K::kDict, "", "a dict");
    FrCall c;
    c.record_id = r.integer_or(e, "record_id", static_cast<int64_t>(k));
    std::vector<std::string> pg;
    r.sequence(r.need(e, "process_group"), "process_group",
               [&](Node x) { pg.emplace_back(r.string(x, "process_group")); });
    if (pg.size() != 2) r.fail("process_group", "expected (name, description)");
    c.group = b.group(pg[0], pg[1]);
    const std::string profiling_name(r.string(r.need(e, "profiling_name"), "profiling_name"));
    const auto op = parse_profiling_name(profiling_name);
    if (!op) {
      r.fail("profiling_name",
             fmt::format("'{}' is not '<backend>:<op>' (p2p: 'send a->b', 'recv b<-a')",
                         profiling_name));
    }
    key.assign(profiling_name);
    for (const char* f : {"input_sizes", "output_sizes", "input_dtypes", "output_dtypes"})
      append_key(t, r.find(e, f), key);
    c.signature = b.signature_by_key(key, [&] {
      FrSignature s;
      s.profiling_name = profiling_name;
      s.op = op->op;
      s.input_sizes = r.sizes(e, "input_sizes");
      s.output_sizes = r.sizes(e, "output_sizes");
      s.input_dtypes = r.strings(e, "input_dtypes");
      s.output_dtypes = r.strings(e, "output_dtypes");
      return s;
    });
    c.is_p2p = r.boolean_or(e, "is_p2p", op->op == "send" || op->op == "recv");
    c.p2p_src = op->src;
    c.p2p_dst = op->dst;
    if (c.is_p2p) {
      c.seq = r.integer(r.need(e, "p2p_seq_id"), "p2p_seq_id");
    } else if (const Node cs = r.get(e, "collective_seq_id"); cs != Tree::kMissing) {
      c.seq = r.integer(cs, "collective_seq_id");
    } else {
      c.seq = r.integer(r.need(e, "seq_id"), "seq_id");  // dumps before collective_seq_id
    }
    c.time_created_ns = r.integer_or(e, "time_created_ns", 0);
    c.state = parse_state(r.string_or(e, "state", "scheduled"));
    c.retired = r.boolean_or(e, "retired", false);
    const int64_t pg_id = r.integer_or(e, "pg_id", -1);
    c.pg_id = pg_id >= 0 && pg_id < (int64_t{1} << 30) ? static_cast<int32_t>(pg_id) : -1;
    c.timeout_ms = r.integer_or(e, "timeout_ms", 0);
    if (const Node frames = r.find(e, "frames"); frames != Tree::kMissing) {
      key.clear();
      append_key(t, frames, key);
      c.stack = b.stack_by_key(key, [&] {
        std::vector<FrFrame> stack;
        r.sequence(frames, "frames", [&](Node f) {
          r.require(f, K::kDict, "frames", "a list of dicts");
          stack.push_back({r.string_or(f, "name", ""), r.string_or(f, "filename", ""),
                           r.integer_or(f, "line", 0)});
        });
        return stack;
      });
    }
    d.calls.push_back(c);
    ++k;
  });
  std::stable_sort(d.calls.begin(), d.calls.end(),
                   [](const FrCall& a, const FrCall& c) { return a.record_id < c.record_id; });
  d.wrapped = !d.calls.empty() && d.calls.front().record_id > 0;
  return d;
}

}  // namespace

std::vector<std::pair<std::string, int64_t>> flight_record_files(
    const std::vector<std::string>& paths) {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& p : paths) {
    std::error_code ec;
    std::vector<std::string> found;
    std::string prefix;
    if (fs::is_directory(p, ec)) {
      for (const auto& e : fs::directory_iterator(p, ec)) {
        if (e.is_regular_file(ec) && rank_of_name(e.path().filename().string()))
          found.push_back(e.path().string());
      }
      if (found.empty()) {
        throw_input_error(
            "{}: the directory holds no file whose name ends in a rank number (as "
            "TORCH_FR_DUMP_TEMP_FILE<rank> does)",
            p);
      }
    } else if (fs::exists(p, ec)) {
      require_regular_file(p);
      found.push_back(p);
    } else {
      // A prefix: <dir>/<stem> stands for <dir>/<stem><rank>.
      const fs::path as_path(p);
      const fs::path dir = as_path.has_parent_path() ? as_path.parent_path() : fs::path(".");
      prefix = as_path.filename().string();
      if (fs::is_directory(dir, ec)) {
        for (const auto& e : fs::directory_iterator(dir, ec)) {
          const std::string name = e.path().filename().string();
          if (e.is_regular_file(ec) && name.size() > prefix.size() &&
              name.compare(0, prefix.size(), prefix) == 0 && rank_of_name(name))
            found.push_back(e.path().string());
        }
      }
      if (found.empty()) {
        throw_input_error(
            "{}: no such file or directory, and no file starts with it followed by "
            "a rank number (a prefix as TORCH_FR_DUMP_TEMP_FILE)",
            p);
      }
    }
    std::sort(found.begin(), found.end());
    for (auto& f : found) {
      const auto r = rank_of_name(fs::path(f).filename().string());
      if (!r) {
        throw_input_error(
            "{}: cannot tell which rank wrote it: a dump's name must end in its "
            "rank number (TORCH_FR_DUMP_TEMP_FILE<rank>, e.g. nccl_trace_rank_3)",
            f);
      }
      out.emplace_back(std::move(f), *r);
    }
  }
  return out;
}

namespace {

FrRankDump parse_one(std::string_view bytes, const std::string& path, int64_t rank,
                     FrJobBuilder& builder, Config& config) {
  ValuePtr root;
  std::string format;
  if (dump_format(bytes, path) == DumpFormat::kPickle) {
    // Plain data (every dump torch writes) takes the fast reader; anything else, hostile or
    // malformed, the restricted unpickler, which reads it or says why not.
    if (const auto flat = FlatPickle::parse(bytes)) {
      VisitBudget budget(path, bytes.size());
      const FlatTree t{*flat, &budget};
      FrRankDump d = convert(t, flat->root(), path, rank, builder, config);
      d.format = "pickle";
      return d;
    }
    format = "pickle";
    root = unpickle(bytes, path, [&](const ValuePtr&) -> ValuePtr {
      throw_input_error("{}: a Flight Recorder dump holds no persistent ids (tensors)", path);
    });
  } else {
    format = "json";
    root = json_to_value(std::string(bytes), path);
  }
  VisitBudget budget(path, bytes.size());
  const ValueTree t{&budget};
  FrRankDump d = convert(t, root.get(), path, rank, builder, config);
  d.format = format;
  return d;
}

FrRankDump read_one(const std::string& path, int64_t rank, FrJobBuilder& builder, Config& config) {
  const std::string bytes = read_bytes(path);
  return parse_one(bytes, path, rank, builder, config);
}

}  // namespace

FrRankDump read_flight_record(const std::string& path, int64_t rank, FrJobBuilder& builder) {
  Config config;
  return read_one(path, rank, builder, config);
}

FrRankDump parse_flight_record(std::string_view bytes, const std::string& what, int64_t rank,
                               FrJobBuilder& builder) {
  Config config;
  return parse_one(bytes, what, rank, builder, config);
}

namespace {

// One reader thread's share of the files, interned in its own builder and merged afterwards.
struct Share {
  FrJobBuilder builder;
  Config config;
  std::vector<FrRankDump> dumps;
};

// `from`'s groups, signatures and stacks interned into `into`, and its calls renumbered.
void merge_share(Share& from, FrJobBuilder& into, Config& config, std::vector<FrRankDump>& out) {
  FrJob& local = from.builder.job();
  std::vector<uint32_t> groups(local.groups.size()), sigs(local.signatures.size()),
      stacks(local.stacks.size());
  for (std::size_t k = 0; k < groups.size(); ++k)
    groups[k] = into.group(local.groups[k].name, local.groups[k].desc);
  for (std::size_t k = 0; k < sigs.size(); ++k) sigs[k] = into.signature(local.signatures[k]);
  for (std::size_t k = 0; k < stacks.size(); ++k) stacks[k] = into.stack(local.stacks[k]);
  for (auto& d : from.dumps) {
    for (auto& c : d.calls) {
      c.group = groups[c.group];
      c.signature = sigs[c.signature];
      c.stack = stacks[c.stack];
    }
    out.push_back(std::move(d));
  }
  config.unnamed_entry = config.unnamed_entry || from.config.unnamed_entry;
  for (const auto& [name, g] : from.config.groups) {
    auto [it, fresh] = config.groups.try_emplace(name, g);
    if (!fresh && it->second.members != g.members) {
      throw_input_error(
          "{}: pg_config: group '{}' has members [{}] here but [{}] in {}: the dumps "
          "are not from one job",
          g.path, name, fmt::join(g.members, ", "), fmt::join(it->second.members, ", "),
          it->second.path);
    }
  }
}

}  // namespace

namespace {

// The files read on every core (parsing is the cost: a 2,000-call dump is ~400 KB of pickle), each
// thread into its own share; the error of the earliest file that failed is rethrown.
std::vector<Share> read_shares(const std::vector<std::pair<std::string, int64_t>>& files,
                               const std::function<void(std::size_t, std::size_t)>& progress) {
  const std::size_t workers = std::max<std::size_t>(
      1, std::min<std::size_t>({files.size(), std::thread::hardware_concurrency(), 64}));
  std::vector<Share> shares(workers);
  std::atomic<std::size_t> done{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::size_t error_index = files.size();
  std::exception_ptr error;
  auto work = [&](std::size_t w) {
    for (std::size_t k = w; k < files.size() && !failed.load(); k += workers) {
      try {
        try {
          shares[w].dumps.push_back(
              read_one(files[k].first, files[k].second, shares[w].builder, shares[w].config));
        } catch (const std::bad_alloc&) {
          throw_input_error(
              "{}: out of memory reading it: not a dump torch writes, or too large "
              "for this machine",
              files[k].first);
        }
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (k < error_index) {
          error_index = k;
          error = std::current_exception();
        }
        failed = true;
        return;
      }
      const std::size_t n = ++done;
      if (progress) {
        std::lock_guard<std::mutex> lock(mu);
        progress(n, files.size());
      }
    }
  };
  std::vector<std::thread> threads;
  for (std::size_t w = 1; w < workers; ++w) threads.emplace_back(work, w);
  work(0);
  for (auto& t : threads) t.join();
  if (error) std::rethrow_exception(error);
  return shares;
}

std::string format_members(const std::vector<int64_t>& m) {
  if (m.size() <= 8) return fmt::format("{}", fmt::join(m, ", "));
  return fmt::format("{}, ... ({} ranks)", fmt::join(m.begin(), m.begin() + 8, ", "), m.size());
}

// The world: the default group's membership where a pg_config gives it (it must be 0..n-1),
// else unknown (the highest rank seen plus one sizes the tables; a note says so). A claimed world
// is bounded by the bytes that claim it: the default group's ranks are listed one by one.
void set_world(FrJob& job, const Config& config) {
  int64_t highest = -1;
  for (const auto& d : job.ranks) highest = std::max(highest, d.rank);
  for (const auto& [name, g] : config.groups) {
    if (!g.members.empty()) highest = std::max(highest, g.members.back());
  }
  if (auto it = config.groups.find("0"); it != config.groups.end() && !it->second.members.empty()) {
    const auto& m = it->second.members;
    if (m.front() != 0 || m.back() != static_cast<int64_t>(m.size()) - 1) {
      throw_input_error(
          "{}: pg_config's default group '0' lists ranks [{}]: the default group is every rank "
          "0..n-1",
          it->second.path, format_members(m));
    }
    job.world = static_cast<int64_t>(m.size());
    job.world_known = true;
    job.world_source = "pg_config";
    if (highest >= job.world) {
      throw_input_error(
          "{}: rank {} is outside the default group [0, {}) that the dumps' "
          "pg_config gives: the dumps are not from one job",
          it->second.path, highest, job.world);
    }
  } else {
    job.world = highest + 1;
  }
  // Per-rank tables are sized by the world: a corrupt rank number must not size them.
  if (job.world > kMaxFrWorld) {
    throw_input_error(
        "the dumps name rank {} ({}): beyond the {} ranks postmortem aligns; a file name or "
        "pg_config is not a rank number",
        job.world - 1, "a file name's number or a pg_config entry", kMaxFrWorld);
  }
}

// Members of the groups no pg_config lists: the default group "0" is the world where it is known,
// else at least every rank that dumped (the default group holds every rank; more may exist); any
// other the ranks whose calls name it. Either way incomplete (members_inferred) until the world
// or a layout says more (oracle::resolve_groups).
void infer_members(FrJob& job, const Config& config) {
  std::vector<std::vector<int64_t>> named(job.groups.size());
  for (const auto& d : job.ranks) {
    for (const auto& c : d.calls) {
      auto& m = named[c.group];
      if (m.empty() || m.back() != d.rank) m.push_back(d.rank);
    }
  }
  for (std::size_t g = 0; g < job.groups.size(); ++g) {
    if (config.groups.count(job.groups[g].name)) continue;
    if (job.groups[g].name == "0" && job.world_known) {
      job.groups[g].members.resize(static_cast<std::size_t>(job.world));
      std::iota(job.groups[g].members.begin(), job.groups[g].members.end(), int64_t{0});
      job.groups[g].from_world = true;
      continue;
    }
    if (job.groups[g].name == "0") {
      named[g].clear();
      for (const auto& d : job.ranks) named[g].push_back(d.rank);
    }
    job.groups[g].members = std::move(named[g]);
    job.groups[g].members_inferred = true;
  }
}

}  // namespace

FrJob read_flight_records(const std::vector<std::string>& paths,
                          const std::function<void(std::size_t, std::size_t)>& progress) {
  const auto files = flight_record_files(paths);
  std::map<int64_t, std::string> seen;
  for (const auto& [path, rank] : files) {
    auto [it, fresh] = seen.try_emplace(rank, path);
    if (!fresh) {
      throw_input_error(
          "{} and {} both claim rank {}: two jobs' dumps in one set, or a dump copied twice",
          it->second, path, rank);
    }
  }
  std::vector<Share> shares = read_shares(files, progress);
  FrJobBuilder builder;
  Config config;
  std::vector<FrRankDump> ranks;
  ranks.reserve(files.size());
  for (auto& share : shares) merge_share(share, builder, config, ranks);
  shares.clear();
  std::map<std::string, std::string> versions;  // version -> first file
  for (const auto& d : ranks) versions.try_emplace(d.version, d.path);
  if (versions.size() > 1) {
    std::vector<std::string> parts;
    for (const auto& [v, p] : versions) parts.push_back(fmt::format("{} (version {})", p, v));
    throw_input_error(
        "the dumps come from different Flight Recorder versions: {}: mixed jobs or "
        "torch builds cannot be aligned",
        fmt::join(parts, ", "));
  }
  for (const auto& [name, g] : config.groups) {
    const uint32_t id = builder.group(name, g.desc);
    builder.job().groups[id].members = g.members;
  }
  FrJob job = builder.take();
  job.ranks = std::move(ranks);
  std::sort(job.ranks.begin(), job.ranks.end(),
            [](const FrRankDump& a, const FrRankDump& b) { return a.rank < b.rank; });
  set_world(job, config);
  if (config.unnamed_entry) {
    job.notes.push_back(
        "pg_config's entry named '' (Gloo's recorder writes one, with some subgroup's ranks) names "
        "no group and was not used");
  }
  infer_members(job, config);
  return job;
}

}  // namespace lossguard::io
