// The float64 oracle against values it did not compute (issue #18):
// fixtures/make_expected_losses.py derives every loss x reduction and its gradient on the committed
// JSON fixtures with PyTorch float64 autograd, from docs/semantics.md alone, and writes
// fixtures/data/expected_losses/losses_<fixture>.json. Here each fixture is read straight into a
// Batch (nlohmann::json and BatchBuilder: no io/ loader) and oracle_loss must reproduce loss,
// denominator, per-token losses and gradient:
//   loss       |got - want| <= 1e-12 |want|  (an expected 0 must be exactly 0)
//   elements   |got - want| <= 1e-12 max(1, |want|)
// A few values on the hand-written fixtures are derived by hand below and asserted directly, so
// that the producer is checked too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "core/batch.h"
#include "core/errors.h"
#include "core/modes.h"
#include "oracle/check/loss.h"

namespace lossguard::oracle {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr double kRelTol = 1e-12;

fs::path fixture_dir() {
  if (const char* env = std::getenv("LOSSGUARD_FIXTURE_DIR"); env != nullptr && *env != '\0')
    return env;
#ifdef LOSSGUARD_FIXTURE_DIR
  return LOSSGUARD_FIXTURE_DIR;
#else
  return fs::path(__FILE__).parent_path().parent_path() / "fixtures" / "data";
#endif
}
fs::path expected_dir() { return fixture_dir() / "expected_losses"; }

json read_json(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + p.string());
  std::ostringstream ss;
  ss << f.rdbuf();
  return json::parse(ss.str());
}

// A JSON dump ({"samples": [{"tokens", "response_length", "loss_mask", "logits", per-token
// fields}]}) as a Batch, every float as float64 (as the io/ JSON loader reads it).
Batch load_batch(const fs::path& path) {
  const json doc = read_json(path);
  const json& samples = doc.is_array() ? doc : doc.at("samples");
  BatchBuilder builder;
  builder.begin_file(path.filename().string());
  int64_t index = 0;
  for (const json& s : samples) {
    const auto tok = s.at("tokens").get<std::vector<int64_t>>();
    const HostArray tokens =
        HostArray::from_i64(DType::kInt64, {static_cast<int64_t>(tok.size())}, tok);
    SampleFields f;
    f.tokens = &tokens;
    f.response_length = s.at("response_length").get<int64_t>();
    std::optional<HostArray> mask, logits;
    if (s.contains("loss_mask") && !s["loss_mask"].is_null()) {
      const auto m = s["loss_mask"].get<std::vector<int64_t>>();
      mask = HostArray::from_i64(DType::kInt64, {static_cast<int64_t>(m.size())}, m);
      f.loss_mask = &*mask;
    }
    if (s.contains("logits") && !s["logits"].is_null() && !s["logits"].empty()) {
      const auto rows = s["logits"].get<std::vector<std::vector<double>>>();
      std::vector<double> flat;
      for (const auto& row : rows) flat.insert(flat.end(), row.begin(), row.end());
      logits = HostArray::from_f64(
          DType::kFloat64,
          {static_cast<int64_t>(rows.size()), static_cast<int64_t>(rows.front().size())}, flat);
      f.logits = &*logits;
    }
    std::map<std::string, HostArray> per_token;
    for (const std::string& name : per_token_field_names()) {
      if (!s.contains(name) || s[name].is_null()) continue;
      const auto v = s[name].get<std::vector<double>>();
      per_token.emplace(name,
                        HostArray::from_f64(DType::kFloat64, {static_cast<int64_t>(v.size())}, v));
    }
    for (const auto& [name, a] : per_token) f.per_token[name] = &a;
    builder.add_sample(index++, f);
  }
  return builder.finish();
}

Batch load_fixture(const std::string& name) { return load_batch(fixture_dir() / name); }

// The gradient as written by the producer: rows of V values (logits) or one value per token.
std::vector<double> flatten(const json& j) {
  std::vector<double> out;
  for (const json& x : j) {
    if (x.is_array()) {
      for (const json& y : x) out.push_back(y.get<double>());
    } else {
      out.push_back(x.get<double>());
    }
  }
  return out;
}

