// Device query for builds without CUDA.
#include "kernels/device_info.h"

namespace lossguard::kernels {

DeviceInfo query_device_info() {
  DeviceInfo d;
  d.status = "this build has no CUDA support";
  return d;
}

}  // namespace lossguard::kernels
