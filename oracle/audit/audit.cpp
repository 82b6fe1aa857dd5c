// Audit of a trainer's captures (SPEC §10). The global batch is rebuilt by sample index from the
// loss-computing ranks (last pipeline stage, TP rank 0), the layout from what each rank says it
// trained, each rank's token_weight mapped to tokens through the ownership rule (§2), and every
// check run on that. Captures that contradict each other are an input error (exit 2); a value the
// trainer recorded that is wrong, infinite or NaN is a failed check (exit 1), never a pass.
#include "oracle/audit/audit.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_map>

#include "core/contract.h"
#include "core/errors.h"
#include "core/term.h"
#include "oracle/count/metrics.h"

namespace lossguard::oracle {

namespace {

bool step_failed(const AuditStep& s, bool strict_scale) {
  for (const auto& c : s.checks) {
    if (c.ok.has_value() && !*c.ok) return true;
  }
  return s.diagnosis.fails(strict_scale);
}

}  // namespace

AuditTolerance audit_tolerance(DType dtype) {
  // u: the unit roundoff of the dtype the trainer computed its per-token loss in.
  // Weights: the hook's gradient dL/dl_t passes through at most a few ops in that dtype (the
  // reduction's division, a compensation factor, the gradient-accumulation division), each
  // rounding by at most u: 4u bounds four roundings. Loss: the scalar is a rounding of a sum
  // accumulated in float32 or wider (u), divided or scaled up to three times (3u), against
  // sum(w·l) whose every w carries the weight's 4u: 8u of the summed magnitude.
  // float32 keeps the 1e-5 used since the first round (~170u: its reductions run over millions of
  // terms with a float accumulator); float64 1e-9.
  switch (dtype) {
    case DType::kBFloat16:
      return {4 * 0x1p-9, 8 * 0x1p-9};  // 7.8e-3, 1.6e-2 (PyTorch's bf16 rtol is 1.6e-2)
    case DType::kFloat16:
      return {4 * 0x1p-11, 8 * 0x1p-11};  // 2.0e-3, 3.9e-3
    case DType::kFloat64:
      return {1e-9, 1e-9};
    default:
      return {1e-5, 1e-5};
  }
}

namespace {

constexpr int64_t kExactMatchTokenLimit = int64_t{1} << 20;

// A global sample index -> its position in the rebuilt batch (looked up once per sample per rank).
// Global sample index -> position in the rebuilt batch: a table when the indices are dense (the
// usual 0..N-1 of a sampler), a hash map otherwise. at() throws std::out_of_range as a map's does.
class SamplePositions {
 public:
  void assign_dense(std::vector<int64_t> table) { dense_ = std::move(table); }
  void set(int64_t idx, int64_t pos) { sparse_[idx] = pos; }
  int64_t at(int64_t idx) const {
    if (!sparse_.empty()) return sparse_.at(idx);
    if (idx < 0 || idx >= static_cast<int64_t>(dense_.size()) || dense_[idx] < 0)
      throw std::out_of_range(fmt::format("sample index {} is not in the batch", idx));
    return dense_[idx];
  }

