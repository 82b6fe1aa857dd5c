// `lossguard check`: the candidate (a CP-sharded trainer: LibTorch in the dump's dtype, or the
// kernels) against the float64 oracle, for every CP size, loss and reduction: denominator (exact),
// loss value, gradient. cli/check_run.cpp runs the cases, oracle/check/check.h judges them,
// cli/check_render.cpp prints the result.
#include <fmt/format.h>

#include <algorithm>
#include <optional>

#include "cli/check_render.h"
#include "cli/check_run.h"
#include "cli/command.h"
#include "cli/inputs.h"
#include "cli/mode_option.h"
#include "cli/placement_options.h"
#include "cli/steps.h"
#include "core/errors.h"
#include "kernels/device_info.h"
#include "oracle/check/compare.h"

namespace lossguard::cli {

namespace {

struct CheckOptions {
  DumpOptions dumps;
  std::vector<int64_t> cp_sizes = {1, 2, 4};
  std::vector<std::string> losses = {"nll"};
  std::vector<std::string> reduces = {"per-token"};
  std::string policy = "fixed";
  std::optional<double> rtol, atol;  // none: the per-dtype defaults and derived bounds
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

CheckPlan plan_of(const CheckOptions& o) {
  CheckPlan plan;
  plan.policy = policy_from_option(o.policy);
  for (const auto& l : o.losses) plan.losses.push_back(mode_from_option<LossKind>("--loss", l));
  for (const auto& r : o.reduces) {
    if (r == "all") {
      plan.reduces = all_reductions();
      break;
    }
    plan.reduces.push_back(mode_from_option<Reduction>("--reduce", r));
  }
  require_sizes_at_least_1("--cp", o.cp_sizes);
  plan.cp_sizes = o.cp_sizes;
  for (const auto& name : o.impls)
    plan.impls.push_back(mode_from_option<trainer::Impl>("--impl", name));
  plan.device = mode_from_option<kernels::Device>("--device", o.device);
  plan.layout = o.layout.layout();
  plan.eps_low = o.eps_low;
  plan.eps_high = o.eps_high;
  plan.settings.rtol = o.rtol;
  plan.settings.atol = o.atol;
  plan.settings.under_contract = !o.contract.empty();
  if (!o.token_loss_is.empty())
    plan.settings.token_loss_is = mode_from_option<LossKind>("--token-loss-is", o.token_loss_is);
  plan.contract = o.contract;
  plan.tp = o.tp;
  return plan;
}

void run_check(const CheckOptions& o, Report& report, Context& ctx) {
  const CheckPlan plan = plan_of(o);
  kernels::require_device(plan.device);
  // LibTorch starts up while the dump is read and the oracle makes its pass over the logits.
  std::optional<trainer::TorchPreload> torch_loading;
  if (std::find(plan.impls.begin(), plan.impls.end(), trainer::Impl::kTorch) != plan.impls.end())
    torch_loading.emplace();
  LoadedBatch loaded = load_batch(o.dumps, report, ctx);
  oracle::require_samples(loaded.batch);
  const CheckView view{&plan, o.impls, o.device, o.token_loss_is};
  run_per_step(loaded.batch, o.dumps.step, report, ctx, [&](const StepView& v) {
    const Batch& b = *v.batch;
    // check --contract: each micro-batch of each DP rank trained under the contract (SPEC §9), on
    // the trainer's own layout where the dump records it.
    const Placement placement =
        v.layout != nullptr ? *v.layout : o.placement.placement(b, o.dumps.dp_shards);
    render_check_heading(b, view, ctx.out);
    const oracle::CheckResult result =
        run_check_step(plan, b, placement, global_batch_size_of(o.global_batch_size, b), ctx);
    render_check(result, view, report, ctx);
    report.record(result.judgement());
  });
}

}  // namespace

constexpr const char* kFooter =
    R"(Losses: nll (from logits, else log_probs), ppo-clip (log_probs, old_log_probs,
advantages), given (the dump's token_loss, whatever it holds; whether it is the per-token nll or
ppo-clip loss of its inputs is a finding, and a check with --token-loss-is nll|ppo-clip).
Reductions: {}, or all.
Tolerances: PyTorch's per dtype ({}), tightened from logits to
the bounds derived from each candidate's arithmetic (JSON: loss_value.bound_derived, grad.bounds);
--rtol/--atol replace both. The gradient streams block by block: memory stays about one block
whatever the dump's size.
Examples:
  lossguard check batch.safetensors --cp 1,2,4,8 --loss nll,ppo-clip --reduce all
  lossguard check batch.safetensors --policy legacy     # CP=1 and CP>1 disagree on empty responses
  lossguard check batch.safetensors --impl torch,kernels # both candidates against the oracle)";

void register_check(CLI::App& root, Commands& commands) {
  auto cmd = std::make_unique<Command>();
  auto opts = std::make_shared<CheckOptions>();
  CLI::App* app = root.add_subcommand("check",
                                      "Candidate (a CP-sharded trainer: LibTorch in the dump "
                                      "dtype, or lossguard's kernels) vs the float64 oracle: "
                                      "denominators, loss, gradients");
  cmd->app = app;
  app->footer(fmt::format(kFooter, mode_choices<Reduction>(), oracle::default_tolerances_text()));
  add_dump_options(*app, opts->dumps, false);
  add_step_option(*app, opts->dumps);
  add_list_option(*app, "--cp", opts->cp_sizes, "CP sizes (comma-separated)");
  add_list_option(*app, "--loss", opts->losses, "Losses (comma-separated)");
  add_list_option(*app, "--reduce", opts->reduces, "Reductions (comma-separated, or all)");
  app->add_option("--policy", opts->policy, "The trainer's counting policy: fixed, legacy or slime")
      ->capture_default_str();
  app->add_option("--rtol", opts->rtol, "Relative tolerance (default: per dtype)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--atol", opts->atol, "Absolute tolerance (default: per dtype)")
      ->check(CLI::NonNegativeNumber);
  app->add_option("--eps-low", opts->eps_low, "ppo-clip lower clip")->capture_default_str();
  app->add_option("--eps-high", opts->eps_high, "ppo-clip upper clip")->capture_default_str();
  add_list_option(*app, "--impl", opts->impls,
                  "Candidate implementations (comma-separated): torch (LibTorch autograd in the "
                  "dump's dtype), kernels (lossguard's counting and fused log-prob/loss/gradient "
                  "kernels, float arithmetic, and the zero-token flag reduced on the device)");
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
  add_global_batch_size_option(*app, opts->global_batch_size);
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
