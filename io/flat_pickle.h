// A fast reader for pickles of plain data only (dicts, lists, tuples, strings, integers, floats,
// bools, None), as torch's c10 pickler and Python's pickler write them: nodes in one arena, strings
// as views into the bytes, nothing allocated per scalar. It understands no global, no call and no
// shared container: on any such opcode, on a malformed or truncated pickle, it returns nullopt and
// the caller reads the bytes with the restricted unpickler (io/pickle.h), which reads or refuses
// them with its own message. So this path never decides that an input is bad; it only makes good
// ones cheap (a Flight Recorder dump of 2,000 calls: ~400 KB, ~200,000 values).
#pragma once
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace lossguard::io {

class FlatPickle {
 public:
  enum class Kind : uint8_t { kNone, kBool, kInt, kFloat, kString, kList, kTuple, kDict };
  struct Node {
    Kind kind = Kind::kNone;
    int64_t i = 0;  // int, bool
    double f = 0.0;
    std::string_view s;
    uint32_t first = kEnd, last = kEnd;  // containers: their links (a dict: key, value, key, ...)
    uint32_t size = 0;                   // items, or a dict's entries
  };
  static constexpr uint32_t kEnd = 0xffffffffu;

  // nullopt: not plain data this reader understands (see above). `bytes` must outlive the result.
  static std::optional<FlatPickle> parse(std::string_view bytes);

  const Node& node(uint32_t n) const { return nodes_[n]; }
  uint32_t root() const { return root_; }
  // The children of a container in order (a dict's keys and values alternate).
  template <class F>
  void for_each_child(uint32_t n, F&& f) const {
    for (uint32_t l = nodes_[n].first; l != kEnd; l = links_[l].next) f(links_[l].node);
  }
  // A dict's value for a string key, or kEnd.
  uint32_t get(uint32_t dict, std::string_view key) const;

 private:
  struct Link {
    uint32_t node;
    uint32_t next;
  };
  std::vector<Node> nodes_;
  std::vector<Link> links_;
  uint32_t root_ = kEnd;
  friend class FlatPickleParser;
};

}  // namespace lossguard::io