 private:
  std::vector<int64_t> dense_;  // [max index + 1], -1 where absent
  std::unordered_map<int64_t, int64_t> sparse_;
};

struct SampleRecord {
  const RankCapture* rank = nullptr;
  int64_t microbatch = 0, position = 0;  // where it was first seen
  int64_t t = 0, r = 0;
  const int64_t* tokens = nullptr;
  const uint8_t* mask = nullptr;
  double denom = -1.0;  // the sample's d_i as the trainer used it (mb.{k}.sample_denoms), else -1
};

std::string where(const RankCapture& c) {
  return fmt::format("rank {} (DP {} CP {} TP {} PP {}, {})", c.rank, c.dp_rank, c.cp_rank,
                     c.tp_rank, c.pp_rank, c.file);
}

// Metadata every capture of a step must share, and each capture's own place in the world.
void check_metadata(int64_t step, const std::vector<const RankCapture*>& all) {
  const RankCapture& first = *all.front();
  for (const RankCapture* c : all) {
    if (c->world_size != first.world_size || c->tp != first.tp || c->pp != first.pp ||
        c->cp != first.cp || c->dp != first.dp) {
      throw_input_error(
          "step {}: {} says world {} (tp {} pp {} cp {} dp {}) but {} says world {} (tp {} pp {} "
          "cp {} dp {})",
          step, where(first), first.world_size, first.tp, first.pp, first.cp, first.dp, where(*c),
          c->world_size, c->tp, c->pp, c->cp, c->dp);
    }
    if (c->tp * c->pp * c->cp * c->dp != c->world_size) {
      throw_input_error("{}: world_size {} is not tp {} x pp {} x cp {} x dp {}", c->file,
                        c->world_size, c->tp, c->pp, c->cp, c->dp);
    }
    if (c->rank < 0 || c->rank >= c->world_size) {
      throw_input_error("{}: rank {} is outside a world of {} (ranks 0..{})", c->file, c->rank,
                        c->world_size, c->world_size - 1);
    }
    auto differs = [&](const char* what, const std::string& a, const std::string& b) {
      if (a != b) {
        throw_input_error("step {}: {} says {} = '{}' but {} says '{}' (one step, one {})", step,
                          first.file, what, a, c->file, b, what);
      }
    };
    differs("reduce", first.reduce, c->reduce);
    differs("cp_layout", std::string(mode_name(first.cp_layout)),
            std::string(mode_name(c->cp_layout)));
    if (!first.global_batch_unit.empty() &&
        !c->global_batch_unit.empty())  // stages before the last
      differs("global_batch_unit", first.global_batch_unit, c->global_batch_unit);  // record no B
    if (first.global_batch_size && c->global_batch_size &&
        *first.global_batch_size != *c->global_batch_size) {
      differs("global_batch_size", std::to_string(*first.global_batch_size),
              std::to_string(*c->global_batch_size));
    }
    auto decls = [](const RankCapture& r) {
      std::string text;
      for (const Term& t : r.terms) text += (text.empty() ? "" : "; ") + term_text(t);
      return text.empty() ? std::string("(none)") : text;
    };
    differs("terms", decls(first), decls(*c));
    if (first.l_norm.has_value() != c->l_norm.has_value() ||
        (first.l_norm && *first.l_norm != *c->l_norm)) {
      differs("l_norm", first.l_norm ? fmt::format("{}", *first.l_norm) : "(none)",
              c->l_norm ? fmt::format("{}", *c->l_norm) : "(none)");
    }
  }
}

struct LossRanks {
  // The loss-computing ranks, one per (DP, CP) coordinate; TP peers are compared with them.
  std::map<std::pair<int64_t, int64_t>, const RankCapture*> by_coord;
  std::vector<const RankCapture*> tp_peers;
};

LossRanks loss_ranks(int64_t step, const std::vector<const RankCapture*>& all) {
  const RankCapture& first = *all.front();
  LossRanks out;
  std::map<int64_t, const RankCapture*> by_rank;
  for (const RankCapture* c : all) {
    if (!by_rank.emplace(c->rank, c).second) {
      throw_input_error("step {}: two captures for rank {}: {} and {}", step, c->rank,
                        by_rank[c->rank]->file, c->file);
    }
    if (c->pp_rank != c->pp - 1) continue;
    if (c->tp_rank != 0) {
      out.tp_peers.push_back(c);
      continue;
    }
    auto [it, fresh] = out.by_coord.emplace(std::make_pair(c->dp_rank, c->cp_rank), c);
    if (!fresh) {
      throw_input_error(
          "step {}: {} and {} both say they are the loss-computing rank of DP {} CP {} (TP 0, "
          "last stage)",
          step, it->second->file, c->file, c->dp_rank, c->cp_rank);
    }
  }
  // Every (DP, CP) coordinate the metadata claims must have its capture. The work is bounded by
  // the captures given, not by the claim (a world of 2^40 in four 9 KB files): count the ones
  // present, and look for the first missing coordinate among at most that many + 1.
  int64_t present = 0;
  for (const auto& [coord, c] : out.by_coord) {
    if (coord.first >= 0 && coord.first < first.dp && coord.second >= 0 && coord.second < first.cp)
      ++present;
  }
  const auto claimed = static_cast<__int128>(first.dp) * static_cast<__int128>(first.cp);
  if (claimed > present) {
    std::string where;
    for (int64_t d = 0; d < first.dp && where.empty(); ++d) {
      for (int64_t c = 0; c < first.cp; ++c) {
        if (!out.by_coord.count({d, c})) {
          where = fmt::format("DP {} CP {}", d, c);
          break;
        }
      }
    }
    const auto more = static_cast<unsigned long long>(claimed - present - 1);
    throw_input_error(
        "step {}: no capture from the loss-computing rank (last pipeline stage, TP rank 0) of "
        "{}{} (the metadata claims DP {} x CP {}; {} capture(s) of loss-computing ranks given)",
        step, where, more > 0 ? fmt::format(" and {} more", more) : "", first.dp, first.cp,
        present);
  }
  return out;
}

// 1. The global batch, by sample index; every rank that holds a sample must hold the same one.
// A dummy micro-batch's samples are not part of it: one that holds effective tokens or weight is
// a coverage problem (its loss would be dropped or counted where it must not be).
struct RebuiltBatch {
  Batch batch;
  SamplePositions position;  // global sample index -> position in the batch
  std::vector<std::string> dummy_problems;
};

// Long: its four steps (read every holder's samples, find each index's first holder, pack the
// batch, name disagreements) share the per-holder tables; each step is commented where it starts.
RebuiltBatch rebuild_batch(int64_t step, const LossRanks& ranks) {
  RebuiltBatch out;
  // Every non-dummy sample as the ranks hold it, in the order they are read; then, per global
  // index, the first holder (the others must agree with it).
  std::vector<std::pair<int64_t, SampleRecord>> held;
  int64_t max_idx = -1;
  for (const auto& [coord, c] : ranks.by_coord) {
    for (const CapturedMicroBatch& mb : c->microbatches) {
      if (mb.dummy) {
        int64_t effective = 0;
        for (uint8_t m : mb.loss_masks) effective += m;
        const bool weighted = std::any_of(mb.token_weight.begin(), mb.token_weight.end(),
                                          [](double w) { return w != 0.0; });
        if (effective > 0 || weighted) {
          out.dummy_problems.push_back(fmt::format(
              "{} micro-batch {} is marked dummy but holds {} sample(s) with {} effective "
              "token(s){}: a dummy micro-batch carries no loss",
              where(*c), mb.index, mb.sample_indices.size(), effective,
              weighted ? " and non-zero token_weight" : ""));
        }
        continue;
      }
      int64_t tok = 0, msk = 0;
      for (std::size_t p = 0; p < mb.sample_indices.size(); ++p) {
        const int64_t idx = mb.sample_indices[p], t = mb.total_lengths[p],
                      r = mb.response_lengths[p];
        if (idx < 0)
          throw_input_error("{}: micro-batch {} names sample index {}", c->file, mb.index, idx);
        held.emplace_back(idx, SampleRecord{c, mb.index, static_cast<int64_t>(p), t, r,
                                            mb.tokens.data() + tok, mb.loss_masks.data() + msk,
                                            mb.sample_denoms ? (*mb.sample_denoms)[p] : -1.0});
        max_idx = std::max(max_idx, idx);
        tok += t;
        msk += r;
      }
    }
  }
  // The first holder of each index: a table over 0..max when the indices are dense.
  const bool dense = max_idx < 2 * static_cast<int64_t>(held.size()) + 1024;
  std::vector<int64_t> first_dense;
  std::unordered_map<int64_t, int64_t> first_sparse;
  if (dense) first_dense.assign(static_cast<std::size_t>(max_idx + 1), -1);
  std::vector<int64_t> unique;  // positions in `held` of each index's first holder
  for (std::size_t k = 0; k < held.size(); ++k) {
    const auto& [idx, rec] = held[k];
    int64_t& first = dense ? first_dense[idx] : first_sparse.try_emplace(idx, -1).first->second;
    if (first < 0) {
      first = static_cast<int64_t>(k);
      if (!dense) unique.push_back(first);  // dense: read off the table in index order below
      continue;
    }
    const SampleRecord& o = held[first].second;
    if (o.t != rec.t || o.r != rec.r || !std::equal(o.tokens, o.tokens + rec.t, rec.tokens) ||
        !std::equal(o.mask, o.mask + rec.r, rec.mask)) {
      throw_input_error(
          "step {}: sample {} differs between {} micro-batch {} and {} micro-batch {} "
          "(lengths {}/{} vs {}/{}, or its tokens or mask)",
          step, idx, where(*o.rank), o.microbatch, where(*rec.rank), rec.microbatch, o.t, o.r,
          rec.t, rec.r);
    }
    if (o.denom != rec.denom) {
      throw_input_error(
          "step {}: sample {} has sample_denoms {} in {} micro-batch {} but {} in {} micro-batch "
          "{}",
          step, idx, o.denom, where(*o.rank), o.microbatch, rec.denom, where(*rec.rank),
          rec.microbatch);
    }
  }
  // The batch in index order, packed (one array per field, as a packed dump's).
  if (dense) {
    for (int64_t idx = 0; idx <= max_idx; ++idx) {
      if (first_dense[idx] >= 0) unique.push_back(first_dense[idx]);
    }
  } else {
    std::sort(unique.begin(), unique.end(),
              [&](int64_t a, int64_t b) { return held[a].first < held[b].first; });
  }
  const auto n = static_cast<int64_t>(unique.size());
  int64_t sum_t = 0, sum_r = 0;
  for (int64_t k : unique) {
    sum_t += held[k].second.t;
    sum_r += held[k].second.r;
  }
  HostArray tokens = HostArray::zeros(DType::kInt64, {sum_t});
  HostArray masks = HostArray::zeros(DType::kUInt8, {sum_r});
  HostArray total_lengths = HostArray::zeros(DType::kInt64, {n});
  HostArray response_lengths = HostArray::zeros(DType::kInt64, {n});
  auto* tok = reinterpret_cast<int64_t*>(tokens.mutable_data());
  auto* msk = reinterpret_cast<uint8_t*>(masks.mutable_data());
  auto* tl = reinterpret_cast<int64_t*>(total_lengths.mutable_data());
  auto* rl = reinterpret_cast<int64_t*>(response_lengths.mutable_data());
  // Per-sample denominators (SPEC §3: d_i as the trainer used it, slime's rollout_mask_sums): the
  // objective's own when recorded; -1 (d_i = m_i) for the samples recorded without one.
  const bool any_denom = std::any_of(unique.begin(), unique.end(),
                                     [&](int64_t k) { return held[k].second.denom >= 0; });
  std::vector<double> denoms(any_denom ? static_cast<std::size_t>(n) : 0, -1.0);
  // The first-holder table becomes the position table: an index's entry is now its place in the
  // batch (absent indices stay -1).
  for (int64_t j = 0; j < n; ++j) {
    const auto& [idx, rec] = held[unique[j]];
    if (dense)
      first_dense[idx] = j;
    else
      out.position.set(idx, j);
    tl[j] = rec.t;
    rl[j] = rec.r;
    if (any_denom) denoms[static_cast<std::size_t>(j)] = rec.denom;
    tok = std::copy(rec.tokens, rec.tokens + rec.t, tok);
    msk = std::copy(rec.mask, rec.mask + rec.r, msk);
  }
  if (dense) out.position.assign_dense(std::move(first_dense));
  BatchBuilder builder(LoadNeeds{true, false, false});
  builder.begin_file(fmt::format("captures of step {}", step));
  PackedFields f;
  f.tokens = &tokens;
  f.total_lengths = &total_lengths;
  f.response_lengths = &response_lengths;
  f.loss_masks = &masks;
  builder.add_packed(f);
  out.batch = builder.finish();
  out.batch.sample_denoms = std::move(denoms);  // a non-finite one fails the weights check
  // Messages name a sample by its global index, as before (a packed file numbers them 0..n-1).
  for (int64_t j = 0; j < n; ++j) out.batch.origins[j].index_in_file = held[unique[j]].first;
  return out;
}

// 2. The layout each rank trained: its micro-batches, their CP size and sub-groups.
StepLayout rebuild_layout(int64_t step, const RankCapture& first, const LossRanks& ranks,
                          const SamplePositions& position) {
  StepLayout layout;
  layout.dp = first.dp;
  layout.cp = first.cp;
  layout.tp = first.tp;
  layout.cp_layout = first.cp_layout;
  layout.source = "dump";
  const int64_t cp = first.cp;
  auto rank_at = [&](int64_t d, int64_t c) -> const RankCapture& {
    return *ranks.by_coord.at({d, c});
  };
  for (int64_t d = 0; d < first.dp; ++d) {
    const RankCapture& lead = rank_at(d, 0);
    for (int64_t c = 1; c < cp; ++c) {
      if (rank_at(d, c).microbatches.size() != lead.microbatches.size()) {
        throw_input_error(
            "step {}: {} has {} micro-batches but {} has {} (the CP ranks of a DP rank train the "
            "same micro-batches)",
            step, where(lead), lead.microbatches.size(), where(rank_at(d, c)),
            rank_at(d, c).microbatches.size());
      }
    }
    for (std::size_t k = 0; k < lead.microbatches.size(); ++k) {
      MicroBatch mb;
      mb.dp_rank = d;
      mb.index = static_cast<int64_t>(k);
      mb.cp_size = lead.microbatches[k].cp_size;
      mb.dummy = lead.microbatches[k].dummy;
      if (mb.cp_size < 1 || cp % mb.cp_size != 0) {
        throw_input_error(
            "{}: micro-batch {} has CP size {}, which does not divide the CP group of {}",
            lead.file, k, mb.cp_size, cp);
      }
      for (int64_t c = 0; c < cp; ++c) {
        const CapturedMicroBatch& m = rank_at(d, c).microbatches[k];
        if (m.cp_size != mb.cp_size || m.dummy != mb.dummy) {
          throw_input_error(
              "step {}: DP rank {} micro-batch {}: CP rank 0 says CP size {}{} but CP rank {} ({}) "
              "says {}{}",
              step, d, k, mb.cp_size, mb.dummy ? " (dummy)" : "", c, rank_at(d, c).file, m.cp_size,
              m.dummy ? " (dummy)" : "");
        }
        if (mb.dummy) continue;  // its samples are not in the batch (rebuild_batch)
        const int64_t g = c / mb.cp_size;
        std::vector<int64_t> pos;
        for (int64_t idx : m.sample_indices) pos.push_back(position.at(idx));
        if (static_cast<int64_t>(mb.groups.size()) <= g) {
          mb.groups.push_back(pos);
        } else if (mb.groups[g] != pos) {
          throw_input_error(
              "step {}: DP rank {} micro-batch {}: CP ranks {} and {} of one CP group hold "
              "different samples ({} and {})",
              step, d, k, g * mb.cp_size, c, rank_at(d, g * mb.cp_size).file, rank_at(d, c).file);
        }
      }
      layout.microbatches.push_back(std::move(mb));
    }
  }
  return layout;
}

// The first few problems of one kind, and how many there were.
struct Problems {
  std::vector<std::string> items;
  int64_t total = 0;
  void add(std::string text) {
    if (total++ < 3) items.push_back(std::move(text));
  }
  bool empty() const { return total == 0; }
  std::string text() const {
    return fmt::format("{}{}", fmt::join(items, "; "),
                       total > 3 ? fmt::format(" (and {} more)", total - 3) : "");
  }
};

// A float record that is inf or NaN, named by its place.
void check_finite(Problems& p, const RankCapture& c, const std::string& record, double v) {
  if (!std::isfinite(v)) p.add(fmt::format("{}: {} = {}", where(c), record, v));
}
// The same for a record named only when it is not finite (the per-token loops: formatting a name
// for every token was a tenth of a large audit's time).
template <typename Name>
void check_finite_lazy(Problems& p, const RankCapture& c, double v, Name&& record) {
  if (!std::isfinite(v)) p.add(fmt::format("{}: {} = {}", where(c), record(), v));
}

// 3. Each loss rank's measured weights placed on the tokens it owns; the per-micro-batch counts
// and loss consistency on the way.
struct Measurement {
  std::vector<double> measured;  // [sum R] sum over ranks of token_weight · grad_scale
  std::vector<int32_t> held;     // [sum R] how many ranks hold each token
  Problems counts, loss, nonfinite_weights, nonfinite_loss;
  std::string masked_weighted;
  int64_t nan_losses = 0;  // micro-batch means over zero tokens: NaN values, zero gradients
  std::string first_nan;
  int64_t num_tokens_seen = 0;
  // Micro-batches whose num_tokens is the whole samples' count on every CP rank of a CP > 1
  // micro-batch (slime: each CP rank counts whole samples and multiplies its loss by cp, so the
  // reduced count is cp x N): consistent when num_tokens_reduced is cp x N.
  int64_t whole_sample_counts = 0;
  bool loss_seen = false, token_loss_seen = false;
  std::string term_without_loss;  // a term hooked without its token_loss: the loss sum is unknown
};

// Calls fn(t, j, p) for every response token t the rank owns in micro-batch mb, in the rank's local
// order (per sample, owned response indices ascending; j = 0, 1, ...; p the sample's position in
// the micro-batch). Returns how many it owns.
template <typename Fn>
int64_t for_owned(const RankCapture& c, const CapturedMicroBatch& mb, const AuditStep& out,
                  const SamplePositions& position, Fn&& fn) {
  const Batch& b = out.batch;
  int64_t j = 0;
  for (std::size_t p = 0; p < mb.sample_indices.size(); ++p) {
    const int64_t i = position.at(mb.sample_indices[p]);
    for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
      if (out.place.owner[t] != c.cp_rank) continue;
      fn(t, j, p);
      ++j;
    }
  }
  return j;
}

// Long: one rank's records read micro-batch by micro-batch in the order the trainer wrote them
// (weights, counts, loss, terms), each check adding to the same Measurement.
void measure_rank(const RankCapture& c, const AuditStep& out, const SamplePositions& position,
                  bool per_token_objective, double loss_tol, Measurement& m, AuditRank& ar) {
  const Batch& b = out.batch;
  check_finite(m.nonfinite_weights, c, "grad_scale", c.grad_scale);
  for (const CapturedMicroBatch& mb : c.microbatches) {
    if (mb.dummy) continue;
    const std::string mbname = fmt::format("micro-batch {}", mb.index);
    for (std::size_t j = 0; j < mb.token_weight.size(); ++j) {
      check_finite_lazy(m.nonfinite_weights, c, mb.token_weight[j],
                        [&] { return fmt::format("{} token_weight[{}]", mbname, j); });
      if (mb.token_loss) {
        check_finite_lazy(m.nonfinite_loss, c, (*mb.token_loss)[j],
                          [&] { return fmt::format("{} token_loss[{}]", mbname, j); });
      }
    }
    if (mb.sample_denoms) {
      for (std::size_t p = 0; p < mb.sample_denoms->size(); ++p) {
        check_finite_lazy(m.nonfinite_weights, c, (*mb.sample_denoms)[p],
                          [&] { return fmt::format("{} sample_denoms[{}]", mbname, p); });
      }
    }
    int64_t owned_effective = 0;
    double weighted_loss = 0.0, magnitude = 0.0;
    const auto held = static_cast<int64_t>(mb.token_weight.size());
    const int64_t owns = for_owned(c, mb, out, position, [&](int64_t t, int64_t j, std::size_t p) {
      if (j >= held) return;  // reported below, with the count
      const double w = mb.token_weight[j] * c.grad_scale;
      if (b.loss_mask[t]) {
        ++owned_effective;
        m.measured[t] += w;
      } else if (w != 0.0 && m.masked_weighted.empty()) {
        m.masked_weighted = fmt::format(
            "{} {}: sample {} response index {} has mask 0 but weight {:.6g}", where(c), mbname,
            mb.sample_indices[p], t - b.response_offsets[position.at(mb.sample_indices[p])], w);
      }
      ++m.held[t];
      if (mb.token_loss) {
        weighted_loss += mb.token_weight[j] * (*mb.token_loss)[j];
        magnitude += std::fabs(mb.token_weight[j] * (*mb.token_loss)[j]);
      }
    });
    if (static_cast<int64_t>(mb.token_weight.size()) != owns) {
      throw_input_error(
          "{}: {}: token_weight has {} entries but the rank owns {} response tokens of its "
          "samples at CP size {} ({} layout)",
          c.file, mbname, mb.token_weight.size(), owns, mb.cp_size,
          mode_name(out.layout.cp_layout));
    }
    for (const auto& [name, term] : mb.terms) {
      if (static_cast<int64_t>(term.token_weight.size()) != owns ||
          (term.token_loss && term.token_loss->size() != term.token_weight.size())) {
        throw_input_error(
            "{}: {}: term {}: token_weight has {} entries{} but the rank owns {} response tokens "
            "of its samples (a term is hooked over the same owned tokens)",
            c.file, mbname, name, term.token_weight.size(),
            term.token_loss ? fmt::format(" and token_loss {}", term.token_loss->size()) : "",
            owns);
      }
      if (term.mask &&
          static_cast<int64_t>(term.mask->size()) != static_cast<int64_t>(mb.loss_masks.size())) {
        throw_input_error("{}: {}: term {}: mask has {} entries, the micro-batch's loss_masks {}",
                          c.file, mbname, name, term.mask->size(), mb.loss_masks.size());
      }
    }
    // The backpropagated loss is the sum of every term's: each term's sum of weight × loss.
    std::string term_without_loss;
    for (const auto& entry : mb.terms) {
      const std::string& name = entry.first;  // (a structured binding clang cannot capture)
      const CapturedTerm& term = entry.second;
      if (!term.token_loss) {
        if (term_without_loss.empty()) term_without_loss = name;
        continue;
      }
      for (std::size_t j = 0; j < term.token_weight.size(); ++j) {
        check_finite_lazy(m.nonfinite_loss, c, (*term.token_loss)[j], [&] {
          return fmt::format("{} term.{}.token_loss[{}]", mbname, name, j);
        });
        weighted_loss += term.token_weight[j] * (*term.token_loss)[j];
        magnitude += std::fabs(term.token_weight[j] * (*term.token_loss)[j]);
      }
    }
    ar.owned_tokens += owns;
    if (mb.num_tokens) {
      ++m.num_tokens_seen;
      int64_t whole_effective = 0;  // the micro-batch's samples' effective tokens, every CP rank's
      for (const int64_t index : mb.sample_indices) {
        const int64_t i = position.at(index);
        for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t)
          whole_effective += b.loss_mask[t] ? 1 : 0;
      }
      if (per_token_objective && *mb.num_tokens != owned_effective) {
        if (mb.cp_size > 1 && *mb.num_tokens == whole_effective) {
          ++m.whole_sample_counts;
        } else {
          m.counts.add(fmt::format(
              "{} {}: num_tokens {} but the rank owns {} effective tokens{}", where(c), mbname,
              *mb.num_tokens, owned_effective,
              mb.cp_size > 1
                  ? fmt::format(" (its samples hold {} over every CP rank)", whole_effective)
                  : std::string()));
        }
      }
    }
    m.loss_seen |= mb.loss.has_value();
    m.token_loss_seen |= mb.token_loss.has_value();
    if (!mb.loss) continue;
    // A mean over zero tokens: NaN in the trainer's loss value while its gradient is exactly 0.
    // With a NaN gradient too (an unclamped count: every weight NaN), it is no such finding: the
    // non-finite weights fail the weights check.
    const bool zero_gradient = std::all_of(mb.token_weight.begin(), mb.token_weight.end(),
                                           [](double w) { return w == 0.0; });
    if (std::isnan(*mb.loss) && owned_effective == 0 && zero_gradient) {
      if (m.nan_losses++ == 0) m.first_nan = fmt::format("{} {}", where(c), mbname);
      continue;
    }
    check_finite(m.nonfinite_loss, c, mbname + " loss", *mb.loss);
    if (!term_without_loss.empty()) {
      if (m.term_without_loss.empty())
        m.term_without_loss = fmt::format("{} {}: term {}", where(c), mbname, term_without_loss);
      continue;
    }
    if (!mb.token_loss || !std::isfinite(*mb.loss) || !std::isfinite(weighted_loss)) continue;
    if (!(std::fabs(*mb.loss - weighted_loss) <=
          loss_tol * magnitude + 0.1 * loss_tol * std::fabs(*mb.loss) + 1e-12)) {
      m.loss.add(fmt::format("{} {}: loss {:.9g} but sum of token_weight x token_loss is {:.9g}",
                             where(c), mbname, *mb.loss, weighted_loss));
    }
  }
  if (per_token_objective && c.num_tokens_reduced && *c.num_tokens_reduced != out.global_tokens) {
    const bool whole_samples =
        m.whole_sample_counts > 0 && *c.num_tokens_reduced == c.cp * out.global_tokens;
    if (!whole_samples) {
      m.counts.add(fmt::format(
          "{}: num_tokens_reduced {} but the step has N = {} effective tokens{}", where(c),
          *c.num_tokens_reduced, out.global_tokens,
          m.whole_sample_counts > 0
              ? fmt::format(" (cp x N = {} with whole-sample counts)", c.cp * out.global_tokens)
              : std::string()));
    }
  }
}

