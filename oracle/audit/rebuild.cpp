// The audit's step rebuilt from its captures (SPEC §10): the metadata they share, the
// loss-computing ranks, the global batch by sample index and the layout each rank trained.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <unordered_map>

#include "core/errors.h"
#include "core/term.h"
#include "oracle/audit/audit_detail.h"

namespace lossguard::oracle::audit_detail {

namespace {

struct SampleRecord {
  const RankCapture* rank = nullptr;
  int64_t microbatch = 0, position = 0;  // where it was first seen
  int64_t t = 0, r = 0;
  const int64_t* tokens = nullptr;
  const uint8_t* mask = nullptr;
  double denom = -1.0;  // the sample's d_i as the trainer used it (mb.{k}.sample_denoms), else -1
};

}  // namespace

std::string where(const RankCapture& c) {
  return fmt::format("rank {} (DP {} CP {} TP {} PP {}, {})", c.rank, c.dp_rank, c.cp_rank,
                     c.tp_rank, c.pp_rank, c.file);
}

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

}  // namespace lossguard::oracle::audit_detail
