// What CUDA/NCCL support this build has and which device the process sees.
#pragma once
#include <string>

namespace lossguard::kernels {

struct DeviceInfo {
  bool cuda_compiled = false;
  bool nccl_compiled = false;
  int device_count = 0;
  std::string device_name;           // device 0
  std::string status;                // why no device, when none
  std::string cuda_runtime_version;  // "13.0"
  std::string nccl_version;          // "2.27.3"
  std::string nccl_library;          // the libnccl.so.2 found at run time
  std::string nccl_status;           // why none was found, when none
};

DeviceInfo query_device_info();

}  // namespace lossguard::kernels