// TP peers compute the same loss: their weights must agree exactly with TP rank 0's.
std::string tp_disagreement(const LossRanks& ranks) {
  for (const RankCapture* peer : ranks.tp_peers) {
    const RankCapture& lead = *ranks.by_coord.at({peer->dp_rank, peer->cp_rank});
    bool same = peer->microbatches.size() == lead.microbatches.size() &&
                peer->grad_scale == lead.grad_scale;
    for (std::size_t k = 0; same && k < lead.microbatches.size(); ++k) {
      const auto& a = peer->microbatches[k];
      const auto& b = lead.microbatches[k];
      same = a.token_weight == b.token_weight && a.sample_indices == b.sample_indices &&
             a.terms.size() == b.terms.size();
      for (auto it = a.terms.begin(), jt = b.terms.begin(); same && it != a.terms.end();
           ++it, ++jt) {
        same = it->first == jt->first && it->second.token_weight == jt->second.token_weight;
      }
    }
    if (!same) return fmt::format("{} disagrees with its TP rank 0 ({})", where(*peer), lead.file);
  }
  return "";
}

AuditCheck coverage_check(const AuditStep& out, const Measurement& m,
                          const std::vector<std::string>& placement_problems,
                          const std::vector<std::string>& dummy_problems,
                          const std::string& tp_problem, std::optional<int64_t> recorded_batch) {
  const Batch& b = out.batch;
  std::string problem;
  for (const auto& p : dummy_problems) {
    if (problem.empty()) problem = p;
  }
  for (const auto& p : placement_problems) {
    if (problem.empty()) problem = p;
  }
  if (problem.empty() && recorded_batch && *recorded_batch > b.num_samples()) {
    problem = fmt::format(
        "the captures record global_batch_size = {} but hold {} sample(s): {} sample(s) of the "
        "step were dropped before the loss",
        *recorded_batch, b.num_samples(), *recorded_batch - b.num_samples());
  }
  for (int64_t i = 0; i < b.num_samples() && problem.empty(); ++i) {
    for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
      if (!b.loss_mask[t] || m.held[t] == 1) continue;
      problem = fmt::format(
          "sample {} response index {} is held by {} rank(s){}", b.origins[i].index_in_file,
          t - b.response_offsets[i], m.held[t],
          m.held[t] == 0 ? " (no rank owns its predicting logit)" : " (placed more than once)");
      break;
    }
  }
  if (problem.empty() && !m.masked_weighted.empty())
    problem = "masked tokens carry weight: " + m.masked_weighted;
  if (problem.empty()) problem = tp_problem;
  if (!problem.empty()) return {"coverage", false, problem};
  return {"coverage", true,
          fmt::format("every one of {} effective tokens held exactly once; masked tokens weigh 0",
                      out.global_tokens)};
}

