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
#include <sstream>
#include <thread>

#include "core/errors.h"
#include "io/dump.h"
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

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw_input_error("{}: cannot open: {}", path, std::strerror(errno));
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Field access that names the file, the entry and the field on every error.
class Reader {
 public:
  Reader(const std::string& path, std::string where) : path_(path), where_(std::move(where)) {}
  Reader at(std::string where) const { return Reader(path_, std::move(where)); }
  // "entry <index>", formatted only when an error names it.
  Reader entry(std::size_t index) const {
    Reader r(path_, "entry");
    r.index_ = static_cast<int64_t>(index);
    return r;
  }

  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw_input_error("{}: {}{}{}: {}", path_, where_,
                      index_ >= 0 ? fmt::format(" {}", index_) : std::string(),
                      field.empty() ? "" : " field '" + field + "'", what);
  }
  const Value& need(const Value& dict, const char* key) const {
    const Value* v = dict.get(key);
    if (v == nullptr) fail(key, "missing");
    return *v;
  }
  int64_t integer(const Value& v, const char* field) const {
    if (v.kind == Kind::kInt) return v.i;
    if (v.kind == Kind::kBool) return v.b ? 1 : 0;
    fail(field, fmt::format("expected an integer, found {}", v.type_name()));
  }
  int64_t integer_or(const Value& dict, const char* key, int64_t fallback) const {
    const Value* v = dict.get(key);
    if (v == nullptr || v->kind == Kind::kNone) return fallback;
    return integer(*v, key);
  }
  const std::string& string(const Value& v, const char* field) const {
    if (v.kind != Kind::kString)
      fail(field, fmt::format("expected a string, found {}", v.type_name()));
    return v.s;
  }
  std::string string_or(const Value& dict, const char* key, const std::string& fallback) const {
    const Value* v = dict.get(key);
    if (v == nullptr || v->kind == Kind::kNone) return fallback;
    return string(*v, key);
  }
  bool boolean_or(const Value& dict, const char* key, bool fallback) const {
    const Value* v = dict.get(key);
    if (v == nullptr || v->kind == Kind::kNone) return fallback;
    if (v->kind == Kind::kBool) return v->b;
    if (v->kind == Kind::kInt) return v->i != 0;
    fail(key, fmt::format("expected a bool, found {}", v->type_name()));
  }
  const std::vector<ValuePtr>& sequence(const Value& v, const char* field) const {
    if (!v.is_sequence()) fail(field, fmt::format("expected a list, found {}", v.type_name()));
    return v.items;
  }
  std::vector<std::vector<int64_t>> sizes(const Value& dict, const char* key) const {
    std::vector<std::vector<int64_t>> out;
    const Value* v = dict.get(key);
    if (v == nullptr || v->kind == Kind::kNone) return out;
    for (const auto& t : sequence(*v, key)) {
      std::vector<int64_t> shape;
      for (const auto& d : sequence(*t, key)) shape.push_back(integer(*d, key));
      out.push_back(std::move(shape));
    }
    return out;
  }
  std::vector<std::string> strings(const Value& dict, const char* key) const {
    std::vector<std::string> out;
    const Value* v = dict.get(key);
    if (v == nullptr || v->kind == Kind::kNone) return out;
    for (const auto& s : sequence(*v, key)) out.push_back(string(*s, key));
    return out;
  }

 private:
  const std::string& path_;
  std::string where_;
  int64_t index_ = -1;
};

FrState parse_state(const std::string& s) {
  if (s == "scheduled") return FrState::kScheduled;
  if (s == "started") return FrState::kStarted;
  if (s == "completed") return FrState::kCompleted;
  return FrState::kOther;
}

