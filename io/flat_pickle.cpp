// The plain-data pickle reader (io/flat_pickle.h): a stack machine over the data opcodes of
// protocols 2-5 only. Every other opcode, an attempt to extend a container referenced twice (the
// only way to a cycle) and every malformed byte end the parse with nullopt.
#include "io/flat_pickle.h"

#include <algorithm>
#include <cstring>

namespace lossguard::io {

class FlatPickleParser {
 public:
  explicit FlatPickleParser(std::string_view in) : in_(in) {
    // About one value per 4 to 8 bytes of pickle: grown once or twice, not 20 times.
    // A first guess, capped: a large file of anything must not reserve gigabytes up front.
    const std::size_t guess = std::min<std::size_t>(in.size() / 8, std::size_t{1} << 20);
    out_.nodes_.reserve(guess);
    out_.links_.reserve(guess);
    shared_.reserve(guess);
    depth_.reserve(guess);
  }

  std::optional<FlatPickle> run() {
    while (pos_ < in_.size()) {
      const auto op = static_cast<uint8_t>(in_[pos_++]);
      if (op == '.') {
        if (stack_.size() != 1 || !marks_.empty()) return std::nullopt;
        out_.root_ = stack_.back();
        return std::move(out_);
      }
      if (!step(op)) return std::nullopt;
    }
    return std::nullopt;  // no STOP: truncated
  }

 private:
  using Kind = FlatPickle::Kind;
  static constexpr uint32_t kEnd = FlatPickle::kEnd;
  static constexpr std::size_t kMaxNodes = std::size_t{1} << 28;
  static constexpr uint64_t kMaxMemo = uint64_t{1} << 26;
  static constexpr uint16_t kMaxDepth = 1000;  // as UnpickleLimits::max_depth

