// `lossguard check`: the candidate (a CP-sharded trainer: LibTorch in the dump's dtype, or the
// kernels) against the float64 oracle, for every CP size, loss and reduction: denominator (exact),
// loss value, gradient.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <optional>

#include "cli/command.h"
#include "cli/inputs.h"
#include "cli/placement_options.h"
#include "cli/steps.h"
#include "core/contract.h"
#include "core/errors.h"
#include "kernels/device.h"
#include "kernels/device_info.h"
#include "oracle/check.h"
#include "oracle/compare.h"
#include "oracle/findings.h"
#include "oracle/loss.h"
#include "trainer/candidate.h"

namespace lossguard::cli {

namespace {

struct CheckOptions {
  DumpOptions dumps;
  std::vector<int64_t> cp_sizes = {1, 2, 4};
  std::vector<std::string> losses = {"nll"};
  std::vector<std::string> reduces = {"per-token"};
  std::string policy = "fixed";
  double rtol = -1, atol = -1;
  double eps_low = 0.2, eps_high = 0.2;
  std::vector<std::string> impls = {"torch"};
  std::string device = "cpu";
  LayoutOptions layout;
  std::string contract;  // empty: the candidate normalises by --policy
  PlacementOptions placement;
  int64_t tp = 1;
  int64_t global_batch_size = 0;
  std::string token_loss_is;  // empty: not stated
};

// The element bounds a gradient was judged by (grad_stream.h): the defaults', then the derived.
nlohmann::ordered_json bounds_json(const std::vector<oracle::ElementBound>& bounds) {
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (std::size_t k = 0; k < bounds.size(); ++k) {
    const oracle::ElementBound& e = bounds[k];
    out.push_back({{"source", k == 0 ? "default" : "derived"},
                   {"atol", e.atol},
                   {"atol_per_weight", e.atol_per_weight},
                   {"rtol", e.rtol},
                   {"alpha", e.alpha},
                   {"alpha_per_spread", e.alpha_per_spread},
                   {"alpha_per_log_sum", e.alpha_per_log_sum},
                   {"alpha_per_abs_lse", e.alpha_per_abs_lse},
                   {"beta", e.beta}});
  }
  return out;
}

// A progress line on a terminal for a check that runs over a second: cases done and rows compared.
class CheckProgress {
 public:
  CheckProgress(Context& ctx, int64_t cases, int64_t rows)
      : ctx_(ctx), cases_(cases), rows_(rows), start_(std::chrono::steady_clock::now()) {}
  void at(int64_t rows_done) {
    if (!ctx_.err_is_terminal) return;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
    if (elapsed < 1.0) return;
    const double done =
        static_cast<double>(case_) +
        static_cast<double>(rows_done) / static_cast<double>(std::max<int64_t>(rows_, 1));
    const double total = static_cast<double>(std::max<int64_t>(cases_, 1));
    const double eta = done > 0 ? elapsed * (total - done) / done : 0.0;
    ctx_.err << fmt::format(
                    "\r\x1b[Kcheck: case {}/{}, {}/{} rows ({:.0f}%), {:.1f} s, ~{:.0f} s left",
                    case_ + 1, cases_, rows_done, rows_, 100.0 * done / total, elapsed, eta)
             << std::flush;
    shown_ = true;
  }
  void case_done() { ++case_; }
  ~CheckProgress() {
    if (shown_) ctx_.err << "\r\x1b[K" << std::flush;
  }

