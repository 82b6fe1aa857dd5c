// The malformed-dump catalog: truncated files, bad headers, overlapping offsets, wrong lengths, R >
// T, bad mask values, missing fields, malicious globals, hostile pickles.
#include "malformed_catalog.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "core/array.h"
#include "io/pickle.h"
#include "io/safetensors.h"
#include "io/torch_zip.h"
#include "test_util.h"

namespace lossguard::testing {

namespace {

std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int k = 0; k < 8; ++k) out[k] = static_cast<char>((n >> (8 * k)) & 0xff);
  return out + header + data;
}

std::string u64(uint64_t n) {
  std::string out(8, '\0');
  for (int k = 0; k < 8; ++k) out[k] = static_cast<char>((n >> (8 * k)) & 0xff);
  return out;
}

// A valid packed header+data for 1 sample with T = 3, R = 1 (int64).
std::string packed_header(const std::string& tokens_offsets = "[0,24]",
                          const std::string& extra = "") {
  return R"({"tokens":{"dtype":"I64","shape":[3],"data_offsets":)" + tokens_offsets +
         R"(},"total_lengths":{"dtype":"I64","shape":[1],"data_offsets":[24,32]},)"
         R"("response_lengths":{"dtype":"I64","shape":[1],"data_offsets":[32,40]})" +
         extra + "}";
}
std::string packed_data() {
  std::string d;
  for (int64_t v : {1, 2, 3, 3, 1}) {
    d += u64(static_cast<uint64_t>(v));
  }
  return d;
}

}  // namespace

