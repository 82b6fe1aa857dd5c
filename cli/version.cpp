// --version: what this binary was built with and what device it sees.
#include <fmt/format.h>

#include "cli/command.h"
#include "kernels/cpu/fused_xent_rows.h"
#include "kernels/device.h"
#include "kernels/device_info.h"
#include "lossguard/build_config.h"

namespace lossguard::cli {

std::string version_text() {
  const kernels::DeviceInfo d = kernels::query_device_info();
  std::string s = fmt::format("lossguard {}\n", LOSSGUARD_VERSION);
  s += fmt::format("LibTorch {} (torch_cpu, c10)\n", LOSSGUARD_TORCH_VERSION);
  s += fmt::format("CUDA: {}\n",
                   d.cuda_compiled ? fmt::format("compiled in (runtime {})", d.cuda_runtime_version)
                                   : "not compiled in");
  // NCCL is loaded at run time (core/nccl_library.h): say which file, or why none
  s += fmt::format("NCCL: {}\n",
                   !d.nccl_compiled ? "not compiled in"
                   : d.nccl_library.empty()
                       ? fmt::format("support compiled in; library not found ({})", d.nccl_status)
                       : fmt::format("{} ({})", d.nccl_version, d.nccl_library));
  s += fmt::format("device: {}\n", d.device_count > 0
                                       ? fmt::format("{} CUDA device(s); device 0: {}",
                                                     d.device_count, d.device_name)
                                       : fmt::format("none ({})", d.status));
  s += fmt::format("CPU kernels: {}, {} thread(s)\n", kernels::xent_cpu_isa(),
                   kernels::cpu_threads());
  return s;
}

}  // namespace lossguard::cli
