// `check`'s renderers (cli/check_render.h).
#include "cli/check_render.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace lossguard::cli {

namespace {

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

nlohmann::ordered_json case_json(const oracle::CheckGroup& g, const oracle::CheckCaseResult& k) {
  const oracle::CheckCase& c = k.verdict;
  const oracle::GradComparison& grad = c.grad;
  return {
      {"cp", k.cp},
      {"impl", k.impl},
      {"loss", loss_kind_name(g.loss)},
      {"reduce", reduction_name(g.reduce)},
      {"dtype", k.dtype},
      {"input", loss_input_name(g.input)},
      {"denominator", {{"want", g.want_denominator}, {"got", k.denominator}, {"ok", c.den_ok}}},
      {"loss_value",
       {{"want", g.want_loss},
        {"got", k.loss},
        {"abs_diff", c.loss_diff},
        {"bound", c.loss_bound},
        {"bound_default", c.loss_bound_default},
        {"bound_derived", c.loss_bound_derived >= 0 ? nlohmann::ordered_json(c.loss_bound_derived)
                                                    : nlohmann::ordered_json(nullptr)},
        {"ok", c.loss_ok}}},
      {"grad",
       {{"checked", grad.checked},
        {"mismatched", grad.mismatched},
        {"masked_nonzero", grad.masked_nonzero},
        {"not_compared", grad.not_compared},
        {"max_abs_diff", grad.max_abs_diff},
        {"max_rel_diff", grad.max_rel_diff},
        {"worst", oracle::location_json(grad.worst)},
        {"worst_relative", oracle::location_json(grad.worst_relative)},
        {"rtol", c.grad_tol.rtol},
        {"atol", c.grad_tol.atol},
        {"atol_scaled_by_weight", c.atol_scaled_by_weight},
        {"bounds", bounds_json(c.grad_bounds)},
        {"ok", grad.ok()}}},
      {"no_signal", g.no_signal},
      {"skip_flag", k.skip ? nlohmann::ordered_json(*k.skip) : nlohmann::ordered_json(nullptr)},
      {"ok", c.ok()}};
}

// One (loss, reduction): its heading, a row per case, its JUnit cases and JSON.
void render_group(const oracle::CheckGroup& g, Report& report, std::ostream& out,
                  nlohmann::ordered_json& cases) {
  out << fmt::format(
      "\nloss {} (d/d {} [{}] {}), reduce {}: oracle loss {:.10g}, denominator {}{}\n",
      loss_kind_name(g.loss), loss_input_name(g.input), fmt::join(g.input_shape, ", "),
      dtype_name(g.input_dtype), reduction_name(g.reduce), g.want_loss, g.want_denominator,
      g.no_signal
          ? " (zero effective tokens: a no-signal step; loss and gradient must be exactly 0)"
          : "");
  out << fmt::format("  {:>3}  {:<7} {:<22} {:<34} {:<28} {}\n", "cp", "impl",
                     "denominator got/want", "loss got (|diff| <= bound)",
                     "grad mismatched/checked", "max |diff|");
  for (const oracle::CheckCaseResult& k : g.cases) {
    const oracle::CheckCase& c = k.verdict;
    const oracle::GradComparison& grad = c.grad;
    out << fmt::format(
        "  {:>3}  {:<7} {:<22} {:<34} {:<28} {:<10.3g} {}\n", k.cp, k.impl,
        fmt::format("{} / {} {}", k.denominator, g.want_denominator, c.den_ok ? "ok" : "WRONG"),
        fmt::format("{:.10g} ({:.2g} {} {:.2g})", k.loss, c.loss_diff, c.loss_ok ? "<=" : ">",
                    c.loss_bound),
        fmt::format("{}/{} ({:.2f}%)", grad.mismatched, grad.checked,
                    grad.checked ? 100.0 * grad.mismatched / grad.checked : 0.0),
        grad.max_abs_diff, c.ok() ? "pass" : "FAIL");
    for (const auto& w : c.why) out << "       " << w << "\n";
    const std::string name =
        fmt::format("cp={} {} {} {}{}", k.cp, loss_kind_name(g.loss), reduction_name(g.reduce),
                    k.dtype, k.default_impl ? "" : fmt::format(" [{}]", k.impl));
    report.add_case(
        {"lossguard.check", name + " denominator", c.den_ok, c.den_ok ? "" : c.why.front(), false});
    report.add_case({"lossguard.check", name + " loss", c.loss_ok,
                     c.loss_ok ? ""
                               : fmt::format("|{} - {}| = {} > {}", k.loss, g.want_loss,
                                             c.loss_diff, c.loss_bound),
                     false});
    report.add_case({"lossguard.check", name + " gradient", grad.ok(),
                     grad.ok() ? ""
                               : fmt::format("{}/{} mismatched; {}", grad.mismatched, grad.checked,
                                             oracle::describe(grad.worst)),
                     false});
    if (k.skip) {
      report.add_case({"lossguard.check", name + " skip flag", c.flag_ok,
                       c.flag_ok ? "" : c.why.back(), false});
    }
    cases.push_back(case_json(g, k));
  }
}

nlohmann::ordered_json render_token_loss(const oracle::TokenLossCheck& t, const CheckView& view,
                                         Report& report, std::ostream& out) {
  const std::string where = oracle::token_loss_worst_text(t);
  const std::string what =
      !t.matches.empty() ? fmt::format("the per-token {} loss", t.matches)
                         : "neither the per-token nll nor the ppo-clip loss of the dump's inputs";
  out << fmt::format(
      "\ntoken_loss: {}{} ({} tokens with mask 1; {} differ from the nll{}){}\n",
      t.judged() ? (t.ok() ? "" : "FAIL: ")
                 : "(not judged: it may carry KL or entropy terms; --token-loss-is states "
                   "what it is) ",
      t.judged() && !t.ok() ? fmt::format("not the per-token {} loss the dump's inputs give ({})",
                                          view.token_loss_is, what)
                            : what,
      t.checked, t.mismatched_nll,
      t.mismatched_ppo >= 0 ? fmt::format(", {} from the ppo-clip loss", t.mismatched_ppo) : "",
      where);
  if (t.judged()) {
    report.add_case({"lossguard.check",
                     fmt::format("token_loss is the per-token {} loss of the dump's inputs",
                                 view.token_loss_is),
                     t.ok(), t.ok() ? "" : where.substr(2), false});
  }
  using J = nlohmann::ordered_json;
  return {{"matches", t.matches.empty() ? J(nullptr) : J(t.matches)},
          {"checked", t.checked},
          {"mismatched_nll", t.mismatched_nll},
          {"mismatched_ppo_clip", t.mismatched_ppo >= 0 ? J(t.mismatched_ppo) : J(nullptr)},
          {"worst", t.matches.empty() ? oracle::location_json(t.worst) : J(nullptr)},
          {"stated", t.judged() ? J(view.token_loss_is) : J(nullptr)},
          {"ok", t.judged() ? J(t.ok()) : J(nullptr)}};
}

}  // namespace

