// Check verdicts: exact denominators, the loss within its derived bound, every gradient element
// within its tolerance, masked rows exactly zero, and the kernels' device zero-token flag (SPEC §4,
// §5).
#include "oracle/check/check.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "core/format.h"
#include "oracle/check/loss.h"
#include "oracle/count/denominators.h"

namespace lossguard::oracle {

namespace {

Tolerance base_tolerance(DType input, const CheckSettings& s) {
  Tolerance t = default_tolerance(input);
  if (s.rtol) t.rtol = *s.rtol;
  if (s.atol) t.atol = *s.atol;
  return t;
}

}  // namespace

LossSpec with_rounding_slack(LossSpec spec, DType input, const CheckSettings& s) {
  spec.rho_rel_error = std::max(base_tolerance(input, s).rtol, 4.0 * unit_roundoff(input));
  return spec;
}

namespace {

// Half the smallest positive subnormal of a dtype: a value under it rounds to 0 when written.
double subnormal_floor(DType d) {
  return d == DType::kFloat16    ? std::ldexp(1.0, -25)
         : d == DType::kBFloat16 ? std::ldexp(1.0, -134)
         : d == DType::kFloat32  ? std::ldexp(1.0, -150)
                                 : std::ldexp(1.0, -1075);
}

// The bounds derived from a candidate's arithmetic for the nll from logits (Arithmetic in
// core/candidate_result.h says what each candidate computes in which dtype). Notation: u_w the
// unit round-off of the working dtype (float, or float64 for float64 logits), u_d the input
// dtype's (unit_roundoff), K the longest chain of float additions in a row's sum of exponentials
// s = sum_k exp(z_k - m), m = max z. First-order error analysis (terms in u^2 dropped):
// - each exp(z_k - m) carries u_w |z_k - m| from its float argument and ~2 u_w of its own, so s
//   is off by at most u_w (K + 3 + spread) relative, spread = sum_k p_k (m - z_k) (row_math.h);
//   log s then carries that as an absolute error.
// - fused kernels: lse = m + log s and l = lse - z_y in float64 (CUDA: lse in float, u_w |lse|),
//   l stored as float (u_w |l|); c l and the sums in float64. The gradient element
//   c exp(z_k - m) exp(m - lse) is three float roundings and the output dtype's (u_d), and p_k's
//   relative error is lse's absolute error plus u_w |z_k - m| <= u_w |log p_k|.
// - LibTorch: log p = (z - m) - log s with log s rounded to the dtype (u_d |log s|: measured, 98%
//   of PyTorch 2.x's bf16 outputs match that model and none is off by more), the difference in
//   float (u_w |log p| twice) written in the dtype (u_d |log p|); c in the dtype (u_d), the product
//   (u_d), the rank's partial sum accumulated in float (n u_w for n terms) and written in the
//   dtype (u_d). Backward: exp(log p) rounded to the dtype (u_d p: at the target, p - 1 cancels
//   and this is most of the error), times c, minus c at the target, written in the dtype.
// LibTorch's kernels are modelled from outside and change between versions: its derived bounds
// are doubled (tests/cli/check_test.cpp found single elements of small random batches past the
// undoubled bound by up to 30%). Each bound is used only where it is tighter than the per-dtype
// default (min of the two).
struct Derived {
  double loss = -1.0;  // -1: none
  ElementBound grad;
};

Derived derive_bounds(const Batch& b, const OracleLoss& want, DType input, const Arithmetic& a) {
  Derived d;
  if (a.kind == Arithmetic::Kind::kUnknown || want.input != LossInput::kLogits) return d;
  const double uw = input == DType::kFloat64 ? std::ldexp(1.0, -53) : std::ldexp(1.0, -24);
  const double ud = unit_roundoff(input), k = static_cast<double>(a.exp_sum_chain);
  const double u64 = std::ldexp(1.0, -53);
  const bool fused = a.kind == Arithmetic::Kind::kFusedFloat;
  CompensatedSum per_token, magnitude;
  int64_t n = 0;
  for (std::size_t row = 0; row < want.coeff.size(); ++row) {
    const double c = want.coeff[row];
    if (c == 0.0 || !b.loss_mask[row]) continue;
    ++n;
    const double l = std::fabs(want.token_loss[row]), s_err = uw * (k + 3.0 + want.spread[row]);
    const double e = fused
                         ? s_err + uw * std::fabs(want.lse[row]) + uw * l
                         : s_err + (uw + ud) * std::fabs(want.log_sum[row]) + 2.0 * uw * l + ud * l;
    per_token.add(std::fabs(c) * e);
    magnitude.add(std::fabs(c) * l);
  }
  const double nn = static_cast<double>(n);
  const double margin = fused ? 1.0 : 2.0;
  d.loss = margin *
           (per_token.value() + magnitude.value() * (fused ? 2.0 * nn * u64 : 3.0 * ud + nn * uw));
  ElementBound& g = d.grad;
  g.atol = subnormal_floor(input);
  g.atol_per_weight = 1e-37;  // float exp flushes below e^-86 = 4.5e-38
  g.alpha_per_spread = uw;
  if (fused) {
    g.rtol = ud + 2.0 * uw;
    g.alpha = uw * (k + 6.0);
    g.alpha_per_abs_lse = uw;
    g.beta = uw;
  } else {
    g.rtol = margin * (2.0 * ud + 2.0 * uw);
    g.alpha = margin * (uw * (k + 4.0) + ud);
    g.alpha_per_spread *= margin;
    g.alpha_per_log_sum = margin * (uw + ud);
    g.beta = margin * (2.0 * uw + ud);
  }
  return d;
}

}  // namespace

TokenLossCheck check_token_loss(const Batch& b, const LossSpec& spec, const CheckSettings& s,
                                const Arithmetic& trainer,
                                const std::vector<RowStats>* logits_stats) {
  TokenLossCheck t;
  if (!b.per_token.count("token_loss") || (!b.logits && !b.per_token.count("log_probs"))) return t;
  t.ran = true;
  t.stated = s.token_loss_is;
  const HostArray& given = b.per_token.at("token_loss");
  const Tolerance tol = base_tolerance(given.dtype, s);
  LossSpec nll_spec = spec;
  nll_spec.loss = LossKind::kNll;
  nll_spec.reduce = Reduction::kPerToken;
  const OracleLoss nll = oracle_loss(b, nll_spec, /*with_logits_grad=*/false, logits_stats);
  const bool has_ppo = b.per_token.count("log_probs") && b.per_token.count("old_log_probs") &&
                       b.per_token.count("advantages");
  OracleLoss ppo;
  if (has_ppo) {
    LossSpec ppo_spec = nll_spec;
    ppo_spec.loss = LossKind::kPpoClip;
    ppo = oracle_loss(b, ppo_spec);
    t.mismatched_ppo = 0;
  }
  // Allowed |token_loss - l|: the dtype's tolerance on |l|, plus, from logits, what a trainer's
  // float log-softmax may add (its sum of exponentials in chains of trainer.exp_sum_chain: see
  // derive_bounds) — no trainer is expected to be float64-exact. ppo-clip's l = max(-rho A,
  // -clip(rho) A) is scaled by rho |A| (1 + |lp - old|) through exp in the dtype.
  const double uf = std::ldexp(1.0, -24);
  const double chain = b.logits ? static_cast<double>(trainer.exp_sum_chain) : 0.0;
  double worst_excess = -1.0;
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    for (int64_t row = b.response_offsets[i]; row < b.response_offsets[i + 1]; ++row) {
      if (!b.loss_mask[row]) continue;
      ++t.checked;
      const double g = given.get_f64(row), l = nll.token_loss[row];
      double allowed = tol.atol + tol.rtol * std::fabs(l);
      if (b.logits) {
        allowed +=
            uf * (chain + 3.0 + nll.spread[row] + std::fabs(nll.log_sum[row]) + 2.0 * std::fabs(l));
      }
      const double d_nll = std::fabs(g - l);
      const bool bad_nll = !(d_nll <= allowed);
      t.mismatched_nll += bad_nll;
      double d_ppo = INFINITY, lp_ = 0.0;
      bool bad_ppo = true;
      if (has_ppo) {
        lp_ = ppo.token_loss[row];
        const double lp = b.per_token.at("log_probs").get_f64(row);
        const double old = b.per_token.at("old_log_probs").get_f64(row);
        const double a = b.per_token.at("advantages").get_f64(row);
        const double scale = std::exp(lp - old) * std::fabs(a) * (1.0 + std::fabs(lp - old));
        d_ppo = std::fabs(g - lp_);
        bad_ppo = !(d_ppo <= tol.atol + tol.rtol * (std::fabs(lp_) + scale));
        t.mismatched_ppo += bad_ppo;
      }
      const double excess = std::min(d_nll / allowed, d_ppo / allowed);
      if ((bad_nll && bad_ppo) && (excess > worst_excess || std::isnan(excess))) {
        worst_excess = excess;
        const bool nearer_ppo = has_ppo && d_ppo < d_nll;
        t.worst = GradLocation{i,
                               row - b.response_offsets[i],
                               -1,
                               -1,
                               -1,
                               g,
                               nearer_ppo ? lp_ : l,
                               nearer_ppo ? d_ppo : d_nll,
                               (nearer_ppo ? lp_ : l) != 0.0
                                   ? (nearer_ppo ? d_ppo : d_nll) / std::fabs(nearer_ppo ? lp_ : l)
                                   : INFINITY};
      }
    }
  }
  if (t.mismatched_nll == 0) {
    t.matches = "nll";
  } else if (t.mismatched_ppo == 0) {
    t.matches = "ppo-clip";
  }
  return t;
}