// Elementwise |got - want| <= 1e-12 max(1, |want|); one failure per vector, naming the worst
// element.
void expect_elements_close(const std::vector<double>& got, const std::vector<double>& want,
                           int64_t cols, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  std::size_t bad = 0, worst = 0;
  double worst_excess = 0.0;
  for (std::size_t k = 0; k < want.size(); ++k) {
    const double diff = std::fabs(got[k] - want[k]);
    const double bound = kRelTol * std::max(1.0, std::fabs(want[k]));
    if (!(diff <= bound)) {  // NaN fails
      if (bad == 0 || !(diff / bound <= worst_excess)) {
        worst = k;
        worst_excess = diff / bound;
      }
      ++bad;
    }
  }
  if (bad > 0) {
    const auto c = static_cast<std::size_t>(std::max<int64_t>(cols, 1));
    ADD_FAILURE() << what << ": " << bad << " of " << want.size()
                  << " elements differ; worst at row " << worst / c << " col " << worst % c
                  << ": got " << got[worst] << ", want " << want[worst] << " (diff "
                  << std::fabs(got[worst] - want[worst]) << ")";
  }
}

void expect_loss_close(double got, double want, const std::string& what) {
  if (want == 0.0) {
    EXPECT_EQ(got, 0.0) << what;
  } else {
    EXPECT_LE(std::fabs(got - want), kRelTol * std::fabs(want))
        << what << ": got " << got << ", want " << want;
  }
}

std::string fmt17(double x) {
  std::ostringstream s;
  s.precision(17);
  s << x;
  return s.str();
}

// The fixtures with expected losses (EveryJsonFixtureHasExpectedLosses keeps this list complete).
const std::vector<std::string>& fixture_stems() {
  static const std::vector<std::string> kStems = {
      "gen_cp-examples",        "gen_empty-responses", "gen_fully-masked", "gen_random",
      "gen_sft-not-preshifted", "gen_sft-preshifted",  "gen_t-zero",       "gen_zero-token",
      "hand_reductions",        "hand_sft_preshifted", "hand_two_tokens"};
  return kStems;
}

// Every committed gen_*.json and hand_*.json fixture has its expected losses (regenerated together
// by scripts/regen-fixtures.sh), and every expected file names an existing fixture.
TEST(OracleExpectedLosses, EveryJsonFixtureHasExpectedLosses) {
  std::set<std::string> fixtures, covered;
  for (const auto& e : fs::directory_iterator(fixture_dir())) {
    const std::string name = e.path().filename().string();
    if (e.path().extension() == ".json" &&
        (name.rfind("gen_", 0) == 0 || name.rfind("hand_", 0) == 0))
      fixtures.insert(name);
  }
  ASSERT_TRUE(fs::is_directory(expected_dir())) << expected_dir();
  for (const auto& e : fs::directory_iterator(expected_dir())) {
    const std::string name = e.path().filename().string();
    if (name.rfind("losses_", 0) != 0 || e.path().extension() != ".json") continue;
    const json doc = read_json(e.path());
    EXPECT_EQ(doc.at("schema").get<std::string>(), "lossguard.expected_losses/1") << name;
    const std::string fixture = doc.at("fixture").get<std::string>();
    EXPECT_EQ(name, "losses_" + fs::path(fixture).stem().string() + ".json");
    EXPECT_TRUE(fs::exists(fixture_dir() / fixture)) << name << " names " << fixture;
    covered.insert(fixture);
  }
  for (const std::string& f : fixtures) {
    EXPECT_TRUE(covered.count(f)) << f << " has no "
                                  << (expected_dir() /
                                      ("losses_" + fs::path(f).stem().string() + ".json"))
                                  << " (run fixtures/make_expected_losses.py)";
  }
  EXPECT_GE(fixtures.size(), 11u) << "8 gen_*.json and 3 hand_*.json fixtures expected in "
                                  << fixture_dir();
  // The parameterised test below runs on a fixed list: it must name every fixture.
  std::set<std::string> listed;
  for (const std::string& stem : fixture_stems()) listed.insert(stem + ".json");
  EXPECT_EQ(listed, fixtures) << "update fixture_stems()";
}

class ExpectedLosses : public ::testing::TestWithParam<std::string> {};

