// The command line through run(argc, argv, out, err): exit codes, text, JSON and JUnit reports.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/app.h"
#include "cli/report.h"
#include "io/dump.h"
#include "malformed_catalog.h"
#include "synth/cases.h"
#include "test_util.h"

namespace lossguard::cli {
namespace {

struct Result {
  int code;
  std::string out, err;
};

Result run_cli(std::vector<std::string> args) {
  args.insert(args.begin(), "lossguard");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  std::ostringstream out, err;
  const int code = run(static_cast<int>(argv.size()), argv.data(), out, err);
  return {code, out.str(), err.str()};
}

std::string fixture(const std::string& name) {
  return (std::filesystem::path(testing::fixture_dir()) / name).string();
}

TEST(Cli, HelpAndVersionExitZero) {
  Result h = run_cli({"--help"});
  EXPECT_EQ(h.code, 0);
  EXPECT_NE(h.out.find("Exit codes"), std::string::npos);
  EXPECT_NE(h.out.find("inspect"), std::string::npos);
  Result v = run_cli({"--version"});
  EXPECT_EQ(v.code, 0);
  EXPECT_NE(v.out.find("LibTorch"), std::string::npos);
  EXPECT_NE(v.out.find("CUDA:"), std::string::npos);
  EXPECT_NE(v.out.find("device:"), std::string::npos);
  EXPECT_EQ(run_cli({"inspect", "--help"}).code, 0);
}

TEST(Cli, UsageErrorsExitTwo) {
  EXPECT_EQ(run_cli({}).code, 2);
  Result r = run_cli({"inspect", "--no-such-flag", fixture("gen_random.json")});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("no-such-flag"), std::string::npos);
  EXPECT_EQ(run_cli({"inspect"}).code, 2);
  EXPECT_EQ(run_cli({"frobnicate"}).code, 2);
}

// A mode's bad value names the option and lists its choices from the mode's name table; a negative
// tolerance is refused (it once silently meant "the default").
TEST(Cli, BadModesAndNegativeTolerancesExitTwoNamingTheChoices) {
  const std::string dump = fixture("gen_random.json");
  Result r = run_cli({"check", dump, "--impl", "cuda-graphs"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--impl must be torch or kernels, got 'cuda-graphs'"), std::string::npos)
      << r.err;
  r = run_cli({"replay", dump, "--backend", "mpi"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--backend must be sim, gloo or nccl, got 'mpi'"), std::string::npos)
      << r.err;
  r = run_cli({"replay", dump, "--flag-group", "pp"});
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("--flag-group must be tp, cp or dp"), std::string::npos) << r.err;
  for (const char* tol : {"--rtol", "--atol"}) {
    r = run_cli({"check", dump, tol, "-0.5"});
    EXPECT_EQ(r.code, 2) << tol;
    EXPECT_NE(r.err.find(tol), std::string::npos) << r.err;
  }
}

TEST(Cli, InspectShowsSamplesAndFindings) {
  Result r = run_cli({"inspect", fixture("gen_cp-examples.safetensors")});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("6 samples: 4 rl, 1 sft, 1 empty"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("empty responses (R = 0): samples 3"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("sft_mask_not_preshifted"), std::string::npos) << r.out;
}

TEST(Cli, InspectJsonFollowsTheSchema) {
  Result r = run_cli({"inspect", fixture("gen_cp-examples.pt"), "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);  // stdout holds only the JSON document
  EXPECT_EQ(j["schema"], "lossguard/1");
  EXPECT_EQ(j["command"], "inspect");
  EXPECT_EQ(j["verdict"], "pass");
  EXPECT_EQ(j["format"], "torch.save");
  EXPECT_TRUE(j["tool_version"].is_string());
  ASSERT_EQ(j["inputs"].size(), 1u);
  ASSERT_EQ(j["samples"].size(), 6u);
  EXPECT_EQ(j["samples"][0]["total_length"], 10);
  EXPECT_EQ(j["samples"][0]["response_length"], 4);
  EXPECT_EQ(j["samples"][3]["kind"], "empty");
  EXPECT_EQ(j["samples"][5]["kind"], "sft");
  bool has_tokens = false;
  for (const auto& f : j["fields"])
    has_tokens |= f["name"] == "tokens" && f["dtype"] == "int64" && f["shape"] == "[60]";
  EXPECT_TRUE(has_tokens) << j["fields"].dump();
  EXPECT_EQ(j["findings"][0]["kind"], "sft_mask_not_preshifted");
}

TEST(Cli, NoSamplesMeansNothingVerified) {
  const auto dir = testing::temp_dir("cli-empty");
  testing::write_file(dir / "e.json", R"({"samples": []})");
  Result r = run_cli({"inspect", (dir / "e.json").string()});
  EXPECT_EQ(r.code, 4) << r.err;
}

TEST(Cli, GenWritesEveryCaseInEveryFormat) {
  const auto dir = testing::temp_dir("cli-gen");
  for (const auto& c : synth::list_cases()) {
    for (const char* ext : {".safetensors", ".pt", ".json"}) {
      const std::string path = (dir / (c.name + ext)).string();
      Result g = run_cli({"gen", "--case", c.name, "--samples", "5", "--max-prompt", "8",
                          "--max-response", "8", "--vocab", "6", "--out", path});
      ASSERT_EQ(g.code, 0) << c.name << ext << ": " << g.err;
      Result i = run_cli({"inspect", path, "--json", "-"});
      ASSERT_EQ(i.code, 0) << c.name << ext << ": " << i.err;
      EXPECT_GT(nlohmann::json::parse(i.out)["num_samples"].get<int>(), 0);
    }
  }
  EXPECT_EQ(run_cli({"gen", "--case", "nope", "--out", (dir / "x.json").string()}).code, 2);
  EXPECT_EQ(run_cli({"gen", "--out", (dir / "x.txt").string()}).code, 2);
  Result l = run_cli({"gen", "--list"});
  EXPECT_EQ(l.code, 0);
  EXPECT_NE(l.out.find("zero-token"), std::string::npos);
}

TEST(Cli, EveryMalformedDumpExitsTwoNamingFileAndProblem) {
  const auto dir = testing::temp_dir("cli-malformed");
  const auto catalog = testing::write_malformed_catalog(dir, testing::fixture_dir());
  for (const auto& m : catalog) {
    SCOPED_TRACE(m.name);
    const std::string json_path = (dir / "report.json").string();
    Result r = run_cli({"inspect", m.path, "--json", json_path});
    EXPECT_EQ(r.code, 2);
    EXPECT_NE(r.err.find(m.path), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(m.expected), std::string::npos) << r.err;
    const auto j = nlohmann::json::parse(testing::read_file(json_path));
    EXPECT_EQ(j["verdict"], "error");
    EXPECT_EQ(j["exit_code"], 2);
  }
}

TEST(Cli, JunitReportIsWritten) {
  const auto dir = testing::temp_dir("cli-junit");
  const std::string junit = (dir / "j.xml").string();
  Result r = run_cli({"inspect", fixture("gen_random.json"), "--junit", junit});
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string x = testing::read_file(junit);
  EXPECT_NE(x.find("<testsuite name=\"lossguard.inspect\" tests=\"1\" failures=\"0\""),
            std::string::npos)
      << x;
}

// A CI gate reads the report file: a passing run whose report cannot be written must not exit 0.
TEST(Cli, UnwritableReportsExitTwo) {
  const std::string dump = fixture("gen_empty-responses.safetensors");
  const std::string nowhere = "/nonexistent-dir/report";
  Result json = run_cli({"count", dump, "--cp", "1,2", "--json", nowhere + ".json"});
  EXPECT_EQ(json.code, 2) << json.err;
  EXPECT_NE(json.err.find("cannot write the JSON report to " + nowhere + ".json"),
            std::string::npos)
      << json.err;
  Result junit = run_cli({"count", dump, "--cp", "1,2", "--junit", nowhere + ".xml"});
  EXPECT_EQ(junit.code, 2) << junit.err;
  // The same run with a writable report passes: the exit code above is the report's doing.
  const auto dir = testing::temp_dir("cli-unwritable");
  EXPECT_EQ(run_cli({"count", dump, "--cp", "1,2", "--json", (dir / "r.json").string()}).code, 0);
}

}  // namespace
}  // namespace lossguard::cli

namespace lossguard::cli {
namespace {

TEST(CliCount, FixedPassesLegacyFailsOnEmptyResponses) {
  const std::string dump = fixture("gen_empty-responses.safetensors");
  Result fixed = run_cli({"count", dump, "--cp", "1,2,4"});
  EXPECT_EQ(fixed.code, 0) << fixed.out << fixed.err;
  Result legacy = run_cli({"count", dump, "--cp", "1,2,4", "--policy", "legacy"});
  EXPECT_EQ(legacy.code, 1);
  EXPECT_NE(legacy.out.find("+1 for each empty sample (R = 0): 1, 4"), std::string::npos)
      << legacy.out;
  EXPECT_NE(legacy.out.find("I1 CP-consistency           FAIL"), std::string::npos) << legacy.out;
}

TEST(CliCount, JsonFollowsTheSchema) {
  Result r = run_cli({"count", fixture("gen_cp-examples.json"), "--cp", "2,1", "--json", "-"});
  EXPECT_EQ(r.code, 1);  // the SFT example's mask is not pre-shifted: I1 fails, as SPEC §2 predicts
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["command"], "count");
  EXPECT_EQ(j["verdict"], "fail");
  EXPECT_EQ(j["policy"], "fixed");
  EXPECT_EQ(j["cp_sizes"], nlohmann::json({1, 2}));
  EXPECT_EQ(j["samples"][0]["per_rank"]["2"], nlohmann::json({0, 4}));
  EXPECT_EQ(j["samples"][1]["per_rank"]["2"], nlohmann::json({3, 5}));
  EXPECT_EQ(j["samples"][5]["per_rank"]["2"], nlohmann::json({2, 4}));
  EXPECT_EQ(j["totals"]["1"], 28);
  EXPECT_EQ(j["totals"]["2"], 27);
  EXPECT_EQ(j["invariants"][0]["name"], "I1");
  EXPECT_EQ(j["invariants"][0]["ok"], false);
}

TEST(CliCount, SplitOverDpAndMicrobatchesAndShards) {
  Result r = run_cli({"count", fixture("gen_random.pt"), "--dp", "2", "--microbatches", "3",
                      "--split", "round-robin", "--json", "-"});
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["invariants"][2]["values"]["parts"], 6);
  Result s =
      run_cli({"count", fixture("gen_random.pt"), fixture("gen_t-zero.json"), "--dp-shards"});
  EXPECT_EQ(s.code, 0) << s.err;
  EXPECT_NE(s.out.find("2 DP rank(s)"), std::string::npos);
}

TEST(CliCount, BadInputsExitTwo) {
  EXPECT_EQ(run_cli({"count", fixture("gen_random.pt"), "--cp", "0"}).code, 2);
  EXPECT_EQ(run_cli({"count", fixture("gen_random.pt"), "--policy", "magic"}).code, 2);
  EXPECT_EQ(run_cli({"count", fixture("gen_random.pt"), "--split", "diagonal", "--dp", "2"}).code,
            2);
  EXPECT_EQ(
      run_cli({"count", fixture("gen_random.pt"), "--padded-total-length", "7", "--cp", "2"}).code,
      2);
  EXPECT_EQ(run_cli({"count", fixture("hostile_eval.pt")}).code, 2);
}

}  // namespace
}  // namespace lossguard::cli

namespace lossguard::cli {
namespace {

// Dumps of one batch whose optional fields differ: only a command that needs the field fails.
TEST(CliCount, OptionalFieldsThatDifferBetweenDumpsFailOnlyWhereNeeded) {
  const auto dir = testing::temp_dir("cli-partial");
  testing::write_file(dir / "a.json", R"({"samples": [{"tokens": [1, 2, 3], "response_length": 2,
      "loss_mask": [1, 1], "log_probs": [-0.1, -0.2], "old_log_probs": [-0.1, -0.2],
      "advantages": [0.5, 0.5]}]})");
  testing::write_file(dir / "b.json", R"({"samples": [{"tokens": [1, 2, 3, 4], "response_length": 2,
      "loss_mask": [1, 0], "log_probs": [-0.3, -0.4], "old_log_probs": [-0.3, -0.4]}]})");
  Result count = run_cli({"count", dir.string(), "--cp", "1,2"});
  EXPECT_EQ(count.code, 0) << count.err;
  Result nll = run_cli({"check", dir.string(), "--cp", "1,2", "--loss", "nll"});
  EXPECT_EQ(nll.code, 0) << nll.err;  // nll from log_probs needs no advantages
  Result ppo = run_cli({"check", dir.string(), "--cp", "1,2", "--loss", "ppo-clip"});
  EXPECT_EQ(ppo.code, 2);
  EXPECT_NE(ppo.err.find("'advantages', which only some dumps have"), std::string::npos) << ppo.err;
  EXPECT_NE(ppo.err.find("b.json"), std::string::npos) << ppo.err;
}

