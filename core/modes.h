// The modes every layer speaks (SPEC §2-§4, §7), each an enum class with one name table: the names
// are the command-line spellings, parsed and printed from that table alone.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lossguard {

// One name table per mode: mode_names<E>() lists every value with its name, in the order shown to
// users.
template <typename E>
struct ModeNames;

template <typename E>
const char* mode_name(E value) {
  for (const auto& [v, name] : ModeNames<E>::kTable) {
    if (v == value) return name;
  }
  return "?";
}
template <typename E>
bool parse_mode(std::string_view name, E* out) {
  for (const auto& [v, n] : ModeNames<E>::kTable) {
    if (name == n) {
      *out = v;
      return true;
    }
  }
  return false;
}
template <typename E>
std::vector<E> all_modes() {
  std::vector<E> out;
  for (const auto& entry : ModeNames<E>::kTable) out.push_back(entry.first);
  return out;
}
// "a, b or c": the accepted names, for error messages and --help.
template <typename E>
std::string mode_choices() {
  std::string s;
  const auto n = std::size(ModeNames<E>::kTable);
  for (std::size_t k = 0; k < n; ++k) {
    s += (k == 0 ? "" : k + 1 == n ? " or " : ", ");
    s += ModeNames<E>::kTable[k].second;
  }
  return s;
}

// The per-token loss (SPEC §4).
enum class LossKind { kNll, kPpoClip, kGiven };
template <>
struct ModeNames<LossKind> {
  static constexpr std::pair<LossKind, const char*> kTable[] = {
      {LossKind::kNll, "nll"}, {LossKind::kPpoClip, "ppo-clip"}, {LossKind::kGiven, "given"}};
};

// The objective's reduction of per-token losses (SPEC §4).
enum class Reduction {
  kPerToken,
  kSampleMean,
  kTokenMean,
  kSeqMeanTokenSum,
  kSeqMeanTokenMean,
  kSeqMeanTokenSumNorm
};
template <>
struct ModeNames<Reduction> {
  static constexpr std::pair<Reduction, const char*> kTable[] = {
      {Reduction::kPerToken, "per-token"},
      {Reduction::kSampleMean, "sample-mean"},
      {Reduction::kTokenMean, "token-mean"},
      {Reduction::kSeqMeanTokenSum, "seq-mean-token-sum"},
      {Reduction::kSeqMeanTokenMean, "seq-mean-token-mean"},
      {Reduction::kSeqMeanTokenSumNorm, "seq-mean-token-sum-norm"}};
};

// What the loss's gradient is taken with respect to.
enum class LossInput { kLogits, kLogProbs, kTokenLoss };
template <>
struct ModeNames<LossInput> {
  static constexpr std::pair<LossInput, const char*> kTable[] = {
      {LossInput::kLogits, "logits"},
      {LossInput::kLogProbs, "log_probs"},
      {LossInput::kTokenLoss, "token_loss"}};
};

// How a trainer counts effective tokens (SPEC §3).
enum class Policy { kFixed, kLegacy, kSlime };
template <>
struct ModeNames<Policy> {
  static constexpr std::pair<Policy, const char*> kTable[] = {
      {Policy::kFixed, "fixed"}, {Policy::kLegacy, "legacy"}, {Policy::kSlime, "slime"}};
};

// How samples are laid out before CP sharding (SPEC §2).
enum class Packing { kThd, kBshd };
template <>
struct ModeNames<Packing> {
  static constexpr std::pair<Packing, const char*> kTable[] = {{Packing::kThd, "thd"},
                                                               {Packing::kBshd, "bshd"}};
};

// How a sample is cut over CP ranks (SPEC §2).
enum class CpLayout { kZigzag, kAllgather };
template <>
struct ModeNames<CpLayout> {
  static constexpr std::pair<CpLayout, const char*> kTable[] = {
      {CpLayout::kZigzag, "zigzag"}, {CpLayout::kAllgather, "allgather"}};
};

// How a global batch is split over DP ranks (SPEC §7).
enum class Split { kContiguous, kRoundRobin };
template <>
struct ModeNames<Split> {
  static constexpr std::pair<Split, const char*> kTable[] = {{Split::kContiguous, "contiguous"},
                                                             {Split::kRoundRobin, "round-robin"}};
};

// The sharding geometry of one run (SPEC §2).
struct ShardLayout {
  Packing packing = Packing::kThd;
  int64_t padded_total_length =
      0;                    // thd: pad every sample to this length (0: ceil(T / 2cp) chunks)
  int64_t max_seq_len = 0;  // bshd: chunks of ceil(max_seq_len / 2cp)
  int64_t pad_multiple =
      0;  // thd: pad each sample to a multiple of lcm(this, 2cp) (Relax's VL path)
};

// Throws InputError naming `what` ("--cp", "--tp") when one of `sizes` is below 1.
void require_sizes_at_least_1(const char* what, const std::vector<int64_t>& sizes);

// Chunk size for a sample of length T on `cp` ranks (the zig-zag cut is 2·cp chunks of this size);
// throws InputError when the layout cannot hold T. `sample_padded` > 0 is the length the sample
// itself says it was padded to (Batch::padded_total_length); it takes precedence over the layout's
// padding and is rounded up to a multiple of 2·cp when it was recorded at another CP size.
int64_t chunk_size(int64_t total_length, int64_t cp, const ShardLayout& layout,
                   int64_t sample_padded = 0);

// What loss a trainer computes and how it reduces it (SPEC §3, §4).
struct LossSpec {
  LossKind loss = LossKind::kNll;
  Reduction reduce = Reduction::kPerToken;
  Policy policy = Policy::kFixed;
  double eps_low = 0.2, eps_high = 0.2;
  double l_norm = 0.0;            // seq-mean-token-sum-norm; 0: the batch's maximum response length
  int64_t global_batch_size = 0;  // B of the sample-mean objectives; 0: the batch's samples
  // ppo-clip's gradient jumps where rho crosses 1 - eps_low or 1 + eps_high. A candidate computing
  // rho in a low-precision dtype (inputs exact in the dtype, so relative error up to this much
  // times 1 + |lp - old|: one rounding of the difference, one of exp) may land on the other side;
  // such tokens are flagged `near_clip_boundary` and their gradient is not compared.
  double rho_rel_error = 0.0;
};

// Short spellings of the name tables.
inline const char* loss_kind_name(LossKind k) { return mode_name(k); }
inline bool parse_loss_kind(const std::string& s, LossKind* out) { return parse_mode(s, out); }
inline const char* reduction_name(Reduction r) { return mode_name(r); }
inline bool parse_reduction(const std::string& s, Reduction* out) { return parse_mode(s, out); }
inline const char* loss_input_name(LossInput i) { return mode_name(i); }
inline const char* policy_name(Policy p) { return mode_name(p); }
inline bool parse_policy(const std::string& s, Policy* out) { return parse_mode(s, out); }
const std::vector<Reduction>& all_reductions();

}  // namespace lossguard
