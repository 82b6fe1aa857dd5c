// Batch findings (SPEC §1, §2): non-finite values with coordinates, T = 0, SFT masks not
// pre-shifted.
#include "oracle/count/findings.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <thread>

#include "core/errors.h"
#include "core/format.h"
#include "oracle/count/denominators.h"

namespace lossguard::oracle {

namespace {

int64_t sample_of_row(const Batch& b, int64_t row) {
  auto it = std::upper_bound(b.response_offsets.begin(), b.response_offsets.end(), row);
  return static_cast<int64_t>(it - b.response_offsets.begin()) - 1;
}

// `rows`: the logits' row statistics, whose non_finite flags say which rows hold a NaN or an
// infinity (then blocks are rows); without them, a bit test of every block.
void scan_non_finite(const Batch& b, const std::string& field, const HostArray& a, int64_t cols,
                     std::size_t max_reported, std::vector<Finding>& out,
                     const std::vector<RowStats>* rows = nullptr) {
  if (!dtype_is_float(a.dtype)) return;
  int64_t count = 0;
  const int64_t n = a.numel();
  // Blocks without a non-finite value are skipped by a bit test, on every core.
  const bool by_row = rows != nullptr && cols > 0 && static_cast<int64_t>(rows->size()) * cols == n;
  const int64_t kBlock = by_row ? cols : int64_t{1} << 20;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<uint8_t> hit(static_cast<std::size_t>(blocks), 0);
  if (by_row) {
    for (int64_t r = 0; r < blocks; ++r) hit[r] = (*rows)[static_cast<std::size_t>(r)].non_finite;
  } else {
    const int64_t threads =
        std::max<int64_t>(1, std::min<int64_t>(blocks, std::thread::hardware_concurrency()));
    std::vector<std::thread> pool;
    for (int64_t w = 0; w < threads; ++w) {
      pool.emplace_back([&, w] {
        for (int64_t k = w; k < blocks; k += threads) {
          hit[k] = a.any_non_finite(k * kBlock, std::min(n, (k + 1) * kBlock));
          if (!hit[k]) a.drop_pages(k * kBlock, std::min(n, (k + 1) * kBlock));
        }
      });
    }
    for (auto& th : pool) th.join();
  }
  for (int64_t k = 0; k < n; ++k) {
    if (!hit[k / kBlock]) {
      k = (k / kBlock + 1) * kBlock - 1;
      continue;
    }
    const double v = a.get_f64(k);
    if (std::isfinite(v)) continue;
    if (static_cast<std::size_t>(count++) >= max_reported) continue;
    const int64_t row = k / cols, col = k % cols;
    const int64_t s = sample_of_row(b, row);
    const int64_t j = row - b.response_offsets[s];
    Finding f{"non_finite",
              "",
              {{"field", field},
               {"sample", s},
               {"response_index", j},
               {"value", std::isnan(v) ? "nan" : (v > 0 ? "inf" : "-inf")}}};
    if (cols > 1) {
      f.detail["vocab_index"] = col;
      f.message = fmt::format("{}: {}[{}, {}] = {}", b.describe_sample(s), field, j, col, v);
    } else {
      f.message = fmt::format("{}: {}[{}] = {}", b.describe_sample(s), field, j, v);
    }
    const bool masked = row < static_cast<int64_t>(b.loss_mask.size()) && !b.loss_mask[row];
    f.detail["masked"] = masked;
    if (masked) {
      f.message +=
          " at a masked position: a trainer that masks by multiplication turns it into NaN (0 * "
          "NaN = NaN) in the loss and every gradient; mask by selection (where / index)";
    }
    out.push_back(std::move(f));
  }
  if (static_cast<std::size_t>(count) > max_reported) {
    out.push_back(
        {"non_finite",
         fmt::format("{}: {} non-finite values in all ({} shown)", field, count, max_reported),
         {{"field", field}, {"count", count}}});
  }
}

}  // namespace

std::vector<Finding> legacy_slicing_findings(const Batch& b) {
  std::vector<int64_t> empty_r;
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    if (b.classify(i, 0).why_empty == NoTokenReason::kEmptyResponse) empty_r.push_back(i);
  }
  if (empty_r.empty()) return {};
  const int64_t i = empty_r.front();
  return {{"legacy_response_slicing",
           fmt::format("legacy response slicing: targets taken as tokens[-R:] give {} with R = 0 "
                       "all T = {} tokens as "
                       "targets for its 0 logits rows (samples with R = 0: {})",
                       b.describe_sample(i), b.total_lengths[i], format_index_list(empty_r)),
           {{"samples", empty_r}}}};
}