TEST(CliWeights, HfGradientAccumulationBugIsNamedAndFails) {
  const std::string dump = fixture("gen_random.safetensors");
  Result ga = run_cli(
      {"weights", dump, "--contract", "hf-ga", "--dp", "2", "--microbatches", "3", "--json", "-"});
  EXPECT_EQ(ga.code, 1) << ga.err;
  const auto doc = nlohmann::json::parse(ga.out);
  EXPECT_EQ(doc["command"], "weights");
  EXPECT_EQ(doc["verdict"], "fail");
  EXPECT_EQ(doc["contract"]["preset"], "hf-ga");
  EXPECT_EQ(doc["contract"]["norm"], "microbatch");
  EXPECT_EQ(doc["contract"]["grad"], "mean:dp");
  EXPECT_EQ(doc["layout"]["dp"], 2);
  EXPECT_EQ(doc["layout"]["source"], "flags");
  EXPECT_EQ(doc["steps"][0]["diagnosis"]["kind"], "per-microbatch");
  EXPECT_FALSE(doc["steps"][0]["invariance"].empty());
  Result ok = run_cli({"weights", dump, "--contract", "megatron-per-token", "--dp", "2", "--cp",
                       "2", "--microbatches", "3"});
  EXPECT_EQ(ok.code, 0) << ok.out;
  EXPECT_NE(ok.out.find("exact"), std::string::npos) << ok.out;
}

TEST(CliWeights, UniformScaleFailsOnlyWhenStrict) {
  const std::string dump = fixture("gen_random.safetensors");
  // Twice the truth on every layout: reported, exit 0; --strict-scale makes it exit 1.
  Result loose = run_cli({"weights", dump, "--contract", "norm=global:dp-cp,scale=2", "--dp", "2"});
  EXPECT_EQ(loose.code, 0) << loose.out;
  EXPECT_NE(loose.out.find("uniform scale ×2"), std::string::npos) << loose.out;
  Result strict = run_cli(
      {"weights", dump, "--contract", "norm=global:dp-cp,scale=2", "--dp", "2", "--strict-scale"});
  EXPECT_EQ(strict.code, 1);
  // A scale that follows the layout (slime's count without its ×cp) breaks I5 and fails anyway.
  Result half =
      run_cli({"weights", dump, "--contract", "count=full-sample,norm=global:dp-cp", "--cp", "2"});
  EXPECT_EQ(half.code, 1) << half.out;
  EXPECT_NE(half.out.find("= 1/cp"), std::string::npos) << half.out;
}

TEST(CliWeights, Bug1AtCp1IsCaughtFromACp2Layout) {
  const std::string dump = fixture("gen_empty-responses.safetensors");
  Result r = run_cli({"weights", dump, "--contract", "relax-legacy", "--cp", "2"});
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("first on CP 1"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("N/N' ="), std::string::npos) << r.out;
}

TEST(CliWeights, SvgAndBadContractsExitTwo) {
  const auto dir = testing::temp_dir("cli-weights");
  const std::string svg = (dir / "w.svg").string();
  const std::string dump = fixture("gen_random.safetensors");
  Result r = run_cli({"weights", dump, "--contract", "hf-ga", "--dp", "2", "--microbatches", "2",
                      "--cp", "2", "--svg", svg});
  EXPECT_EQ(r.code, 1);
  const std::string x = testing::read_file(svg);
  EXPECT_NE(x.find("<svg"), std::string::npos);
  EXPECT_NE(x.find("DP 1 micro-batch 1"), std::string::npos);
  EXPECT_NE(x.find("CP rank 1"), std::string::npos);
  Result bad = run_cli({"weights", dump, "--contract", "hf-gaa"});
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("unknown preset 'hf-gaa'"), std::string::npos) << bad.err;
  Result noc = run_cli({"weights", dump});
  EXPECT_EQ(noc.code, 2);
  Result help = run_cli({"weights", "--help"});
  EXPECT_EQ(help.code, 0);
  EXPECT_NE(help.out.find("hf-num-items-across-devices"), std::string::npos);
}

