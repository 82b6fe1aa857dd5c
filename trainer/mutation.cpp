// Test-only candidate mutations (see mutation.h).
#include "trainer/mutation.h"

#include <cmath>
#include <cstdlib>
#include <cstring>

#include "core/errors.h"
#include "trainer/shard_plan.h"

namespace lossguard::trainer {

std::optional<Mutation> mutation_from_environment() {
  const char* spec = std::getenv("LOSSGUARD_TEST_MUTATION");
  if (spec == nullptr || *spec == '\0') return std::nullopt;
  Mutation m;
  std::string s = spec;
  if (const auto colon = s.find(':'); colon != std::string::npos) {
    m.factor = std::strtod(s.c_str() + colon + 1, nullptr);
    s = s.substr(0, colon);
  }
  m.kind = s;
  for (const char* k : {"shift-target", "drop-row", "swap-chunk", "scale-grad", "masked-row",
                        "sample-denom", "weight-token", "weight-sample", "weight-rank"}) {
    if (m.kind == k) return m;
  }
  throw_input_error("LOSSGUARD_TEST_MUTATION={}: unknown mutation", spec);
}

namespace {

// The first row with mask 1 (of an RL sample when rl_only), or -1.
int64_t first_effective_row(const Batch& b, bool rl_only, const std::vector<int32_t>* owned) {
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    if (rl_only && b.prompt_length(i) == 0) continue;
    for (int64_t row = b.response_offsets[i]; row < b.response_offsets[i + 1]; ++row) {
      if (b.loss_mask[row] && (owned == nullptr || (*owned)[row] >= 0)) return row;
    }
  }
  return -1;
}

int64_t cols_of(const HostArray& g) { return g.shape.size() == 2 ? g.shape[1] : 1; }

void set(HostArray& g, int64_t k, double v) {
  HostArray one = HostArray::from_f64(g.dtype, {1}, {v});
  const std::size_t e = dtype_size_bytes(g.dtype);
  std::memcpy(g.mutable_data() + k * e, one.data, e);
}

}  // namespace

std::optional<Batch> mutate_input(const Mutation& m, const Batch& b) {
  if (m.kind == "shift-target") {
    const int64_t row = first_effective_row(b, true, nullptr);
    if (row < 0 || !b.logits) return std::nullopt;
    Batch out = b;  // the logits are shared, not copied; only a token changes
    int64_t i = 0;
    while (b.response_offsets[i + 1] <= row) ++i;
    int64_t& y =
        out.tokens[b.token_offsets[i] + b.prompt_length(i) + (row - b.response_offsets[i])];
    y = (y + 1) % b.vocab_size();
    return out;
  }
  if (m.kind == "sample-denom") {
    for (int64_t i = 0; i < b.num_samples(); ++i) {
      const int64_t mi = b.mask_sum(i);
      if (mi == 0) continue;
      Batch out = b;
      if (out.sample_denoms.empty()) out.sample_denoms.assign(b.num_samples(), -1.0);
      out.sample_denoms[i] = b.sample_denom(i, mi) + 1.0;
      return out;
    }
  }
  return std::nullopt;
}

std::vector<double> mutate_weights(const Mutation& m, const Batch& b, int64_t cp,
                                   const ShardLayout& layout) {
  if (m.kind.rfind("weight-", 0) != 0) return {};
  std::vector<double> scale(static_cast<std::size_t>(b.num_response_tokens()), 1.0);
  const double f = 1.0 + m.factor;
  if (m.kind == "weight-token") {
    const int64_t row = first_effective_row(b, false, nullptr);
    if (row >= 0) scale[row] = f;
  } else if (m.kind == "weight-sample") {
    for (int64_t i = 0; i < b.num_samples(); ++i) {
      if (b.mask_sum(i) == 0) continue;
      for (int64_t row = b.response_offsets[i]; row < b.response_offsets[i + 1]; ++row)
        scale[row] = f;
      break;
    }
  } else {  // weight-rank
    const ShardPlan plan = plan_shards(b, cp, layout);
    for (const OwnedRow& o : plan.owned[0]) scale[o.row] = f;
  }
  return scale;
}

bool mutates_output(const Mutation& m) {
  return m.kind == "drop-row" || m.kind == "scale-grad" || m.kind == "swap-chunk" ||
         m.kind == "masked-row";
}

void mutate_output(const Mutation& m, const Batch& b, CandidateResult* r) {
  HostArray& g = r->grad;
  const int64_t cols = cols_of(g);
  if (m.kind == "drop-row" || m.kind == "scale-grad") {
    const int64_t row = first_effective_row(b, false, &r->row_rank);
    if (row < 0) return;
    if (m.kind == "drop-row") {
      for (int64_t c = 0; c < cols; ++c) set(g, row * cols + c, 0.0);
      return;
    }
    int64_t best = row * cols;
    for (int64_t c = 0; c < cols; ++c)
      if (std::fabs(g.get_f64(row * cols + c)) > std::fabs(g.get_f64(best))) best = row * cols + c;
    set(g, best, g.get_f64(best) * m.factor);
  } else if (m.kind == "swap-chunk") {
    int64_t first[2] = {-1, -1};
    for (int64_t row = 0; row < b.num_response_tokens(); ++row) {
      if (r->row_rank[row] != 0 || !b.loss_mask[row]) continue;
      const int8_t c = r->row_chunk[row];
      if (c >= 0 && first[c] < 0) first[c] = row;
    }
    if (first[0] < 0 || first[1] < 0) return;
    for (int64_t c = 0; c < cols; ++c) {
      const double a = g.get_f64(first[0] * cols + c), z = g.get_f64(first[1] * cols + c);
      set(g, first[0] * cols + c, z);
      set(g, first[1] * cols + c, a);
    }
  } else if (m.kind == "masked-row") {
    for (int64_t row = 0; row < b.num_response_tokens(); ++row) {
      if (!b.loss_mask[row]) {
        set(g, row * cols, 1e-3);
        return;
      }
    }
  }
}

}  // namespace lossguard::trainer