std::vector<MalformedDump> write_malformed_catalog(const std::filesystem::path& dir,
                                                   const std::string& fixture_dir) {
  std::vector<MalformedDump> c;
  auto add = [&](const std::string& name, const std::string& file, const std::string& bytes,
                 const std::string& expected) {
    write_file(dir / file, bytes);
    c.push_back({name, (dir / file).string(), expected});
  };
  // safetensors
  const std::string good = safetensors_bytes(packed_header(), packed_data());
  add("safetensors truncated data", "truncated.safetensors", good.substr(0, good.size() - 5),
      "run past the data buffer");
  add("safetensors shorter than its size field", "tiny.safetensors", "abc",
      "shorter than its 8-byte header size");
  add("safetensors header longer than the file", "long_header.safetensors", u64(5000) + "{}",
      "header claims 5000 bytes");
  add("safetensors header over the cap", "huge_header.safetensors", u64(200'000'000) + "{}",
      "exceeds the format's cap");
  add("safetensors header not JSON", "not_json.safetensors", safetensors_bytes("{nope", ""),
      "not valid JSON");
  add("safetensors header not an object", "not_object.safetensors", safetensors_bytes("[1,2]", ""),
      "does not start with '{'");
  add("safetensors overlapping offsets", "overlap.safetensors",
      safetensors_bytes(
          packed_header("[0,24]", R"(,"x":{"dtype":"I64","shape":[1],"data_offsets":[16,24]})"),
          packed_data()),
      "overlap");
  add("safetensors gap in offsets", "gap.safetensors",
      safetensors_bytes(R"({"tokens":{"dtype":"I64","shape":[1],"data_offsets":[8,16]}})",
                        std::string(16, '\0')),
      "leaving a gap");
  add("safetensors size not shape x dtype", "wrong_size.safetensors",
      safetensors_bytes(R"({"tokens":{"dtype":"I64","shape":[2],"data_offsets":[0,24]}})",
                        packed_data().substr(0, 24)),
      "needs 16");
  add("safetensors duplicate tensor name", "duplicate.safetensors",
      safetensors_bytes(
          R"({"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},"a":{"dtype":"I64","shape":[1],"data_offsets":[8,16]}})",
          std::string(16, '\0')),
      "names tensor 'a' twice");
  add("safetensors unsupported dtype", "f8.safetensors",
      safetensors_bytes(R"({"a":{"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]}})",
                        std::string(1, '\0')),
      "unsupported dtype");
  add("safetensors trailing bytes", "trailing.safetensors", good + "xyz", "trailing bytes");
  add("packed lengths disagree with tokens", "sum.safetensors",
      safetensors_bytes(packed_header(), packed_data().substr(0, 24) + u64(4) + u64(1)),
      "disagrees with sum(total_lengths) = 4");
  // Regression of the fuzzer's first finding (a signed overflow summing packed lengths): lengths
  // near 2^63 are refused before anything is added up.
  add("packed lengths whose sum overflows", "overflow.json",
      R"({"tokens": [1], "total_lengths": [9223372036854775807, 9223372036854775807],
          "response_lengths": [0, 0]})",
      "sample 0: total_length = 9223372036854775807 is implausibly large");
  // JSON
  add("JSON syntax error", "syntax.json", R"({"samples": [)", "invalid JSON");
  add("JSON R > T", "r_gt_t.json", R"({"samples": [{"tokens": [1,2], "response_length": 3}]})",
      "sample 0: response_length R = 3 exceeds total_length T = 2");
  add("JSON mask length", "mask_len.json",
      R"({"samples": [{"tokens": [1,2,3], "response_length": 2, "loss_mask": [1]}]})",
      "len(loss_mask) = 1 but response_length R = 2");
  add("JSON mask value", "mask_val.json",
      R"({"samples": [{"tokens": [1,2,3], "response_length": 2, "loss_mask": [1, 3]}]})",
      "loss_mask[1] = 3 (must be 0 or 1)");
  add("JSON missing tokens", "no_tokens.json", R"({"samples": [{"response_length": 2}]})",
      "field 'tokens' is missing");
  add("JSON missing response length", "no_r.json", R"({"samples": [{"tokens": [1]}]})",
      "field 'response_length' is missing");
  add("JSON negative length", "neg.json",
      R"({"samples": [{"tokens": [1,2], "response_length": -1}]})",
      "response_length = -1 is negative");
  add("JSON T disagrees with tokens", "t_len.json",
      R"({"samples": [{"tokens": [1,2], "total_length": 5, "response_length": 1}]})",
      "total_length = 5 disagrees with len(tokens) = 2");
  add("JSON per-token length", "lp_len.json",
      R"({"samples": [{"tokens": [1,2], "response_length": 1, "log_probs": [-1, -2]}]})",
      "len(log_probs) = 2 but response_length R = 1");
  add("JSON logits rows", "logit_rows.json",
      R"({"samples": [{"tokens": [1,2], "response_length": 1, "logits": [[0,1],[1,0]]}]})",
      "logits.shape[0] = 2 but response_length R = 1");
  add("JSON ragged logits", "ragged.json",
      R"({"samples": [{"tokens": [1,2,3], "response_length": 2, "logits": [[0,1],[1]]}]})",
      "ragged rows");
  add("JSON string tokens", "str_tokens.json",
      R"({"samples": [{"tokens": "abc", "response_length": 1}]})", "holds a str");
  add("JSON no batch", "nobatch.json", R"({"hello": 1})", "no batch found");
  add("JSON nested too deep", "deep.json", std::string(5000, '[') + std::string(5000, ']'),
      "deeper than 1000");
  // torch.save
  add("torch.save not a zip", "random.pt", "this is not a zip file at all",
      "not a torch.save archive");
  add("torch.save legacy format", "legacy.pt", std::string("\x80\x02\x8a\x0a", 4) + "legacy",
      "legacy (pre-1.6, non-zip)");
  {
    io::PickleWriter p;
    p.proto();
    p.empty_dict();
    p.mark();
    p.string("tokens");
    p.integer(5);
    // no SETITEMS and no STOP: truncated
    io::write_torch_archive((dir / "truncated_pickle.pt").string(), p.out, {});
    c.push_back({"truncated pickle", (dir / "truncated_pickle.pt").string(), "truncated pickle"});
  }
  {
    std::string pk = "\x80\x02";
    for (int k = 0; k < 5000; ++k) pk += "]";  // EMPTY_LIST
    for (int k = 0; k < 4999; ++k) pk += "a";  // APPEND
    pk += ".";
    io::write_torch_archive((dir / "deep_pickle.pt").string(), pk, {});
    c.push_back(
        {"pickle nested too deep", (dir / "deep_pickle.pt").string(), "nested deeper than 1000"});
  }
  {
    // A tensor whose size reaches past its storage.
    HostArray storage = HostArray::from_i64(DType::kInt64, {2}, {1, 2});
    io::PickleWriter p;
    p.proto();
    p.global("torch._utils", "_rebuild_tensor_v2");
    p.mark();
    p.mark();
    p.string("storage");
    p.global("torch", "LongStorage");
    p.string("0");
    p.string("cpu");
    p.integer(2);
    p.tuple();
    p.binpersid();
    p.integer(0);
    p.mark();
    p.integer(5);
    p.tuple();
    p.mark();
    p.integer(1);
    p.tuple();
    p.boolean(false);
    p.none();
    p.tuple();
    p.reduce();
    p.stop();
    io::write_torch_archive((dir / "storage_oob.pt").string(), p.out, {&storage});
    c.push_back(
        {"tensor past its storage", (dir / "storage_oob.pt").string(), "storage of 2 elements"});
  }
  {
    // Storage record shorter than its declared element count.
    HostArray storage = HostArray::from_i64(DType::kInt64, {1}, {1});
    io::PickleWriter p;
    p.proto();
    p.global("torch._utils", "_rebuild_tensor_v2");
    p.mark();
    p.mark();
    p.string("storage");
    p.global("torch", "LongStorage");
    p.string("0");
    p.string("cpu");
    p.integer(4);
    p.tuple();
    p.binpersid();
    p.integer(0);
    p.mark();
    p.integer(4);
    p.tuple();
    p.mark();
    p.integer(1);
    p.tuple();
    p.boolean(false);
    p.none();
    p.tuple();
    p.reduce();
    p.stop();
    io::write_torch_archive((dir / "storage_short.pt").string(), p.out, {&storage});
    c.push_back({"storage record too short", (dir / "storage_short.pt").string(),
                 "has 8 bytes but 4 elements"});
  }
  {
    io::PickleWriter p;
    p.proto();
    p.global("nt", "system");
    p.stop();
    io::write_torch_archive((dir / "nt_system.pt").string(), p.out, {});
    c.push_back({"malicious global nt.system", (dir / "nt_system.pt").string(),
                 "names the global nt.system"});
  }
  {
    // STACK_GLOBAL form of builtins.exec, protocol 4.
    std::string pk = "\x80\x04";
    pk +=
        "\x8c\x08"
        "builtins"
        "\x8c\x04"
        "exec"
        "\x93"
        ".";
    io::write_torch_archive((dir / "stack_exec.pt").string(), pk, {});
    c.push_back({"malicious STACK_GLOBAL builtins.exec", (dir / "stack_exec.pt").string(),
                 "names the global builtins.exec"});
  }
  {
    std::string pk =
        "\x80\x02"
        "X\xff\xff\xff\x7f";  // a 2 GiB string header in a tiny file
    io::write_torch_archive((dir / "huge_string.pt").string(), pk, {});
    c.push_back({"pickle string longer than the data", (dir / "huge_string.pt").string(),
                 "exceeds the limit"});
  }
  {
    io::write_torch_archive((dir / "memo.pt").string(), std::string("\x80\x02h\x05.", 5), {});
    c.push_back({"pickle reads a memo key never stored", (dir / "memo.pt").string(),
                 "memo key 5 was never stored"});
  }
  {
    // A list appended to itself through the memo: a reference cycle.
    io::write_torch_archive((dir / "cycle.pt").string(),
                            std::string("\x80\x02]q\x00h\x00"
                                        "a.",
                                        9),
                            {});
    c.push_back({"pickle reference cycle", (dir / "cycle.pt").string(), "reference cycle"});
  }
  {
    std::string pk =
        "\x80\x02"
        "}"
        "\x82\x01"
        ".";
    io::write_torch_archive((dir / "ext.pt").string(), pk, {});
    c.push_back({"pickle extension opcode", (dir / "ext.pt").string(), "EXT1/2/4"});
  }
  {
    const std::string zip = read_file(std::filesystem::path(fixture_dir) / "torch_packed_fp32.pt");
    add("torch.save truncated archive", "truncated_zip.pt", zip.substr(0, zip.size() / 2),
        "malformed torch.save archive");
  }
  for (const char* hostile :
       {"hostile_os_system.pt", "hostile_eval.pt", "hostile_subprocess.pt", "hostile_getattr.pt"}) {
    c.push_back({std::string("committed hostile pickle ") + hostile,
                 (std::filesystem::path(fixture_dir) / hostile).string(),
                 "which can execute code; nothing was executed"});
  }
  c.push_back({"opaque numpy tokens",
               (std::filesystem::path(fixture_dir) / "opaque_tokens_numpy.pt").string(),
               "field 'tokens' holds a pickled object"});
  add("unknown format", "data.bin", "\x01\x02\x03", "unknown dump format");
  c.push_back({"missing file", (dir / "does-not-exist.pt").string(), "no such file or directory"});
  return c;
}

}  // namespace lossguard::testing