CaseJudge::CaseJudge(const Batch& b, const LossSpec& spec, const OracleLoss& want, DType input,
                     const Arithmetic& arithmetic, const CheckSettings& s,
                     std::function<void(int64_t)> progress)
    : b_(b), spec_(spec), want_(want), judge_denominator_(!s.under_contract) {
  CheckCase& c = c_;
  c.tol = base_tolerance(input, s);
  int64_t terms = 0;
  for (double x : want.coeff) terms += x != 0.0;
  c.loss_bound_default =
      loss_tolerance(want.loss, want.term_scale, terms, input,
                     input == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32, c.tol);
  c.loss_bound = c.loss_bound_default;
  const bool overridden = s.rtol.has_value(), any_override = s.rtol || s.atol;
  c.grad_tol = overridden ? c.tol : gradient_tolerance(input, spec.loss, c.tol);
  // [0]: PyTorch's per-dtype tolerances. From logits, unless --rtol is given, widened by autograd's
  // rounding of p (|c| u p (2 + |log p|), see compare.cpp), with the absolute slack |c| u plus half
  // a subnormal instead of atol (PyTorch's 1e-5 is for values of order 1, a gradient element is
  // scaled by its token's weight) unless --atol is given.
  ElementBound def;
  def.atol = c.grad_tol.atol;
  def.rtol = c.grad_tol.rtol;
  if (want.input == LossInput::kLogits && !overridden) {
    const double u = unit_roundoff(input);
    def.alpha = 2.0 * u;
    def.beta = u;
    if (!s.atol) {
      def.atol = subnormal_floor(input);
      def.atol_per_weight = u;
      c.atol_scaled_by_weight = true;
    }
  }
  c.grad_bounds.push_back(def);
  if (!any_override) {
    const Derived d = derive_bounds(b, want, input, arithmetic);
    if (d.loss >= 0) {
      c.loss_bound_derived = d.loss;
      c.loss_bound = std::min(c.loss_bound, d.loss);
      c.grad_bounds.push_back(d.grad);
    }
  }
  GradStreamSettings gs;
  gs.bounds = c.grad_bounds;
  gs.got_dtype = input;
  gs.skip_rows = spec.loss == LossKind::kPpoClip ? &want.near_clip_boundary : nullptr;
  gs.progress = std::move(progress);
  stream_ = std::make_unique<GradStream>(b, want, std::move(gs));
}

