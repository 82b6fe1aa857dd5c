// CPU twin of the fused cross entropy: rows split over the worker threads, each running the row
// kernel built for the best instruction set this CPU has.
#include <cstdlib>

#if defined(__x86_64__)
#include <cpuid.h>
#endif
#include <fmt/format.h>

#include <stdexcept>
#include <string>

#include "kernels/cpu/fused_xent_rows.h"
#include "kernels/cpu/parallel.h"

namespace lossguard::kernels {

namespace {

using RowsFn = void (*)(const XentArgs&, int64_t, int64_t);

struct Isa {
  const char* name;
  RowsFn rows;
};

}  // namespace

bool xent_isa_runs(const std::string& name) {
  if (name == "generic") return true;
#if defined(__x86_64__) && defined(LOSSGUARD_XENT_X86)
  __builtin_cpu_init();
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) &&
                    (ecx & bit_F16C) != 0;  // not every compiler's builtin knows it
  const bool v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                  __builtin_cpu_supports("bmi2") && f16c;
  const bool v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (name == "avx2") return v3;
  if (name == "avx512") return v4;
#endif
  return false;
}

namespace {

Isa pick_isa() {
  const char* forced = std::getenv("LOSSGUARD_CPU_ISA");
  const std::string want = forced != nullptr ? forced : "";
#if defined(__x86_64__) && defined(LOSSGUARD_XENT_X86)
  if (xent_isa_runs("avx512") && want != "avx2" && want != "generic")
    return {"avx512", avx512::xent_rows};
  if (xent_isa_runs("avx2") && want != "generic") return {"avx2", avx2::xent_rows};
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
      throw std::out_of_range(
          fmt::format("fused_xent: row {} has target {} outside the vocabulary [0, {})", r,
                      a.targets[r], a.vocab));
    }
  }
  const RowsFn rows = isa().rows;
  parallel_ranges(a.rows, 4, [&](int64_t begin, int64_t end, int) { rows(a, begin, end); });
}

}  // namespace lossguard::kernels
