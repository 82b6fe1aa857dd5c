// CPU twin of the fused cross entropy: rows split over the worker threads, each running the row kernel
// built for the best instruction set this CPU has.
#include <cstdlib>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "kernels/cpu/fused_xent_rows.h"
#include "kernels/cpu/parallel.h"

namespace lossguard::kernels {

namespace {

using RowsFn = void (*)(const XentArgs&, int64_t, int64_t);

struct Isa {
  const char* name;
  RowsFn rows;
};

Isa pick_isa() {
  const char* forced = std::getenv("LOSSGUARD_CPU_ISA");
  const std::string want = forced != nullptr ? forced : "";
#if defined(__x86_64__) && defined(LOSSGUARD_XENT_X86)
  __builtin_cpu_init();
  const bool v4 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
                  __builtin_cpu_supports("bmi2");
  if (v4 && want != "avx2" && want != "generic") return {"avx512", avx512::xent_rows};
  if (v3 && want != "generic") return {"avx2", avx2::xent_rows};
#endif
  return {"generic", generic::xent_rows};
}

const Isa& isa() {
  static const Isa chosen = pick_isa();
  return chosen;
}

}  // namespace

const char* xent_cpu_isa() { return isa().name; }

void fused_xent_cpu(const XentArgs& a) {
  for (int64_t r = 0; r < a.rows; ++r) {
    if (a.active != nullptr && !a.active[r]) continue;
    if (a.targets[r] < 0 || a.targets[r] >= a.vocab) {
      throw std::out_of_range(fmt::format("fused_xent: row {} has target {} outside the vocabulary [0, {})", r, a.targets[r], a.vocab));
    }
  }
  const RowsFn rows = isa().rows;
  parallel_ranges(a.rows, 4, [&](int64_t begin, int64_t end, int) { rows(a, begin, end); });
}

}  // namespace lossguard::kernels