TEST(CliTopo, JsonGroupsFollowTheSchema) {
  Result r = run_cli({"topo", "--tp", "2", "--pp", "2", "--cp", "2", "--dp", "2", "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["world"], 16);
  EXPECT_EQ(j["ranks"][9]["pipeline_last_rank"], 9);
  EXPECT_EQ(j["ranks"][1]["pipeline_last_rank"], 9);
  EXPECT_EQ(j["groups"]["dp_cp"][1], nlohmann::json({1, 3, 5, 7}));
  EXPECT_EQ(j["groups"]["pp"][0], nlohmann::json({0, 8}));
  EXPECT_EQ(run_cli({"topo", "--tp", "0"}).code, 2);
}

TEST(CliReplay, ExitCodesPerProtocol) {
  const std::string zero = fixture("gen_zero-token.safetensors");
  const std::string tokens = fixture("gen_random.safetensors");
  EXPECT_EQ(run_cli({"replay", zero, "--tp", "2", "--pp", "2", "--protocol", "pr285"}).code, 0);
  EXPECT_EQ(run_cli({"replay", tokens, "--tp", "2", "--pp", "2", "--protocol", "pr285"}).code, 0);
  Result src = run_cli({"replay", zero, "--tp", "2", "--pp", "2", "--protocol", "pr285-src-local"});
  EXPECT_EQ(src.code, 3);
  EXPECT_NE(src.out.find("ranks 0, 2 (2): error"), std::string::npos) << src.out;
  EXPECT_EQ(run_cli({"replay", tokens, "--dp", "4", "--protocol", "pr285-always-broadcast"}).code,
            3);
  EXPECT_EQ(
      run_cli({"replay", zero, "--dp", "2", "--protocol", "values0", "--reduce", "sample-mean"})
          .code,
      1);
  EXPECT_EQ(
      run_cli({"replay", zero, "--dp", "2", "--protocol", "values0", "--reduce", "per-token"}).code,
      0);
  EXPECT_EQ(run_cli({"replay", zero, "--protocol", "no-skip"}).code, 1);
  EXPECT_EQ(run_cli({"replay", zero, "--protocol", "nonsense"}).code, 2);
  EXPECT_EQ(run_cli({"replay", zero, "--backend", "mpi"}).code, 2);
}

TEST(CliReplay, JsonAndSvgReports) {
  const auto dir = testing::temp_dir("cli-replay");
  const std::string svg = (dir / "grid.svg").string();
  Result r = run_cli({"replay", fixture("gen_zero-token.pt"), "--tp", "2", "--pp", "2",
                      "--protocol", "pr285-src-local", "--json", "-", "--svg", svg});
  EXPECT_EQ(r.code, 3);
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["verdict"], "fault");
  EXPECT_EQ(j["expected"], "skip");
  EXPECT_EQ(j["global_tokens"], 0);
  ASSERT_EQ(j["ranks"].size(), 4u);
  EXPECT_EQ(j["ranks"][0]["outcome"], "error");
  EXPECT_EQ(j["ranks"][0]["decision"], nullptr);
  EXPECT_EQ(j["ranks"][3]["decision"], "step");
  EXPECT_EQ(j["ranks"][3]["outcome"], "blocked");
  EXPECT_EQ(j["metrics"]["no_signal"], true);
  const std::string s = testing::read_file(svg);
  EXPECT_NE(s.find("<svg"), std::string::npos);
  EXPECT_NE(s.find("rank 3: blocked (wrong decision)"), std::string::npos);
}

// Data-dependent participation through the CLI: replay_participation.json's DP rank 1 holds a last
// micro-batch with no effective token (samples 2, 3 at --dp 2 --microbatches 2) and, at 9 tokens
// per micro-batch, two micro-batches against DP rank 0's one.
TEST(CliReplay, ParticipationProtocolsGiveTheirPredictedOutcomes) {
  const std::string dump = fixture("replay_participation.json");
  Result local = run_cli({"replay", dump, "--dp", "2", "--microbatches", "2", "--protocol",
                          "microbatch-skip-local", "--json", "-"});
  EXPECT_EQ(local.code, 3);
  auto j = nlohmann::json::parse(local.out);
  EXPECT_EQ(j["ranks"][0]["outcome"], "mismatch");
  EXPECT_EQ(j["ranks"][1]["outcome"], "mismatch");
  EXPECT_NE(j["ranks"][1]["detail"].get<std::string>().find("skipped the backward of 1 of its 2"),
            std::string::npos)
      << j["ranks"][1]["detail"];
  EXPECT_EQ(
      run_cli({"replay", dump, "--dp", "2", "--microbatches", "2", "--protocol", "microbatch-skip"})
          .code,
      0);
  Result uneven = run_cli({"replay", dump, "--dp", "2", "--ep", "2", "--max-tokens-per-mb", "9",
                           "--protocol", "microbatches-local", "--json", "-"});
  EXPECT_EQ(uneven.code, 3);
  j = nlohmann::json::parse(uneven.out);
  EXPECT_EQ(j["microbatches"], 2);
  EXPECT_EQ(j["min_microbatches"], 1);
  EXPECT_EQ(j["ep"], 2);
  EXPECT_EQ(run_cli({"replay", dump, "--dp", "2", "--ep", "2", "--max-tokens-per-mb", "9",
                     "--protocol", "microbatches-max"})
                .code,
            0);
  Result nan = run_cli({"replay", dump, "--tp", "2", "--dp", "2", "--protocol", "nan-skip-rank0",
                        "--nan-ranks", "1", "--json", "-"});
  EXPECT_EQ(nan.code, 1);
  j = nlohmann::json::parse(nan.out);
  EXPECT_EQ(j["expected"], "skip");
  EXPECT_EQ(j["nan_ranks"], nlohmann::json::array({1}));
  EXPECT_EQ(j["findings"][0]["kind"], "nonfinite_step");
  EXPECT_EQ(run_cli({"replay", dump, "--tp", "2", "--dp", "2", "--protocol", "nan-skip",
                     "--nan-ranks", "1"})
                .code,
            0);
  EXPECT_EQ(run_cli({"replay", dump, "--tp", "2", "--dp", "2", "--protocol",
                     "flag-broadcast-src-local", "--flag-group", "dp"})
                .code,
            3);
  // Bad values name the option.
  for (const std::vector<std::string>& bad : {std::vector<std::string>{"--nan-ranks", "4"},
                                              {"--nan-ranks", "x"},
                                              {"--grad-sync", "x"},
                                              {"--flag-group", "pp"},
                                              {"--ep", "3"},
                                              {"--max-tokens-per-mb", "-1"}}) {
    std::vector<std::string> args = {"replay", dump, "--tp", "2", "--dp", "2"};
    args.insert(args.end(), bad.begin(), bad.end());
    Result r = run_cli(args);
    EXPECT_EQ(r.code, 2) << bad[0] << " " << bad[1];
    EXPECT_NE(r.err.find(bad[0]), std::string::npos) << r.err;
  }
  Result topo = run_cli({"topo", "--pp", "2", "--dp", "4", "--ep", "2", "--json", "-"});
  EXPECT_EQ(topo.code, 0);
  j = nlohmann::json::parse(topo.out);
  EXPECT_EQ(j["groups"]["ep"], nlohmann::json::parse("[[0,1],[2,3],[4,5],[6,7]]"));
  EXPECT_EQ(j["groups"]["edp"], nlohmann::json::parse("[[0,2],[1,3],[4,6],[5,7]]"));
}

// At 131,072 ranks the rank grid stays small and readable: runs of equal outcomes are one
// rectangle, and the axes are labelled.
TEST(CliReplay, SvgAt131072RanksAggregatesRuns) {
  const auto dir = testing::temp_dir("cli-replay-svg");
  const std::string svg = (dir / "big.svg").string();
  Result r = run_cli({"replay", fixture("gen_zero-token.safetensors"), "--tp", "8", "--pp", "16",
                      "--cp", "8", "--dp", "128", "--protocol", "pr285-src-local", "--svg", svg});
  EXPECT_EQ(r.code, 3);
  const std::string s = testing::read_file(svg);
  EXPECT_LT(s.size(), 200u * 1024u) << "bytes";
  // src = PP-1 = 15 is rank 15 of stage 0: every pipeline but rank 15's errors.
  EXPECT_NE(s.find("<title>ranks 0-14: error</title>"), std::string::npos);
  EXPECT_NE(s.find("<title>rank 15: blocked (wrong decision)</title>"), std::string::npos);
  EXPECT_NE(s.find("<title>ranks 16-8191: error</title>"), std::string::npos);
  EXPECT_NE(s.find(">dp 0<"), std::string::npos);
  EXPECT_NE(s.find(">stage 1<"), std::string::npos);  // 16 rows of 28 px: every label fits
  // 64 stages of 12 px: every other stage is labelled, so labels never overlap.
  const std::string deep = (dir / "deep.svg").string();
  EXPECT_EQ(run_cli({"replay", fixture("gen_zero-token.safetensors"), "--pp", "64", "--dp", "2",
                     "--svg", deep})
                .code,
            0);
  const std::string d = testing::read_file(deep);
  EXPECT_NE(d.find(">stage 2<"), std::string::npos);
  EXPECT_EQ(d.find(">stage 1<"), std::string::npos);
  EXPECT_NE(d.find(">stage 63<"), std::string::npos);
}

TEST(CliReplay, DpShardsPlaceEachDumpOnItsRank) {
  Result r = run_cli({"replay", fixture("gen_zero-token.json"), fixture("gen_random.json"), "--dp",
                      "2", "--dp-shards", "--pp", "2"});
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(run_cli({"replay", fixture("gen_zero-token.json"), "--dp", "2", "--dp-shards"}).code,
            2);
}

}  // namespace
}  // namespace lossguard::cli