TEST_P(ExpectedLosses, OracleMatchesIndependentTorchFloat64) {
  const fs::path file = expected_dir() / ("losses_" + GetParam() + ".json");
  ASSERT_TRUE(fs::exists(file)) << file << " (run fixtures/make_expected_losses.py)";
  const json doc = read_json(file);
  const std::string fixture = doc.at("fixture").get<std::string>();
  const Batch batch = load_fixture(fixture);
  const json& sizes = doc.at("sizes");
  ASSERT_EQ(batch.num_samples(), sizes.at("samples").get<int64_t>());
  const bool zero_tokens = sizes.at("N").get<int64_t>() == 0;

  std::size_t compared = 0;
  for (const json& c : doc.at("cases")) {
    LossSpec spec;
    ASSERT_TRUE(parse_loss_kind(c.at("loss").get<std::string>(), &spec.loss)) << c.at("loss");
    spec.eps_low = doc.at("eps_low").get<double>();
    spec.eps_high = doc.at("eps_high").get<double>();
    if (c.contains("error")) {
      // The fixture lacks the fields this loss needs: the oracle must refuse, naming them.
      EXPECT_THROW(oracle_loss(batch, spec), InputError) << c.at("loss") << ": " << c.at("error");
      continue;
    }
    const std::string input = c.at("input").get<std::string>();
    // nll from log_probs on a dump that has logits: the oracle reads the logits when there are
    // any, so drop them.
    Batch dropped;
    const Batch* b = &batch;
    if (spec.loss == LossKind::kNll && input == "log_probs" && batch.logits) {
      dropped = batch;
      dropped.logits.reset();
      b = &dropped;
    }
    const std::vector<double> want_token_loss = flatten(c.at("token_loss"));
    const int64_t cols = c.at("grad_cols").get<int64_t>();
    const json& reductions = c.at("reductions");
    for (auto it = reductions.begin(); it != reductions.end(); ++it) {
      const std::string reduce_name = it.key();
      const json& r = it.value();
      const std::string what =
          fixture + " " + c.at("loss").get<std::string>() + " (d/d " + input + ") " + reduce_name;
      SCOPED_TRACE(what);
      ASSERT_TRUE(parse_reduction(reduce_name, &spec.reduce)) << reduce_name;
      const OracleLoss o = oracle_loss(*b, spec);
      EXPECT_EQ(std::string(loss_input_name(o.input)), input);
      EXPECT_EQ(o.grad_cols, cols);
      EXPECT_EQ(o.denominator, r.at("denominator").get<int64_t>());
      EXPECT_EQ(o.no_signal, zero_tokens);
      expect_loss_close(o.loss, r.at("loss").get<double>(), what);
      expect_elements_close(o.token_loss, want_token_loss, 1, what + " token_loss");
      expect_elements_close(o.grad, flatten(r.at("grad")), cols, what + " grad");
      ++compared;
    }
  }
  // Only gen_cp-examples (masks only) has nothing to compare: every loss is refused there.
  if (GetParam() != "gen_cp-examples") {
    EXPECT_GE(compared, 6u);
  }
}

std::string param_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string s = info.param;
  for (char& ch : s) {
    if (ch == '-') ch = '_';
  }
  return s;
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ExpectedLosses, ::testing::ValuesIn(fixture_stems()),
                         param_name);

TEST(OracleExpectedLosses, EveryLossAndInputIsCompared) {
  std::set<std::string> kinds;
  for (const std::string& stem : fixture_stems()) {
    const json doc = read_json(expected_dir() / ("losses_" + stem + ".json"));
    for (const json& c : doc.at("cases")) {
      if (!c.contains("error"))
        kinds.insert(c.at("loss").get<std::string>() + "/" + c.at("input").get<std::string>());
    }
  }
  for (const char* k : {"nll/logits", "nll/log_probs", "ppo-clip/log_probs", "given/token_loss"})
    EXPECT_TRUE(kinds.count(k)) << k << " is never compared";
}

// ---- Values derived by hand on the hand-written fixtures ----

OracleLoss run(const std::string& fixture, LossKind loss, Reduction reduce,
               bool drop_logits = false) {
  Batch b = load_fixture(fixture);
  if (drop_logits) b.logits.reset();
  LossSpec spec;
  spec.loss = loss;
  spec.reduce = reduce;
  return oracle_loss(b, spec);
}

void expect_rel(double got, double want, const char* what) {
  EXPECT_NEAR(got, want, kRelTol * std::fabs(want)) << what << ": got " << fmt17(got);
}

