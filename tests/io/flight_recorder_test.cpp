// The Flight Recorder reader (SPEC §12) on dumps written here in torch's layout: both formats, the
// rank from the file name, directories and prefixes, and every bad set refused naming its file:
// a pickle that would run code, a truncated file, a missing field, two files for one rank, mixed
// versions, groups whose members disagree. Real torch dumps: tests/postmortem/.
#include "io/flight_recorder.h"

#include <gtest/gtest.h>

#include <fstream>

#include "core/errors.h"
#include "io/flat_pickle.h"
#include "io/pickle.h"
#include "test_util.h"

namespace lossguard::io {
namespace {

struct Entry {
  std::string group = "0", desc = "default_pg", op = "gloo:all_reduce";
  int64_t seq = 1;
  std::vector<int64_t> size = {3};
};

// A dump as c10d's FlightRecorder::dump_pickle writes it (protocol 2: dicts, lists, a tuple for
// process_group), with `pg_ranks` as pg_config's "ranks" string for the default group.
std::string pickled_dump(const std::vector<Entry>& entries, const std::string& version = "2.10",
                         const std::string& pg_ranks = "", bool with_frames = true) {
  PickleWriter p;
  p.proto();
  p.empty_dict();
  p.mark();
  p.string("version");
  p.string(version);
  p.string("pg_config");
  p.empty_dict();
  if (!pg_ranks.empty()) {
    p.mark();
    p.string("0");
    p.empty_dict();
    p.mark();
    p.string("name");
    p.string("0");
    p.string("desc");
    p.string("default_pg");
    p.string("ranks");
    p.string(pg_ranks);
    p.setitems();
    p.setitems();
  }
  p.string("entries");
  p.empty_list();
  p.mark();
  for (std::size_t k = 0; k < entries.size(); ++k) {
    const Entry& e = entries[k];
    p.empty_dict();
    p.mark();
    p.string("record_id");
    p.integer(static_cast<int64_t>(k));
    p.string("pg_id");
    p.integer(0);
    p.string("process_group");
    p.mark();
    p.string(e.group);
    p.string(e.desc);
    p.tuple();
    p.string("collective_seq_id");
    p.integer(e.seq);
    p.string("p2p_seq_id");
    p.integer(0);
    p.string("profiling_name");
    p.string(e.op);
    p.string("time_created_ns");
    p.integer(1000 + static_cast<int64_t>(k));
    p.string("input_sizes");
    p.empty_list();
    p.mark();
    p.empty_list();
    p.mark();
    for (int64_t d : e.size) p.integer(d);
    p.appends();
    p.appends();
    p.string("input_dtypes");
    p.empty_list();
    p.mark();
    p.string("Float");
    p.appends();
    p.string("state");
    p.string("scheduled");
    p.string("time_discovered_started_ns");
    p.none();
    p.string("retired");
    p.boolean(true);
    p.string("is_p2p");
    p.boolean(false);
    if (with_frames) {
      p.string("frames");
      p.empty_list();
      p.mark();
      p.empty_dict();
      p.mark();
      p.string("name");
      p.string("train_step");
      p.string("filename");
      p.string("train.py");
      p.string("line");
      p.integer(42);
      p.setitems();
      p.appends();
    }
    p.setitems();
  }
  if (!entries.empty()) p.appends();
  p.setitems();
  p.stop();
  return p.out;
}

void write(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string error_of(const std::vector<std::string>& paths) {
  try {
    read_flight_records(paths);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

TEST(FlightRecorder, ReadsTorchsPickleLayout) {
  auto dir = testing::temp_dir("fr_read");
  write(dir / "fr_trace_rank_0",
        pickled_dump({{}, {"5", "dp", "gloo:broadcast", 1, {1}}}, "2.10", "[0, 1]"));
  write(dir / "fr_trace_rank_1", pickled_dump({{}}, "2.10", "[0, 1]"));
  const FrJob job = read_flight_records({dir.string()});
  ASSERT_EQ(job.ranks.size(), 2u);
  EXPECT_EQ(job.world, 2);
  EXPECT_TRUE(job.world_known);
  EXPECT_EQ(job.world_source, "pg_config");
  EXPECT_EQ(job.ranks[0].rank, 0);
  EXPECT_EQ(job.ranks[0].format, "pickle");
  ASSERT_EQ(job.ranks[0].calls.size(), 2u);
  const FrCall& b = job.ranks[0].calls[1];
  EXPECT_EQ(job.groups[b.group].name, "5");
  EXPECT_EQ(job.groups[b.group].desc, "dp");
  EXPECT_TRUE(job.groups[b.group].members_inferred);
  EXPECT_EQ(job.groups[b.group].members, (std::vector<int64_t>{0}));
  EXPECT_EQ(job.signatures[b.signature].op, "broadcast");
  EXPECT_EQ(job.signatures[b.signature].input_sizes, (std::vector<std::vector<int64_t>>{{1}}));
  EXPECT_EQ(b.time_created_ns, 1001);
  ASSERT_EQ(job.stacks[b.stack].size(), 1u);
  EXPECT_EQ(job.stacks[b.stack][0].filename, "train.py");
  EXPECT_EQ(job.stacks[b.stack][0].line, 42);
  const FrCall& a = job.ranks[1].calls[0];
  EXPECT_EQ(job.groups[a.group].members, (std::vector<int64_t>{0, 1}));  // from pg_config
  EXPECT_FALSE(job.groups[a.group].members_inferred);
}

TEST(FlightRecorder, ReadsTheJsonDumpAndAPrefix) {
  auto dir = testing::temp_dir("fr_json");
  const std::string json =
      R"({"version": "2.10", "pg_config": {}, "entries": [{"record_id": 0, "process_group":
      ["0", "default_pg"], "collective_seq_id": 1, "p2p_seq_id": 0, "profiling_name":
      "nccl:send 0->1", "is_p2p": true, "input_sizes": [[4]], "input_dtypes": ["Float"],
      "state": "completed", "time_created_ns": 7}]})";
  write(dir / "trace_3.json", json);
  write(dir / "other_9", pickled_dump({{}}));
  const FrJob job = read_flight_records({(dir / "trace_").string()});  // a prefix
  ASSERT_EQ(job.ranks.size(), 1u);
  EXPECT_EQ(job.ranks[0].rank, 3);
  EXPECT_EQ(job.ranks[0].format, "json");
  const FrCall& c = job.ranks[0].calls[0];
  EXPECT_TRUE(c.is_p2p);
  EXPECT_EQ(c.p2p_src, 0);
  EXPECT_EQ(c.p2p_dst, 1);
  EXPECT_EQ(c.state, FrState::kCompleted);
  // No pg_config: the world is unknown (the tables are sized by the highest rank seen), and the
  // default group's members are the ranks that dumped, marked incomplete: never 0-3 guessed.
  EXPECT_EQ(job.world, 4);
  EXPECT_FALSE(job.world_known);
  EXPECT_EQ(job.groups[c.group].members, (std::vector<int64_t>{3}));
  EXPECT_TRUE(job.groups[c.group].members_inferred);
}

TEST(FlightRecorder, APickleThatWouldRunCodeIsRefusedWithoutRunningIt) {
  auto dir = testing::temp_dir("fr_hostile");
  PickleWriter p;
  p.proto();
  p.global("os", "system");
  p.mark();
  p.string("touch " + (dir / "pwned").string());
  p.tuple();
  p.reduce();
  p.stop();
  write(dir / "fr_trace_rank_0", p.out);
  const std::string e = error_of({dir.string()});
  EXPECT_NE(e.find("fr_trace_rank_0"), std::string::npos) << e;
  EXPECT_NE(e.find("os.system"), std::string::npos) << e;
  EXPECT_FALSE(std::filesystem::exists(dir / "pwned"));
}

TEST(FlightRecorder, BadSetsAreRefusedNamingTheFile) {
  auto dir = testing::temp_dir("fr_bad");
  const std::string good = pickled_dump({{}});
  // truncated
  write(dir / "cut_0", good.substr(0, good.size() / 2));
  std::string e = error_of({(dir / "cut_0").string()});
  EXPECT_NE(e.find("cut_0"), std::string::npos) << e;
  // neither pickle nor JSON
  write(dir / "text_0", "hello");
  e = error_of({(dir / "text_0").string()});
  EXPECT_NE(e.find("not a Flight Recorder dump"), std::string::npos) << e;
  // a field missing: named with its entry
  write(
      dir / "noname_0",
      R"({"version": "2.10", "entries": [{"process_group": ["0", ""], "collective_seq_id": 1}]})");
  e = error_of({(dir / "noname_0").string()});
  EXPECT_NE(e.find("entry 0 field 'profiling_name': missing"), std::string::npos) << e;
  // not a version lossguard reads
  write(dir / "v1_0", pickled_dump({{}}, "1.5"));
  e = error_of({(dir / "v1_0").string()});
  EXPECT_NE(e.find("'1.5'"), std::string::npos) << e;
  // two files for one rank
  auto dup = testing::temp_dir("fr_dup");
  write(dup / "a_1", good);
  write(dup / "b_1", good);
  e = error_of({dup.string()});
  EXPECT_NE(e.find("a_1"), std::string::npos) << e;
  EXPECT_NE(e.find("b_1"), std::string::npos) << e;
  EXPECT_NE(e.find("both claim rank 1"), std::string::npos) << e;
  // mixed versions
  auto mixed = testing::temp_dir("fr_mixed");
  write(mixed / "t_0", pickled_dump({{}}, "2.10"));
  write(mixed / "t_1", pickled_dump({{}}, "2.7"));
  e = error_of({mixed.string()});
  EXPECT_NE(e.find("t_1 (version 2.7)"), std::string::npos) << e;
  // one group, two memberships
  auto split = testing::temp_dir("fr_split");
  write(split / "t_0", pickled_dump({{}}, "2.10", "[0, 1]"));
  write(split / "t_1", pickled_dump({{}}, "2.10", "[0, 1, 2]"));
  e = error_of({split.string()});
  EXPECT_NE(e.find("not from one job"), std::string::npos) << e;
  // a rank number no job has: refused, not used to size per-rank tables
  auto huge = testing::temp_dir("fr_huge");
  write(huge / "t_123456789", good);
  e = error_of({huge.string()});
  EXPECT_NE(e.find("rank 123456789"), std::string::npos) << e;
  // a default group that is not 0..n-1 (a world claimed by one number: not a world)
  auto claim = testing::temp_dir("fr_claim");
  write(claim / "t_0", pickled_dump({{}}, "2.10", "[16777215]"));
  write(claim / "t_1", pickled_dump({{}}, "2.10", "[16777215]"));
  e = error_of({claim.string()});
  EXPECT_NE(e.find("default group '0' lists ranks [16777215]"), std::string::npos) << e;
  // a name without a rank
  write(dir / "trace.pkl", good);
  e = error_of({(dir / "trace.pkl").string()});
  EXPECT_NE(e.find("must end in its rank number"), std::string::npos) << e;
}

TEST(FlightRecorder, PgStatusAndRetirementSayWhichCallsCompleted) {
  // Gloo's entries all read "scheduled": pg_status (keyed by the rank's pg_id) and `retired` say
  // which completed. Call 1 is retired; call 2 is not, and pg_status says 1 completed.
  auto dir = testing::temp_dir("fr_status");
  const std::string json =
      R"({"version": "2.10", "pg_status": {"0": {"last_enqueued_collective": 2,
      "last_started_collective": -1, "last_completed_collective": 1}}, "entries": [
      {"record_id": 0, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 1,
       "profiling_name": "gloo:all_reduce", "state": "scheduled", "retired": true},
      {"record_id": 1, "pg_id": 0, "process_group": ["0", "default_pg"], "collective_seq_id": 2,
       "profiling_name": "gloo:all_reduce", "state": "scheduled", "retired": false}]})";
  write(dir / "t_0", json);
  const FrJob job = read_flight_records({dir.string()});
  const FrRankDump& d = job.ranks[0];
  ASSERT_EQ(d.pg_status.size(), 1u);
  EXPECT_EQ(d.pg_status[0].last_completed, 1);
  EXPECT_EQ(d.last_completed(0), 1);
  EXPECT_TRUE(d.calls[0].retired);
  EXPECT_TRUE(d.finished(d.calls[0]));
  EXPECT_FALSE(d.finished(d.calls[1]));  // enqueued, never completed: where the rank waits
}

