#include "oracle/weights/scale_names.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

namespace lossguard::oracle {
namespace {

bool close(double a, double b, double tol) {
  if (!std::isfinite(a) || !std::isfinite(b)) return false;
  return std::fabs(a - b) <= tol * std::max(std::fabs(a), std::fabs(b));
}

// A factor of a product: its name in formulas, its value, the exponents tried, whether the
// layout moves it, and how a sentence names it ("CP = 2", "its own 24 tokens").
struct Symbol {
  std::string name;
  double value = 1.0;
  int lo = -1, hi = 1;
  bool layout = false;
  std::string phrase;  // "" : "NAME = value"
};

std::string number(double v) {
  return v == std::floor(v) && std::fabs(v) < 1e15 ? fmt::format("{}", static_cast<int64_t>(v))
                                                   : fmt::format("{:.6g}", v);
}

std::string phrase_of(const Symbol& s) {
  return s.phrase.empty() ? s.name + " = " + number(s.value) : s.phrase;
}

// "1/cp", "dp*cp", "M*dp*cp/B", "N/(M*n)" from exponents over symbols.
std::string product_text(const std::vector<Symbol>& syms, const std::vector<int>& e) {
  std::string num, den;
  int den_factors = 0;
  for (std::size_t k = 0; k < syms.size(); ++k) {
    for (int x = 0; x < std::abs(e[k]); ++x) {
      std::string& part = e[k] > 0 ? num : den;
      part += (part.empty() ? "" : "*") + syms[k].name;
      den_factors += e[k] < 0;
    }
  }
  if (den.empty()) return num.empty() ? "1" : num;
  return (num.empty() ? "1" : num) + "/" + (den_factors > 1 ? "(" + den + ")" : den);
}

// Every exponent vector over syms of total cost 1..max_cost, cheapest first, in the order of the
// symbols (the first symbol outermost, its exponents ascending); f(e, cost) returns true to stop.
template <class F>
void each_product(const std::vector<Symbol>& syms, int max_cost, F&& f) {
  std::vector<int> e(syms.size(), 0);
  for (int cost = 1; cost <= max_cost; ++cost) {
    bool stop = false;
    auto rec = [&](auto&& self, std::size_t k, int left) -> void {
      if (stop) return;
      if (k == syms.size()) {
        if (left == 0) stop = f(e, cost);
        return;
      }
      for (int x = syms[k].lo; x <= syms[k].hi && !stop; ++x) {
        if (std::abs(x) > left || (x != 0 && syms[k].value == 1.0)) continue;
        e[k] = x;
        self(self, k + 1, left - std::abs(x));
      }
      e[k] = 0;
    };
    rec(rec, 0, cost);
    if (stop) return;
  }
}

double value_of(const std::vector<Symbol>& syms, const std::vector<int>& e) {
  double v = 1.0;
  for (std::size_t k = 0; k < syms.size(); ++k) v *= std::pow(syms[k].value, e[k]);
  return v;
}

std::string joined(const std::vector<std::string>& parts, const char* sep) {
  std::string out;
  for (const auto& p : parts) out += (out.empty() ? "" : sep) + p;
  return out;
}

// "a", "a and b", "a, b and c".
std::string listed(const std::vector<std::string>& parts) {
  if (parts.size() < 2) return joined(parts, "");
  std::vector<std::string> head(parts.begin(), parts.end() - 1);
  return joined(head, ", ") + " and " + parts.back();
}

// "the same step at CP = 1 applies ×2 this update": every layout factor of the product set to 1.
std::string same_step_text(const std::vector<Symbol>& syms, const std::vector<int>& e, double r) {
  std::vector<std::string> at;
  double rest = 1.0;
  for (std::size_t k = 0; k < syms.size(); ++k) {
    if (e[k] == 0) continue;
    if (syms[k].layout) {
      at.push_back(syms[k].name == "M" ? "M = 1 (one micro-batch per DP rank)"
                                       : syms[k].phrase + " = 1");
    } else {
      rest *= std::pow(syms[k].value, e[k]);
    }
  }
  return fmt::format("the same step at {} applies ×{:.6g} this update", listed(at), rest / r);
}

// The objective's divisor as the sentence names it, with its value ("N = 240") and without ("N").
struct Divisor {
  std::string full, brief;
};
Divisor objective_divisor(const ScaleContext& ctx) {
  if (!ctx.reduce_known) return {};
  const std::string n = ctx.global_tokens > 0 ? fmt::format("N = {}", ctx.global_tokens) : "N";
  const std::string b = ctx.global_batch > 0 ? fmt::format("B = {}", ctx.global_batch) : "B";
  switch (ctx.reduce) {
    case Reduction::kPerToken:
    case Reduction::kTokenMean:
      return {n, "N"};
    case Reduction::kSampleMean:
      return {"each sample's own tokens and " + b, "each sample's own tokens and B"};
    case Reduction::kSeqMeanTokenSum:
      return {b, "B"};
    case Reduction::kSeqMeanTokenMean:
      return {"each sample's own tokens and B'", "each sample's own tokens and B'"};
    case Reduction::kSeqMeanTokenSumNorm:
      return {b + " and L_norm", "B and L_norm"};
  }
  return {};
}

// The step's sizes any unit formula may use, after the unit's own counts.
void add_step_symbols(std::vector<Symbol>& syms, const StepLayout& l, const ScaleContext& ctx,
                      int64_t m) {
  syms.push_back(
      {"N", static_cast<double>(ctx.global_tokens > 0 ? ctx.global_tokens : 1), -1, 1, false, ""});
  syms.push_back({"M", static_cast<double>(m), -1, 1, true, ""});
  syms.push_back({"dp", static_cast<double>(l.dp), -1, 1, true, fmt::format("DP = {}", l.dp)});
  syms.push_back({"cp", static_cast<double>(l.cp), -1, 1, true, fmt::format("CP = {}", l.cp)});
  syms.push_back({"tp", static_cast<double>(l.tp), -1, 1, true, fmt::format("TP = {}", l.tp)});
  syms.push_back(
      {"B", static_cast<double>(ctx.global_batch > 0 ? ctx.global_batch : 1), -1, 1, false, ""});
}

struct Counts {
  std::vector<double> sample_tokens, sample_length;         // [S]
  std::vector<double> mb_tokens, mb_samples;                // [microbatches]
  std::vector<double> rank_tokens, rank_samples, rank_mbs;  // [dp]
  std::vector<double> shard_tokens;                         // [microbatches * cp]
};

Counts count_units(const Batch& b, const std::vector<int32_t>& sample_microbatch,
                   const std::vector<double>& shard_tokens, const StepLayout& l) {
  Counts c;
  const int64_t s = b.num_samples();
  const std::size_t nmb = l.microbatches.size();
  c.sample_tokens.assign(static_cast<std::size_t>(s), 0.0);
  c.sample_length.assign(static_cast<std::size_t>(s), 0.0);
  c.mb_tokens.assign(nmb, 0.0);
  c.mb_samples.assign(nmb, 0.0);
  c.shard_tokens = shard_tokens;
  c.rank_tokens.assign(static_cast<std::size_t>(l.dp), 0.0);
  c.rank_samples.assign(static_cast<std::size_t>(l.dp), 0.0);
  c.rank_mbs.assign(static_cast<std::size_t>(l.dp), 0.0);
  const std::vector<int64_t> per_rank = l.microbatches_per_rank();
  for (std::size_t d = 0; d < per_rank.size(); ++d)
    c.rank_mbs[d] = static_cast<double>(per_rank[d]);
  for (int64_t i = 0; i < s; ++i) {
    const int32_t k = sample_microbatch.empty() ? -1 : sample_microbatch[i];
    double d = 0.0;
    for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) d += b.loss_mask[t];
    c.sample_tokens[i] = d;
    c.sample_length[i] = static_cast<double>(b.response_offsets[i + 1] - b.response_offsets[i]);
    if (k < 0) continue;
    c.mb_tokens[k] += d;
    c.mb_samples[k] += 1.0;
    const int64_t r = l.microbatches[k].dp_rank;
    if (r >= 0 && r < l.dp) {
      c.rank_tokens[r] += d;
      c.rank_samples[r] += 1.0;
    }
  }
  return c;
}

// The unit's own symbols (values per unit, by the diagnosis's numbering) and its label.
struct UnitKind {
  std::vector<std::pair<std::string, std::vector<double>>> own;  // name -> value per unit
  std::vector<std::string> own_phrase;  // "its own {} tokens" with {} the value
};

UnitKind unit_kind(const std::string& kind, const Counts& c,
                   const std::vector<int32_t>& sample_microbatch, const StepLayout& l) {
  UnitKind u;
  const std::size_t nmb = l.microbatches.size();
  if (kind == "per-rank") {
    u.own = {{"n", c.rank_tokens}, {"s", c.rank_samples}, {"m", c.rank_mbs}};
    u.own_phrase = {"its own {} tokens", "its own {} samples", "its own {} micro-batches"};
  } else if (kind == "per-microbatch") {
    std::vector<double> rank_of(nmb);
    for (std::size_t k = 0; k < nmb; ++k) rank_of[k] = c.rank_tokens[l.microbatches[k].dp_rank];
    u.own = {{"n", c.mb_tokens}, {"s", c.mb_samples}, {"n_rank", rank_of}};
    u.own_phrase = {"its own {} tokens", "its own {} samples", "its DP rank's {} tokens"};
  } else if (kind == "per-cp-shard" && c.shard_tokens.size() == nmb * l.cp) {
    std::vector<double> n(nmb * l.cp), s(nmb * l.cp);
    for (std::size_t k = 0; k < nmb; ++k) {
      for (int64_t cp = 0; cp < l.cp; ++cp) {
        n[k * l.cp + cp] = c.mb_tokens[k];
        s[k * l.cp + cp] = c.mb_samples[k];
      }
    }
    u.own = {{"n_shard", c.shard_tokens}, {"n", n}, {"s", s}};
    u.own_phrase = {"its own {} tokens (the CP rank's share)", "the micro-batch's {} tokens",
                    "the micro-batch's {} samples"};
  } else if (kind == "per-sample") {
    std::vector<double> n(c.sample_tokens.size(), 0.0);
    for (std::size_t i = 0; i < n.size(); ++i) {
      const int32_t k = sample_microbatch.empty() ? -1 : sample_microbatch[i];
      n[i] = k >= 0 ? c.mb_tokens[k] : 0.0;
    }
    u.own = {{"d", c.sample_tokens}, {"len", c.sample_length}, {"n", n}};
    u.own_phrase = {"its own {} tokens", "its response length {}", "its micro-batch's {} tokens"};
  }
  return u;
}

// "1 tokens" -> "1 token" in a phrase whose count is 1.
std::string singular_one(std::string s) {
  for (const char* w : {"tokens", "samples", "micro-batches"}) {
    const std::string many = std::string(" 1 ") + w;
    const std::size_t at = s.find(many);
    if (at == std::string::npos) continue;
    const std::size_t end = at + many.size();
    if (end < s.size() && s[end] != ' ' && s[end] != ',' && s[end] != ')') continue;
    const std::string one =
        std::string(w) == "micro-batches" ? "micro-batch" : std::string(w, std::strlen(w) - 1);
    s.replace(at + 3, std::strlen(w), one);
  }
  return s;
}

std::string unit_label(const std::string& kind, int64_t u, const StepLayout& l) {
  if (kind == "per-rank") return fmt::format("DP rank {}", u);
  if (kind == "per-sample") return fmt::format("sample {}", u);
  const int64_t k = kind == "per-cp-shard" ? u / l.cp : u;
  if (k < 0 || k >= static_cast<int64_t>(l.microbatches.size())) return fmt::format("unit {}", u);
  const MicroBatch& mb = l.microbatches[k];
  const std::string m = fmt::format("micro-batch {} of DP rank {}", mb.index, mb.dp_rank);
  return kind == "per-cp-shard" ? fmt::format("CP rank {}'s share of {}", u % l.cp, m) : m;
}

}  // namespace

