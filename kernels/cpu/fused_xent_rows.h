// The per-ISA row kernels of the fused cross entropy (cpu/fused_xent_body.h), chosen once per
// process.
#pragma once
#include <cstdint>
#include <string>

#include "kernels/fused_xent.h"

namespace lossguard::kernels {

struct HalfBits {
  uint16_t bits;
};
struct BFloat16Bits {
  uint16_t bits;
};

namespace avx512 {
void xent_rows(const XentArgs& a, int64_t begin, int64_t end);
}
namespace avx2 {
void xent_rows(const XentArgs& a, int64_t begin, int64_t end);
}
namespace generic {
void xent_rows(const XentArgs& a, int64_t begin, int64_t end);
}

// "avx512", "avx2" or "generic": what this CPU runs (LOSSGUARD_CPU_ISA=generic|avx2 forces a lower
// one).
const char* xent_cpu_isa();
// Whether this build has the named row kernel and this CPU can run it.
bool xent_isa_runs(const std::string& name);

}  // namespace lossguard::kernels