AuditCheck counts_check(const AuditStep& out, const Measurement& m, bool recorded_reduced,
                        bool per_token_objective) {
  if (m.num_tokens_seen == 0 && !recorded_reduced) return {"counts", std::nullopt, "not recorded"};
  if (!per_token_objective) {
    return {"counts", std::nullopt,
            fmt::format("shown, not judged under {} (N = {})", mode_name(out.reduce),
                        out.global_tokens)};
  }
  if (!m.counts.empty()) return {"counts", false, m.counts.text()};
  // Whole-sample counts are consistent only with the loss x cp that compensates them: then the
  // weights are exact; without it every weight is 1/cp of the truth (a scale Adam would hide).
  if (m.whole_sample_counts > 0 && out.global_tokens > 0 && !out.diagnosis.exact()) {
    return {"counts", false,
            fmt::format(
                "every CP rank counts its micro-batch's whole samples (num_tokens_reduced = cp x "
                "N = {} x {}) but the weights are not those of the loss x cp that compensates "
                "it: {}",
                out.layout.cp, out.global_tokens, out.diagnosis.summary())};
  }
  if (m.whole_sample_counts > 0) {
    return {
        "counts", true,
        fmt::format("every CP rank counts its micro-batch's whole samples (slime's convention, the "
                    "loss x cp); {}N = {}",
                    recorded_reduced ? "num_tokens_reduced is cp x " : "", out.global_tokens)};
  }
  return {"counts", true,
          fmt::format("{}{}N = {}",
                      m.num_tokens_seen > 0 ? "every num_tokens is the rank's owned count; " : "",
                      recorded_reduced ? "num_tokens_reduced is " : "", out.global_tokens)};
}

