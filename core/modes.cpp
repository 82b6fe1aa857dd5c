// The layout geometry shared by the oracle and the candidates (SPEC §2).
#include "core/modes.h"

#include <numeric>

#include "core/errors.h"

namespace lossguard {

void require_sizes_at_least_1(const char* what, const std::vector<int64_t>& sizes) {
  for (int64_t s : sizes) {
    if (s < 1) throw_input_error("{} sizes must be >= 1, got {}", what, s);
  }
}

int64_t chunk_size(int64_t t, int64_t cp, const ShardLayout& layout, int64_t sample_padded) {
  if (cp < 1) throw_input_error("CP size must be >= 1, got {}", cp);
  const int64_t parts = 2 * cp;
  if (layout.packing == Packing::kBshd) {
    if (layout.max_seq_len <= 0) throw_input_error("bshd packing needs --max-seq-len > 0");
    if (t > layout.max_seq_len)
      throw_input_error("a sample of length {} exceeds --max-seq-len {}", t, layout.max_seq_len);
    return (layout.max_seq_len + parts - 1) / parts;
  }
  if (sample_padded > 0) {
    if (t > sample_padded)
      throw_input_error("a sample of length {} states padded_total_length {}", t, sample_padded);
    return (sample_padded + parts - 1) / parts;
  }
  if (layout.padded_total_length > 0) {
    if (layout.padded_total_length % parts != 0) {
      throw_input_error("--padded-total-length {} is not a multiple of 2*cp = {}",
                        layout.padded_total_length, parts);
    }
    if (t > layout.padded_total_length) {
      throw_input_error("a sample of length {} exceeds --padded-total-length {}", t,
                        layout.padded_total_length);
    }
    return layout.padded_total_length / parts;
  }
  if (layout.pad_multiple > 0) {
    const int64_t unit = std::lcm(layout.pad_multiple, parts);
    return (t + unit - 1) / unit * unit / parts;
  }
  return (t + parts - 1) / parts;
}

}  // namespace lossguard