 private:
  Context& ctx_;
  int64_t cases_, rows_, case_ = 0;
  std::chrono::steady_clock::time_point start_;
  bool shown_ = false;
};

nlohmann::ordered_json location_json(const oracle::GradLocation& l) {
  return {{"sample", l.sample},
          {"response_index", l.response_index},
          {"vocab_index", l.vocab_index < 0 ? nlohmann::ordered_json(nullptr)
                                            : nlohmann::ordered_json(l.vocab_index)},
          {"cp_rank", l.cp_rank},
          {"chunk", l.chunk},
          {"got", l.got},
          {"want", l.want},
          {"abs_diff", l.abs_diff},
          {"rel_diff", std::isfinite(l.rel_diff) ? nlohmann::ordered_json(l.rel_diff)
                                                 : nlohmann::ordered_json(nullptr)}};
}

void run_check(const CheckOptions& o, Report& report, Context& ctx) {
  const Policy policy = policy_from_option(o.policy);
  std::vector<LossKind> losses;
  for (const auto& l : o.losses) {
    LossKind k;
    if (!parse_loss_kind(l, &k))
      throw_input_error("--loss must be nll, ppo-clip or given, got '{}'", l);
    losses.push_back(k);
  }
  std::vector<Reduction> reduces;
  for (const auto& r : o.reduces) {
    if (r == "all") {
      reduces = all_reductions();
      break;
    }
    Reduction x;
    if (!parse_reduction(r, &x)) throw_input_error("--reduce: unknown reduction '{}'", r);
    reduces.push_back(x);
  }
  for (int64_t c : o.cp_sizes) {
    if (c < 1) throw_input_error("--cp sizes must be >= 1, got {}", c);
  }
  std::vector<trainer::Impl> impls;
  for (const auto& name : o.impls) {
    trainer::Impl i;
    if (!trainer::parse_impl(name, &i))
      throw_input_error("--impl must be torch or kernels, got '{}'", name);
    impls.push_back(i);
  }
  kernels::Device device;
  if (!kernels::parse_device(o.device, &device))
    throw_input_error("--device must be cpu or cuda, got '{}'", o.device);
  if (device == kernels::Device::kCuda &&
      !kernels::cuda_available()) {  // SPEC §8: nothing verified, exit 4
    const kernels::DeviceInfo info = kernels::query_device_info();
    throw UnverifiedError(fmt::format("--device cuda: no CUDA device ({})",
                                      info.status.empty() ? "none found" : info.status));
  }
  const ShardLayout layout = o.layout.layout();
  // LibTorch starts up while the dump is read and the oracle makes its pass over the logits.
  std::optional<trainer::TorchPreload> torch_loading;
  if (std::find(impls.begin(), impls.end(), trainer::Impl::kTorch) != impls.end())
    torch_loading.emplace();
  LoadedBatch loaded = load_batch(o.dumps, report, ctx);
  if (loaded.batch.num_samples() == 0) throw UnverifiedError("the dumps hold no samples");
  run_per_step(loaded.batch, o.dumps.step, report, ctx, [&](const StepView& v) {
    const Batch& b = *v.batch;
    // check --contract: each micro-batch of each DP rank trained under the contract (SPEC §9), on
    // the trainer's own layout where the dump records it.
    const Placement placement =
        v.layout != nullptr ? *v.layout : o.placement.placement(b, o.dumps.dp_shards);
    int64_t global_batch_size = o.global_batch_size;
    if (global_batch_size == 0 && b.metadata.contains("global_batch_size") &&
        b.metadata["global_batch_size"].is_number_integer()) {
      global_batch_size = b.metadata["global_batch_size"].get<int64_t>();
    }
    std::ostream& out = ctx.out;
    out << fmt::format("lossguard check: {} samples, policy {}, CP sizes {}, candidate {}{}\n",
                       b.num_samples(), policy_name(policy), fmt::join(o.cp_sizes, ", "),
                       fmt::join(o.impls, " and "),
                       device == kernels::Device::kCuda ? " (kernels on CUDA)" : "");

    if (policy == Policy::kLegacy) report.add_findings(oracle::legacy_slicing_findings(b));

    nlohmann::ordered_json cases = nlohmann::ordered_json::array();
    bool all_ok = true;
    // The oracle's one pass over the logits, shared by every (loss, reduction) case.
    const std::vector<oracle::RowStats> logits_stats = oracle::oracle_logits_stats(b);
    CheckProgress progress(
        ctx,
        static_cast<int64_t>(losses.size() * reduces.size() * o.cp_sizes.size() * impls.size()),
        b.num_response_tokens());
    for (LossKind loss : losses) {
      for (Reduction reduce : reduces) {
        LossSpec spec;
        spec.loss = loss;
        spec.reduce = reduce;
        spec.policy = policy;
        spec.eps_low = o.eps_low;
        spec.eps_high = o.eps_high;
        if (!o.contract.empty()) spec.global_batch_size = global_batch_size;
        const LossInput which = loss_input(b, loss);
        const HostArray& input = which == LossInput::kLogits     ? *b.logits
                                 : which == LossInput::kLogProbs ? b.per_token.at("log_probs")
                                                                 : b.per_token.at("token_loss");
        oracle::CheckSettings settings;
        settings.rtol = o.rtol;
        settings.atol = o.atol;
        settings.judge_denominator = o.contract.empty();
        spec = oracle::with_rounding_slack(spec, input.dtype, settings);
        const oracle::OracleLoss want =
            oracle::oracle_loss(b, spec, /*with_logits_grad=*/false, &logits_stats);
        out << fmt::format(
            "\nloss {} (d/d {} [{}] {}), reduce {}: oracle loss {:.10g}, denominator {}{}\n",
            loss_kind_name(loss), loss_input_name(want.input), fmt::join(input.shape, ", "),
            dtype_name(input.dtype), reduction_name(reduce), want.loss, want.denominator,
            want.no_signal
                ? " (zero effective tokens: a no-signal step; loss and gradient must be exactly 0)"
                : "");
        out << fmt::format("  {:>3}  {:<7} {:<22} {:<34} {:<28} {}\n", "cp", "impl",
                           "denominator got/want", "loss got (|diff| <= bound)",
                           "grad mismatched/checked", "max |diff|");
        for (int64_t cp : o.cp_sizes) {
          for (trainer::Impl impl : impls) {
            trainer::CandidateInput in;
            in.batch = &b;
            in.spec = spec;
            in.cp = cp;
            in.layout = layout;
            in.impl = impl;
            in.device = device;
            Contract contract;
            if (!o.contract.empty()) {
              contract = parse_contract(o.contract, reduce);
              in.contract = &contract;
              in.placement = &placement;
              in.tp = o.tp;
              in.global_batch_size = global_batch_size;
            }
            // The candidate streams its gradient into the judge block by block (SPEC §5 "Scale").
            const int64_t vocab = input.shape.size() == 2 ? input.shape[1] : 1;
            oracle::CaseJudge judge(b, spec, want, input.dtype,
                                    trainer::arithmetic_of(impl, vocab, device), settings,
                                    [&](int64_t rows_done) { progress.at(rows_done); });
            in.sink = judge.sink();
            const trainer::CandidateOutput got = trainer::run_candidate(in);
            progress.case_done();
            // Under a contract the trainer's own count is shown, not judged (slime's full-sample
            // count is cp·N by design): its loss and gradient say whether the tokens are weighted
            // right.
            const oracle::CheckCase c = judge.finish(got);
            const bool den_ok = c.den_ok, loss_ok = c.loss_ok, flag_ok = c.flag_ok, ok = c.ok();
            const double bound = c.loss_bound, loss_diff = c.loss_diff;
            const oracle::GradComparison& g = c.grad;
            const oracle::Tolerance& grad_tol = c.grad_tol;
            const std::vector<std::string>& why = c.why;
            all_ok &= ok;
            out << fmt::format("  {:>3}  {:<7} {:<22} {:<34} {:<28} {:<10.3g} {}\n", cp,
                               trainer::impl_name(impl),
                               fmt::format("{} / {} {}", got.denominator, want.denominator,
                                           den_ok ? "ok" : "WRONG"),
                               fmt::format("{:.10g} ({:.2g} {} {:.2g})", got.loss, loss_diff,
                                           loss_ok ? "<=" : ">", bound),
                               fmt::format("{}/{} ({:.2f}%)", g.mismatched, g.checked,
                                           g.checked ? 100.0 * g.mismatched / g.checked : 0.0),
                               g.max_abs_diff, ok ? "pass" : "FAIL");
            for (const auto& w : why) out << "       " << w << "\n";
            const std::string name = fmt::format(
                "cp={} {} {} {}{}", cp, loss_kind_name(loss), reduction_name(reduce), got.dtype,
                impl == trainer::Impl::kTorch ? ""
                                              : fmt::format(" [{}]", trainer::impl_name(impl)));
            report.add_case({"lossguard.check", name + " denominator", den_ok,
                             den_ok ? "" : why.front(), false});
            report.add_case({"lossguard.check", name + " loss", loss_ok,
                             loss_ok ? ""
                                     : fmt::format("|{} - {}| = {} > {}", got.loss, want.loss,
                                                   loss_diff, bound),
                             false});
            report.add_case({"lossguard.check", name + " gradient", g.ok(),
                             g.ok() ? ""
                                    : fmt::format("{}/{} mismatched; {}", g.mismatched, g.checked,
                                                  oracle::describe(g.worst)),
                             false});
            if (got.skip_flag >= 0) {
              report.add_case({"lossguard.check", name + " skip flag", flag_ok,
                               flag_ok ? "" : why.back(), false});
            }
            cases.push_back(
                {{"cp", cp},
                 {"impl", trainer::impl_name(impl)},
                 {"loss", loss_kind_name(loss)},
                 {"reduce", reduction_name(reduce)},
                 {"dtype", got.dtype},
                 {"input", loss_input_name(want.input)},
                 {"denominator",
                  {{"want", want.denominator}, {"got", got.denominator}, {"ok", den_ok}}},
                 {"loss_value",
                  {{"want", want.loss},
                   {"got", got.loss},
                   {"abs_diff", loss_diff},
                   {"bound", bound},
                   {"bound_default", c.loss_bound_default},
                   {"bound_derived", c.loss_bound_derived >= 0
                                         ? nlohmann::ordered_json(c.loss_bound_derived)
                                         : nlohmann::ordered_json(nullptr)},
                   {"ok", loss_ok}}},
                 {"grad",
                  {{"checked", g.checked},
                   {"mismatched", g.mismatched},
                   {"masked_nonzero", g.masked_nonzero},
                   {"not_compared", g.not_compared},
                   {"max_abs_diff", g.max_abs_diff},
                   {"max_rel_diff", g.max_rel_diff},
                   {"worst", location_json(g.worst)},
                   {"worst_relative", location_json(g.worst_relative)},
                   {"rtol", grad_tol.rtol},
                   {"atol", grad_tol.atol},
                   // From logits with the default tolerances, each element's absolute slack is
                   // |c| u + half the smallest subnormal (c its token's weight), not atol.
                   {"atol_scaled_by_weight",
                    want.input == LossInput::kLogits && o.atol < 0 && o.rtol < 0},
                   {"bounds", bounds_json(c.grad_bounds)},
                   {"ok", g.ok()}}},
                 {"no_signal", want.no_signal},
                 {"skip_flag", got.skip_flag < 0 ? nlohmann::ordered_json(nullptr)
                                                 : nlohmann::ordered_json(got.skip_flag == 1)},
                 {"ok", ok}});
          }
        }
      }
    }
    // `given` takes the dump's token_loss as the truth: it must itself be the per-token loss the
    // oracle computes from the dump's logits or log-probs.
    nlohmann::ordered_json token_loss_json = nullptr;
    if (std::find(losses.begin(), losses.end(), LossKind::kGiven) != losses.end()) {
      LossSpec tl_spec;
      tl_spec.eps_low = o.eps_low;
      tl_spec.eps_high = o.eps_high;
      oracle::CheckSettings tl_settings;
      tl_settings.rtol = o.rtol;
      tl_settings.atol = o.atol;
      if (o.token_loss_is == "nll") {
        tl_settings.token_loss_is = LossKind::kNll;
      } else if (o.token_loss_is == "ppo-clip") {
        tl_settings.token_loss_is = LossKind::kPpoClip;
      }
      const oracle::TokenLossCheck t = oracle::check_token_loss(
          b, tl_spec, tl_settings,
          trainer::arithmetic_of(trainer::Impl::kTorch, b.logits ? b.vocab_size() : 1,
                                 kernels::Device::kCpu),
          &logits_stats);
      if (t.ran) {
        const std::string where =
            t.ok() ? ""
                   : fmt::format(
                         "; worst: sample {}, response index {}: token_loss {:.9g}, oracle {:.9g}",
                         t.worst.sample, t.worst.response_index, t.worst.got, t.worst.want);
        const std::string what =
            !t.matches.empty()
                ? fmt::format("the per-token {} loss", t.matches)
                : "neither the per-token nll nor the ppo-clip loss of the dump's inputs";
        out << fmt::format(
            "\ntoken_loss: {}{} ({} tokens with mask 1; {} differ from the nll{}){}\n",
            t.judged() ? (t.ok() ? "" : "FAIL: ")
                       : "(not judged: it may carry KL or entropy terms; --token-loss-is states "
                         "what it is) ",
            t.judged() && !t.ok()
                ? fmt::format("not the per-token {} loss the dump's inputs give ({})",
                              o.token_loss_is, what)
                : what,
            t.checked, t.mismatched_nll,
            t.mismatched_ppo >= 0 ? fmt::format(", {} from the ppo-clip loss", t.mismatched_ppo)
                                  : "",
            where);
        if (t.judged()) {
          report.add_case({"lossguard.check",
                           fmt::format("token_loss is the per-token {} loss of the dump's inputs",
                                       o.token_loss_is),
                           t.ok(), t.ok() ? "" : where.substr(2), false});
        } else if (t.matches.empty()) {
          report.add_findings({{"token_loss_not_plain",
                                fmt::format("token_loss is neither the per-token nll nor the "
                                            "ppo-clip loss of the dump's inputs (a KL, entropy or "
                                            "other term?){}",
                                            where),
                                {{"worst", location_json(t.worst)}}}});
        }
        token_loss_json = {
            {"matches", t.matches.empty() ? nlohmann::ordered_json(nullptr)
                                          : nlohmann::ordered_json(t.matches)},
            {"checked", t.checked},
            {"mismatched_nll", t.mismatched_nll},
            {"mismatched_ppo_clip", t.mismatched_ppo >= 0 ? nlohmann::ordered_json(t.mismatched_ppo)
                                                          : nlohmann::ordered_json(nullptr)},
            {"worst", t.matches.empty() ? location_json(t.worst) : nlohmann::ordered_json(nullptr)},
            {"stated", t.judged() ? nlohmann::ordered_json(o.token_loss_is)
                                  : nlohmann::ordered_json(nullptr)},
            {"ok", t.judged() ? nlohmann::ordered_json(t.ok()) : nlohmann::ordered_json(nullptr)}};
        all_ok &= t.ok();
      }
    }
    const auto findings = oracle::batch_findings(b, 20, &logits_stats);
    report.add_findings(findings);
    print_findings(out, report.findings());
    out << fmt::format("\nverdict: {}\n", all_ok ? "pass: the candidate matches the oracle"
                                                 : "FAIL: the candidate differs from the oracle");
    auto& res = report.results();
    res["policy"] = policy_name(policy);
    res["cp_sizes"] = o.cp_sizes;
    res["impls"] = o.impls;
    res["device"] = o.device;
    res["cases"] = cases;
    res["token_loss"] = token_loss_json;
    report.verified();
    if (!all_ok) report.fail();
  });
}

}  // namespace

void register_check(CLI::App& root, Commands& commands) {
  auto cmd = std::make_unique<Command>();
  auto opts = std::make_shared<CheckOptions>();
  CLI::App* app = root.add_subcommand("check",
                                      "Candidate (a CP-sharded trainer: LibTorch in the dump "
                                      "dtype, or lossguard's kernels) vs the float64 oracle: "
                                      "denominators, loss, gradients");
  cmd->app = app;
  app->footer(
      "Losses: nll (from logits, else log_probs), ppo-clip (log_probs, old_log_probs, advantages), "
      "given (the dump's token_loss, whatever it holds; whether it is the per-token nll or "
      "ppo-clip "
      "loss of\nits inputs is a finding, and a check with --token-loss-is nll|ppo-clip).\n"
      "Reductions: per-token, sample-mean, token-mean, seq-mean-token-sum, seq-mean-token-mean, "
      "seq-mean-token-sum-norm,\n"
      "or all. Tolerances: PyTorch's per dtype (fp16 1e-3/1e-5, bf16 1.6e-2/1e-5, fp32 "
      "1.3e-6/1e-5, fp64 1e-7/1e-7),\n"
      "tightened from logits to the bounds derived from each candidate's arithmetic (JSON: "
      "loss_value.bound_derived, grad.bounds);\n"
      "--rtol/--atol replace both. The gradient streams block by block: memory stays about one "
      "block whatever the dump's size.\n"
      "Examples:\n  lossguard check batch.safetensors --cp 1,2,4,8 --loss nll,ppo-clip --reduce "
      "all\n"
      "  lossguard check batch.safetensors --policy legacy     # CP=1 and CP>1 disagree on empty "
      "responses\n"
      "  lossguard check batch.safetensors --impl torch,kernels # both candidates against the "
      "oracle");
  add_dump_options(*app, opts->dumps, false);
  add_step_option(*app, opts->dumps);
  app->add_option("--cp", opts->cp_sizes, "CP sizes (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--loss", opts->losses, "Losses (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--reduce", opts->reduces, "Reductions (comma-separated, or all)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--policy", opts->policy, "The trainer's counting policy: fixed, legacy or slime")
      ->capture_default_str();
  app->add_option("--rtol", opts->rtol, "Relative tolerance (default: per dtype)");
  app->add_option("--atol", opts->atol, "Absolute tolerance (default: per dtype)");
  app->add_option("--eps-low", opts->eps_low, "ppo-clip lower clip")->capture_default_str();
  app->add_option("--eps-high", opts->eps_high, "ppo-clip upper clip")->capture_default_str();
  app->add_option("--impl", opts->impls,
                  "Candidate implementations (comma-separated): torch (LibTorch autograd in the "
                  "dump's dtype), "
                  "kernels (lossguard's counting and fused log-prob/loss/gradient kernels, float "
                  "arithmetic, "
                  "and the zero-token flag reduced on the device)")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--device", opts->device, "Where the kernels run: cpu or cuda")
      ->capture_default_str();
  add_layout_options(*app, opts->layout);
  app->add_option(
      "--contract", opts->contract,
      "Train the candidate under a normalisation contract (a preset or key=value,...; see "
      "`lossguard weights --help`) over the --dp x --microbatches placement, and compare its "
      "gradient with the objective's");
  add_placement_options(*app, opts->placement, false);
  app->add_option("--tp", opts->tp,
                  "Tensor-parallel size (for contracts that count over the world group)")
      ->capture_default_str();
  app->add_option("--global-batch-size", opts->global_batch_size,
                  "B of the sample-mean objectives (default: the dump's global_batch_size, else "
                  "its samples)")
      ->check(CLI::Range(int64_t{1}, kMaxCount));
  app->add_option("--token-loss-is", opts->token_loss_is,
                  "State what the dump's token_loss is (nll or ppo-clip of its inputs): a check "
                  "then (default: a finding, since real per-token losses carry KL or entropy "
                  "terms)")
      ->check(CLI::IsMember({"nll", "ppo-clip"}));
  add_output_options(*app, cmd->output);
  cmd->run = [opts](Report& r, Context& c) { run_check(*opts, r, c); };
  commands.push_back(std::move(cmd));
}

}  // namespace lossguard::cli