std::string ScaleName::text() const { return joined(products, " or "); }

ScaleName name_scale(double r, const StepLayout& l, const ScaleContext& ctx, double tol) {
  const std::vector<int64_t> per_rank = l.microbatches_per_rank();
  const int64_t m = per_rank.empty() ? 1 : *std::max_element(per_rank.begin(), per_rank.end());
  const std::vector<Symbol> syms = {
      {"cp", static_cast<double>(l.cp), -2, 2, true, "CP"},
      {"dp", static_cast<double>(l.dp), -2, 2, true, "DP"},
      {"tp", static_cast<double>(l.tp), -1, 1, true, "TP"},
      {"M", static_cast<double>(m), -2, 2, true, "M"},
      {"pp", static_cast<double>(ctx.pp), -1, 1, true, "PP"},
      {"B", static_cast<double>(ctx.global_batch > 0 ? ctx.global_batch : 1), -1, 0, false, "B"},
      {"(N/Nc)",
       ctx.global_tokens > 0 && ctx.clamped_tokens > 0
           ? static_cast<double>(ctx.global_tokens) / static_cast<double>(ctx.clamped_tokens)
           : 1.0,
       0, 1, false, "N/Nc"},
      {"N", static_cast<double>(ctx.global_tokens > 0 ? ctx.global_tokens : 1), -1, 1, false, "N"},
  };
  const std::size_t kB = 5, kNc = 6, kN = 7;
  // The step's constants name a scale in the shapes trainers have, not in any product that happens
  // to hit r (a token sum ×46 is N, not M·M·B·N/Nc): N alone (a sum, or a count twice); 1/B only
  // with layout sizes (M·dp·cp/B: the micro-batch size) or alone; N/Nc with at most two sizes.
  auto plausible = [&](const std::vector<int>& e) {
    int layout_cost = 0;
    for (std::size_t k = 0; k < kB; ++k) layout_cost += std::abs(e[k]);
    if (e[kN] != 0) return layout_cost == 0 && e[kB] == 0 && e[kNc] == 0;
    if (e[kNc] != 0) return layout_cost <= 2 && e[kB] == 0;
    return true;
  };
  ScaleName out;
  int found_cost = 0;
  each_product(syms, 4, [&](const std::vector<int>& e, int cost) {
    if (found_cost != 0 && cost > found_cost) return true;
    if (!plausible(e) || !close(value_of(syms, e), r, tol)) return false;
    found_cost = cost;
    out.products.push_back(product_text(syms, e));
    bool layout = false;
    for (std::size_t k = 0; k < syms.size(); ++k) layout |= e[k] != 0 && syms[k].layout;
    if (layout && !out.layout_dependent) {
      out.layout_dependent = true;
      out.same_step = same_step_text(syms, e, r);
    }
    return false;
  });
  // The trainer's declared constants decide where one equals r: one of them, or their product.
  double all = 1.0;
  std::vector<std::string> names;
  for (const auto& [name, value] : ctx.declared) {
    all *= value;
    names.push_back(fmt::format("{} = {:.6g}", name, value));
    if (out.declared.empty() && close(value, r, tol)) out.declared = names.back();
  }
  if (out.declared.empty() && ctx.declared.size() > 1 && close(all, r, tol)) {
    out.declared = joined(names, " × ");
  }
  if (!out.declared.empty()) out.layout_dependent = false;
  return out;
}