AuditCheck loss_check(const Measurement& m) {
  if (!m.nonfinite_loss.empty()) return {"loss", false, "not finite: " + m.nonfinite_loss.text()};
  if (!m.loss_seen || !m.token_loss_seen) {
    return {
        "loss", std::nullopt,
        fmt::format("not recorded ({})", !m.loss_seen && !m.token_loss_seen ? "loss and token_loss"
                                         : !m.loss_seen                     ? "loss"
                                                                            : "token_loss")};
  }
  if (!m.loss.empty()) return {"loss", false, m.loss.text()};
  if (!m.term_without_loss.empty()) {
    return {"loss", std::nullopt,
            fmt::format("not checked: {} recorded no token_loss (the loss is the sum over every "
                        "term)",
                        m.term_without_loss)};
  }
  return {"loss", true, "every loss is the sum of token_weight x token_loss"};
}

// Pipeline stages (SPEC §10): a stage before the last computes no loss; it must apply the scaling
// the last stage of its (DP, CP) coordinate applied and hold the count that stage reduced
// (Megatron's finalize_model_grads broadcasts it from the last stage). Judged only when PP > 1.
AuditCheck stages_check(const LossRanks& ranks, const std::vector<const RankCapture*>& all) {
  Problems problems;
  int64_t compared = 0;
  for (const RankCapture* c : all) {
    if (c->pp_rank == c->pp - 1) continue;
    if (!c->microbatches.empty()) {
      problems.add(
          fmt::format("{} is pipeline stage {} of {} but records {} micro-batch(es): only "
                      "the last stage computes the loss",
                      where(*c), c->pp_rank, c->pp, c->microbatches.size()));
    }
    const auto it = ranks.by_coord.find({c->dp_rank, c->cp_rank});
    if (it == ranks.by_coord.end()) continue;  // reported as missing (exit 2) before this
    const RankCapture& last = *it->second;
    ++compared;
    const double a = c->grad_scale, b = last.grad_scale;
    if (!(std::fabs(a - b) <= 1e-12 * std::max(std::fabs(a), std::fabs(b)))) {
      problems.add(
          fmt::format("{} scaled its gradients by {:.9g} where the last stage ({}) scaled "
                      "by {:.9g}: the stages train with different normalisations",
                      where(*c), a, last.file, b));
    }
    if (c->num_tokens_reduced && last.num_tokens_reduced &&
        *c->num_tokens_reduced != *last.num_tokens_reduced) {
      problems.add(
          fmt::format("{} holds num_tokens_reduced {} where the last stage ({}) reduced {}: "
                      "the count did not reach it",
                      where(*c), *c->num_tokens_reduced, last.file, *last.num_tokens_reduced));
    }
  }
  if (!problems.empty()) return {"stages", false, problems.text()};
  return {"stages", true,
          fmt::format("{} rank(s) of the earlier stage(s) applied the last stage's gradient scale "
                      "and hold its count",
                      compared)};
}

// The skip decision: expected from the global fixed count, identical on every rank; a stepping
// rank's norm finite, a skipping rank's 0.
AuditCheck decision_check(const AuditStep& out, const std::vector<const RankCapture*>& all) {
  Problems problems;
  int64_t recorded = 0;
  for (const RankCapture* c : all) {
    if (c->grad_norm && !std::isfinite(*c->grad_norm)) {
      problems.add(fmt::format("rank {} ({}) reports grad_norm {}{}", c->rank, c->file,
                               *c->grad_norm,
                               c->skipped && !*c->skipped ? " and stepped on it" : ""));
    }
    // The LR scheduler advances exactly when the optimizer steps (SPEC §7: a skipped step
    // advances neither); without `skipped`, against the expected decision.
    if (c->scheduler_stepped) {
      const bool optimizer_stepped = c->skipped ? !*c->skipped : !out.expected_skip;
      if (*c->scheduler_stepped != optimizer_stepped) {
        problems.add(fmt::format("rank {} {} the LR scheduler while its optimizer {}", c->rank,
                                 *c->scheduler_stepped ? "advanced" : "did not advance",
                                 c->skipped ? (*c->skipped ? "skipped" : "stepped")
                                            : (out.expected_skip ? "should skip" : "should step")));
      }
      if (!c->skipped) ++recorded;
    }
    if (!c->skipped) continue;
    ++recorded;
    if (*c->skipped != out.expected_skip) {
      problems.add(fmt::format(
          "rank {}{} {} (expected {}: N = {})", c->rank,
          c->pp > 1 ? fmt::format(" (pipeline stage {} of {})", c->pp_rank, c->pp) : std::string(),
          *c->skipped ? "skipped" : "stepped", out.expected_skip ? "skip" : "step",
          out.global_tokens));
    }
    if (*c->skipped && c->grad_norm && *c->grad_norm != 0.0 && std::isfinite(*c->grad_norm))
      problems.add(fmt::format("rank {} skipped but reports grad_norm {}", c->rank, *c->grad_norm));
  }
  if (!problems.empty()) return {"decision", false, problems.text()};
  if (!recorded) return {"decision", std::nullopt, "not recorded (skipped)"};
  return {"decision", true,
          fmt::format("all {} recording rank(s) {} (N = {})", recorded,
                      out.expected_skip ? "skipped" : "stepped", out.global_tokens)};
}

AuditCheck metrics_check(const std::vector<const RankCapture*>& all) {
  Problems problems;
  int64_t metric_ranks = 0;
  for (const RankCapture* c : all) {
    if (!c->metrics_values) continue;
    ++metric_ranks;
    for (std::size_t j = 0; j < c->metrics_values->size(); ++j)
      check_finite_lazy(problems, *c, (*c->metrics_values)[j],
                        [&] { return fmt::format("metrics.values[{}]", j); });
    try {
      normalize_metrics(*c->metrics_values, c->metrics_keys);
    } catch (const MetricsError& e) {
      problems.add(fmt::format("rank {}: {}", c->rank, e.what()));
    }
  }
  if (!problems.empty()) return {"metrics", false, problems.text()};
  if (!metric_ranks) return {"metrics", std::nullopt, "not recorded"};
  return {"metrics", true, fmt::format("{} rank(s) normalise", metric_ranks)};
}

// 5. The terms besides main (SPEC §11), each weighed over its own mask from its own records,
// relative to main's scale: 5a finds what was hooked, 5b flags the undeclared, 5c rebuilds a field
// mask, 5d measures one term, 5e judges it.

// 5a. Every term some loss rank hooked, with the first place it carries non-zero weight ("" when it
// weighs nothing anywhere).
std::map<std::string, std::string> hooked_terms(const LossRanks& ranks) {
  std::map<std::string, std::string> hooked;
  for (const auto& [coord, c] : ranks.by_coord) {
    for (const CapturedMicroBatch& mb : c->microbatches) {
      if (mb.dummy) continue;
      for (const auto& [name, term] : mb.terms) {
        std::string& first = hooked[name];
        if (!first.empty()) continue;
        for (std::size_t j = 0; j < term.token_weight.size(); ++j) {
          if (term.token_weight[j] != 0.0) {
            first = fmt::format("{} micro-batch {} token {} (weight {:.6g})", where(*c), mb.index,
                                j, term.token_weight[j] * c->grad_scale);
            break;
          }
        }
      }
    }
  }
  return hooked;
}

// 5b. A hooked term the captures do not declare: a failure when it carries weight (a loss the
// objective does not name is active), shown otherwise.
void flag_undeclared(AuditStep& out, const std::string& name, const std::string& first_weight) {
  AuditTerm t;
  t.term.name = name;
  t.declared = false;
  t.hooked = true;
  t.diagnosis.kind = "not-run";
  if (!first_weight.empty()) {
    out.checks.push_back(
        {name + ".declared", false,
         fmt::format("term {} carries weight but the captures do not declare it (metadata "
                     "terms): a loss the objective does not name is active; first at {}",
                     name, first_weight)});
    out.findings.push_back({"undeclared_term",
                            fmt::format("step {}: term {} is hooked with non-zero weight but not "
                                        "declared (first at {})",
                                        out.step, name, first_weight),
                            {{"term", name}}});
  } else {
    out.checks.push_back(
        {name + ".declared", std::nullopt,
         fmt::format("term {} is hooked but not declared; its weight is 0 everywhere", name)});
  }
  out.terms.push_back(std::move(t));
}

