// Masked token counting (SPEC §2, §3): every sample's effective tokens owned by every rank of
// several CP sizes, in one pass over the loss masks. Counts are int64 end to end; CPU and CUDA
// agree exactly.
//
// Shared parameters (pointers in the memory of the Device the op runs on):
//   loss_mask         [sum R] uint8, 0 or 1, the samples' masks concatenated
//   mask_offsets      [S + 1] int64, sample i's mask is loss_mask[mask_offsets[i],
//   mask_offsets[i+1]) total_lengths     [S] int64, T_i;   response_lengths [S] int64, R_i (R_i ==
//   T_i: an SFT sample) cp_sizes          host array of CP sizes (each >= 1), num_cp of them chunk
//   how each sample's chunk size is chosen for a CP size (the layout, validated by the
//                     caller: chunk_size throws on layouts that cannot hold a sample)
//   counts            out, int64, for CP size c at offset sum_{c' < c} S * cp_{c'}: [S, cp_c]
//   row-major,
//                     counts[i * cp + r] = effective tokens of sample i whose predicting logit rank
//                     r holds
#pragma once
#include <cstdint>
#include <vector>

#include "core/modes.h"
#include "kernels/device.h"

namespace lossguard {
struct Batch;  // core/batch.h (kept out of this header: CUDA translation units include it)
}

namespace lossguard::kernels {

struct ChunkRule {
  int64_t padded_total_length = 0;  // > 0: every sample padded to this (thd with padding)
  int64_t max_seq_len = 0;          // > 0: bshd, chunks of ceil(max_seq_len / 2cp)
  int64_t pad_multiple = 0;         // > 0: each sample padded to a multiple of lcm(this, 2cp)
  // [S] or null, in the op's device memory: each sample's own padded length (0: none), which
  // takes precedence over padded_total_length and pad_multiple.
  const int64_t* padded_lengths = nullptr;
  // none of these: chunks of ceil(T / 2cp)
};

struct TokenCountArgs {
  const uint8_t* loss_mask = nullptr;
  const int64_t* mask_offsets = nullptr;
  const int64_t* total_lengths = nullptr;
  const int64_t* response_lengths = nullptr;
  int64_t num_samples = 0;
  const int64_t* cp_sizes = nullptr;  // host memory
  int num_cp = 0;
  ChunkRule chunk;
  int64_t* counts = nullptr;
};

// The chunk rule of a layout (thd, thd padded, bshd).
inline ChunkRule chunk_rule(const ShardLayout& layout) {
  ChunkRule rule;
  if (layout.packing == Packing::kBshd)
    rule.max_seq_len = layout.max_seq_len;
  else
    rule.padded_total_length = layout.padded_total_length;
  rule.pad_multiple = layout.pad_multiple;
  return rule;
}
// The arguments for a batch in host memory; `counts` is left to the caller.
TokenCountArgs host_token_count_args(const Batch& batch, const std::vector<int64_t>& cp_sizes,
                                     const ShardLayout& layout = {});

// Total int64 entries of `counts`: S * sum of cp sizes.
int64_t token_count_size(const TokenCountArgs& a);

// The chunk size of a sample of length t, whose own padded length is `padded` (0: none), on cp
// ranks under `rule` (no validation; core's chunk_size validates). A padded length that is not a
// multiple of 2cp (recorded at another CP size) is rounded up to one.
#ifdef __CUDACC__
__host__ __device__
#endif
    inline int64_t
    chunk_size_of(int64_t t, int64_t cp, const ChunkRule& rule, int64_t padded = 0) {
  const int64_t parts = 2 * cp;
  if (rule.max_seq_len > 0) return (rule.max_seq_len + parts - 1) / parts;
  const int64_t length = padded > 0 ? padded : rule.padded_total_length;
  if (length > 0) return (length + parts - 1) / parts;
  if (rule.pad_multiple > 0) {
    int64_t a = rule.pad_multiple, b = parts;
    while (b != 0) {
      const int64_t c = a % b;
      a = b;
      b = c;
    }
    const int64_t unit = rule.pad_multiple / a * parts;  // lcm(pad_multiple, 2cp)
    return (t + unit - 1) / unit * unit / parts;
  }
  return (t + parts - 1) / parts;
}

void count_tokens(const TokenCountArgs& a, Device device);

// The twins, for tests and benchmarks that compare them; count_tokens is the switch.
void count_tokens_cpu(const TokenCountArgs& a);
void count_tokens_cuda(const TokenCountArgs& a);  // throws when the build has no CUDA

}  // namespace lossguard::kernels