namespace lossguard::cli {
namespace {

TEST(CliLimits, LogitsLargerThanTheMemoryBudgetAreRefusedWithTheSizeNeeded) {
  // Logits given per sample (a JSON dump) are copied into one array: refused over the budget.
  ::setenv("LOSSGUARD_MEMORY_LIMIT", "100", 1);
  Result r = run_cli({"inspect", fixture("gen_random.json")});
  ::unsetenv("LOSSGUARD_MEMORY_LIMIT");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("gen_random.json"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("of memory but only 100 B are available"), std::string::npos) << r.err;
  // A packed dump's logits are read where they are mapped, never copied: the budget is not needed.
  ::setenv("LOSSGUARD_MEMORY_LIMIT", "100", 1);
  Result mapped = run_cli({"inspect", fixture("gen_random.safetensors")});
  ::unsetenv("LOSSGUARD_MEMORY_LIMIT");
  EXPECT_EQ(mapped.code, 0) << mapped.err;
  // Counting does not load the logits, so the same budget is enough for it.
  ::setenv("LOSSGUARD_MEMORY_LIMIT", "100", 1);
  Result c = run_cli({"count", fixture("gen_random.safetensors")});
  ::unsetenv("LOSSGUARD_MEMORY_LIMIT");
  EXPECT_EQ(c.code, 0) << c.err;
  EXPECT_EQ(run_cli({"inspect", fixture("gen_random.safetensors")}).code, 0);
}

nlohmann::json expected_slime(const std::string& name) {
  std::ifstream f(fixture("expected_slime/" + name));
  return nlohmann::json::parse(f);
}

// slime's format-2 train dump: two optimizer steps whose first has no effective token, and the
// trainer's own DP / micro-batch layout (expected values from fixtures/make_slime_fixtures.py).
TEST(CliDumps, Format2StepsAreReplayedAndCountedOneByOne) {
  const nlohmann::json want = expected_slime("slime_format2_two_steps.json");
  const std::string dump = fixture("slime_format2_two_steps.pt");
  Result r = run_cli({"replay", dump, "--dp", "2", "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const auto doc = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));
  ASSERT_EQ(doc["steps"].size(), 2u);
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(doc["steps"][s]["step"], s);
    EXPECT_EQ(doc["steps"][s]["expected"], want["steps"][s]["expected"]) << s;
    EXPECT_EQ(doc["steps"][s]["global_tokens"], want["steps"][s]["num_tokens"]) << s;
  }
  // A protocol that never skips steps on the zero-token step 0 only: exit 1, step 0 named.
  Result drift = run_cli({"replay", dump, "--dp", "2", "--protocol", "no-skip"});
  EXPECT_EQ(drift.code, 1) << drift.out;
  EXPECT_NE(drift.out.find("== step 0 of 2"), std::string::npos) << drift.out;
  // count reports the trainer's placement (in batch indices), not a contiguous split.
  Result c = run_cli({"count", dump, "--json", "-", "--cp", "1,2"});
  ASSERT_EQ(c.code, 0) << c.out << c.err;
  const auto cdoc = nlohmann::json::parse(c.out.substr(c.out.find("{\n")));
  for (int s = 0; s < 2; ++s) {
    const auto& st = cdoc["steps"][s];
    EXPECT_EQ(st["placement"]["source"], "dump");
    // Samples are renumbered within the step: map the expected batch indices the same way.
    std::vector<int64_t> members = want["steps"][s]["sample_indices"];
    std::sort(members.begin(), members.end());
    nlohmann::json placement = want["steps"][s]["placement"];
    for (auto& rank : placement)
      for (auto& mb : rank)
        for (auto& i : mb)
          i = std::lower_bound(members.begin(), members.end(), i.get<int64_t>()) - members.begin();
    EXPECT_EQ(st["placement"]["samples"], placement) << s;
    EXPECT_EQ(st["totals"]["1"], want["steps"][s]["num_tokens"]);
  }
  Result one = run_cli({"count", dump, "--step", "1", "--json", "-"});
  ASSERT_EQ(one.code, 0) << one.err;
  const auto odoc = nlohmann::json::parse(one.out.substr(one.out.find("{\n")));
  EXPECT_EQ(odoc["step"], 1);
  EXPECT_EQ(odoc["totals"]["1"], 13);
  EXPECT_EQ(run_cli({"count", dump, "--step", "2"}).code, 2);
  // The rollout_positions spelling of slime@1706a09.
  const nlohmann::json want2 = expected_slime("slime_format2_rollout_positions.json");
  Result p = run_cli({"count", fixture("slime_format2_rollout_positions.pt"), "--json", "-"});
  ASSERT_EQ(p.code, 0) << p.err;
  const auto pdoc = nlohmann::json::parse(p.out.substr(p.out.find("{\n")));
  EXPECT_EQ(pdoc["placement"]["samples"], want2["steps"][0]["placement"]);
  EXPECT_EQ(pdoc["totals"]["1"], want2["steps"][0]["num_tokens"]);
  // inspect lists the steps and the recorded layout, in the dump's sample numbers.
  Result in = run_cli({"inspect", dump, "--json", "-"});
  ASSERT_EQ(in.code, 0) << in.err;
  const auto idoc = nlohmann::json::parse(in.out.substr(in.out.find("{\n")));
  ASSERT_EQ(idoc["steps"].size(), 2u);
  for (int s = 0; s < 2; ++s) {
    EXPECT_EQ(idoc["steps"][s]["effective_tokens"], want["steps"][s]["num_tokens"]);
    EXPECT_EQ(idoc["steps"][s]["placement"], want["steps"][s]["placement"]);
  }
  Result text = run_cli({"inspect", dump});
  EXPECT_NE(text.out.find("zero-token step"), std::string::npos) << text.out;
}

TEST(CliDumps, PerRankRolloutDataDirectoryCountsEachDpRankOnce) {
  const nlohmann::json want = expected_slime("slime_per_rank_cp2.json");
  Result r = run_cli({"count", fixture("slime_per_rank_cp2"), "--cp", "1,2", "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const auto doc = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));
  std::vector<nlohmann::json> samples;
  for (const auto& rank : want["dp_ranks"])
    for (const auto& s : rank["samples"]) samples.push_back(s);
  ASSERT_EQ(doc["samples"].size(), samples.size());  // the CP replicas are one DP rank's samples
  int64_t n = 0;
  for (std::size_t i = 0; i < samples.size(); ++i) {
    EXPECT_EQ(doc["samples"][i]["per_rank"]["2"], samples[i]["cp_effective"]) << i;
    n += samples[i]["mask_sum"].get<int64_t>();
  }
  EXPECT_EQ(doc["totals"]["1"], n);
  // Each rank's CP-local log-probs and advantages, put back where the zig-zag rule says they
  // belong, give the full per-token fields the producer sliced them from.
  std::vector<io::Dump> dumps;
  for (const auto& p : io::expand_dump_paths({fixture("slime_per_rank_cp2")}))
    dumps.push_back(io::read_dump(p));
  const Batch b = io::build_batch(dumps, {});
  ASSERT_EQ(b.num_samples(), static_cast<int64_t>(samples.size()));
  for (const char* field : {"log_probs", "advantages"}) {
    ASSERT_TRUE(b.per_token.count(field)) << field << " " << b.metadata.dump();
    for (std::size_t i = 0; i < samples.size(); ++i) {
      const auto& want_values = samples[i][field];
      for (std::size_t j = 0; j < want_values.size(); ++j)
        EXPECT_EQ(b.per_token.at(field).get_f64(b.response_offsets[i] + static_cast<int64_t>(j)),
                  want_values[j].get<double>())
            << field << " sample " << i << " index " << j;
    }
  }
  // One rank's dump alone holds only its own tokens' values: set aside, with the reason.
  Result c = run_cli({"check", fixture("slime_per_rank_cp2/3_1.pt"), "--loss", "nll"});
  EXPECT_EQ(c.code, 2);
  EXPECT_NE(c.err.find("CP-local"), std::string::npos) << c.err;
}

TEST(CliDumps, PerSamplePaddedLengthsRemovedSamplesAndDenominators) {
  const nlohmann::json want = expected_slime("relax_vl_padded.json");
  Result r = run_cli({"count", fixture("relax_vl_padded.pt"), "--cp", "1,2", "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  auto doc = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));
  for (std::size_t i = 0; i < want["samples"].size(); ++i)
    EXPECT_EQ(doc["samples"][i]["per_rank"]["2"], want["samples"][i]["effective_padded"]) << i;
  // The same without the field, padded by --pad-multiple tp*cp*2 = 8.
  Result m = run_cli({"count", fixture("relax_vl_padded.pt"), "--cp", "2", "--pad-multiple", "8",
                      "--field", "padded_total_length=none", "--json", "-"});
  ASSERT_EQ(m.code, 0) << m.out << m.err;
  doc = nlohmann::json::parse(m.out.substr(m.out.find("{\n")));
  for (std::size_t i = 0; i < want["samples"].size(); ++i)
    EXPECT_EQ(doc["samples"][i]["per_rank"]["2"], want["samples"][i]["effective_padded"]) << i;
  Result u = run_cli({"count", fixture("relax_vl_padded.pt"), "--cp", "2", "--field",
                      "padded_total_length=none", "--json", "-"});
  doc = nlohmann::json::parse(u.out.substr(u.out.find("{\n")));
  for (std::size_t i = 0; i < want["samples"].size(); ++i)
    EXPECT_EQ(doc["samples"][i]["per_rank"]["2"], want["samples"][i]["effective_unpadded"]) << i;

  const nlohmann::json rd = expected_slime("slime_removed_and_denoms.json");
  Result c = run_cli({"count", fixture("slime_removed_and_denoms.json"), "--json", "-"});
  ASSERT_EQ(c.code, 0) << c.err;
  doc = nlohmann::json::parse(c.out.substr(c.out.find("{\n")));
  EXPECT_EQ(doc["totals"]["1"], rd["num_tokens"]);
  for (std::size_t i = 0; i < rd["samples"].size(); ++i)
    EXPECT_EQ(doc["samples"][i]["mask_sum"], rd["samples"][i]["mask_sum"]) << i;
  // Under sample-mean each sample's weights are m_t / (B d_i) with the dump's d_i.
  Result w = run_cli({"weights", fixture("slime_removed_and_denoms.json"), "--reduce",
                      "sample-mean", "--contract", "truth", "--per-token", "--json", "-"});
  ASSERT_EQ(w.code, 0) << w.out << w.err;
  doc = nlohmann::json::parse(w.out.substr(w.out.find("{\n")));
  const auto& samples = doc["steps"][0]["samples"];
  const double b = static_cast<double>(rd["samples"].size());
  for (std::size_t i = 0; i < rd["samples"].size(); ++i) {
    const auto& mask = rd["samples"][i]["effective_mask"];
    for (std::size_t j = 0; j < mask.size(); ++j) {
      const double expect =
          mask[j].get<int>() ? 1.0 / (b * rd["samples"][i]["denominator"].get<double>()) : 0.0;
      EXPECT_NEAR(samples[i]["truth"][j].get<double>(), expect, 1e-15) << i << " " << j;
    }
  }
}

TEST(CliDumps, AllgatherAndDynamicCpCountsHoldTheInvariants) {
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--cp-layout", "allgather", "--allgather-pad", "4"},
        std::vector<std::string>{"--dynamic-cp", "6", "--microbatches", "2"}}) {
    std::vector<std::string> args = {
        "count", fixture("gen_random.safetensors"), "--cp", "1,2,4", "--json", "-"};
    args.insert(args.end(), extra.begin(), extra.end());
    Result r = run_cli(args);
    ASSERT_EQ(r.code, 0) << r.out << r.err;
    const auto doc = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));
    for (const auto& inv : doc["invariants"]) EXPECT_TRUE(inv["ok"].get<bool>()) << inv;
    EXPECT_EQ(doc["totals"]["1"], doc["totals"]["4"]);
  }
}

// A dump over 2 GiB (SPEC §8: files of any size; no 32-bit size or offset anywhere): a sparse
// safetensors file whose bf16 logits [4,000 x 300,000] are a hole on disk, its counting fields at
// the start and after the logits. count reads the masks without touching the logits.
TEST(CliDumps, SparseDumpOver2GiBIsCounted) {
  const auto dir = testing::temp_dir("sparse");
  const std::string path = (dir / "big.safetensors").string();
  const int64_t s = 8, r = 500, p = 3, v = 300000, t = p + r;
  const int64_t logits_bytes = s * r * v * 2;  // 2.4 GB
  std::vector<int64_t> tokens(static_cast<std::size_t>(s * t), 1), tl(s, t), rl(s, r),
      mask(static_cast<std::size_t>(s * r), 1);
  for (std::size_t k = 0; k < mask.size(); k += 5) mask[k] = 0;  // 400 per sample
  nlohmann::ordered_json h;
  int64_t off = 0;
  auto put = [&](const char* name, const char* dtype, std::vector<int64_t> shape, int64_t bytes) {
    h[name] = {{"dtype", dtype}, {"shape", shape}, {"data_offsets", {off, off + bytes}}};
    off += bytes;
  };
  put("tokens", "I64", {s * t}, s * t * 8);
  put("logits", "BF16", {s * r, v}, logits_bytes);  // the counting fields after it sit past 2 GiB
  put("total_lengths", "I64", {s}, s * 8);
  put("response_lengths", "I64", {s}, s * 8);
  put("loss_masks", "I64", {s * r}, s * r * 8);
  std::string header = h.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  {
    std::ofstream f(path, std::ios::binary);
    const uint64_t n = header.size();
    f.write(reinterpret_cast<const char*>(&n), 8);
    f << header;
    f.write(reinterpret_cast<const char*>(tokens.data()), s * t * 8);
    f.seekp(8 + static_cast<std::streamoff>(header.size()) + s * t * 8 + logits_bytes);
    f.write(reinterpret_cast<const char*>(tl.data()), s * 8);
    f.write(reinterpret_cast<const char*>(rl.data()), s * 8);
    f.write(reinterpret_cast<const char*>(mask.data()), s * r * 8);
  }
  ASSERT_GT(std::filesystem::file_size(path), uint64_t{1} << 31);
  Result c = run_cli({"count", path, "--cp", "1,2", "--json", "-"});
  ASSERT_EQ(c.code, 0) << c.out << c.err;
  const auto doc = nlohmann::json::parse(c.out.substr(c.out.find("{\n")));
  EXPECT_EQ(doc["totals"]["1"], s * 400);
  EXPECT_EQ(doc["totals"]["2"], s * 400);
  Result i = run_cli({"inspect", path, "--json", "-"});
  ASSERT_EQ(i.code, 0) << i.err;
  EXPECT_NE(i.out.find("300000"), std::string::npos);
  std::filesystem::remove(path);
}

// inspect finds what a trainer's numbers need before anything runs: a NaN logit at a masked
// position (named as such: multiplying by the mask turns it into NaN) and a target outside the
// vocabulary.
TEST(CliDumps, InspectNamesNanAtMaskedPositionAndOutOfVocabTargets) {
  synth::GenOptions o;
  o.seed = 3;
  o.num_samples = 3;
  o.vocab_size = 5;
  o.min_prompt = 2;
  o.empty_fraction = 0.0;
  o.masked_fraction = 0.0;
  Batch b = synth::make_case("random", o);
  // Sample 0: mask its response index 0 and put a NaN in that row; sample 1: target 7 >= V = 5.
  b.loss_mask[b.response_offsets[0]] = 0;
  std::vector<double> logits(static_cast<std::size_t>(b.logits->numel()));
  for (int64_t k = 0; k < b.logits->numel(); ++k) logits[k] = b.logits->get_f64(k);
  logits[b.response_offsets[0] * 5 + 2] = std::nan("");
  b.logits = HostArray::from_f64(DType::kFloat32, b.logits->shape, logits);
  ASSERT_GT(b.response_lengths[1], 0);
  b.loss_mask[b.response_offsets[1]] = 1;
  b.tokens[b.token_offsets[1] + b.prompt_length(1)] = 7;
  const auto dir = testing::temp_dir("findings");
  const std::string path = (dir / "f.safetensors").string();
  io::write_batch(b, path);
  Result r = run_cli({"inspect", path, "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto doc = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));
  bool nan_masked = false, oov = false;
  for (const auto& f : doc["findings"]) {
    if (f["kind"] == "non_finite" && f["sample"] == 0 && f["response_index"] == 0 &&
        f["vocab_index"] == 2 && f["masked"] == true)
      nan_masked = f["message"].get<std::string>().find("mask by selection") != std::string::npos;
    if (f["kind"] == "target_out_of_vocab" && f["sample"] == 1 && f["response_index"] == 0 &&
        f["token"] == 7)
      oov = true;
  }
  EXPECT_TRUE(nan_masked) << doc["findings"].dump(1);
  EXPECT_TRUE(oov) << doc["findings"].dump(1);
}

// I3 broken on purpose: a recorded layout (slime format 2, written by hand) that gives sample 1 to
// both DP ranks. count must fail I3 and name the sample. (A sample no step holds is not an error:
// slime drops trailing rollouts that do not fill a step.)
TEST(CliDumps, ALayoutThatIsNotAPartitionFailsI3WithTheSamplesNamed) {
  const auto dir = testing::temp_dir("i3");
  const std::string path = (dir / "twice.json").string();
  std::ofstream(path) << R"({"format_version": 2, "samples": [
    {"tokens": [1, 2, 3, 4], "response_length": 2, "rollout_position": 0},
    {"tokens": [1, 2, 3, 4], "response_length": 2, "rollout_position": 1},
    {"tokens": [1, 2, 3, 4], "response_length": 2, "rollout_position": 2}],
   "dp_shards": [
    {"data_parallel_rank": 0, "partition": [0, 1], "num_microbatches": [1], "micro_batch_indices": [[0, 1]]},
    {"data_parallel_rank": 1, "partition": [1, 2], "num_microbatches": [1], "micro_batch_indices": [[0, 1]]}]})";
  Result r = run_cli({"count", path, "--cp", "1,2", "--json", "-"});
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  const auto doc = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));
  bool named = false;
  for (const auto& inv : doc["invariants"]) {
    if (inv["name"] != "I3") continue;
    EXPECT_FALSE(inv["ok"].get<bool>());
    const std::string d = inv["detail"];
    named = d.find("sample 1 is placed twice") != std::string::npos;
    EXPECT_TRUE(named) << d;
  }
  EXPECT_TRUE(named);
}

