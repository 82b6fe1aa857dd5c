// Loss terms (SPEC §11): names, masks, the `weights --term` syntax, and the batch a term sees.
#include "core/term.h"

#include <fmt/format.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>

#include "core/contract.h"
#include "core/errors.h"

namespace lossguard {

std::string TermMask::text() const {
  switch (kind) {
    case TermMaskKind::kLoss:
      return "loss";
    case TermMaskKind::kAll:
      return "all";
    case TermMaskKind::kShift:
      return fmt::format("shift:{}", shift);
    case TermMaskKind::kRoll:
      return fmt::format("roll:{}", shift);
    case TermMaskKind::kField:
      return "field";
  }
  return "?";
}

bool valid_term_name(const std::string& name) {
  if (name.empty() || name.size() > 64 || name[0] < 'a' || name[0] > 'z') return false;
  for (char ch : name) {
    if (!((ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_' || ch == '-'))
      return false;
  }
  return !is_contract_component_key(name);
}

TermMask parse_term_mask(const std::string& text, const std::string& what) {
  TermMask m;
  if (text == "loss") return m;
  if (text == "all") {
    m.kind = TermMaskKind::kAll;
    return m;
  }
  if (text == "field") {
    m.kind = TermMaskKind::kField;
    return m;
  }
  const bool roll = text.rfind("roll:", 0) == 0;
  if (text.rfind("shift:", 0) == 0 || roll) {
    const std::string j = text.substr(roll ? 5 : 6);
    char* end = nullptr;
    errno = 0;
    const long long v = j.empty() ? 0 : std::strtoll(j.c_str(), &end, 10);
    if (!j.empty() && errno == 0 && end != nullptr && *end == '\0' && v >= 1 &&
        v <= kMaxTermShift) {
      m.kind = roll ? TermMaskKind::kRoll : TermMaskKind::kShift;
      m.shift = v;
      return m;
    }
    throw_input_error("{}: mask '{}': the depth of {}:J must be an integer in [1, {}]", what, text,
                      roll ? "roll" : "shift", kMaxTermShift);
  }
  throw_input_error("{}: unknown mask '{}' (loss, all, shift:J, roll:J or field)", what, text);
}

double parse_term_coef(const std::string& text, const std::string& what) {
  char* end = nullptr;
  errno = 0;
  const double v = text.empty() ? NAN : std::strtod(text.c_str(), &end);
  if (text.empty()) {
    throw_input_error("{}: the coefficient is empty (give a number, or leave COEF out: 1)", what);
  }
  if (end == nullptr || *end != '\0' || !std::isfinite(v)) {
    throw_input_error("{}: coefficient '{}' is not a finite number", what, text);
  }
  // strtod flags ERANGE on overflow (inf, caught above) and on results below the smallest normal
  // double: a subnormal coefficient is a finite number no trainer's float32 can hold.
  if (errno == ERANGE || (v != 0.0 && std::fabs(v) < std::numeric_limits<float>::min())) {
    throw_input_error(
        "{}: coefficient '{}' is subnormal (nonzero, below {:g}, the smallest normal float32): "
        "a trainer's float32 loses it; give 0 or a normal number",
        what, text, std::numeric_limits<float>::min());
  }
  return v;
}

Term parse_term(const std::string& text) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  while (true) {
    const std::size_t colon = text.find(':', start);
    parts.push_back(
        text.substr(start, colon == std::string::npos ? std::string::npos : colon - start));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  Term t;
  t.name = parts[0];
  if (!valid_term_name(t.name)) {
    throw_input_error(
        "--term '{}': '{}' is not a term name ([a-z][a-z0-9_-]*, at most 64 characters, not a "
        "contract component: {})",
        text, t.name, contract_component_keys_text());
  }
  const std::string what = fmt::format("--term {}", t.name);
  if (parts.size() < 2)
    throw_input_error("{}: give NAME:REDUCE[:COEF][:MASK], got '{}'", what, text);
  if (!parse_reduction(parts[1], &t.reduce)) {
    throw_input_error("{}: reduce '{}' is not {}", what, parts[1], mode_choices<Reduction>());
  }
  std::size_t next = 2;
  // COEF is optional: a part that starts like a number is the coefficient, else the mask begins;
  // an empty part (kl:per-token::loss) is an empty coefficient, not an empty mask.
  if (next < parts.size() && next + 1 < parts.size() && parts[next].empty()) {
    parse_term_coef(parts[next], what);  // throws: the coefficient is empty
  }
  if (next < parts.size() && !parts[next].empty() &&
      (std::isdigit(static_cast<unsigned char>(parts[next][0])) || parts[next][0] == '-' ||
       parts[next][0] == '+' || parts[next][0] == '.' || parts[next] == "inf" ||
       parts[next] == "nan")) {
    t.coef = parse_term_coef(parts[next], what);
    ++next;
  }
  if (next < parts.size()) {
    std::string mask = parts[next];
    for (std::size_t k = next + 1; k < parts.size(); ++k) mask += ":" + parts[k];
    t.mask = parse_term_mask(mask, what);
  }
  return t;
}

std::string term_text(const Term& t) {
  return fmt::format("{}: {}, coef {}, mask {}", t.name, mode_name(t.reduce), t.coef,
                     t.mask.text());
}

std::vector<uint8_t> term_mask(const Batch& b, const TermMask& mask) {
  switch (mask.kind) {
    case TermMaskKind::kLoss:
      return b.loss_mask;
    case TermMaskKind::kField:
      throw_input_error("a field mask is recorded by the trainer; it cannot be derived");
    case TermMaskKind::kAll: {
      std::vector<uint8_t> out(b.loss_mask.size(), 1);
      for (int64_t i = 0; i < b.num_samples(); ++i) {
        const int64_t begin = b.response_offsets[i], end = b.response_offsets[i + 1];
        if (b.is_removed(i)) {
          for (int64_t t = begin; t < end; ++t) out[t] = 0;
        } else if (end > begin && b.response_lengths[i] == b.total_lengths[i]) {
          out[end - 1] = 0;  // an SFT sample's last position predicts nothing (SPEC §1)
        }
      }
      return out;
    }
    case TermMaskKind::kShift:
    case TermMaskKind::kRoll: {
      const bool roll = mask.kind == TermMaskKind::kRoll;
      std::vector<uint8_t> out(b.loss_mask.size(), 0);
      for (int64_t i = 0; i < b.num_samples(); ++i) {
        const int64_t begin = b.response_offsets[i], end = b.response_offsets[i + 1];
        for (int64_t t = begin; t + mask.shift < end; ++t)
          out[t] = (roll || b.loss_mask[t]) && b.loss_mask[t + mask.shift] ? 1 : 0;
      }
      return out;
    }
  }
  return b.loss_mask;
}

Batch with_mask(const Batch& b, std::vector<uint8_t> mask, bool keep_sample_denoms) {
  LG_CHECK(mask.size() == b.loss_mask.size(), "with_mask: {} mask entries for {} tokens",
           mask.size(), b.loss_mask.size());
  Batch out;
  out.files = b.files;
  out.origins = b.origins;
  out.total_lengths = b.total_lengths;
  out.response_lengths = b.response_lengths;
  out.token_offsets = b.token_offsets;
  out.response_offsets = b.response_offsets;
  out.loss_mask = std::move(mask);
  out.loss_mask_given = true;
  out.padded_total_lengths = b.padded_total_lengths;
  if (keep_sample_denoms) out.sample_denoms = b.sample_denoms;
  out.removed = b.removed;
  out.steps = b.steps;
  out.metadata = b.metadata;
  return out;
}

std::vector<TermContract> parse_term_contracts(const std::string& reduce,
                                               const std::vector<std::string>& contracts,
                                               const std::vector<std::string>& terms) {
  Term main_term;
  if (!parse_mode(reduce, &main_term.reduce)) {
    throw_input_error("--reduce must be {}, got '{}'", mode_choices<Reduction>(), reduce);
  }
  std::vector<TermContract> out{{main_term, {}}};
  for (const auto& text : terms) {
    Term t = parse_term(text);
    if (t.name == kMainTerm) {
      throw_input_error("--term {}: 'main' is the term of --reduce and --contract; name the others",
                        text);
    }
    if (t.mask.kind == TermMaskKind::kField) {
      throw_input_error(
          "--term {}: a field mask is recorded by a trainer (audit); weights derives masks from "
          "the dump: loss, all or shift:J",
          t.name);
    }
    for (const auto& have : out) {
      if (have.term.name == t.name) throw_input_error("--term {} is given twice", t.name);
    }
    out.push_back({t, {}});
  }
  std::vector<std::optional<std::string>> given(out.size());
  for (const auto& text : contracts) {
    std::size_t k = 0;
    std::string body = text;
    const std::size_t eq = text.find('=');
    if (eq != std::string::npos && valid_term_name(text.substr(0, eq))) {
      const std::string name = text.substr(0, eq);
      body = text.substr(eq + 1);
      for (k = 0; k < out.size() && out[k].term.name != name; ++k) {
      }
      if (k == out.size()) {
        throw_input_error("--contract {}: no term '{}' (declare it with --term {}:REDUCE)", text,
                          name, name);
      }
    }
    if (given[k]) {
      throw_input_error("--contract: two contracts for term {}: '{}' and '{}'", out[k].term.name,
                        *given[k], body);
    }
    given[k] = body;
  }
  if (!given[0]) {
    throw_input_error(
        "--contract: no contract for the main term (give a preset or key=value "
        "without a NAME= prefix)");
  }
  for (std::size_t k = 0; k < out.size(); ++k) {
    out[k].contract = parse_contract(given[k] ? *given[k] : *given[0], out[k].term.reduce);
  }
  return out;
}

}  // namespace lossguard
