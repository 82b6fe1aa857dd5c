// CPU twin of the masked token counter: per sample, one pass over the mask gives the prefix sums
// each rank's count is a difference of. Short masks keep every prefix (a few cycles a token, no
// sorting); long ones only those at the chunk boundaries of the requested CP sizes, summing the
// segments between them 16 bytes at a time.
#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "core/batch.h"
#include "kernels/cpu/parallel.h"
#include "kernels/token_count.h"

namespace lossguard::kernels {

namespace {

int64_t sum_bytes(const uint8_t* p, int64_t n) {
  int64_t s = 0, k = 0;
#if defined(__SSE2__)
  __m128i acc = _mm_setzero_si128();
  const __m128i zero = _mm_setzero_si128();
  for (; k + 16 <= n; k += 16) {
    acc = _mm_add_epi64(
        acc, _mm_sad_epu8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + k)), zero));
  }
  alignas(16) int64_t lanes[2];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), acc);
  s = lanes[0] + lanes[1];
#endif
  for (; k < n; ++k) s += p[k];
  return s;
}

}  // namespace

TokenCountArgs host_token_count_args(const Batch& b, const std::vector<int64_t>& cp_sizes,
                                     const ShardLayout& layout) {
  TokenCountArgs a;
  a.loss_mask = b.loss_mask.data();
  a.mask_offsets = b.response_offsets.data();
  a.total_lengths = b.total_lengths.data();
  a.response_lengths = b.response_lengths.data();
  a.num_samples = b.num_samples();
  a.cp_sizes = cp_sizes.data();
  a.num_cp = static_cast<int>(cp_sizes.size());
  a.chunk = chunk_rule(layout);
  if (!b.padded_total_lengths.empty()) a.chunk.padded_lengths = b.padded_total_lengths.data();
  return a;
}

int64_t token_count_size(const TokenCountArgs& a) {
  int64_t total = 0;
  for (int c = 0; c < a.num_cp; ++c) total += a.cp_sizes[c];
  return total * a.num_samples;
}

void count_tokens_cpu(const TokenCountArgs& a) {
  std::vector<int64_t> out_offset(static_cast<std::size_t>(a.num_cp), 0);
  int64_t max_cuts = 2;
  for (int c = 0; c < a.num_cp; ++c) {
    if (c > 0) out_offset[c] = out_offset[c - 1] + a.num_samples * a.cp_sizes[c - 1];
    max_cuts += 2 * a.cp_sizes[c];
  }
  const int64_t total = token_count_size(a);
  if (total == 0) return;  // no samples (counts may then be null)
  std::memset(a.counts, 0, static_cast<std::size_t>(total) * sizeof(int64_t));
  parallel_ranges(a.num_samples, 4096, [&](int64_t begin, int64_t end, int) {
    constexpr int64_t kShort =
        2048;  // below this, a full prefix array is cheaper than sorting cuts
    std::vector<int64_t> cuts, prefix;
    std::vector<int32_t> full_prefix(static_cast<std::size_t>(kShort + 1));
    cuts.reserve(static_cast<std::size_t>(max_cuts));
    prefix.reserve(static_cast<std::size_t>(max_cuts));
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = a.total_lengths[i], r = a.response_lengths[i];
      const int64_t padded = a.chunk.padded_lengths != nullptr ? a.chunk.padded_lengths[i] : 0;
      const bool sft = r == t;
      // Mask index k is predicted by the logit at position k + off; the last position predicts
      // nothing.
      const int64_t off = sft ? 0 : t - r - 1;
      // (At CP = 1 the unsharded trainer sums the whole mask, SFT index T-1 included.)
      const int64_t owned_len = sft ? std::max<int64_t>(t - 1, 0) : r;
      const uint8_t* mask = a.loss_mask + a.mask_offsets[i];
      auto clip = [&](int64_t position) {
        return std::clamp<int64_t>(position - off, 0, owned_len);
      };
      if (r <= kShort) {
        full_prefix[0] = 0;
        for (int64_t k = 0; k < r; ++k) full_prefix[k + 1] = full_prefix[k] + mask[k];
        for (int c = 0; c < a.num_cp; ++c) {
          const int64_t cp = a.cp_sizes[c], cs = chunk_size_of(t, cp, a.chunk, padded);
          int64_t* out = a.counts + out_offset[c] + i * cp;
          if (cp == 1) {
            out[0] = full_prefix[r];
            continue;
          }
          for (int64_t b = 0; b < 2 * cp; ++b) {
            out[b < cp ? b : 2 * cp - 1 - b] +=
                full_prefix[clip((b + 1) * cs)] - full_prefix[clip(b * cs)];
          }
        }
        continue;
      }
      cuts.assign({0, owned_len, r});
      for (int c = 0; c < a.num_cp; ++c) {
        const int64_t cp = a.cp_sizes[c], cs = chunk_size_of(t, cp, a.chunk, padded);
        for (int64_t b = 1; b < 2 * cp; ++b) cuts.push_back(clip(b * cs));
      }
      std::sort(cuts.begin(), cuts.end());
      cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
      prefix.assign(cuts.size(), 0);
      for (std::size_t s = 1; s < cuts.size(); ++s)
        prefix[s] = prefix[s - 1] + sum_bytes(mask + cuts[s - 1], cuts[s] - cuts[s - 1]);
      auto prefix_at = [&](int64_t k) {
        return prefix[std::lower_bound(cuts.begin(), cuts.end(), k) - cuts.begin()];
      };
      for (int c = 0; c < a.num_cp; ++c) {
        const int64_t cp = a.cp_sizes[c], cs = chunk_size_of(t, cp, a.chunk, padded);
        int64_t* out = a.counts + out_offset[c] + i * cp;
        if (cp == 1) {
          out[0] = prefix_at(r);
          continue;
        }
        for (int64_t b = 0; b < 2 * cp; ++b) {
          const int64_t rank = b < cp ? b : 2 * cp - 1 - b;
          out[rank] += prefix_at(clip((b + 1) * cs)) - prefix_at(clip(b * cs));
        }
      }
    }
  });
}

}  // namespace lossguard::kernels