// pg_config's "ranks": "[0, 1, 2]" as c10d writes it, or a list.
std::vector<int64_t> parse_ranks(const Value& v, const Reader& r) {
  std::vector<int64_t> out;
  if (v.is_sequence()) {
    for (const auto& x : v.items) out.push_back(r.integer(*x, "ranks"));
  } else if (v.kind == Kind::kString) {
    int64_t cur = -1;
    for (char c : v.s) {
      if (std::isdigit(static_cast<unsigned char>(c))) {
        cur = (cur < 0 ? 0 : cur * 10) + (c - '0');
        if (cur > (int64_t{1} << 40)) r.fail("ranks", "a rank beyond 2^40");
      } else {
        if (cur >= 0) out.push_back(cur);
        cur = -1;
        if (c != '[' && c != ']' && c != ',' && c != ' ')
          r.fail("ranks", fmt::format("expected a list of ranks, found '{}'", v.s.substr(0, 80)));
      }
    }
    if (cur >= 0) out.push_back(cur);
  } else {
    r.fail("ranks", fmt::format("expected a list of ranks, found {}", v.type_name()));
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

FrRankDump convert(const Value& root, const std::string& path, int64_t rank, FrJobBuilder& b,
                   Config& config) {
  const Reader top(path, "the dump");
  if (!root.is_dict()) top.fail("", fmt::format("expected a dict, found {}", root.type_name()));
  FrRankDump d;
  d.rank = rank;
  d.path = path;
  d.version = top.string(top.need(root, "version"), "version");
  if (d.version.rfind("2.", 0) != 0) {
    top.fail("version", fmt::format("'{}' is not a Flight Recorder dump version lossguard reads "
                                    "(2.x: torch 2.6 to 2.15)",
                                    d.version));
  }
  d.comm_lib_version = top.string_or(root, "comm_lib_version", "");
  if (const Value* pg = root.get("pg_config"); pg != nullptr && pg->kind != Kind::kNone) {
    if (!pg->is_dict()) top.fail("pg_config", "expected a dict");
    for (const auto& [k, v] : pg->entries) {
      const Reader r = top.at(fmt::format("pg_config['{}']", k->s));
      if (!v->is_dict()) r.fail("", "expected a dict");
      std::string name = r.string_or(*v, "name", k->kind == Kind::kString ? k->s : "");
      // Gloo's recorder (torch 2.15) writes one pg_config entry named "" whose ranks are those of
      // some group this rank joined, not the default group's: it names no group, so it is skipped.
      if (name.empty()) {
        config.unnamed_entry = true;
        continue;
      }
      ConfigGroup g{parse_ranks(r.need(*v, "ranks"), r), r.string_or(*v, "desc", ""), path};
      auto [it, fresh] = config.groups.try_emplace(name, g);
      if (!fresh && it->second.members != g.members) {
        r.fail("ranks", fmt::format("group '{}' has members [{}] here but [{}] in {}: the dumps "
                                    "are not from one job",
                                    name, fmt::join(g.members, ", "),
                                    fmt::join(it->second.members, ", "), it->second.path));
      }
    }
  }
  const Value& entries = top.need(root, "entries");
  const auto& items = top.sequence(entries, "entries");
  d.calls.reserve(items.size());
  for (std::size_t k = 0; k < items.size(); ++k) {
    const Reader r = top.entry(k);
    const Value& e = *items[k];
    if (!e.is_dict()) r.fail("", fmt::format("expected a dict, found {}", e.type_name()));
    FrCall c;
    c.record_id = r.integer_or(e, "record_id", static_cast<int64_t>(k));
    const Value& pg = r.need(e, "process_group");
    const auto& pg_items = r.sequence(pg, "process_group");
    if (pg_items.size() != 2) r.fail("process_group", "expected (name, description)");
    c.group =
        b.group(r.string(*pg_items[0], "process_group"), r.string(*pg_items[1], "process_group"));
    FrSignature s;
    s.profiling_name = r.string(r.need(e, "profiling_name"), "profiling_name");
    const auto op = parse_profiling_name(s.profiling_name);
    if (!op) {
      r.fail("profiling_name",
             fmt::format("'{}' is not '<backend>:<op>' (p2p: 'send a->b', 'recv b<-a')",
                         s.profiling_name));
    }
    s.op = op->op;
    s.input_sizes = r.sizes(e, "input_sizes");
    s.output_sizes = r.sizes(e, "output_sizes");
    s.input_dtypes = r.strings(e, "input_dtypes");
    s.output_dtypes = r.strings(e, "output_dtypes");
    c.is_p2p = r.boolean_or(e, "is_p2p", op->op == "send" || op->op == "recv");
    c.p2p_src = op->src;
    c.p2p_dst = op->dst;
    if (c.is_p2p) {
      c.seq = r.integer(r.need(e, "p2p_seq_id"), "p2p_seq_id");
    } else if (e.get("collective_seq_id") != nullptr) {
      c.seq = r.integer(*e.get("collective_seq_id"), "collective_seq_id");
    } else {
      c.seq = r.integer(r.need(e, "seq_id"), "seq_id");  // dumps before collective_seq_id
    }
    c.signature = b.signature(std::move(s));
    c.time_created_ns = r.integer_or(e, "time_created_ns", 0);
    c.state = parse_state(r.string_or(e, "state", "scheduled"));
    c.retired = r.boolean_or(e, "retired", false);
    c.timeout_ms = r.integer_or(e, "timeout_ms", 0);
    if (const Value* frames = e.get("frames"); frames != nullptr && frames->kind != Kind::kNone) {
      std::vector<FrFrame> stack;
      for (const auto& f : r.sequence(*frames, "frames")) {
        if (!f->is_dict()) r.fail("frames", "expected a list of dicts");
        stack.push_back({r.string_or(*f, "name", ""), r.string_or(*f, "filename", ""),
                         r.integer_or(*f, "line", 0)});
      }
      c.stack = b.stack(std::move(stack));
    }
    d.calls.push_back(c);
  }
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

FrRankDump read_one(const std::string& path, int64_t rank, FrJobBuilder& builder, Config& config) {
  const std::string bytes = read_bytes(path);
  ValuePtr root;
  std::string format;
  std::size_t first = 0;
  while (first < bytes.size() && std::isspace(static_cast<unsigned char>(bytes[first]))) ++first;
  if (!bytes.empty() && static_cast<unsigned char>(bytes[0]) == 0x80) {
    format = "pickle";
    root = unpickle(bytes, path, [&](const ValuePtr&) -> ValuePtr {
      throw_input_error("{}: a Flight Recorder dump holds no persistent ids (tensors)", path);
    });
  } else if (first < bytes.size() && bytes[first] == '{') {
    format = "json";
    root = json_to_value(bytes, path);
  } else {
    throw_input_error(
        "{}: not a Flight Recorder dump (neither a pickle, which starts with byte "
        "0x80, nor a JSON object){}",
        path, bytes.empty() ? ": the file is empty" : "");
  }
  FrRankDump d = convert(*root, path, rank, builder, config);
  d.format = format;
  return d;
}

}  // namespace

FrRankDump read_flight_record(const std::string& path, int64_t rank, FrJobBuilder& builder) {
  Config config;
  return read_one(path, rank, builder, config);
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
  // Files are read on every core: parsing is the cost (a 2,000-call dump is ~400 KB of pickle).
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
        shares[w].dumps.push_back(
            read_one(files[k].first, files[k].second, shares[w].builder, shares[w].config));
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

  FrJobBuilder builder;
  Config all;
  std::map<std::string, ConfigGroup>& config = all.groups;
  std::vector<FrRankDump> ranks;
  ranks.reserve(files.size());
  for (auto& share : shares) merge_share(share, builder, all, ranks);
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
  for (const auto& [name, g] : config) {
    const uint32_t id = builder.group(name, g.desc);
    builder.job().groups[id].members = g.members;
  }
  FrJob job = builder.take();
  job.ranks = std::move(ranks);
  std::sort(job.ranks.begin(), job.ranks.end(),
            [](const FrRankDump& a, const FrRankDump& b) { return a.rank < b.rank; });
  // Groups no pg_config lists: their members are the ranks whose calls name them.
  std::vector<std::vector<int64_t>> named(job.groups.size());
  for (const auto& d : job.ranks) {
    for (const auto& c : d.calls) {
      auto& m = named[c.group];
      if (m.empty() || m.back() != d.rank) m.push_back(d.rank);
    }
  }
  // The world: the default group's membership where a pg_config gives it, else the highest rank
  // seen plus one.
  int64_t highest = -1;
  for (const auto& d : job.ranks) highest = std::max(highest, d.rank);
  for (const auto& [name, g] : config) {
    if (!g.members.empty()) highest = std::max(highest, g.members.back());
  }
  if (auto it = config.find("0"); it != config.end() && !it->second.members.empty()) {
    job.world = it->second.members.back() + 1;
    job.world_from_config = true;
    if (highest >= job.world) {
      throw_input_error(
          "{}: rank {} is outside the default group [0, {}) that the dumps' "
          "pg_config gives: the dumps are not from one job",
          it->second.path, highest, job.world);
    }
  } else {
    job.world = highest + 1;
    job.notes.push_back(fmt::format(
        "the world size ({}) is the highest rank seen plus one: no dump lists the default group",
        job.world));
  }
  if (all.unnamed_entry) {
    job.notes.push_back(
        "pg_config's entry named '' (Gloo's recorder writes one, with some subgroup's ranks) names "
        "no group and was not used");
  }
  std::vector<std::string> inferred;
  for (std::size_t g = 0; g < job.groups.size(); ++g) {
    if (job.groups[g].name == "0" && !config.count("0")) {
      // The default group is the world (torch.distributed's group.WORLD, named "0").
      job.groups[g].members.resize(static_cast<std::size_t>(job.world));
      std::iota(job.groups[g].members.begin(), job.groups[g].members.end(), int64_t{0});
      continue;
    }
    if (!config.count(job.groups[g].name)) {
      job.groups[g].members = std::move(named[g]);
      job.groups[g].members_inferred = true;
      inferred.push_back(job.groups[g].name);
    }
  }
  if (!inferred.empty()) {
    job.notes.push_back(fmt::format(
        "no dump's pg_config lists group(s) {}: their members are the ranks whose calls name "
        "them (Gloo's recorder lists none); a member that never issued a call on such a group "
        "cannot be seen",
        fmt::join(inferred, ", ")));
  }
  return job;
}

}  // namespace lossguard::io