TEST(FlightRecorder, AFileThatIsNoDumpIsRefusedFromItsFirstByte) {
  // A 1 GiB sparse file of zeros: refused on its first byte, never read whole (the test would
  // take seconds and a GiB of memory otherwise).
  auto dir = testing::temp_dir("fr_zeros");
  const auto path = dir / "t_0";
  { std::ofstream(path, std::ios::binary); }
  std::filesystem::resize_file(path, std::uintmax_t{1} << 30);
  const std::string e = error_of({path.string()});
  EXPECT_NE(e.find("starts with byte 0x00"), std::string::npos) << e;
}

TEST(FlightRecorder, SharedReferencesThatExpandBeyondTheBytesAreRefused) {
  // 9 levels of 10 memo references in under 1 KB: 10^9 values if followed. Both readers refuse
  // it against a visit budget proportional to the file's bytes (the fast one takes plain data;
  // the same bytes with a tuple opcode the fast reader does not take go to the restricted one).
  for (const bool restricted : {false, true}) {
    PickleWriter p;
    p.proto();
    p.empty_dict();
    p.mark();
    p.string("version");
    p.string("2.10");
    p.string("entries");
    p.empty_list();
    p.mark();
    p.empty_dict();
    p.mark();
    for (const char* k : {"process_group"}) p.string(k);
    p.mark();
    p.string("0");
    p.string("default_pg");
    p.tuple();
    p.string("profiling_name");
    p.string("gloo:all_reduce");
    p.string("collective_seq_id");
    p.integer(1);
    // "junk": [L0, L1, ..., L8], each L(k) a list of 10 references to L(k-1), memo key k;
    // "frames": L9, 10 references to L8.
    p.string("junk");
    p.empty_list();
    p.mark();
    p.empty_list();
    p.out += 'q';  // BINPUT 0: the innermost list
    p.out += '\0';
    for (int level = 1; level <= 9; ++level) {
      if (level == 9) {
        p.appends();
        p.string("frames");
      }
      p.empty_list();
      p.mark();
      for (int k = 0; k < 10; ++k) {
        p.out += 'h';  // BINGET level - 1
        p.out += static_cast<char>(level - 1);
      }
      p.appends();
      p.out += 'q';  // BINPUT level
      p.out += static_cast<char>(level);
    }
    if (restricted) p.out += "N\x85\x30";  // (None,) popped again: the fast reader declines it
    p.setitems();
    p.appends();
    p.setitems();
    p.stop();
    ASSERT_LT(p.out.size(), 1024u);
    auto dir = testing::temp_dir(restricted ? "fr_bomb_r" : "fr_bomb");
    write(dir / "t_0", p.out);
    const std::string e = error_of({dir.string()});
    EXPECT_NE(e.find("t_0"), std::string::npos) << e;
    EXPECT_NE(e.find("expand to more than"), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace lossguard::io

namespace lossguard::io {
namespace {

// An opcode without a mark of its own never reaches below a pending MARK: Python's unpickler
// refuses each of these ("unexpected MARK found", checked with pickle.loads), so the fast reader
// must not take them (the fuzzer found the SETITEM one: the fast path took what the restricted
// unpickler refuses).
TEST(FlatPickle, RefusesOpcodesThatReachBelowAPendingMark) {
  using namespace std::string_literals;  // (a literal is split where a hex escape would eat a
                                         // letter)
  const std::string setitem =
      "\x80\x02}(X\x01\x00\x00\x00"
      "a}su."s;  // SETITEM into the dict below '('
  const std::string append =
      "\x80\x02](K\x01"
      "ae."s;  // APPEND into the list below '('
  const std::string binput =
      "\x80\x02(q\x00"
      "K\x01"
      "t."s;  // BINPUT of the mark's empty frame
  for (const std::string& bad : {setitem, append, binput}) {
    EXPECT_FALSE(FlatPickle::parse(bad)) << ::testing::PrintToString(bad);
    EXPECT_THROW(unpickle(bad, "t", [](const ValuePtr&) -> ValuePtr { return nullptr; }),
                 InputError);
  }
  // The well-formed neighbour: SETITEMS closing its own mark.
  const auto ok = FlatPickle::parse(
      "\x80\x02}(X\x01\x00\x00\x00"
      "aK\x01"
      "u."s);
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->node(ok->root()).size, 1u);
}

// A PROTO opcode anywhere in the stream names a protocol the restricted unpickler reads (2 to 5),
// or the fast reader refuses it too (the fuzzer found a PROTO 0 in the middle of a dump: the fast
// path skipped its byte, the restricted unpickler refused it).
TEST(FlatPickle, RefusesTheProtocolsTheUnpicklerRefuses) {
  using namespace std::string_literals;
  for (const std::string& bad : {"\x80\x02]\x80\x00."s, "\x80\x01]."s, "\x80\x06]."s}) {
    EXPECT_FALSE(FlatPickle::parse(bad)) << ::testing::PrintToString(bad);
    EXPECT_THROW(unpickle(bad, "t", [](const ValuePtr&) -> ValuePtr { return nullptr; }),
                 InputError);
  }
  EXPECT_TRUE(FlatPickle::parse("\x80\x02]\x80\x05."s));  // a later PROTO of a readable protocol
}

// The fast reader takes plain data only and hands everything else to the restricted unpickler.
TEST(FlatPickle, ReadsPlainDataAndDefersEverythingElse) {
  const std::string dump = pickled_dump({{}, {"5", "dp", "gloo:broadcast", 1, {1}}});
  const auto flat = FlatPickle::parse(dump);
  ASSERT_TRUE(flat);
  const uint32_t entries = flat->get(flat->root(), "entries");
  ASSERT_NE(entries, FlatPickle::kEnd);
  EXPECT_EQ(flat->node(entries).size, 2u);
  EXPECT_EQ(flat->node(flat->get(flat->root(), "version")).s, "2.10");

  // A call (os.system) is not plain data.
  PickleWriter evil;
  evil.proto();
  evil.global("os", "system");
  evil.mark();
  evil.string("true");
  evil.tuple();
  evil.reduce();
  evil.stop();
  EXPECT_FALSE(FlatPickle::parse(evil.out));
  // Truncated.
  EXPECT_FALSE(FlatPickle::parse(dump.substr(0, dump.size() - 1)));
  // A list memoised, then appended into itself: a cycle.
  PickleWriter cyc;
  cyc.proto();
  cyc.empty_list();
  cyc.out += "q\x01";  // BINPUT 1
  cyc.out += "h\x01";  // BINGET 1
  cyc.out += "a";      // APPEND: the list into itself
  cyc.stop();
  EXPECT_FALSE(FlatPickle::parse(cyc.out));
  // A dict shared by two lists (torch's pickler shares a stack's frame dicts) is read once.
  PickleWriter shared;
  shared.proto();
  shared.empty_list();
  shared.mark();
  shared.empty_dict();
  shared.mark();
  shared.string("line");
  shared.integer(7);
  shared.setitems();
  shared.out += "q\x02";  // BINPUT 2: the finished dict
  shared.out += "h\x02";  // BINGET 2: the same dict again
  shared.appends();
  shared.stop();
  const auto s = FlatPickle::parse(shared.out);
  ASSERT_TRUE(s);
  std::vector<uint32_t> items;
  s->for_each_child(s->root(), [&](uint32_t n) { items.push_back(n); });
  ASSERT_EQ(items.size(), 2u);
  EXPECT_EQ(items[0], items[1]);
  EXPECT_EQ(s->node(s->get(items[0], "line")).i, 7);
}

TEST(FlatPickle, TheFastAndTheFullReaderGiveOneJob) {
  // A dump the fast reader defers (a harmless global inside, read by the full unpickler as an
  // opaque value) reads as the same calls as its plain twin.
  auto dir = testing::temp_dir("fr_twin");
  write(dir / "plain_0", pickled_dump({{}, {"5", "dp", "gloo:broadcast", 1, {1}}}));
  std::string odd = pickled_dump({{}, {"5", "dp", "gloo:broadcast", 1, {1}}});
  // Replace the final STOP by: a key and a collections.OrderedDict() call, SETITEM, STOP.
  odd.pop_back();
  PickleWriter extra;
  extra.string("extra");
  extra.global("collections", "OrderedDict");
  extra.out += ")";
  extra.reduce();
  extra.out += "s";
  extra.stop();
  odd += extra.out;
  ASSERT_FALSE(FlatPickle::parse(odd));
  write(dir / "odd_1", odd);
  const FrJob job = read_flight_records({dir.string()});
  ASSERT_EQ(job.ranks.size(), 2u);
  ASSERT_EQ(job.ranks[0].calls.size(), job.ranks[1].calls.size());
  for (std::size_t k = 0; k < job.ranks[0].calls.size(); ++k) {
    const FrCall& a = job.ranks[0].calls[k];
    const FrCall& b = job.ranks[1].calls[k];
    EXPECT_EQ(a.group, b.group);
    EXPECT_EQ(a.signature, b.signature);
    EXPECT_EQ(a.stack, b.stack);
    EXPECT_EQ(a.seq, b.seq);
    EXPECT_EQ(a.time_created_ns, b.time_created_ns);
  }
}

}  // namespace
}  // namespace lossguard::io

namespace lossguard::io {
namespace {

// Dumps torch 2.15 wrote (tests/postmortem/fr_job.py --scenario seed-pp1-broadcast, Gloo): the
// fast reader takes every one (torch's pickler shares the frames' dicts), and both formats read
// as the same calls.
TEST(FlightRecorder, RealTorchDumpsTakeTheFastPathAndBothFormatsAgree) {
  const std::filesystem::path dir =
      std::filesystem::path(LOSSGUARD_FIXTURE_DIR) / "flight_recorder" / "seed-pp1-broadcast";
  for (int r = 0; r < 4; ++r) {
    std::ifstream f(dir / ("fr_trace_rank_" + std::to_string(r)), std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    EXPECT_TRUE(FlatPickle::parse(bytes)) << r;
  }
  const FrJob pickled = read_flight_records({dir.string()});
  const FrJob json = read_flight_records({(dir / "json").string()});
  ASSERT_EQ(pickled.ranks.size(), 4u);
  ASSERT_EQ(json.ranks.size(), 4u);
  const std::vector<std::size_t> calls = {4, 1, 1, 1};  // rank 0 went on to the barrier
  for (std::size_t r = 0; r < 4; ++r) {
    ASSERT_EQ(pickled.ranks[r].calls.size(), calls[r]) << r;
    ASSERT_EQ(json.ranks[r].calls.size(), calls[r]) << r;
    for (std::size_t k = 0; k < calls[r]; ++k) {
      const FrCall& a = pickled.ranks[r].calls[k];
      const FrCall& b = json.ranks[r].calls[k];
      EXPECT_EQ(pickled.groups[a.group].name, json.groups[b.group].name);
      EXPECT_EQ(pickled.signatures[a.signature].profiling_name,
                json.signatures[b.signature].profiling_name);
      EXPECT_EQ(pickled.signatures[a.signature].input_sizes,
                json.signatures[b.signature].input_sizes);
      EXPECT_EQ(a.seq, b.seq);
      EXPECT_EQ(a.time_created_ns, b.time_created_ns);
    }
  }
  EXPECT_EQ(pickled.signatures[pickled.ranks[0].calls[3].signature].op, "barrier");
  EXPECT_FALSE(pickled.stacks[pickled.ranks[0].calls[3].stack].empty());  // JSON has no frames
}

}  // namespace
}  // namespace lossguard::io
