// Where a kernel runs. Every op in kernels/ takes a Device and pointers in that device's memory;
// the one switch in dispatch.cpp routes to the CPU twin or the CUDA kernel.
#pragma once
#include <string>

namespace lossguard::kernels {

enum class Device { kCpu, kCuda };

const char* device_name(Device d);
bool parse_device(const std::string& s, Device* out);  // "cpu", "cuda"

// True when this build has CUDA and the process sees at least one device.
bool cuda_available();

// Worker threads for the CPU twins: LOSSGUARD_NUM_THREADS, else the hardware's concurrency.
int cpu_threads();

}  // namespace lossguard::kernels