// Relax's per-rank train dumps ({"rollout_id", "rank", "samples"}) of one DP rank's two CP ranks
// hold the same samples: a directory of them counts those samples once; ranks that disagree on a
// sample are an input error naming both files.
TEST(CliDumps, PerRankRelaxDumpsOfOneDpRankCountOnce) {
  const auto dir = testing::temp_dir("relax-ranks");
  const std::string a =
      R"({"tokens": [1, 2, 3, 4, 5], "response_length": 3, "loss_mask": [1, 0, 1]})";
  const std::string b = R"({"tokens": [7, 8, 9], "response_length": 2, "loss_mask": [1, 1]})";
  std::ofstream(dir / "r0.json") << R"({"rollout_id": 4, "rank": 0, "samples": [)" << a << "," << b
                                 << "]}";
  std::ofstream(dir / "r1.json") << R"({"rollout_id": 4, "rank": 1, "samples": [)" << a << "," << b
                                 << "]}";
  std::ofstream(dir / "r2.json") << R"({"rollout_id": 4, "rank": 2, "samples": [)" << b << "]}";
  Result r = run_cli({"count", dir.string(), "--cp", "1", "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const auto doc = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));
  EXPECT_EQ(doc["samples"].size(), 3u);  // r1 is r0's replica; r2 another DP rank's sample
  EXPECT_EQ(doc["totals"]["1"], 2 + 2 + 2);
  std::ofstream(dir / "r1.json", std::ios::trunc)
      << R"({"rollout_id": 4, "rank": 1, "samples": [{"tokens": [1, 2, 3, 4, 5], "response_length": 3, "loss_mask": [1, 1, 1]},)"
      << b << "]}";
  Result bad = run_cli({"count", dir.string()});
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.err.find("r1.json"), std::string::npos) << bad.err;
  EXPECT_NE(bad.err.find("disagree"), std::string::npos) << bad.err;
}

// The aliases and --field the README promises, at the command line: `input_ids` read as tokens,
// a loss mask under another key mapped with --field, and a field ignored with KEY none.
// The gate never calls an overflowing, underflowing or zero contract a pass (issue: no false
// green): a scale outside what a float32 trainer can apply is refused by weights and check alike,
// and the echo keeps every digit given.
TEST(CliWeights, ContractsOutsideFloat32AreRefusedByWeightsAndCheck) {
  const std::string dump = fixture("gen_random.safetensors");
  for (const char* contract : {"scale=1e308", "megatron-per-token,scale=1e200*1e200",
                               "megatron-per-token,scale=1e-200*1e-200", "scale=1e-39"}) {
    Result w = run_cli({"weights", dump, "--contract", contract, "--strict-scale"});
    EXPECT_EQ(w.code, 2) << contract << "\n" << w.out << w.err;
    EXPECT_NE(w.err.find("outside the float32 range"), std::string::npos) << w.err;
    Result c = run_cli({"check", dump, "--contract", contract, "--cp", "1"});
    EXPECT_EQ(c.code, 2) << contract << "\n" << c.out << c.err;
  }
  Result echo =
      run_cli({"weights", dump, "--contract", "norm=global:dp-cp,scale=1.00000001", "--json", "-"});
  const auto doc = nlohmann::json::parse(echo.out);
  EXPECT_EQ(doc["contract"]["scale"], "1.00000001") << echo.out;
  EXPECT_EQ(echo.code, 0);  // a uniform scale, reported
  Result strict = run_cli(
      {"weights", dump, "--contract", "norm=global:dp-cp,scale=1.00000001", "--strict-scale"});
  EXPECT_EQ(strict.code, 1) << strict.out;
}

// Options out of range are usage errors naming the valid range, never silently replaced.
TEST(CliWeights, OptionsOutOfRangeExitTwoWithTheRange) {
  const std::string dump = fixture("gen_random.safetensors");
  const std::vector<std::vector<std::string>> bad = {
      {"--reduce", "seq-mean-token-sum-norm", "--l-norm", "0"},
      {"--reduce", "seq-mean-token-sum-norm", "--l-norm", "-1"},
      {"--reduce", "seq-mean-token-sum-norm", "--l-norm", "inf"},
      {"--reduce", "seq-mean-token-sum-norm", "--l-norm", "1e308"},
      {"--global-batch-size", "0"},
      {"--global-batch-size", "-1"},
      {"--dynamic-cp", "0", "--cp", "2"},
      {"--pad-multiple", "0"},
      {"--step", "-1"},
      {"--dp", "2147483647"},
      {"--dp", "0"},
      {"--microbatches", "100000", "--dp", "100"},
      {"--cp", "0"}};
  for (const auto& extra : bad) {
    std::vector<std::string> args = {"weights", dump, "--contract", "truth"};
    args.insert(args.end(), extra.begin(), extra.end());
    Result r = run_cli(args);
    EXPECT_EQ(r.code, 2) << fmt::format("{}", fmt::join(extra, " ")) << "\n" << r.out << r.err;
    EXPECT_TRUE(r.err.find("not in range") != std::string::npos ||
                r.err.find("at most") != std::string::npos)
        << r.err;
  }
  EXPECT_EQ(run_cli({"count", dump, "--max-rows", "-1"}).code, 2);
  EXPECT_EQ(run_cli({"inspect", dump, "--max-rows", "-1"}).code, 2);
}

// A JSON dump whose object holds a key twice, or a field under two of its names, is ambiguous.
TEST(CliDumps, DuplicateAndAliasedKeysAreInputErrorsNamingBoth) {
  const auto dir = testing::temp_dir("dup-keys");
  const std::string twice = (dir / "twice.json").string();
  std::ofstream(twice) << R"({"samples": [{"tokens": [5, 6, 7], "response_length": 2,
                             "loss_mask": [1, 1], "loss_mask": [0, 1]}]})";
  Result r = run_cli({"count", twice});
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_NE(r.err.find("'loss_mask'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("twice"), std::string::npos) << r.err;
  const std::string alias = (dir / "alias.json").string();
  std::ofstream(alias) << R"({"samples": [{"tokens": [5, 6, 7], "response_length": 2,
                             "loss_mask": [1, 1], "loss_masks": [0, 1]}]})";
  Result a = run_cli({"count", alias});
  EXPECT_EQ(a.code, 2) << a.out;
  EXPECT_NE(a.err.find("'loss_mask' and 'loss_masks'"), std::string::npos) << a.err;
  EXPECT_NE(a.err.find("sample 0"), std::string::npos) << a.err;
}