std::vector<Finding> batch_findings(const Batch& b, std::size_t max_reported,
                                    const std::vector<RowStats>* logits_stats) {
  std::vector<Finding> out;
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    const SampleClass note = b.classify(i, b.mask_sum(i));
    if (note.why_empty == NoTokenReason::kTZero) {
      out.push_back(
          {"zero_length_sample",
           fmt::format("{}: T = 0 (an empty sample; it counts 0 tokens)", b.describe_sample(i)),
           {{"sample", i}}});
    } else if (note.sft_not_preshifted) {
      out.push_back(
          {"sft_mask_not_preshifted",
           fmt::format(
               "{}: SFT mask not pre-shifted: its last entry is 1, counted at CP=1 but never owned "
               "at CP>1 (docs/semantics.md §2)",
               b.describe_sample(i)),
           {{"sample", i}}});
    }
  }
  if (b.logits)
    scan_non_finite(b, "logits", *b.logits, b.vocab_size(), max_reported, out, logits_stats);
  for (const auto& [name, a] : b.per_token) scan_non_finite(b, name, a, 1, max_reported, out);
  // Targets outside the logits' vocabulary (an effective row's target: RL tokens[P + j]; SFT
  // tokens[j + 1], 0 for the last row): the loss cannot be computed for them.
  if (b.logits && !b.tokens.empty()) {
    const int64_t v = b.vocab_size();
    std::size_t bad = 0;
    for (int64_t i = 0; i < b.num_samples(); ++i) {
      const int64_t p = b.prompt_length(i), t = b.total_lengths[i];
      for (int64_t j = 0; j < b.response_lengths[i]; ++j) {
        if (!b.loss_mask[b.response_offsets[i] + j]) continue;
        const int64_t next = p > 0 ? p + j : j + 1;
        const int64_t y = next < t ? b.tokens[b.token_offsets[i] + next] : 0;
        if (y >= 0 && y < v) continue;
        if (bad++ < max_reported) {
          out.push_back({"target_out_of_vocab",
                         fmt::format("{}: the target of response index {} is token {}, outside the "
                                     "logits' vocabulary [0, {})",
                                     b.describe_sample(i), j, y, v),
                         {{"sample", i}, {"response_index", j}, {"token", y}, {"vocab_size", v}}});
        }
      }
    }
    if (bad > max_reported) {
      out.push_back(
          {"target_out_of_vocab",
           fmt::format("{} targets outside the vocabulary in all ({} shown)", bad, max_reported),
           {{"count", bad}}});
    }
  }
  return out;
}

BatchSummary summarize_batch(const Batch& b) {
  BatchSummary s;
  s.classes.reserve(static_cast<std::size_t>(b.num_samples()));
  for (int64_t i = 0; i < b.num_samples(); ++i) {
    const int64_t m = b.mask_sum(i);
    const SampleClass c = b.classify(i, m);
    s.kinds[static_cast<int>(c.kind)]++;
    s.effective_tokens += m;
    if (c.why_empty == NoTokenReason::kEmptyResponse) s.empty_responses.push_back(i);
    if (c.why_empty == NoTokenReason::kFullyMasked) s.fully_masked.push_back(i);
    if (c.sft) s.sft.push_back(i);
    s.classes.push_back(c);
    s.mask_sums.push_back(m);
  }
  for (const BatchStep& st : b.steps) {
    int64_t m = 0;
    for (int64_t i : st.samples) m += s.mask_sums[static_cast<std::size_t>(i)];
    s.step_effective_tokens.push_back(m);
  }
  s.findings = batch_findings(b);
  return s;
}

Judgement samples_judgement(const Batch& batch) {
  return batch.num_samples() == 0 ? Judgement::nothing_verified(kNoSamplesReason)
                                  : Judgement::verified();
}

void require_samples(const Batch& batch) {
  const Judgement j = samples_judgement(batch);
  if (!j.unverified.empty()) throw UnverifiedError(j.unverified);
}

}  // namespace lossguard::oracle