// Long: the unit's own symbols and the step's, the cheapest formula that fits every unit, then
// the sentence for the worst unit (its divisions against the objective's).
UnitFactor name_unit_factor(const Batch& b, const std::vector<int32_t>& sample_microbatch,
                            const std::vector<double>& shard_tokens, const StepLayout& l,
                            const std::string& kind, const std::vector<double>& unit_ratio,
                            int64_t worst, const ScaleContext& ctx, double tol) {
  UnitFactor out;
  const Counts counts = count_units(b, sample_microbatch, shard_tokens, l);
  const UnitKind uk = unit_kind(kind, counts, sample_microbatch, l);
  if (uk.own.empty()) return out;
  const std::size_t units = unit_ratio.size();
  for (const auto& [name, v] : uk.own) {
    if (v.size() != units) return out;
  }
  const std::vector<int64_t> per_rank = l.microbatches_per_rank();
  const int64_t m = per_rank.empty() ? 1 : *std::max_element(per_rank.begin(), per_rank.end());
  // The own symbols first (value 2 stands for "varies": never skipped as a size of 1).
  std::vector<Symbol> syms;
  for (const auto& [name, v] : uk.own) syms.push_back({name, 2.0, -1, 1, false, ""});
  const std::size_t own = syms.size();
  add_step_symbols(syms, l, ctx, m);
  // An own count equal in every unit is a constant in disguise (2 samples per micro-batch where
  // M = 2): among the cheapest formulas, the one with fewest such counts wins, so the step's name.
  std::vector<bool> constant_own(own, true);
  for (std::size_t k = 0; k < own; ++k) {
    double first = NAN;
    for (std::size_t u = 0; u < units; ++u) {
      if (std::isnan(unit_ratio[u])) continue;
      if (std::isnan(first)) first = uk.own[k].second[u];
      if (uk.own[k].second[u] != first) constant_own[k] = false;
    }
  }
  // Small batches make coincidences (N = 8 tokens on one DP rank is also the rank's count; B = 6
  // samples is also M·dp = 6), so every formula that fits is ranked: fewest own
  // counts that are constants in disguise (2 samples per micro-batch where M = 2); then, under a
  // per-token objective (w* = m/N), those with N once in the numerator — the trainer's own weight
  // named without N; then those without B where a layout product is the same number; then cost.
  const std::size_t n_index = own;  // add_step_symbols puts N first, B last
  const std::size_t b_index = syms.size() - 1;
  const bool per_token = ctx.reduce_known && (ctx.reduce == Reduction::kPerToken ||
                                              ctx.reduce == Reduction::kTokenMean);
  std::vector<int> best;
  std::array<int, 4> best_key{};
  for (const bool n_first : {true, false}) {
    if (n_first && !per_token) continue;
    each_product(syms, n_first ? 5 : 4, [&](const std::vector<int>& e, int cost) {
      if (n_first && e[n_index] != 1) return false;
      bool uses_own = false;
      for (std::size_t k = 0; k < own; ++k) uses_own |= e[k] != 0;
      if (!uses_own) return false;
      double step_part = 1.0;
      for (std::size_t k = own; k < syms.size(); ++k) step_part *= std::pow(syms[k].value, e[k]);
      for (std::size_t u = 0; u < units; ++u) {
        if (std::isnan(unit_ratio[u])) continue;
        double v = step_part;
        for (std::size_t k = 0; k < own; ++k) {
          const double x = uk.own[k].second[u];
          if (e[k] < 0 && x == 0.0) return false;
          v *= std::pow(x, e[k]);
        }
        if (!close(v, unit_ratio[u], tol)) return false;
      }
      int disguised = 0;
      for (std::size_t k = 0; k < own; ++k) disguised += e[k] != 0 && constant_own[k];
      const std::array<int, 4> key{disguised, n_first ? 0 : 1, e[b_index] != 0 ? 1 : 0, cost};
      if (best.empty() || key < best_key) {
        best = e;
        best_key = key;
      }
      return false;
    });
  }
  if (best.empty()) return out;
  out.formula = product_text(syms, best);
  if (worst < 0 || static_cast<std::size_t>(worst) >= units) return out;
  std::vector<std::string> den, num;
  for (std::size_t k = 0; k < syms.size(); ++k) {
    if (best[k] == 0) continue;
    const std::string p = k < own ? singular_one(fmt::format(fmt::runtime(uk.own_phrase[k]),
                                                             number(uk.own[k].second[worst])))
                                  : phrase_of(syms[k]);
    (best[k] < 0 ? den : num).push_back(p);
  }
  const std::string unit = unit_label(kind, worst, l);
  const Divisor obj = objective_divisor(ctx);
  if (num.empty()) {
    out.advice = obj.full.empty()
                     ? fmt::format(
                           "{} is divided by {} on top of the objective's normalisation: "
                           "remove that division",
                           unit, listed(den))
                     : fmt::format("{} is divided by {}, then by {}: divide by {} only", unit,
                                   listed(den), obj.full, obj.brief);
  } else if (den.empty()) {
    out.advice =
        fmt::format("{} is not divided by {}: divide by {}", unit, listed(num), listed(num));
  } else {
    out.advice = fmt::format("{} is divided by {} instead of {}: divide by {}", unit, listed(den),
                             listed(num), listed(num));
  }
  if (!ctx.loss_site.empty()) out.advice += fmt::format(" (in {})", ctx.loss_site);
  return out;
}

}  // namespace lossguard::oracle