// 5c. A field mask as the ranks that hooked the term recorded it, [sum R]; ranks must agree and
// every sample must be covered (exit 2 otherwise).
std::vector<uint8_t> recorded_field_mask(const AuditStep& out, const LossRanks& ranks,
                                         const std::string& name, const SamplePositions& position) {
  const Batch& b = out.batch;
  constexpr uint8_t kUnset = 2;
  std::vector<uint8_t> mask(b.loss_mask.size(), kUnset);
  for (const auto& [coord, c] : ranks.by_coord) {
    for (const CapturedMicroBatch& mb : c->microbatches) {
      if (mb.dummy) continue;
      auto it = mb.terms.find(name);
      if (it == mb.terms.end()) continue;
      if (!it->second.mask) {
        throw_input_error(
            "{}: micro-batch {}: term {} is declared with a field mask but records no "
            "mb.{}.term.{}.mask",
            c->file, mb.index, name, mb.index, name);
      }
      int64_t off = 0;
      for (std::size_t p = 0; p < mb.sample_indices.size(); ++p) {
        const int64_t i = position.at(mb.sample_indices[p]);
        for (int64_t r = 0; r < b.response_lengths[i]; ++r) {
          const uint8_t v = (*it->second.mask)[off + r];
          uint8_t& dst = mask[b.response_offsets[i] + r];
          if (dst != kUnset && dst != v) {
            throw_input_error(
                "step {}: term {}: sample {} response index {} has mask {} in {} but {} elsewhere",
                out.step, name, mb.sample_indices[p], r, v, c->file, dst);
          }
          dst = v;
        }
        off += b.response_lengths[i];
      }
    }
  }
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    for (int64_t t = b.response_offsets[i]; t < b.response_offsets[i + 1]; ++t) {
      if (mask[t] == kUnset) {
        throw_input_error(
            "step {}: term {} has a field mask, but no rank that hooked it recorded the mask of "
            "sample {}",
            out.step, name, b.origins[i].index_in_file);
      }
    }
  }
  return mask;
}

// 5d. One declared term's records placed on its tokens: measured weights, and the problems found
// on the way (weight outside the mask, a rank owning term tokens that hooked nothing, counts).
struct TermMeasurement {
  std::vector<double> measured;  // [sum R]
  Problems coverage, counts, nonfinite;
  int64_t num_tokens_seen = 0;
};

TermMeasurement measure_term(const AuditStep& out, const LossRanks& ranks, const Term& decl,
                             const Batch& tb, const SamplePositions& position) {
  const Batch& b = out.batch;
  const std::string& name = decl.name;
  const bool per_token =
      decl.reduce == Reduction::kPerToken || decl.reduce == Reduction::kTokenMean;
  TermMeasurement m;
  m.measured.assign(tb.loss_mask.size(), 0.0);
  for (const auto& entry : ranks.by_coord) {
    const RankCapture* c = entry.second;  // (a structured binding clang cannot capture)
    for (const CapturedMicroBatch& mb : c->microbatches) {
      if (mb.dummy) continue;
      auto it = mb.terms.find(name);
      const CapturedTerm* ct = it == mb.terms.end() ? nullptr : &it->second;
      int64_t owned_in_mask = 0;
      for_owned(*c, mb, out, position, [&](int64_t t, int64_t j, std::size_t p) {
        owned_in_mask += tb.loss_mask[t];
        if (ct == nullptr) return;
        const double w = ct->token_weight[j] * c->grad_scale;
        check_finite_lazy(m.nonfinite, *c, ct->token_weight[j], [&] {
          return fmt::format("micro-batch {} term.{}.token_weight[{}]", mb.index, name, j);
        });
        if (tb.loss_mask[t]) {
          m.measured[t] += w;
        } else if (w != 0.0) {
          m.coverage.add(fmt::format(
              "{} micro-batch {}: sample {} response index {} is outside term {}'s mask ({}) but "
              "weighs {:.6g}",
              where(*c), mb.index, mb.sample_indices[p],
              t - b.response_offsets[position.at(mb.sample_indices[p])], name, decl.mask.text(),
              w));
        }
      });
      if (ct == nullptr) {
        if (owned_in_mask > 0) {
          m.coverage.add(fmt::format(
              "{} micro-batch {} owns {} token(s) of term {} but hooked no {} loss: their "
              "gradient is dropped",
              where(*c), mb.index, owned_in_mask, name, name));
        }
        continue;
      }
      if (!ct->num_tokens) continue;
      ++m.num_tokens_seen;
      if (per_token && *ct->num_tokens != owned_in_mask) {
        m.counts.add(fmt::format(
            "{} micro-batch {}: term.{}.num_tokens {} but the rank owns {} token(s) under the "
            "term's mask ({})",
            where(*c), mb.index, name, *ct->num_tokens, owned_in_mask, decl.mask.text()));
      }
    }
  }
  return m;
}

// 5e. One declared term's checks (coverage, counts, weights), its diagnosis and finding.
void judge_term(AuditStep& out, AuditTerm& at, const TermMeasurement& m) {
  const Term& decl = at.term;
  const std::string& name = decl.name;
  out.checks.push_back(
      m.coverage.empty()
          ? AuditCheck{name + ".coverage", true,
                       fmt::format("every rank that owns its {} token(s) hooked it; tokens outside "
                                   "its mask ({}) weigh 0",
                                   at.tokens, decl.mask.text())}
          : AuditCheck{name + ".coverage", false, m.coverage.text()});
  const bool per_token =
      decl.reduce == Reduction::kPerToken || decl.reduce == Reduction::kTokenMean;
  if (m.num_tokens_seen == 0) {
    out.checks.push_back({name + ".counts", std::nullopt, "not recorded"});
  } else if (!per_token) {
    out.checks.push_back(
        {name + ".counts", std::nullopt,
         fmt::format("shown, not judged under {} (N = {})", mode_name(decl.reduce), at.tokens)});
  } else {
    out.checks.push_back(
        m.counts.empty()
            ? AuditCheck{name + ".counts", true,
                         fmt::format("every term.{}.num_tokens is the rank's owned count; N = {}",
                                     name, at.tokens)}
            : AuditCheck{name + ".counts", false, m.counts.text()});
  }
  if (!m.nonfinite.empty()) {
    out.checks.push_back({name + ".weights", false, "not finite: " + m.nonfinite.text()});
    return;
  }
  // A term's scale is part of the objective (its coefficient relative to main): any difference
  // fails, a uniform one too.
  const bool ok = !at.diagnosis.fails(true);
  out.checks.push_back({name + ".weights", ok,
                        ok ? at.diagnosis.summary()
                           : fmt::format("{} (relative to main, coefficient {})",
                                         at.diagnosis.summary(), decl.coef)});
  if (ok) return;
  out.findings.push_back(
      {"term_normalisation",
       fmt::format("step {}: term {}: {} relative to main", out.step, name, at.diagnosis.summary()),
       {{"term", name},
        {"diagnosis", at.diagnosis.kind},
        {"scale", at.diagnosis.kind == "uniform-scale" ? at.diagnosis.scale : 1.0},
        {"named", at.diagnosis.named}}});
}

// What the diagnosis names a ratio by: PP and B of the step, the objective, the trainer's
// declared scales on main and the function its loss comes from (capture metadata).
ScaleContext scale_context(const RankCapture& first, const ObjectiveSizes& sizes, Reduction reduce,
                           bool main) {
  ScaleContext ctx;
  ctx.pp = first.pp;
  ctx.global_batch = sizes.global_batch_size;
  ctx.reduce = reduce;
  ctx.reduce_known = true;
  if (main) ctx.declared = first.declared_scales;
  ctx.loss_site = first.loss_site;
  return ctx;
}

// The presets that reproduce a step's weights, those of the trainer that wrote the captures first
// (metadata `trainer`): an HF bug is named by an HF preset before an identical Megatron one. The
// order within each group is kept. A Megatron, slime or Relax run is not explained by another
// trainer's preset (hf-ga, trl-bnpo) unless `every_trainer` (audit --explain): its own presets,
// truth and the single component changes stay.
void order_for_trainer(std::vector<std::string>& matches, const std::string& trainer,
                       bool every_trainer) {
  if (trainer.empty() || matches.empty()) return;
  const std::vector<std::string> families =
      trainer == "trl"        ? std::vector<std::string>{"trl-", "hf-"}
      : trainer == "megatron" ? std::vector<std::string>{"megatron-", "slime", "relax"}
      : trainer == "slime"    ? std::vector<std::string>{"slime", "megatron-"}
      : trainer == "relax"    ? std::vector<std::string>{"relax", "megatron-"}
                              : std::vector<std::string>{trainer + "-", trainer};
  auto rank = [&](const std::string& name) -> std::size_t {
    if (name == "truth") return 0;  // an exact step's first entry stays first
    for (std::size_t k = 0; k < families.size(); ++k) {
      if (name.rfind(families[k], 0) == 0) return k + 1;
    }
    return families.size() + 1;
  };
  std::stable_sort(matches.begin(), matches.end(),
                   [&](const std::string& a, const std::string& b) { return rank(a) < rank(b); });
  const bool megatron_family = trainer == "megatron" || trainer == "slime" || trainer == "relax";
  if (!megatron_family || every_trainer) return;
  const std::vector<ContractPreset>& presets = contract_presets();
  auto foreign = [&](const std::string& match) {  // "hf-ga" or "hf-ga with scale=cp"
    const std::string name = match.substr(0, match.find(" with "));
    const bool preset = std::any_of(presets.begin(), presets.end(),
                                    [&](const ContractPreset& p) { return name == p.name; });
    return preset && rank(name) > families.size();
  };
  matches.erase(std::remove_if(matches.begin(), matches.end(), foreign), matches.end());
}