// check --loss given takes token_loss as it is: a KL term in it is a finding, not a failure; it
// fails only against what the user states it is.
TEST(CliCheck, GivenTokenLossWithAKlTermIsAFindingUnlessStated) {
  const auto dir = testing::temp_dir("given-kl");
  // V = 2, logits [0, 0]: every nll is log 2. token_loss = nll + 0.1 (a KL penalty), or exactly
  // nll.
  auto write = [&](const std::string& name, double extra) {
    const std::string path = (dir / name).string();
    const double l = std::log(2.0) + extra;
    std::ofstream(path) << fmt::format(
        R"({{"samples": [{{"tokens": [1, 0, 1], "response_length": 2, "loss_mask": [1, 1],
             "logits": [[0.0, 0.0], [0.0, 0.0]], "token_loss": [{:.17g}, {:.17g}]}}]}})",
        l, l);
    return path;
  };
  const std::string kl = write("kl.json", 0.1), plain = write("plain.json", 0.0);
  Result r = run_cli({"check", kl, "--loss", "given", "--cp", "1", "--json", "-"});
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  auto doc = nlohmann::json::parse(r.out.substr(r.out.find("{\n")));
  bool finding = false;
  for (const auto& f : doc["findings"]) finding |= f["kind"] == "token_loss_not_plain";
  EXPECT_TRUE(finding) << doc["findings"].dump();
  EXPECT_TRUE(doc["token_loss"]["ok"].is_null());
  Result stated = run_cli({"check", kl, "--loss", "given", "--cp", "1", "--token-loss-is", "nll"});
  EXPECT_EQ(stated.code, 1) << stated.out;
  Result right =
      run_cli({"check", plain, "--loss", "given", "--cp", "1", "--token-loss-is", "nll"});
  EXPECT_EQ(right.code, 0) << right.out << right.err;
  EXPECT_EQ(run_cli({"check", plain, "--token-loss-is", "kl"}).code, 2);
}

TEST(CliDumps, InputIdsAliasAndFieldMapping) {
  const auto dir = testing::temp_dir("alias");
  const std::string path = (dir / "a.json").string();
  std::ofstream(path) << R"({"samples": [{"input_ids": [5, 6, 7, 8], "response_length": 3,
                             "mask": [1, 0, 1]}]})";
  Result plain = run_cli({"count", path, "--cp", "1", "--json", "-"});
  ASSERT_EQ(plain.code, 0) << plain.err;
  auto doc = nlohmann::json::parse(plain.out.substr(plain.out.find("{\n")));
  EXPECT_EQ(doc["totals"]["1"], 3);  // no mask known: all ones
  Result mapped = run_cli({"count", path, "--cp", "1", "--field", "loss_mask=mask", "--json", "-"});
  ASSERT_EQ(mapped.code, 0) << mapped.err;
  doc = nlohmann::json::parse(mapped.out.substr(mapped.out.find("{\n")));
  EXPECT_EQ(doc["totals"]["1"], 2);
  Result none = run_cli({"count", path, "--field", "tokens=none"});
  EXPECT_EQ(none.code, 2);
  EXPECT_NE(none.err.find("'tokens' is missing"), std::string::npos) << none.err;
}

// SPEC §8's precedence when several outcomes apply: 3 > 1 > 2 > 4 (fault, fail, error,
// unverified), every combination.
TEST(CliReport, ExitCodePrecedenceIsFaultFailErrorUnverified) {
  for (int mask = 0; mask < 16; ++mask) {
    Report r("t");
    r.record(Judgement::verified(/*failed=*/(mask & 4) != 0, /*faulted=*/(mask & 8) != 0));
    if (mask & 1) r.unverified("u");
    if (mask & 2) r.error("e");
    const int want = mask & 8 ? 3 : mask & 4 ? 1 : mask & 2 ? 2 : mask & 1 ? 4 : 0;
    EXPECT_EQ(r.exit_code(), want) << "outcomes " << mask;
  }
}

// A result's judgement is recorded as the library decided it: nothing verified is exit 4 with its
// reason (thrown, as every command's "nothing verified" reaches cli/app.cpp), a fault outranks a
// failure of another step.
TEST(CliReport, RecordsTheLibrarysOutcome) {
  Report r("t");
  EXPECT_EQ(r.exit_code(), 4);  // nothing recorded: nothing verified
  EXPECT_THROW(r.record(Judgement::nothing_verified("no samples")), UnverifiedError);
  r.record(Judgement::verified());
  EXPECT_EQ(r.exit_code(), 0);
  r.record(Judgement::verified(/*failed=*/true));
  EXPECT_EQ(r.exit_code(), 1);
  r.record(Judgement::verified());  // a later passing step keeps the failure
  EXPECT_EQ(r.exit_code(), 1);
  r.record(Judgement::verified(false, /*faulted=*/true));
  EXPECT_EQ(r.exit_code(), 3);
  Report f("t");
  f.fault_error("rank 2: boom");
  EXPECT_EQ(f.exit_code(), 3);
}

// --junit on every command that judges: a JUnit document with a test case per check, failures
// marked, written even when the command fails.
TEST(CliReport, JunitForCountCheckReplayAndTopo) {
  const auto dir = testing::temp_dir("junit-all");
  const std::vector<std::pair<std::vector<std::string>, int>> runs = {
      {{"count", fixture("gen_empty-responses.safetensors"), "--policy", "legacy"}, 1},
      {{"check", fixture("gen_random.safetensors"), "--cp", "1,2"}, 0},
      {{"replay", fixture("gen_zero-token.safetensors"), "--dp", "2", "--protocol", "no-skip"}, 1},
      {{"topo", "--tp", "2", "--pp", "2"}, 0}};
  int k = 0;
  for (auto [args, code] : runs) {
    const std::string path = (dir / ("j" + std::to_string(k++) + ".xml")).string();
    args.insert(args.end(), {"--junit", path});
    Result r = run_cli(args);
    EXPECT_EQ(r.code, code) << args[0] << ": " << r.err;
    const std::string x = testing::read_file(path);
    EXPECT_NE(x.find("<testsuite"), std::string::npos) << args[0];
    EXPECT_NE(x.find("<testcase"), std::string::npos) << args[0] << ": " << x;
    EXPECT_EQ(x.find("<failure") != std::string::npos, code == 1) << args[0] << ": " << x;
  }
}