// hand_two_tokens.json, V = 3:
//   s0 RL, tokens [2 | 1 0] (P = 1), mask 11:
//     row 0, logits [0, ln 3, 0], predicts tokens[1] = 1: l = ln(1 + 3 + 1) - ln 3 = ln(5/3);
//     row 1, logits [0, 0, 0], predicts tokens[2] = 0: l = ln 3.
//   s1 SFT, tokens [1 2], mask 11 (not pre-shifted):
//     row 0, logits [0, 0, ln 2], predicts tokens[1] = 2: l = ln(1 + 1 + 2) - ln 2 = ln 2;
//     row 1, logits [ln 3, 0, 0], the dummy target 0: l = ln(3 + 1 + 1) - ln 3 = ln(5/3).
//     (Scoring SFT row j against tokens[j] instead would give ln 4 and ln 5.)
//   s2 empty (R = 0).
//   N = 4, B = 3, two non-empty samples, L_norm = 2;
//   sum of losses ln(5/3) + ln 3 + ln 2 + ln(5/3) = ln(50/3).
TEST(OracleExpectedLosses, HandTwoTokensNllFromLogits) {
  const double total = std::log(50.0 / 3.0);
  const std::string f = "hand_two_tokens.json";
  expect_rel(run(f, LossKind::kNll, Reduction::kPerToken).loss, total / 4, "per-token");
  // sample-mean: (ln(5/3)+ln 3)/2 + (ln 2+ln(5/3))/2 + 0, over B = 3: ln(50/3)/6.
  expect_rel(run(f, LossKind::kNll, Reduction::kSampleMean).loss, total / 6, "sample-mean");
  expect_rel(run(f, LossKind::kNll, Reduction::kSeqMeanTokenSum).loss, total / 3,
             "seq-mean-token-sum");
  expect_rel(run(f, LossKind::kNll, Reduction::kSeqMeanTokenMean).loss, total / 4,
             "seq-mean-token-mean");
  // Dr.GRPO: over B · L_norm = 3 · 2.
  expect_rel(run(f, LossKind::kNll, Reduction::kSeqMeanTokenSumNorm).loss, total / 6,
             "seq-mean-token-sum-norm");

  // Gradient, per-token (c = 1/4): (softmax - onehot) / 4 per row.
  const OracleLoss o = run(f, LossKind::kNll, Reduction::kPerToken);
  ASSERT_EQ(o.grad_cols, 3);
  const std::vector<double> want = {
      0.05,     -0.1,     0.05,      // softmax [1/5, 3/5, 1/5], target 1
      -1.0 / 6, 1.0 / 12, 1.0 / 12,  // softmax [1/3, 1/3, 1/3], target 0
      1.0 / 16, 1.0 / 16, -1.0 / 8,  // softmax [1/4, 1/4, 1/2], target 2
      -0.1,     0.05,     0.05};     // softmax [3/5, 1/5, 1/5], dummy target 0
  expect_elements_close(o.grad, want, 3, "hand nll grad");
}

// hand_two_tokens.json, ppo-clip (eps 0.2) from log_probs lp, old_log_probs, advantages A:
//   s0: lp = old, rho = 1 (inside the clip range): A = 2 -> l = -2, dl/dlp = -rho A = -2;
//       A = -1 -> l = 1, dl/dlp = 1.
//   s1: lp - old = ln 2, rho = 2, A = 1: max(-2, -1.2) = -1.2, clipped -> gradient 0;
//       lp - old = -ln 2, rho = 1/2, A = 1: max(-0.5, -0.8) = -0.5, unclipped -> dl/dlp = -0.5.
//   per-token: (-2 + 1 - 1.2 - 0.5) / 4 = -0.675; gradient [-2, 1, 0, -0.5] / 4.
//   nll from log_probs [-1, -2, -0.5, -3]: 6.5 / 4 = 1.625, gradient -1/4 each.
//   given, token_loss [0.5, 1.5 | 2, 4], sample-mean: (2/2 + 6/2) / 3 = 4/3.
TEST(OracleExpectedLosses, HandTwoTokensPpoClipNllFromLogProbsAndGiven) {
  const std::string f = "hand_two_tokens.json";
  const OracleLoss ppo = run(f, LossKind::kPpoClip, Reduction::kPerToken);
  expect_rel(ppo.loss, -0.675, "ppo-clip per-token");
  expect_elements_close(ppo.grad, {-0.5, 0.25, 0.0, -0.125}, 1, "ppo-clip grad");
  EXPECT_EQ(ppo.grad[2], 0.0) << "the clipped token carries no gradient";

  const OracleLoss nll = run(f, LossKind::kNll, Reduction::kPerToken, /*drop_logits=*/true);
  EXPECT_EQ(nll.input, LossInput::kLogProbs);
  expect_rel(nll.loss, 1.625, "nll from log_probs");
  expect_elements_close(nll.grad, {-0.25, -0.25, -0.25, -0.25}, 1, "nll log_probs grad");

  expect_rel(run(f, LossKind::kGiven, Reduction::kSampleMean).loss, 4.0 / 3.0, "given sample-mean");
}