  bool take(std::size_t n, std::string_view& out) {
    if (in_.size() - pos_ < n) return false;
    out = in_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  bool uint_le(std::size_t n, uint64_t& v) {
    std::string_view b;
    if (!take(n, b)) return false;
    v = 0;
    for (std::size_t k = 0; k < n; ++k) v |= uint64_t{static_cast<uint8_t>(b[k])} << (8 * k);
    return true;
  }
  bool push_node(FlatPickle::Node n) {
    if (out_.nodes_.size() >= kMaxNodes) return false;
    stack_.push_back(static_cast<uint32_t>(out_.nodes_.size()));
    out_.nodes_.push_back(n);
    shared_.push_back(0);
    depth_.push_back(0);
    return true;
  }
  bool push_int(int64_t v) {
    FlatPickle::Node n;
    n.kind = Kind::kInt;
    n.i = v;
    return push_node(n);
  }
  bool push_string(std::size_t len_bytes) {
    uint64_t len = 0;
    std::string_view s;
    if (!uint_le(len_bytes, len) || len > in_.size() || !take(static_cast<std::size_t>(len), s))
      return false;
    FlatPickle::Node n;
    n.kind = Kind::kString;
    n.s = s;
    return push_node(n);
  }
  bool is_container(uint32_t n) const {
    const Kind k = out_.nodes_[n].kind;
    return k == Kind::kList || k == Kind::kTuple || k == Kind::kDict;
  }
  // Links `child` under `parent`; false when that nests containers deeper than the full
  // unpickler allows (the reader of the result recurses).
  bool link(uint32_t parent, uint32_t child) {
    const uint16_t d = static_cast<uint16_t>(depth_[child] + 1);
    if (d > kMaxDepth) return false;
    if (d > depth_[parent]) depth_[parent] = d;
    FlatPickle::Node& p = out_.nodes_[parent];
    const auto l = static_cast<uint32_t>(out_.links_.size());
    out_.links_.push_back({child, kEnd});
    if (p.last == kEnd) {
      p.first = l;
    } else {
      out_.links_[p.last].next = l;
    }
    p.last = l;
    return true;
  }
  // The lowest stack slot an opcode may pop or read without a mark of its own: the values above the
  // last mark (Python's unpickler keeps them as a stack of their own, so SETITEM, APPEND, TUPLEn or
  // BINPUT reaching below a pending mark is an error there too).
  std::size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  // Whether the top `n` values lie above the last mark.
  bool above_floor(std::size_t n) const { return stack_.size() >= floor() + n; }
  // The values above the last mark, popped (with the mark).
  bool pop_mark(std::size_t& from) {
    if (marks_.empty()) return false;
    from = marks_.back();
    marks_.pop_back();
    return from <= stack_.size();
  }
  bool build(Kind kind, std::size_t from) {
    FlatPickle::Node n;
    n.kind = kind;
    const auto id = static_cast<uint32_t>(out_.nodes_.size());
    if (out_.nodes_.size() >= kMaxNodes) return false;
    out_.nodes_.push_back(n);
    shared_.push_back(0);
    depth_.push_back(0);
    if (kind == Kind::kDict && (stack_.size() - from) % 2 != 0) return false;
    for (std::size_t k = from; k < stack_.size(); ++k) {
      if (!link(id, stack_[k])) return false;
    }
    out_.nodes_[id].size = static_cast<uint32_t>(kind == Kind::kDict ? (stack_.size() - from) / 2
                                                                     : stack_.size() - from);
    stack_.resize(from);
    stack_.push_back(id);
    return true;
  }
  // Appends stack[from:] to the container below them (a list's items, a dict's key-value pairs).
  bool extend(std::size_t from, Kind want) {
    if (from <= floor() || from > stack_.size())
      return false;  // the target lies above the last mark
    const uint32_t target = stack_[from - 1];
    if (out_.nodes_[target].kind != want || shared_[target]) return false;
    const std::size_t n = stack_.size() - from;
    if (want == Kind::kDict && n % 2 != 0) return false;
    for (std::size_t k = from; k < stack_.size(); ++k) {
      if (!link(target, stack_[k])) return false;
    }
    out_.nodes_[target].size += static_cast<uint32_t>(want == Kind::kDict ? n / 2 : n);
    stack_.resize(from);
    return true;
  }
  bool memo_put(uint64_t key) {
    if (!above_floor(1) || key >= kMaxMemo) return false;
    if (memo_.size() <= key) memo_.resize(static_cast<std::size_t>(key) + 1, kEnd);
    if (memo_[static_cast<std::size_t>(key)] == kEnd) ++memo_size_;
    memo_[static_cast<std::size_t>(key)] = stack_.back();
    return true;
  }
  bool memo_get(uint64_t key) {
    if (key >= memo_.size() || memo_[static_cast<std::size_t>(key)] == kEnd) return false;
    const uint32_t n = memo_[static_cast<std::size_t>(key)];
    // A container referenced twice (torch's pickler shares its stack frames' dicts) is read as
    // one node under several parents, and is never extended again: no container can then come
    // to contain itself.
    if (is_container(n)) shared_[n] = 1;
    stack_.push_back(n);
    return true;
  }

  // Long: one case per opcode understood; the table of the pickle format itself.
  bool step(uint8_t op) {
    uint64_t v = 0;
    std::string_view b;
    std::size_t from = 0;
    switch (op) {
      case 0x80: {  // PROTO, anywhere in the stream: the protocols the restricted unpickler reads
        if (!take(1, b)) return false;
        const auto protocol = static_cast<uint8_t>(b[0]);
        return protocol >= 2 && protocol <= 5;
      }
      case 0x95:  // FRAME
        return uint_le(8, v);
      case '(':
        marks_.push_back(stack_.size());
        return true;
      case '}':
      case ']':
      case ')': {
        FlatPickle::Node n;
        n.kind = op == '}' ? Kind::kDict : op == ']' ? Kind::kList : Kind::kTuple;
        return push_node(n);
      }
      case 'd':
        return pop_mark(from) && build(Kind::kDict, from);
      case 'l':
        return pop_mark(from) && build(Kind::kList, from);
      case 't':
        return pop_mark(from) && build(Kind::kTuple, from);
      case 0x85:
      case 0x86:
      case 0x87: {
        const std::size_t n = op - 0x84u;
        return above_floor(n) && build(Kind::kTuple, stack_.size() - n);
      }
      case 's':
        return above_floor(3) && extend(stack_.size() - 2, Kind::kDict);
      case 'u':
        return pop_mark(from) && extend(from, Kind::kDict);
      case 'a':
        return above_floor(2) && extend(stack_.size() - 1, Kind::kList);
      case 'e':
        return pop_mark(from) && extend(from, Kind::kList);
      case 'X':
        return push_string(4);
      case 0x8c:
        return push_string(1);
      case 0x8d:
        return push_string(8);
      case 'J':
        return uint_le(4, v) && push_int(static_cast<int32_t>(static_cast<uint32_t>(v)));
      case 'K':
        return uint_le(1, v) && push_int(static_cast<int64_t>(v));
      case 'M':
        return uint_le(2, v) && push_int(static_cast<int64_t>(v));
      case 0x8a: {  // LONG1: little-endian two's complement of up to 8 bytes here
        uint64_t n = 0;
        if (!uint_le(1, n) || n > 8 || !uint_le(static_cast<std::size_t>(n), v)) return false;
        if (n > 0 && n < 8 && (v >> (8 * n - 1)) & 1) v |= ~uint64_t{0} << (8 * n);  // sign
        return push_int(static_cast<int64_t>(v));
      }
      case 'N':
        return push_node({});
      case 0x88:
      case 0x89: {
        FlatPickle::Node n;
        n.kind = Kind::kBool;
        n.i = op == 0x88 ? 1 : 0;
        return push_node(n);
      }
      case 'G': {
        if (!take(8, b)) return false;
        uint64_t bits = 0;
        for (int k = 0; k < 8; ++k) bits = bits << 8 | static_cast<uint8_t>(b[k]);  // big-endian
        FlatPickle::Node n;
        n.kind = Kind::kFloat;
        std::memcpy(&n.f, &bits, sizeof(n.f));
        return push_node(n);
      }
      case 'q':
        return uint_le(1, v) && memo_put(v);
      case 'r':
        return uint_le(4, v) && memo_put(v);
      case 0x94:                      // MEMOIZE
        return memo_put(memo_size_);  // the key is the memo's size, as Python's Unpickler has it
      case 'h':
        return uint_le(1, v) && memo_get(v);
      case 'j':
        return uint_le(4, v) && memo_get(v);
      default:
        return false;  // a global, a call, a persistent id, ...: not plain data
    }
  }

  std::string_view in_;
  std::size_t pos_ = 0;
  FlatPickle out_;
  std::vector<uint32_t> stack_;
  std::vector<std::size_t> marks_;
  std::vector<uint32_t> memo_;
  std::vector<uint8_t> shared_;  // per node: referenced again through the memo
  std::vector<uint16_t> depth_;  // per node: containers nested below it
  uint64_t memo_size_ = 0;       // keys stored
};

std::optional<FlatPickle> FlatPickle::parse(std::string_view bytes) {
  return FlatPickleParser(bytes).run();
}

uint32_t FlatPickle::get(uint32_t dict, std::string_view key) const {
  const Node& d = nodes_[dict];
  if (d.kind != Kind::kDict) return kEnd;
  for (uint32_t l = d.first; l != kEnd; l = links_[links_[l].next].next) {
    const Node& k = nodes_[links_[l].node];
    if (k.kind == Kind::kString && k.s == key) return links_[links_[l].next].node;
  }
  return kEnd;
}

}  // namespace lossguard::io
