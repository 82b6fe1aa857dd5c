// What a candidate (trainer/: LibTorch or the kernels) computed for one check case, as plain data
// the oracle judges (SPEC §5). The trainer fills it; the oracle never sees how.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/array.h"

namespace lossguard {

// Where a candidate delivers its gradient: a block of response rows at a time, each row once, in
// any order (`data`: n rows of the input's width, row-major, in the input's dtype). The check
// compares each block against the oracle as it arrives, so neither side ever holds a [rows, vocab]
// gradient (SPEC §5 "Scale"). Plain function pointer and context: it crosses the LibTorch plugin's
// boundary.
struct GradSink {
  void* context = nullptr;
  void (*rows)(void* context, const int64_t* rows, int64_t n, const void* data) = nullptr;
  explicit operator bool() const { return rows != nullptr; }
  void operator()(const int64_t* r, int64_t n, const void* data) const {
    rows(context, r, n, data);
  }
};

// Hands a whole gradient (`rows` rows of row_bytes each, row-major) to `sink` in blocks of `block`
// rows, in order: for a candidate's gradient collected whole (tests, mutations).
inline void stream_rows(const std::byte* data, int64_t rows, std::size_t row_bytes, int64_t block,
                        const GradSink& sink) {
  std::vector<int64_t> ids;
  for (int64_t r0 = 0; r0 < rows; r0 += block) {
    const int64_t n = rows - r0 < block ? rows - r0 : block;
    ids.resize(static_cast<std::size_t>(n));
    for (int64_t k = 0; k < n; ++k) ids[static_cast<std::size_t>(k)] = r0 + k;
    sink(ids.data(), n, data + static_cast<std::size_t>(r0) * row_bytes);
  }
}

// How a candidate computes the nll from logits: `check` derives its tolerances from it
// (oracle/check/check.cpp has the derivations). kUnknown: the per-dtype defaults alone.
struct Arithmetic {
  enum class Kind {
    kUnknown,
    // lossguard's fused kernel: float arithmetic on the input values; a row's sum of exponentials
    // in float blocks (at most `exp_sum_chain` additions in a row), added in float64; lse and each
    // l_t in float64, l_t stored as float; c_t l_t and the sums in float64; the gradient c (p -
    // onehot) in float, written in the input dtype.
    kFusedFloat,
    // LibTorch autograd in the input dtype: log_softmax computed in float (PyTorch's CPU kernel
    // for float, bfloat16 and float16; float64 in float64), its output written in the dtype; the
    // coefficient c_t, the product c_t l_t and the rank's partial sum (accumulated in float) in
    // the dtype; the backward in float, written in the dtype.
    kTorch,
  };
  Kind kind = Kind::kUnknown;
  int64_t exp_sum_chain = 0;  // the longest run of float additions in one row's sum of exponentials
};

struct CandidateResult {
  int64_t denominator = 0;  // the denominator the trainer used (per-token: N summed over CP ranks)
  double loss = 0.0;        // SUM over CP ranks of each rank's partial loss
  HostArray grad;           // reassembled gradient w.r.t. the loss input, in its dtype
  std::vector<int32_t> row_rank;  // per response row: the CP rank that owns it (-1: none)
  std::vector<int8_t>
      row_chunk;      // per response row: which of the owner's two chunks (0, 1; -1: none)
  std::string dtype;  // working dtype
  // The kernels' zero-token flag as reduced on the device (true: skip); none: not computed.
  std::optional<bool> skip_flag;
};

}  // namespace lossguard
