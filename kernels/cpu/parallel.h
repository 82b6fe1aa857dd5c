// Splits [0, n) into contiguous ranges over the CPU twins' worker threads (kernels::cpu_threads()),
// at least `grain` items each; the calling thread takes the first range. An exception in any range
// (a failed allocation, say) is rethrown in the caller once every thread has finished.
#pragma once
#include <algorithm>
#include <cstdint>
#include <exception>
#include <thread>
#include <vector>

#include "kernels/device.h"

namespace lossguard::kernels {

template <typename Fn>
void parallel_ranges(int64_t n, int64_t grain, Fn&& fn) {
  const int64_t want = grain > 0 ? (n + grain - 1) / grain : 1;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(cpu_threads(), want));
  if (parts == 1) {
    if (n > 0) fn(int64_t{0}, n, 0);
    return;
  }
  std::vector<std::thread> workers;
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(parts));
  workers.reserve(static_cast<std::size_t>(parts - 1));
  auto bounds = [&](int64_t p) { return p * n / parts; };
  auto guarded = [&](int64_t p) {
    try {
      fn(bounds(p), bounds(p + 1), static_cast<int>(p));
    } catch (...) {
      errors[static_cast<std::size_t>(p)] = std::current_exception();
    }
  };
  for (int64_t p = 1; p < parts; ++p) workers.emplace_back(guarded, p);
  guarded(0);
  for (auto& w : workers) w.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace lossguard::kernels
