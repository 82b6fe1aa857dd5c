// SPEC §6, literally.
#include "oracle/count/metrics.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace lossguard::oracle {

NormalizedMetrics normalize_metrics(const std::vector<double>& values,
                                    const std::vector<std::string>& keys) {
  if (values.size() != keys.size() + 1) {
    throw MetricsError(
        fmt::format("{} values for {} keys: expected [denominator, one value per key]",
                    values.size(), keys.size()));
  }
  NormalizedMetrics out;
  const double den = values[0];
  if (den == 0.0) {
    std::vector<std::string> nonzero;
    for (std::size_t k = 0; k < keys.size(); ++k) {
      if (values[k + 1] != 0.0) nonzero.push_back(fmt::format("{} = {}", keys[k], values[k + 1]));
    }
    if (!nonzero.empty()) {
      throw MetricsError(fmt::format(
          "denominator is 0 but numerators are not: {} (the reducer and the denominator disagree)",
          fmt::join(nonzero, ", ")));
    }
    out.no_signal = true;
    for (const auto& k : keys) out.values.emplace_back(k, 0.0);
    return out;
  }
  for (std::size_t k = 0; k < keys.size(); ++k)
    out.values.emplace_back(keys[k], values[k + 1] / den);
  return out;
}

}  // namespace lossguard::oracle