void audit_terms(AuditStep& out, const LossRanks& ranks, const std::vector<Term>& declared,
                 const SamplePositions& position, const ObjectiveSizes& main_sizes,
                 const AuditOptions& opt, double relative_to, const PlacedTokens& placed) {
  const Batch& b = out.batch;
  ObjectiveSizes sizes = main_sizes;
  sizes.main_mask = &b.loss_mask;  // a term's contract may count under main's mask
  const std::map<std::string, std::string> hooked = hooked_terms(ranks);
  for (const auto& [name, first_weight] : hooked) {
    const bool is_declared = std::any_of(declared.begin(), declared.end(),
                                         [&n = name](const Term& t) { return t.name == n; });
    if (!is_declared) flag_undeclared(out, name, first_weight);
  }
  for (const Term& decl : declared) {
    AuditTerm at;
    at.term = decl;
    at.hooked = hooked.count(decl.name) > 0;
    at.relative_to = relative_to;
    at.diagnosis.kind = "not-run";
    if (!at.hooked) {
      out.checks.push_back({decl.name + ".weights", std::nullopt,
                            fmt::format("not run: term {} is declared ({}) but no rank hooked it",
                                        decl.name, term_text(decl))});
      out.terms.push_back(std::move(at));
      continue;
    }
    const Batch tb = with_mask(b,
                               decl.mask.kind == TermMaskKind::kField
                                   ? recorded_field_mask(out, ranks, decl.name, position)
                                   : term_mask(b, decl.mask),
                               decl.mask.kind == TermMaskKind::kLoss);
    for (uint8_t v : tb.loss_mask) at.tokens += v;
    at.truth = true_weights(tb, decl.reduce, sizes);
    for (double& w : at.truth) w *= decl.coef * relative_to;
    TermMeasurement m = measure_term(out, ranks, decl, tb, position);
    at.measured = std::move(m.measured);
    at.diagnosis = diagnose_weights(
        tb, at.measured, at.truth, out.place, out.layout, at.tokens, 0, out.term_weight_rel_tol,
        scale_context(*ranks.by_coord.begin()->second, sizes, decl.reduce, false));
    judge_term(out, at, m);
    if (opt.match_presets && at.tokens > 0 && !at.diagnosis.exact() &&
        at.diagnosis.kind != "non-finite" && decl.coef != 0.0) {
      std::vector<double> plain = at.measured;
      for (double& w : plain) w /= decl.coef * relative_to;
      at.matches = matching_presets(tb, out.layout, plain, decl.reduce, sizes,
                                    out.term_weight_rel_tol, &placed);
      order_for_trainer(at.matches, ranks.by_coord.begin()->second->trainer,
                        opt.every_trainer_preset);
    }
    out.terms.push_back(std::move(at));
  }
}

// B and L_norm as the captures record them (the trainer's own global batch size when any rank
// records it), resolved for the step's batch.
ObjectiveSizes recorded_sizes(const Batch& b, const std::vector<const RankCapture*>& all,
                              std::optional<int64_t>* recorded_batch) {
  for (const RankCapture* c : all) {
    if (c->global_batch_size) *recorded_batch = c->global_batch_size;
  }
  ObjectiveSizes sizes;
  if (*recorded_batch) sizes.global_batch_size = **recorded_batch;
  if (all.front()->l_norm) sizes.l_norm = *all.front()->l_norm;
  return resolve_sizes(b, sizes);
}

// Every loss rank's recorded weights placed on the step's tokens (each rank's AuditRank in
// out.ranks), and the finding for micro-batch means over zero tokens.
void measure_ranks(AuditStep& out, const LossRanks& ranks, const SamplePositions& position,
                   bool per_token_objective, double loss_tol, Measurement& m) {
  const int64_t step = out.step;
  for (const auto& [coord, c] : ranks.by_coord) {
    AuditRank ar{c->rank,    c->dp_rank,
                 c->cp_rank, c->tp_rank,
                 c->pp_rank, static_cast<int64_t>(c->microbatches.size()),
                 0,          c->grad_scale,
                 c->skipped, c->grad_norm,
                 c->file};
    measure_rank(*c, out, position, per_token_objective, loss_tol, m, ar);
    out.ranks.push_back(ar);
  }
  if (m.nan_losses > 0) {
    out.findings.push_back({"mean_over_zero_tokens",
                            fmt::format("step {}: {} micro-batch loss value(s) are NaN, a mean "
                                        "over zero tokens, while their gradient is 0 "
                                        "(first: {})",
                                        step, m.nan_losses, m.first_nan),
                            {{"step", step}, {"microbatches", m.nan_losses}}});
  }
}

// The checks that need one weight per token (counts, weights, loss, each term's), the diagnosis and
// the contracts that reproduce the measured weights.
void weigh_step(AuditStep& out, const Measurement& m, const std::vector<const RankCapture*>& all,
                const LossRanks& ranks, const SamplePositions& position,
                const ObjectiveSizes& sizes, const AuditOptions& opt, const ContractWeights& owned,
                bool per_token_objective) {
  const Batch& b = out.batch;
  const RankCapture& first = *all.front();
  bool recorded_reduced = false;
  int64_t contract_count = 0;  // a measured run's N' (names N/N'), from its recorded counts
  for (const RankCapture* c : all) {
    recorded_reduced |= c->num_tokens_reduced.has_value();
    if (c->num_tokens_reduced && per_token_objective) contract_count = *c->num_tokens_reduced;
  }
  out.diagnosis = diagnose_weights(b, out.measured, out.truth, out.place, out.layout,
                                   out.global_tokens, contract_count, out.weight_rel_tol,
                                   scale_context(first, sizes, out.reduce, true));
  out.checks.push_back(counts_check(out, m, recorded_reduced, per_token_objective));
  if (!m.nonfinite_weights.empty()) {
    out.checks.push_back({"weights", false, "not finite: " + m.nonfinite_weights.text()});
  } else {
    out.checks.push_back(
        {"weights", !out.diagnosis.fails(opt.strict_scale), out.diagnosis.summary()});
  }
  const PlacedTokens placed{out.place, owned.problems};  // every candidate contract's placement
  // Naming the presets an exact step matches is a pass per preset over the tokens: shown for
  // steps up to 2^20 response tokens; a step that fails is always matched.
  const bool worth_matching =
      !out.diagnosis.exact() || b.num_response_tokens() <= kExactMatchTokenLimit;
  if (opt.match_presets && worth_matching && out.global_tokens > 0 &&
      out.diagnosis.kind != "non-finite") {
    out.matches = matching_presets(b, out.layout, out.measured, out.reduce, sizes,
                                   out.weight_rel_tol, &placed);
    order_for_trainer(out.matches, all.front()->trainer, opt.every_trainer_preset);
  }
  out.checks.push_back(loss_check(m));
  audit_terms(out, ranks, first.terms, position, sizes, opt,
              out.diagnosis.kind == "uniform-scale" ? out.diagnosis.scale : 1.0, placed);
}

// Records no part of the format names (a misspelled `skiped`): a finding per rank, an input error
// under --strict.
void report_unknown_records(AuditStep& out, const std::vector<const RankCapture*>& all,
                            bool strict) {
  for (const RankCapture* c : all) {
    if (c->unknown_records.empty()) continue;
    const std::string names = fmt::format("'{}'", fmt::join(c->unknown_records, "', '"));
    if (strict) {
      throw_input_error(
          "{}: record(s) {} are not part of the capture format (SPEC §10, §11); a misspelling? "
          "(without --strict: a warning)",
          c->file, names);
    }
    out.findings.push_back(
        {"unknown_record",
         fmt::format("step {}: {}: record(s) {} are not part of the capture format and were "
                     "ignored (a misspelling? --strict makes this an error)",
                     out.step, c->file, names),
         {{"rank", c->rank}, {"records", c->unknown_records}}});
  }
}