// hand_reductions.json is the worked example of docs/semantics.md §4: s0 mask 10, losses 2, 9;
// s1 mask 111, losses 1, 1, 1; s2 mask 00. N = 4, B = 3, L_norm = 3, masked-in sum 5.
TEST(OracleExpectedLosses, HandReductionsTableOfSemanticsSection4) {
  const std::string f = "hand_reductions.json";
  const std::vector<std::pair<Reduction, double>> table = {
      {Reduction::kPerToken, 5.0 / 4},
      {Reduction::kTokenMean, 5.0 / 4},
      {Reduction::kSampleMean, (2.0 / 1 + 3.0 / 3 + 0) / 3},
      {Reduction::kSeqMeanTokenSum, 5.0 / 3},
      {Reduction::kSeqMeanTokenMean, (2.0 / 1 + 3.0 / 3) / 2},
      {Reduction::kSeqMeanTokenSumNorm, 5.0 / 9}};  // B · L_norm = 3 · 3
  for (const auto& [reduce, value] : table) {
    expect_rel(run(f, LossKind::kGiven, reduce).loss, value, reduction_name(reduce));
    // log_probs = -token_loss, so nll reads the same losses.
    expect_rel(run(f, LossKind::kNll, reduce).loss, value, reduction_name(reduce));
  }
  // The masked 9 and the fully masked sample get exactly zero gradient.
  const OracleLoss o = run(f, LossKind::kGiven, Reduction::kPerToken);
  expect_elements_close(o.grad, {0.25, 0.0, 0.25, 0.25, 0.25, 0.0, 0.0}, 1, "given grad");
  EXPECT_EQ(o.grad[1], 0.0);
  EXPECT_EQ(o.grad[5], 0.0);
  EXPECT_EQ(o.grad[6], 0.0);
}

// hand_sft_preshifted.json, V = 3:
//   s0 SFT, tokens [0 2 1], mask 110 (pre-shifted):
//     row 0, logits [0, 0, ln 3], predicts tokens[1] = 2: l = ln 5 - ln 3;
//     row 1, logits [0, ln 2, 0], predicts tokens[2] = 1: l = ln 4 - ln 2 = ln 2;
//     row 2 masked.
//   s1 RL, tokens [1 0 | 2 1], mask 01:
//     row 0 (logits [9, -9, 0]) masked;
//     row 1, logits [0, 0, 0], predicts tokens[3] = 1: l = ln 3.
//   N = 3, B = 2, L_norm = 3: per-token (ln(5/3) + ln 2 + ln 3) / 3 = ln(10) / 3;
//   sample-mean (ln(10/3) / 2 + ln 3) / 2.
TEST(OracleExpectedLosses, HandSftPreshiftedTargetsTheNextToken) {
  const std::string f = "hand_sft_preshifted.json";
  expect_rel(run(f, LossKind::kNll, Reduction::kPerToken).loss, std::log(10.0) / 3, "per-token");
  expect_rel(run(f, LossKind::kNll, Reduction::kSampleMean).loss,
             (std::log(10.0 / 3.0) / 2 + std::log(3.0)) / 2, "sample-mean");
  // Dr.GRPO: over B · L_norm = 2 · 3.
  expect_rel(run(f, LossKind::kNll, Reduction::kSeqMeanTokenSumNorm).loss, std::log(10.0) / 6,
             "seq-mean-token-sum-norm");
  const OracleLoss o = run(f, LossKind::kNll, Reduction::kPerToken);
  ASSERT_EQ(o.grad.size(), 15u);
  const std::vector<double> want = {
      1.0 / 15, 1.0 / 15, -2.0 / 15,  // softmax [1/5, 1/5, 3/5], target 2, / 3
      1.0 / 12, -1.0 / 6, 1.0 / 12,   // softmax [1/4, 1/2, 1/4], target 1, / 3
      0.0,      0.0,      0.0,        // masked
      0.0,      0.0,      0.0,        // masked
      1.0 / 9,  -2.0 / 9, 1.0 / 9};   // softmax [1/3, 1/3, 1/3], target 1, / 3
  expect_elements_close(o.grad, want, 3, "hand sft grad");
  for (int k = 6; k < 12; ++k) EXPECT_EQ(o.grad[k], 0.0) << "masked row element " << k;
}

}  // namespace
}  // namespace lossguard::oracle