CheckCase evaluate_check(const Batch& b, const LossSpec& spec, const OracleLoss& want,
                         const CandidateResult& got, DType input, const CheckSettings& s,
                         const Arithmetic& arithmetic) {
  CaseJudge judge(b, spec, want, input, arithmetic, s);
  const int64_t rows = b.num_response_tokens();
  if (rows > 0 && got.grad.data != nullptr) {
    stream_rows(got.grad.data, rows, got.grad.size_bytes() / static_cast<std::size_t>(rows), rows,
                judge.sink());
  }
  return judge.finish(got);
}

CheckCase CaseJudge::finish(const CandidateResult& got) {
  CheckCase c = std::move(c_);
  const Batch& b = b_;
  const LossSpec& spec = spec_;
  const OracleLoss& want = want_;
  c.den_ok = !judge_denominator_ || got.denominator == want.denominator;
  c.loss_diff = std::fabs(got.loss - want.loss);
  c.loss_ok = c.loss_diff <= c.loss_bound && (!want.no_signal || got.loss == 0.0);
  c.grad = stream_->finish(got.row_rank, got.row_chunk);
  // The kernels' zero-token flag, reduced on the device, must say what the oracle says.
  c.flag_ok = !got.skip_flag || *got.skip_flag == want.no_signal;

  if (!c.den_ok) {
    std::vector<int64_t> zero;
    for (int64_t i = 0; i < b.num_samples(); ++i) {
      if (b.mask_sum(i) == 0) zero.push_back(i);
    }
    std::string reason;
    if (!zero.empty() && got.denominator - want.denominator == static_cast<int64_t>(zero.size())) {
      reason = fmt::format(
          ": +1 for each sample without effective tokens (policy {} counts max(m, 1)): {}",
          policy_name(spec.policy), format_index_list(zero));
    }
    c.why.push_back(fmt::format("denominator {} differs from the oracle's {}{}", got.denominator,
                                want.denominator, reason));
  }
  if (c.grad.mismatched > 0) c.why.push_back("worst gradient: " + describe(c.grad.worst));
  if (c.grad.not_compared > 0) {
    c.why.push_back(fmt::format(
        "note: {} token(s) with rho within rounding of a clip boundary: gradient not compared",
        c.grad.not_compared));
  }
  if (c.grad.masked_nonzero > 0) {
    c.why.push_back(fmt::format("{} gradient entries of masked tokens are not exactly zero",
                                c.grad.masked_nonzero));
  }
  if (want.no_signal && got.loss != 0.0) {
    c.why.push_back(fmt::format("a zero-token batch must give loss 0, got {}", got.loss));
  }
  if (!c.flag_ok) {
    c.why.push_back(
        fmt::format("the device zero-token flag says {} but the batch has {} effective tokens",
                    *got.skip_flag ? "skip" : "step", want.no_signal ? "no" : "some"));
  } else if (got.skip_flag.value_or(false)) {
    c.why.push_back(
        "zero-token flag, reduced on the device and read once: skip (no optimizer.step(), no LR "
        "step)");
  }
  return c;
}

