// Device query for CUDA builds (and NCCL's version and file when NCCL support is built; the library
// is found at run time, core/nccl_library.h).
#include <cuda_runtime.h>

#include <string>

#include "kernels/device_info.h"
#include "lossguard/build_config.h"
#if LOSSGUARD_HAVE_NCCL
#include <nccl.h>

#include "core/errors.h"
#include "core/nccl_library.h"
#endif

namespace lossguard::kernels {

DeviceInfo query_device_info() {
  DeviceInfo d;
  d.cuda_compiled = true;
  int rt = 0;
  cudaRuntimeGetVersion(&rt);
  d.cuda_runtime_version = std::to_string(rt / 1000) + "." + std::to_string((rt % 1000) / 10);
#if LOSSGUARD_HAVE_NCCL
  d.nccl_compiled = true;
  try {
    const auto& lib = lossguard::nccl_library("NCCL support");
    d.nccl_library = lib.path;
    int v = 0;
    auto get_version =
        reinterpret_cast<decltype(&ncclGetVersion)>(nccl_symbol(lib, "ncclGetVersion"));
    if (get_version(&v) == ncclSuccess) {
      d.nccl_version = std::to_string(v / 10000) + "." + std::to_string((v % 10000) / 100) + "." +
                       std::to_string(v % 100);
    }
  } catch (const lossguard::InputError& e) {
    d.nccl_status = e.what();
  }
#endif
  const cudaError_t err = cudaGetDeviceCount(&d.device_count);
  if (err != cudaSuccess) {
    d.device_count = 0;
    d.status = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
    cudaGetLastError();
    return d;
  }
  if (d.device_count == 0) {
    d.status = "no CUDA device";
    return d;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess) d.device_name = prop.name;
  return d;
}

}  // namespace lossguard::kernels
