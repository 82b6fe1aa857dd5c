// Splits [0, n) into contiguous ranges over the CPU twins' worker threads (kernels::cpu_threads()), at
// least `grain` items each; the calling thread takes the first range. Exceptions are not expected from
// `fn` (the twins validate before they split).
#pragma once
#include <algorithm>
#include <cstdint>
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
  workers.reserve(static_cast<std::size_t>(parts - 1));
  auto bounds = [&](int64_t p) { return p * n / parts; };
  for (int64_t p = 1; p < parts; ++p) {
    workers.emplace_back([&, p] { fn(bounds(p), bounds(p + 1), static_cast<int>(p)); });
  }
  fn(bounds(0), bounds(1), 0);
  for (auto& w : workers) w.join();
}

}  // namespace lossguard::kernels