std::string token_loss_worst_text(const TokenLossCheck& t) {
  if (t.ok()) return "";
  return fmt::format("; worst: sample {}, response index {}: token_loss {:.9g}, oracle {:.9g}",
                     t.worst.sample, t.worst.response_index, t.worst.got, t.worst.want);
}

std::vector<Finding> token_loss_findings(const TokenLossCheck& t) {
  if (!t.ran || t.judged() || !t.matches.empty()) return {};
  return {{"token_loss_not_plain",
           fmt::format("token_loss is neither the per-token nll nor the ppo-clip loss of the "
                       "dump's inputs (a KL, entropy or other term?){}",
                       token_loss_worst_text(t)),
           {{"worst", location_json(t.worst)}}}};
}

bool CheckResult::ok() const {
  for (const CheckGroup& g : groups) {
    for (const CheckCaseResult& c : g.cases) {
      if (!c.verdict.ok()) return false;
    }
  }
  return !token_loss || token_loss->ok();
}

std::vector<Finding> check_findings(const Batch& b, Policy policy,
                                    const std::optional<TokenLossCheck>& token_loss,
                                    const std::vector<RowStats>* logits_stats) {
  std::vector<Finding> out;
  if (policy == Policy::kLegacy) out = legacy_slicing_findings(b);
  if (token_loss) {
    for (auto& f : token_loss_findings(*token_loss)) out.push_back(std::move(f));
  }
  for (auto& f : batch_findings(b, 20, logits_stats)) out.push_back(std::move(f));
  return out;
}

}  // namespace lossguard::oracle
