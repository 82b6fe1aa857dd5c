// Metrics normalisation (SPEC §6): values = [denominator, v_1..v_k] for keys k_1..k_k.
#pragma once
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace lossguard::oracle {

// The reducer and the denominator disagree (a non-zero numerator over a zero denominator), or the
// values do not fit the keys: a trainer must fail fast here.
class MetricsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct NormalizedMetrics {
  std::vector<std::pair<std::string, double>> values;
  bool no_signal = false;  // denominator 0 and every numerator 0: every metric reported as 0.0
};

NormalizedMetrics normalize_metrics(const std::vector<double>& values,
                                    const std::vector<std::string>& keys);

}  // namespace lossguard::oracle
