// Counting throughput: loads a dump, times oracle::count_owned_tokens and the token-count kernel
// (CPU twin) over several CP sizes (best of N), checks they agree exactly, and times a memcpy of
// the same number of bytes in the same process, on one thread (the oracle's reference) and on the
// kernel's threads (the kernel's); prints them as JSON.
//   count_throughput DUMP [CP,CP,...] [REPEATS]
#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "io/dump.h"
#include "kernels/cpu/parallel.h"
#include "kernels/token_count.h"
#include "oracle/count/denominators.h"

using Clock = std::chrono::steady_clock;
using namespace lossguard;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: count_throughput DUMP [CP,CP,...] [REPEATS]\n";
    return 2;
  }
  std::vector<int64_t> cps = {1, 2, 4, 8};
  if (argc > 2) {
    cps.clear();
    std::stringstream ss(argv[2]);
    for (std::string x; std::getline(ss, x, ',');) cps.push_back(std::stoll(x));
  }
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 5;
  const auto t0 = Clock::now();
  auto dump = lossguard::io::read_dump(argv[1]);
  auto batch = lossguard::io::build_batch({dump}, {}, lossguard::LoadNeeds{false, false, false});
  const double load_s = std::chrono::duration<double>(Clock::now() - t0).count();

  double best_count = 1e30;
  int64_t checksum = 0;
  for (int k = 0; k < repeats; ++k) {
    const auto a = Clock::now();
    auto counts = lossguard::oracle::count_owned_tokens(batch, cps, {});
    best_count = std::min(best_count, std::chrono::duration<double>(Clock::now() - a).count());
    checksum = lossguard::oracle::global_denominator(lossguard::Policy::kFixed, counts, 0);
  }
  kernels::TokenCountArgs ka = kernels::host_token_count_args(batch, cps);
  std::vector<int64_t> kernel_counts(static_cast<std::size_t>(kernels::token_count_size(ka)));
  ka.counts = kernel_counts.data();
  double best_kernel = 1e30;
  for (int k = 0; k < repeats; ++k) {
    const auto a = Clock::now();
    kernels::count_tokens(ka, kernels::Device::kCpu);
    best_kernel = std::min(best_kernel, std::chrono::duration<double>(Clock::now() - a).count());
  }
  const auto oracle_counts = lossguard::oracle::count_owned_tokens(batch, cps, {});
  std::size_t offset = 0;
  for (std::size_t c = 0; c < cps.size(); ++c) {
    for (std::size_t e = 0; e < oracle_counts.per_rank[c].size(); ++e) {
      if (kernel_counts[offset + e] != oracle_counts.per_rank[c][e]) {
        std::cerr << "count_throughput: the kernel and the oracle disagree at cp " << cps[c]
                  << ", entry " << e << "\n";
        return 1;
      }
    }
    offset += oracle_counts.per_rank[c].size();
  }
  // Bytes the count must read: the masks once, plus the two lengths per sample.
  const double bytes =
      static_cast<double>(batch.loss_mask.size()) + 16.0 * static_cast<double>(batch.num_samples());
  std::vector<uint8_t> src(batch.loss_mask.size()), dst(batch.loss_mask.size());
  std::memset(src.data(), 1, src.size());
  std::memset(dst.data(), 0, dst.size());
  double best_copy = 1e30, best_threaded_copy = 1e30;
  for (int k = 0; k < repeats; ++k) {
    auto a = Clock::now();
    std::memcpy(dst.data(), src.data(), src.size());
    best_copy = std::min(best_copy, std::chrono::duration<double>(Clock::now() - a).count());
    a = Clock::now();  // on as many threads as the kernel uses: its fair reference
    kernels::parallel_ranges(
        static_cast<int64_t>(src.size()), 1 << 20, [&](int64_t b, int64_t e, int) {
          std::memcpy(dst.data() + b, src.data() + b, static_cast<std::size_t>(e - b));
        });
    best_threaded_copy =
        std::min(best_threaded_copy, std::chrono::duration<double>(Clock::now() - a).count());
  }
  nlohmann::json j = {
      {"samples", batch.num_samples()},
      {"response_tokens", batch.num_response_tokens()},
      {"cp_sizes", cps},
      {"load_and_validate_s", load_s},
      {"count_s", best_count},
      {"count_bytes_per_s", bytes / best_count},
      {"memcpy_bytes_per_s", static_cast<double>(src.size()) / best_copy},
      {"count_vs_memcpy", (bytes / best_count) / (static_cast<double>(src.size()) / best_copy)},
      {"kernel_count_s", best_kernel},
      {"kernel_threads", kernels::cpu_threads()},
      {"kernel_count_bytes_per_s", bytes / best_kernel},
      {"memcpy_threaded_bytes_per_s", static_cast<double>(src.size()) / best_threaded_copy},
      {"kernel_count_vs_threaded_memcpy",
       (bytes / best_kernel) / (static_cast<double>(src.size()) / best_threaded_copy)},
      {"denominator_cp1", checksum},
      {"dst_probe", static_cast<int>(dst[dst.size() / 2])}};
  std::cout << j.dump() << "\n";
  return 0;
}
