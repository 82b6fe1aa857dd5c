// `lossguard check`: the candidate (a CP-sharded trainer: LibTorch in the dump's dtype, or the
// kernels) against the float64 oracle, for every CP size, loss and reduction: denominator (exact),
// loss value, gradient.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

#include "cli/command.h"
#include "cli/inputs.h"
#include "cli/placement_options.h"
#include "core/contract.h"
#include "core/errors.h"
#include "kernels/device.h"
#include "kernels/device_info.h"
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

std::string location_text(const oracle::GradLocation& l) {
  return fmt::format("sample {}, response index {}{}, CP rank {} chunk {}: got {:.9g}, want {:.9g}",
                     l.sample, l.response_index,
                     l.vocab_index >= 0 ? fmt::format(", vocab index {}", l.vocab_index) : "",
                     l.cp_rank, l.chunk, l.got, l.want);
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
  LoadedBatch loaded = load_batch(o.dumps, report, ctx);
  const Batch& b = loaded.batch;
  if (b.num_samples() == 0) throw UnverifiedError("the dumps hold no samples");
  // check --contract: each micro-batch of each DP rank trained under the contract (SPEC §9).
  const Placement placement = o.placement.placement(b, o.dumps.dp_shards);
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

  // Samples without effective tokens: what `legacy` and `slime` over-count, and the old slicing
  // bug.
  std::vector<int64_t> zero_samples, empty_r;
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    if (b.mask_sum(i) == 0) zero_samples.push_back(i);
    if (b.response_lengths[i] == 0 && b.total_lengths[i] > 0) empty_r.push_back(i);
  }
  if (policy == Policy::kLegacy && !empty_r.empty()) {
    const int64_t i = empty_r.front();
    report.add_findings(
        {{"legacy_response_slicing",
          fmt::format("legacy response slicing: targets taken as tokens[-R:] give {} with R = 0 "
                      "all T = {} tokens "
                      "as targets for its 0 logits rows (samples with R = 0: {})",
                      b.describe_sample(i), b.total_lengths[i], oracle::format_index_list(empty_r)),
          {{"samples", empty_r}}}});
  }

  nlohmann::ordered_json cases = nlohmann::ordered_json::array();
  bool all_ok = true;
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
      oracle::Tolerance tol = oracle::default_tolerance(input.dtype);
      if (o.rtol >= 0) tol.rtol = o.rtol;
      if (o.atol >= 0) tol.atol = o.atol;
      // rho = exp(lp - old) and the clip bounds are each rounded in the dtype: a few unit
      // round-offs.
      spec.rho_rel_error = std::max(tol.rtol, 4.0 * oracle::unit_roundoff(input.dtype));
      const oracle::OracleLoss want = oracle::oracle_loss(b, spec);
      int64_t terms = 0;
      for (double c : want.coeff) terms += c != 0.0;
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
          const trainer::CandidateOutput got = trainer::run_candidate(in);
          // Under a contract the trainer's own count is shown, not judged (slime's full-sample
          // count is cp·N by design): its loss and gradient say whether the tokens are weighted
          // right.
          const bool den_ok = in.contract != nullptr || got.denominator == want.denominator;
          const double bound = oracle::loss_tolerance(
              want.loss, want.term_scale, terms, input.dtype,
              input.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32, tol);
          const double loss_diff = std::fabs(got.loss - want.loss);
          const bool loss_ok = loss_diff <= bound && (!want.no_signal || got.loss == 0.0);
          const oracle::Tolerance grad_tol =
              o.rtol >= 0 ? tol
                          : oracle::gradient_tolerance(input.dtype, static_cast<int>(loss), tol);
          const oracle::GradComparison g = oracle::compare_gradients(
              b, want.grad, got.grad, want.grad_cols, got.row_rank, got.row_chunk, grad_tol,
              loss == LossKind::kPpoClip ? &want.near_clip_boundary : nullptr,
              want.input == LossInput::kLogits && o.rtol < 0 ? &want.coeff : nullptr,
              oracle::unit_roundoff(input.dtype));
          // The kernels' zero-token flag, reduced on the device, must say what the oracle says.
          const bool flag_ok = got.skip_flag < 0 || (got.skip_flag == 1) == want.no_signal;
          const bool ok = den_ok && loss_ok && g.ok() && flag_ok;
          all_ok &= ok;
          out << fmt::format(
              "  {:>3}  {:<7} {:<22} {:<34} {:<28} {:<10.3g} {}\n", cp, trainer::impl_name(impl),
              fmt::format("{} / {} {}", got.denominator, want.denominator, den_ok ? "ok" : "WRONG"),
              fmt::format("{:.10g} ({:.2g} {} {:.2g})", got.loss, loss_diff, loss_ok ? "<=" : ">",
                          bound),
              fmt::format("{}/{} ({:.2f}%)", g.mismatched, g.checked,
                          g.checked ? 100.0 * g.mismatched / g.checked : 0.0),
              g.max_abs_diff, ok ? "pass" : "FAIL");
          std::vector<std::string> why;
          if (!den_ok) {
            std::string reason;
            if (got.denominator - want.denominator == static_cast<int64_t>(zero_samples.size()) &&
                !zero_samples.empty()) {
              reason = fmt::format(
                  ": +1 for each sample without effective tokens (policy {} counts max(m, 1)): {}",
                  policy_name(policy), oracle::format_index_list(zero_samples));
            }
            why.push_back(fmt::format("denominator {} differs from the oracle's {}{}",
                                      got.denominator, want.denominator, reason));
          }
          if (g.mismatched > 0) why.push_back("worst gradient: " + location_text(g.worst));
          if (g.not_compared > 0) {
            why.push_back(
                fmt::format("note: {} token(s) with rho within rounding of a clip boundary: "
                            "gradient not compared",
                            g.not_compared));
          }
          if (g.masked_nonzero > 0)
            why.push_back(fmt::format("{} gradient entries of masked tokens are not exactly zero",
                                      g.masked_nonzero));
          if (want.no_signal && got.loss != 0.0)
            why.push_back(fmt::format("a zero-token batch must give loss 0, got {}", got.loss));
          if (!flag_ok) {
            why.push_back(fmt::format(
                "the device zero-token flag says {} but the batch has {} effective tokens",
                got.skip_flag == 1 ? "skip" : "step", want.no_signal ? "no" : "some"));
          } else if (got.skip_flag == 1) {
            why.push_back(
                "zero-token flag, reduced on the device and read once: skip (no optimizer.step(), "
                "no LR step)");
          }
          for (const auto& w : why) out << "       " << w << "\n";
          const std::string name = fmt::format(
              "cp={} {} {} {}{}", cp, loss_kind_name(loss), reduction_name(reduce), got.dtype,
              impl == trainer::Impl::kTorch ? "" : fmt::format(" [{}]", trainer::impl_name(impl)));
          report.add_case(
              {"lossguard.check", name + " denominator", den_ok, den_ok ? "" : why.front(), false});
          report.add_case(
              {"lossguard.check", name + " loss", loss_ok,
               loss_ok ? ""
                       : fmt::format("|{} - {}| = {} > {}", got.loss, want.loss, loss_diff, bound),
               false});
          report.add_case({"lossguard.check", name + " gradient", g.ok(),
                           g.ok() ? ""
                                  : fmt::format("{}/{} mismatched; {}", g.mismatched, g.checked,
                                                location_text(g.worst)),
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
                 {"ok", g.ok()}}},
               {"no_signal", want.no_signal},
               {"skip_flag", got.skip_flag < 0 ? nlohmann::ordered_json(nullptr)
                                               : nlohmann::ordered_json(got.skip_flag == 1)},
               {"ok", ok}});
        }
      }
    }
  }
  const auto findings = oracle::batch_findings(b);
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
  report.verified();
  if (!all_ok) report.fail();
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
      "given (token_loss).\n"
      "Reductions: per-token, sample-mean, token-mean, seq-mean-token-sum, seq-mean-token-mean, "
      "seq-mean-token-sum-norm,\n"
      "or all. Default tolerances per dtype (docs/semantics.md §5): fp16 1e-3/1e-5, bf16 "
      "1.6e-2/1e-5, fp32 1.3e-6/1e-5, fp64 1e-7/1e-7.\n"
      "Examples:\n  lossguard check batch.safetensors --cp 1,2,4,8 --loss nll,ppo-clip --reduce "
      "all\n"
      "  lossguard check batch.safetensors --policy legacy     # CP=1 and CP>1 disagree on empty "
      "responses\n"
      "  lossguard check batch.safetensors --impl torch,kernels # both candidates against the "
      "oracle");
  add_dump_options(*app, opts->dumps, false);
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
  app->add_option(
      "--global-batch-size", opts->global_batch_size,
      "B of the sample-mean objectives (default: the dump's global_batch_size, else its samples)");
  add_output_options(*app, cmd->output);
  cmd->run = [opts](Report& r, Context& c) { run_check(*opts, r, c); };
  commands.push_back(std::move(cmd));
}

}  // namespace lossguard::cli