// A failing replay's JUnit messages and findings name the ranks, as runs ("0-3"): here no-skip on
// a zero-token batch over DP 4 makes all four ranks step, and pr285-src-local over TP 2 x PP 2
// errors on ranks 0 and 2 (their groups lack the global src) while 1 and 3 block.
TEST(CliReport, ReplayFailuresNameTheRanks) {
  const auto dir = testing::temp_dir("junit-ranks");
  const std::string drift = (dir / "drift.xml").string();
  Result r = run_cli({"replay", fixture("gen_zero-token.safetensors"), "--dp", "4", "--protocol",
                      "no-skip", "--junit", drift, "--json", "-"});
  EXPECT_EQ(r.code, 1) << r.err;
  const std::string x = testing::read_file(drift);
  EXPECT_NE(x.find("4 rank(s) (0-3) decided to run optimizer.step()"), std::string::npos) << x;
  const auto j = nlohmann::json::parse(r.out.substr(r.out.find('{')));
  bool seen = false;
  for (const auto& f : j["findings"]) {
    if (f["kind"] == "parameter_drift") {
      seen = true;
      EXPECT_EQ(f["ranks"], 4);
      EXPECT_EQ(f["rank_set"], "0-3");
    }
  }
  EXPECT_TRUE(seen) << j["findings"].dump();
  const std::string fault = (dir / "fault.xml").string();
  Result f = run_cli({"replay", fixture("gen_zero-token.safetensors"), "--tp", "2", "--pp", "2",
                      "--protocol", "pr285-src-local", "--junit", fault});
  EXPECT_EQ(f.code, 3) << f.err;
  const std::string y = testing::read_file(fault);
  EXPECT_NE(y.find("4 rank(s) (0-3) errored, blocked or mismatched"), std::string::npos) << y;
}

// Multi-term weights (SPEC §11) on the 3-sample batch of the hand derivations (m = 111 | 10 |
// 1111): a KL term averaged per micro-batch is named per term, relative to main; the correct
// three-term contract passes; bad declarations exit 2 naming the term.
std::string terms_dump() {
  static const auto dir = testing::temp_dir("cli-terms");  // removed at exit
  const auto path = dir / "three.json";
  testing::write_file(path, R"({"lossguard.schema": "1", "samples": [
    {"tokens": [1, 2, 3, 4, 5], "response_length": 3, "loss_mask": [1, 1, 1]},
    {"tokens": [1, 2, 3, 4], "response_length": 2, "loss_mask": [1, 0]},
    {"tokens": [1, 2, 3, 4, 5, 6], "response_length": 4, "loss_mask": [1, 1, 1, 1]}]})");
  return path.string();
}

TEST(CliWeightsTerms, ThreeTermsCorrectPassAndJsonHasATermsLevel) {
  const std::string dump = terms_dump();
  Result r = run_cli({"weights", dump, "--contract", "megatron-per-token", "--term",
                      "kl:per-token:0.1", "--term", "mtp:per-token:0.3:shift:1", "--term",
                      "aux:per-token:0.01:all", "--microbatches", "3", "--cp", "2", "--json", "-"});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  const auto& terms = doc["steps"][0]["terms"];
  ASSERT_EQ(terms.size(), 4u);
  EXPECT_EQ(terms[0]["name"], "main");
  EXPECT_EQ(terms[1]["name"], "kl");
  EXPECT_EQ(terms[1]["coef"], 0.1);
  EXPECT_EQ(terms[2]["mask"], "shift:1");
  EXPECT_EQ(terms[2]["effective_tokens"], 5);  // 2 + 0 + 3
  EXPECT_EQ(terms[3]["effective_tokens"], 9);  // every response token
  for (const auto& t : terms) EXPECT_EQ(t["diagnosis"]["kind"], "exact") << t["name"];
  // One term: the JSON is as before, no terms level.
  Result one = run_cli({"weights", dump, "--contract", "megatron-per-token", "--json", "-"});
  ASSERT_EQ(one.code, 0);
  EXPECT_FALSE(nlohmann::json::parse(one.out)["steps"][0].contains("terms"));
}

TEST(CliWeightsTerms, KlPerMicrobatchIsNamedRelativeToMain) {
  const std::string dump = terms_dump();
  Result r = run_cli({"weights", dump, "--contract", "megatron-per-token", "--term",
                      "kl:per-token:0.1", "--contract", "kl=norm=microbatch", "--term",
                      "mtp:per-token:0.3:shift:1", "--microbatches", "3", "--json", "-"});
  ASSERT_EQ(r.code, 1) << r.out << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  const auto& terms = doc["steps"][0]["terms"];
  EXPECT_EQ(terms[0]["diagnosis"]["kind"], "exact");
  EXPECT_EQ(terms[1]["contract"]["norm"], "microbatch");
  EXPECT_EQ(terms[1]["diagnosis"]["kind"], "per-microbatch");
  // w / w* = N / n_mb = 8/3, 8, 2 (one sample per micro-batch).
  EXPECT_NEAR(terms[1]["diagnosis"]["max_ratio"].get<double>(), 8.0, 1e-12);
  EXPECT_NEAR(terms[1]["diagnosis"]["min_ratio"].get<double>(), 2.0, 1e-12);
  EXPECT_EQ(terms[2]["diagnosis"]["kind"], "exact");
  bool named = false;
  for (const auto& f : doc["findings"]) named |= f["kind"] == "term_normalisation";
  EXPECT_TRUE(named) << doc["findings"];
  // Equal micro-batches (M = 2 over samples 0+1 and 2: 4 and 4 tokens): the KL is ×M uniformly,
  // and a uniform scale of a term relative to main fails (it changes the terms' balance).
  Result eq =
      run_cli({"weights", dump, "--contract", "megatron-per-token", "--term", "kl:per-token:0.1",
               "--contract", "kl=norm=microbatch", "--microbatches", "2", "--vary", "none"});
  EXPECT_EQ(eq.code, 1) << eq.out;
  EXPECT_NE(eq.out.find("uniform scale ×2 = M"), std::string::npos) << eq.out;
  // Main ×2 and KL ×2: the balance holds (an optimizer like Adam sees no difference): exit 0.
  Result both = run_cli({"weights", dump, "--contract", "norm=global:dp-cp,scale=2", "--term",
                         "kl:per-token:0.1", "--vary", "none"});
  EXPECT_EQ(both.code, 0) << both.out;
}

// Megatron-core 0.16.1 under calculate_per_token_loss divides its MTP loss by the main count
// (N = 8), while the MTP mask holds N_mtp = 5 tokens: a uniform 5/8 relative to the objective.
TEST(CliWeightsTerms, MegatronMtpPerTokenDividesByTheMainCount) {
  const std::string dump = terms_dump();
  Result r = run_cli({"weights", dump, "--contract", "megatron-per-token", "--term",
                      "mtp:per-token:0.3:roll:1", "--contract", "mtp=megatron-mtp-per-token",
                      "--cp", "2", "--json", "-"});
  ASSERT_EQ(r.code, 1) << r.out << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  const auto& mtp = doc["steps"][0]["terms"][1];
  EXPECT_EQ(mtp["contract"]["preset"], "megatron-mtp-per-token");
  EXPECT_EQ(mtp["effective_tokens"], 5);
  EXPECT_EQ(mtp["diagnosis"]["kind"], "uniform-scale");
  EXPECT_NEAR(mtp["diagnosis"]["scale"].get<double>(), 5.0 / 8, 1e-12);
  // Counted under its own mask, the same term is exact.
  Result own = run_cli({"weights", dump, "--contract", "megatron-per-token", "--term",
                        "mtp:per-token:0.3:roll:1", "--cp", "2"});
  EXPECT_EQ(own.code, 0) << own.out;
}

TEST(CliWeightsTerms, BadDeclarationsExitTwoNamingTheTerm) {
  const std::string dump = terms_dump();
  auto expect2 = [&](std::vector<std::string> extra, const std::string& needle) {
    std::vector<std::string> args = {"weights", dump, "--contract", "megatron-per-token"};
    args.insert(args.end(), extra.begin(), extra.end());
    Result r = run_cli(args);
    EXPECT_EQ(r.code, 2) << r.out;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
  };
  expect2({"--term", "kl:per-token:0.1:rolled"}, "--term kl: unknown mask 'rolled'");
  expect2({"--term", "kl:per-token:nan"}, "--term kl: coefficient 'nan'");
  expect2({"--term", "kl:per-token", "--term", "kl:sample-mean"}, "--term kl is given twice");
  expect2({"--term", "main:per-token"}, "'main' is the term of --reduce");
  expect2({"--contract", "kl=norm=microbatch"}, "no term 'kl'");
  expect2({"--term", "kl:per-token", "--contract", "kl=hf-ga", "--contract", "kl=truth"},
          "two contracts for term kl");
  expect2({"--term", "kl:per-token:field"}, "a field mask is recorded by a trainer");
}

// ---- The gate never lies, round 2: a red-team catalogue. Each row was a false green, a false red,
// a crash or an unclear message found by an adversarial pass (commands on the bundled 6-sample
// batch); the expected exit code and the words the message must hold are the documented ones.
struct RedTeamCase {
  std::vector<std::string> args;  // after the dump
  std::string command = "weights";
  int code;
  std::string needle;  // in stdout + stderr
};