void render_check_heading(const Batch& b, const CheckView& view, std::ostream& out) {
  const CheckPlan& plan = *view.plan;
  out << fmt::format("lossguard check: {} samples, policy {}, CP sizes {}, candidate {}{}\n",
                     b.num_samples(), policy_name(plan.policy), fmt::join(plan.cp_sizes, ", "),
                     fmt::join(view.impl_names, " and "),
                     plan.device == kernels::Device::kCuda ? " (kernels on CUDA)" : "");
}

void render_check(const oracle::CheckResult& r, const CheckView& view, Report& report,
                  Context& ctx) {
  std::ostream& out = ctx.out;
  const CheckPlan& plan = *view.plan;
  nlohmann::ordered_json cases = nlohmann::ordered_json::array();
  for (const oracle::CheckGroup& g : r.groups) render_group(g, report, out, cases);
  nlohmann::ordered_json token_loss_json = nullptr;
  if (r.token_loss) token_loss_json = render_token_loss(*r.token_loss, view, report, out);
  report.add_findings(r.findings);
  print_findings(out, r.findings);
  out << fmt::format("\nverdict: {}\n", r.ok() ? "pass: the candidate matches the oracle"
                                               : "FAIL: the candidate differs from the oracle");
  auto& res = report.results();
  res["policy"] = policy_name(plan.policy);
  res["cp_sizes"] = plan.cp_sizes;
  res["impls"] = view.impl_names;
  res["device"] = view.device_name;
  res["cases"] = cases;
  res["token_loss"] = token_loss_json;
}

}  // namespace lossguard::cli
