// CPU twin of the device-side skip decision.
#include "kernels/zero_flag.h"

namespace lossguard::kernels {

void reduce_skip_decision_cpu(const int64_t* counts, int64_t n, SkipDecision* decision) {
  int64_t total = 0;
  for (int64_t k = 0; k < n; ++k) total += counts[k];
  decision->num_tokens = total;
  decision->skip = total == 0 ? 1 : 0;
}

}  // namespace lossguard::kernels
