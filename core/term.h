// Loss terms (SPEC §11): a real objective is L = sum_k c_k · L_k — the policy or cross-entropy term
// `main`, a KL penalty, an entropy bonus, an MTP loss at depth j, an MoE aux or z-loss — each with
// its own per-token loss, mask, reduction and coefficient. Every term is weighed exactly as a
// single-term objective over its own mask (weights, diagnosis, I5): `with_mask` makes the batch
// that term sees, so one mechanism serves them all.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/batch.h"
#include "core/contract.h"
#include "core/modes.h"

namespace lossguard {

// Which response tokens carry a term's loss.
//   loss     the response's loss mask m_t (the default; the main term's)
//   all      every response token, masked or not (an aux or z-loss over every position), but the
//            last of an SFT sample (R = T), which predicts nothing (SPEC §1)
//   shift:j  multi-token prediction at depth j: m_t · m_{t+j} within the sample; the last j
//            response tokens carry none
//   roll:j   Megatron-core's MTP mask at depth j: m_{t+j} within the sample (the loss mask rolled
//            left by j, the last j zeroed: multi_token_prediction.py:158-161, 243-252, 0.16.1)
//   field    a per-token mask the trainer recorded (a capture's mb.{k}.term.NAME.mask)
enum class TermMaskKind { kLoss, kAll, kShift, kRoll, kField };
struct TermMask {
  TermMaskKind kind = TermMaskKind::kLoss;
  int64_t shift = 0;         // shift:j, roll:j
  std::string text() const;  // "loss", "all", "shift:1", "field"
  bool operator==(const TermMask&) const = default;
};

struct Term {
  std::string name = "main";
  Reduction reduce = Reduction::kPerToken;
  double coef = 1.0;  // c_k: finite
  TermMask mask;
};

inline constexpr const char* kMainTerm = "main";
inline constexpr int64_t kMaxTermShift = 1 << 20;

// A term name: [a-z][a-z0-9_-]*, at most 64 characters, none of the contract's component names
// (count, clamp, norm, sample, scale, grad: `--contract NAME=C` must stay unambiguous).
bool valid_term_name(const std::string& name);

// "loss", "all", "shift:J", "roll:J" (1 <= J <= 2^20) or "field". Throws InputError naming `what`
// (the term and where it was given) and the accepted masks.
TermMask parse_term_mask(const std::string& text, const std::string& what);

// A finite coefficient from text; throws InputError naming `what`.
double parse_term_coef(const std::string& text, const std::string& what);

// "NAME:REDUCE[:COEF][:MASK]" (the `weights --term` form; MASK may be shift:J). Throws InputError
// naming the term and the part that is wrong.
Term parse_term(const std::string& text);

// "kl: per-token, coef 0.1, mask loss".
std::string term_text(const Term& t);

// A term as `weights` weighs it: its declaration and the contract its trainer applies to it.
struct TermContract {
  Term term;
  Contract contract;
};
// The main term from `reduce` and the unqualified contract; one more per `terms` entry
// (NAME:REDUCE[:COEF][:MASK]) with its own `NAME=C` among `contracts`, else the main term's.
// Throws InputError naming the option (--reduce, --term, --contract) and the part that is wrong.
std::vector<TermContract> parse_term_contracts(const std::string& reduce,
                                               const std::vector<std::string>& contracts,
                                               const std::vector<std::string>& terms);

// A term's mask over the batch's response tokens, [sum R]: loss, all or shift:j from the batch's
// own loss mask (a sample the trainer removed carries no term's loss). A field mask cannot be
// derived: InputError (the caller gives it).
std::vector<uint8_t> term_mask(const Batch& batch, const TermMask& mask);

// The batch a term sees: the same samples and layout with `mask` ([sum R], 0/1) as the loss mask.
// Per-sample denominators the dump states refer to the loss mask, so they are dropped unless the
// mask is the loss mask itself (d_i follows the term's mask, SPEC §11).
Batch with_mask(const Batch& batch, std::vector<uint8_t> mask, bool keep_sample_denoms = false);

}  // namespace lossguard