// A recorded B below the samples held is right only when B counts something coarser than samples
// (slime's step_global_batch_size counts rollouts); counted in samples, the objective divides by
// too few. A finding, not a failure; not raised when the captures say B counts rollouts.
void note_batch_size_below_samples(AuditStep& out, int64_t recorded_batch) {
  const int64_t held = out.batch.num_samples();
  if (recorded_batch >= held) return;
  out.findings.push_back(
      {"global_batch_size_below_samples",
       fmt::format("step {}: the captures record global_batch_size = {} but hold {} samples: the "
                   "objective divides by {} (right if B counts rollouts of several samples; if it "
                   "counts samples, samples were duplicated or B is miscounted)",
                   out.step, recorded_batch, held, recorded_batch),
       {{"step", out.step}, {"global_batch_size", recorded_batch}, {"samples", held}}});
}

// The first main-term value (token_weight, token_loss) of any loss-computing rank that `dtype`
// cannot hold, as "file: record[i] = v"; "" when every one fits.
std::string value_outside(DType dtype, const LossRanks& ranks) {
  for (const auto& entry : ranks.by_coord) {
    const RankCapture* c =
        entry.second;  // (a lambda may not capture a structured binding in C++17)
    for (const CapturedMicroBatch& mb : c->microbatches) {
      auto first_outside = [&](const std::vector<double>& values, const char* record) {
        for (std::size_t t = 0; t < values.size(); ++t) {
          if (!dtype_holds(dtype, values[t]))
            return fmt::format("{}: mb.{}.{}[{}] = {:.9g}", c->file, mb.index, record, t,
                               values[t]);
        }
        return std::string();
      };
      std::string found = first_outside(mb.token_weight, "token_weight");
      if (found.empty() && mb.token_loss) found = first_outside(*mb.token_loss, "token_loss");
      if (!found.empty()) return found;
    }
  }
  return {};
}

// Tolerances from the dtype the step claims, its least precise rank's (SPEC §10). One trainer
// computes its per-token loss in one dtype, and every value it records is one that dtype holds:
// where any loss-computing rank's main records hold a value the claimed bf16/fp16 cannot, the
// claim is not believed for the main term (a float32 trainer, or one rank's metadata, cannot
// widen the tolerance to pass a 0.5% weight error) and a finding names the value. Named terms
// keep the claim (a bf16 KL beside a float32 policy loss is common), and so does the loss check,
// a sum over every term. Returns the loss tolerance.
double set_tolerances(AuditStep& out, const std::vector<const RankCapture*>& all,
                      const LossRanks& ranks, const AuditOptions& opt) {
  DType claimed = all.front()->dtype;
  const RankCapture* claimant = all.front();
  for (const RankCapture* c : all) {
    if (audit_tolerance(c->dtype).loss > audit_tolerance(claimed).loss) {
      claimed = c->dtype;
      claimant = c;
    }
  }
  DType main = claimed;
  if (claimed == DType::kBFloat16 || claimed == DType::kFloat16) {
    if (const std::string outside = value_outside(claimed, ranks); !outside.empty()) {
      main = DType::kFloat32;
      out.findings.push_back(
          {"dtype_claim",
           fmt::format("step {}: {} claims dtype = {}, but {} is not a {} value: the main term's "
                       "records were not computed in {}; judged with float32's tolerance",
                       out.step, claimant->file, dtype_name(claimed), outside, dtype_name(claimed),
                       dtype_name(claimed)),
           {{"claimed", std::string(dtype_name(claimed))}, {"value", outside}}});
    }
  }
  out.weight_rel_tol = opt.weight_rel_tol.value_or(audit_tolerance(main).weight);
  out.term_weight_rel_tol = opt.weight_rel_tol.value_or(audit_tolerance(claimed).weight);
  out.dtype = main;
  return audit_tolerance(claimed).loss;
}

AuditStep audit_step(int64_t step, const std::vector<const RankCapture*>& all,
                     const AuditOptions& opt) {
  AuditStep out;
  out.step = step;
  check_metadata(step, all);
  report_unknown_records(out, all, opt.strict_records);
  const RankCapture& first = *all.front();
  const LossRanks ranks = loss_ranks(step, all);
  if (opt.reduce) {
    out.reduce = *opt.reduce;
  } else if (!first.reduce.empty() && !parse_reduction(first.reduce, &out.reduce)) {
    throw_input_error("{}: metadata reduce = '{}' is not {}", first.file, first.reduce,
                      mode_choices<Reduction>());
  }
  RebuiltBatch rebuilt = rebuild_batch(step, ranks);
  out.batch = std::move(rebuilt.batch);
  const Batch& b = out.batch;
  if (b.num_samples() == 0 && rebuilt.dummy_problems.empty()) {
    throw UnverifiedError(fmt::format(
        "step {}: the {} capture(s) hold no sample in any micro-batch (first: {}): nothing to "
        "audit",
        step, all.size(), first.file));
  }
  out.layout = rebuild_layout(step, first, ranks, rebuilt.position);

  // 3. The truth, the ownership of every token, and each rank's measured weights placed on it.
  for (uint8_t mk : b.loss_mask) out.global_tokens += mk;
  out.expected_skip = out.global_tokens == 0;
  std::optional<int64_t> recorded_batch;
  const ObjectiveSizes sizes = recorded_sizes(b, all, &recorded_batch);
  const bool in_rollouts = std::any_of(all.begin(), all.end(), [](const RankCapture* c) {
    return c->global_batch_unit == "rollouts";  // fewer than the samples, by design
  });
  if (recorded_batch && !in_rollouts) note_batch_size_below_samples(out, *recorded_batch);
  out.truth = true_weights(b, out.reduce, sizes);
  // The ownership each rank's weights are mapped through (a sample placed twice is owned where
  // first placed: the second holder's weights then land on no token of its own, and coverage
  // names the duplicate).
  const ContractWeights owned =
      contract_weights(b, out.layout, preset_contract("truth", out.reduce), sizes);
  out.place = owned.place;
  const double loss_tol = set_tolerances(out, all, ranks, opt);
  const bool per_token_objective =
      out.reduce == Reduction::kPerToken || out.reduce == Reduction::kTokenMean;
  Measurement m;
  m.measured.assign(static_cast<std::size_t>(b.num_response_tokens()), 0.0);
  m.held.assign(static_cast<std::size_t>(b.num_response_tokens()), 0);
  if (owned.problems.empty())
    measure_ranks(out, ranks, rebuilt.position, per_token_objective, loss_tol, m);
  out.measured = m.measured;

  // 4. The checks. A layout that holds a sample twice has no single weight per token: the checks
  // that need one are not run, and coverage names the duplicate.
  out.checks.push_back(coverage_check(out, m, owned.problems, rebuilt.dummy_problems,
                                      tp_disagreement(ranks), recorded_batch));
  if (!owned.problems.empty()) {
    const std::string why = "not run: the layout holds a sample twice (see coverage)";
    for (const char* name : {"counts", "weights", "loss"})
      out.checks.push_back({name, std::nullopt, why});
    for (const Term& t : first.terms)
      out.checks.push_back({t.name + ".weights", std::nullopt, why});
    out.diagnosis.kind = "not-run";  // not diagnosed; coverage fails the step
  } else {
    weigh_step(out, m, all, ranks, rebuilt.position, sizes, opt, owned, per_token_objective);
  }
  if (first.pp > 1) out.checks.push_back(stages_check(ranks, all));
  out.checks.push_back(decision_check(out, all));
  out.checks.push_back(metrics_check(all));
  return out;
}

}  // namespace

AuditResult audit_captures(const std::vector<RankCapture>& captures, const AuditOptions& options) {
  if (captures.empty()) throw UnverifiedError("no captures given");
  std::map<int64_t, std::vector<const RankCapture*>> by_step;
  for (const RankCapture& c : captures) by_step[c.step].push_back(&c);
  AuditResult out;
  const RankCapture& first = captures.front();
  out.header = {captures.size(), first.world_size, first.tp, first.pp, first.cp, first.dp};
  for (const auto& [step, ranks] : by_step) {
    AuditStep s = audit_step(step, ranks, options);
    s.failed = step_failed(s, options.strict_scale);
    s.summary = s.diagnosis.summary();
    // The ratio per micro-batch and CP rank: only where asked (--svg draws the first step), and
    // only for a step whose weights were judged (a layout that holds a sample twice is not).
    if (options.shard_ratios && out.steps.empty() && s.diagnosis.kind != "not-run")
      s.shards = shard_ratios(s.batch, s.measured, s.truth, s.place, s.layout);
    out.failed = out.failed || s.failed;
    out.steps.push_back(std::move(s));
  }
  return out;
}

}  // namespace lossguard::oracle
