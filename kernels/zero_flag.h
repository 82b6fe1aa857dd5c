// The skip decision on the device (SPEC §7, bug 2): the global effective-token count reduced where
// the counts live and the zero flag derived there, so a trainer's hot path synchronises with the
// host once, at the end, instead of after every count.
//
//   counts      [n] int64 in the Device's memory: per-rank (or per-sample) effective-token counts;
//   their
//               SUM is the global denominator N of the DP x CP group
//   decision    out, in the Device's memory: {N, skip = (N == 0)}
#pragma once
#include <cstdint>

#include "kernels/device.h"

namespace lossguard::kernels {

struct SkipDecision {
  int64_t num_tokens = 0;
  int64_t skip = 0;  // 1: zero effective tokens, the optimizer step must not run
};

// Reduces and flags on the device, without synchronising.
void reduce_skip_decision(const int64_t* counts, int64_t n, SkipDecision* decision, Device device);
// The one host synchronisation: copies the decision to the host.
SkipDecision read_skip_decision(const SkipDecision* decision, Device device);

void reduce_skip_decision_cpu(const int64_t* counts, int64_t n, SkipDecision* decision);
void reduce_skip_decision_cuda(const int64_t* counts, int64_t n, SkipDecision* decision);
SkipDecision read_skip_decision_cuda(const SkipDecision* decision);

}  // namespace lossguard::kernels