TEST(CliRedTeam, EachCaseExitsAsDocumentedAndSaysWhy) {
  const std::string dump = fixture("gen_random.safetensors");
  const std::vector<RedTeamCase> cases = {
      // a scale outside float32 reached through symbols, on the given layout or an I5 variation
      {{"--contract", "megatron-per-token,scale=1e38*M", "--microbatches", "8"},
       "weights",
       2,
       "outside the float32 range"},
      {{"--contract", "megatron-per-token,scale=M*M*M*M*M*M*M", "--microbatches", "1048576"},
       "weights",
       2,
       "outside the float32 range"},
      {{"--contract", "megatron-per-token,scale=1e-37*1/M", "--microbatches", "1024"},
       "weights",
       2,
       "outside the float32 range"},
      // 1e38 at the given M = 1; 4e38 on the I5 variation M = 4
      {{"--contract", "megatron-per-token,scale=1e38*M"},
       "weights",
       2,
       "on the layout DP 1 CP 1 TP 1 M 4"},
      // a uniform scale no optimizer hides
      {{"--contract", "megatron-per-token,scale=1e-30"}, "weights", 1, "too small for Adam"},
      {{"--contract", "megatron-per-token,scale=1e20"}, "weights", 1, "too large"},
      {{"--contract", "megatron-per-token,scale=2"}, "weights", 0, "uniform scale ×2"},
      // components in any order, never read as a term name
      {{"--contract", "count-of=term,norm=global:dp-cp"}, "weights", 0, "pass"},
      // NaN and infinities in every numeric option
      {{"--contract", "truth", "--reduce", "seq-mean-token-sum-norm", "--l-norm", "nan"},
       "weights",
       2,
       "--l-norm"},
      {{"--rtol", "nan", "--cp", "1"}, "check", 2, "--rtol"},
      {{"--atol", "nan", "--cp", "1"}, "check", 2, "--atol"},
      {{"--atol", "-inf", "--cp", "1"}, "check", 2, "--atol"},
      {{"--eps-low", "nan", "--cp", "1", "--loss", "ppo-clip"}, "check", 2, "--eps-low"},
      // coefficients: subnormal and empty say so
      {{"--contract", "megatron-per-token", "--term", "kl:per-token:1e-320"},
       "weights",
       2,
       "subnormal"},
      {{"--contract", "megatron-per-token", "--term", "kl:per-token:1e-39"},
       "weights",
       2,
       "subnormal"},
      {{"--contract", "megatron-per-token", "--term", "kl:per-token::loss"},
       "weights",
       2,
       "coefficient is empty"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> args = {c.command, dump};
    args.insert(args.end(), c.args.begin(), c.args.end());
    Result r = run_cli(args);
    const std::string all = r.out + r.err;
    EXPECT_EQ(r.code, c.code) << fmt::format("{}", fmt::join(args, " ")) << "\n" << all;
    EXPECT_NE(all.find(c.needle), std::string::npos)
        << fmt::format("{}", fmt::join(args, " ")) << ": no '" << c.needle << "' in\n"
        << all;
  }
  // The same components in both orders give the same verdict.
  Result a =
      run_cli({"weights", dump, "--contract", "policy=legacy,norm=global:dp-cp", "--json", "-"});
  Result b =
      run_cli({"weights", dump, "--contract", "norm=global:dp-cp,policy=legacy", "--json", "-"});
  EXPECT_NE(a.code, 2) << a.err;  // was "no term 'policy'"
  EXPECT_EQ(a.code, b.code);
  EXPECT_EQ(nlohmann::json::parse(a.out)["contract"], nlohmann::json::parse(b.out)["contract"]);
}

TEST(CliRedTeam, ThousandTermsAtAHugeLayoutAreRefusedByTheirSize) {
  const std::string dump = fixture("gen_random.safetensors");
  std::vector<std::string> args = {"weights", dump,     "--contract", "megatron-per-token",
                                   "--dp",    "1048576"};
  for (int k = 0; k < 1000; ++k) {
    args.push_back("--term");
    args.push_back(fmt::format("t{}:per-token:0.1", k));
  }
  Result r = run_cli(args);
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_NE(r.err.find("1001 terms x 1048576 micro-batches"), std::string::npos) << r.err;
}

TEST(CliRedTeam, PathsThatAreNotRegularFilesAreRefusedWithTheirKind) {
  const auto dir = testing::temp_dir("cli-fifo");
  const std::string fifo = (dir / "p.safetensors").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const char* command : {"inspect", "count", "audit"}) {
    Result r = run_cli({command, fifo});  // open() on a FIFO would block: status first
    EXPECT_EQ(r.code, 2) << command << r.err;
    EXPECT_NE(r.err.find("is a pipe or FIFO, not a regular file"), std::string::npos) << r.err;
  }
  Result dev = run_cli({"inspect", "/dev/null"});
  EXPECT_EQ(dev.code, 2);
  EXPECT_NE(dev.err.find("a character device"), std::string::npos) << dev.err;
  // Inside a directory such entries are skipped, as before.
  testing::write_file(
      dir / "b.json",
      R"({"samples": [{"tokens": [1, 2, 3], "response_length": 2, "loss_mask": [1, 1]}]})");
  Result skip = run_cli({"count", dir.string()});
  EXPECT_EQ(skip.code, 0) << skip.err;
}

// The TRL presets on the completions TRL really batches (8, 24, 48 at DP x M dividing them):
// exact, every I5 variation TRL cannot build skipped and said so (they failed 'first on DP 8').
TEST(CliRedTeam, TrlPresetsPassAtTheLayoutsTrlBuilds) {
  const auto dir = testing::temp_dir("cli-trl");
  struct Preset {
    const char* contract;
    std::vector<std::string> objective;
  };
  const std::vector<Preset> presets = {
      {"trl-grpo", {"--reduce", "sample-mean"}},
      {"trl-luspo", {"--reduce", "seq-mean-token-sum"}},
      {"trl-dapo", {"--reduce", "per-token"}},
      {"trl-dr-grpo", {"--reduce", "seq-mean-token-sum-norm", "--l-norm", "8"}}};
  for (int n : {8, 24, 48}) {
    const std::string batch = (dir / fmt::format("b{}.safetensors", n)).string();
    ASSERT_EQ(run_cli({"gen", "--out", batch, "--samples", std::to_string(n), "--vocab", "0",
                       "--max-response", "8", "--seed", std::to_string(n)})
                  .code,
              0);
    for (const auto& p : presets) {
      std::vector<std::string> args = {
          "weights",        batch, "--contract", p.contract,        "--dp",   "2",
          "--microbatches", "2",   "--vary",     "dp,microbatches", "--json", "-"};
      args.insert(args.end(), p.objective.begin(), p.objective.end());
      Result r = run_cli(args);
      EXPECT_EQ(r.code, 0) << n << " " << p.contract << "\n" << r.out.substr(0, 3000) << r.err;
      if (r.out.empty() || r.out[0] != '{') continue;
      const auto doc = nlohmann::json::parse(r.out);
      int skipped = 0, weighed = 0;
      for (const auto& inv : doc["steps"][0]["invariance"]) {
        if (inv["skipped"].is_null()) {
          ++weighed;
          EXPECT_EQ(inv["ok"], true) << inv;
        } else {
          ++skipped;
          const int dp = inv["layout"]["dp"], m = inv["layout"]["microbatches"];
          EXPECT_TRUE(dp * m > n || n % (dp * m) != 0) << inv;
        }
      }
      EXPECT_GT(weighed, 0) << n << " " << p.contract;
      EXPECT_EQ(skipped > 0, n % 16 != 0 || n < 16) << n << " " << p.contract << r.out;
    }
  }
  // norm=generation:S with S = M weighs as the plain preset (variations with M < S skipped).
  const std::string b24 = (dir / "b24.safetensors").string();
  Result gen = run_cli({"weights", b24, "--reduce", "per-token", "--contract",
                        "trl-dapo,norm=generation:4,scale=dp*4*1/M", "--dp", "2", "--microbatches",
                        "4", "--vary", "dp,microbatches"});
  EXPECT_EQ(gen.code, 0) << gen.out << gen.err;
  EXPECT_NE(gen.out.find("not a multiple of the generation batch"), std::string::npos) << gen.out;
}

}  // namespace
}  // namespace lossguard::cli

namespace lossguard::cli {
namespace {

// `postmortem` in-process on the committed real dumps (torch 2.15, Gloo; tests/postmortem/fr_job.py
// --scenario seed-pp1-broadcast): exit 3, the divergence and the protocol in the text and the JSON.
TEST(CliPostmortem, TheSeedDeadlockFromRealDumps) {
  const std::string dir = fixture("flight_recorder/seed-pp1-broadcast");
  Result r = run_cli({"postmortem", dir, "--json", "-"});
  EXPECT_EQ(r.code, 3) << r.err;
  const auto doc = nlohmann::json::parse(r.out);
  EXPECT_EQ(doc["command"], "postmortem");
  EXPECT_EQ(doc["verdict"], "fault");
  EXPECT_EQ(doc["divergences"][0]["not_issued"], nlohmann::json({1, 2, 3}));
  EXPECT_EQ(doc["protocol_matches"][0]["protocol"], "pr285-always-broadcast");
  Result text = run_cli({"postmortem", dir + "/json"});  // the JSON form of the same dumps
  EXPECT_EQ(text.code, 3);
  EXPECT_NE(text.out.find("NAMED: pr285-always-broadcast"), std::string::npos) << text.out;
  // the prefix TORCH_FR_DUMP_TEMP_FILE names; one that matches nothing is exit 2
  Result prefix = run_cli({"postmortem", dir + "/fr_trace_rank_", "--json", "-"});
  EXPECT_EQ(prefix.code, 3) << prefix.err;
  EXPECT_EQ(nlohmann::json::parse(prefix.out)["inputs"].size(), 4u);
  Result none = run_cli({"postmortem", dir + "/no_such_prefix_"});
  EXPECT_EQ(none.code, 2);
  EXPECT_NE(none.err.find("no_such_prefix_"), std::string::npos) << none.err;
}

}  // namespace
}  // namespace lossguard::cli
