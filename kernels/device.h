// Where a kernel runs. Every op in kernels/ takes a Device and pointers in that device's memory;
// the one switch in dispatch.cpp routes to the CPU twin or the CUDA kernel.
#pragma once
#include <string>

#include "core/modes.h"

namespace lossguard::kernels {

enum class Device { kCpu, kCuda };

// True when this build has CUDA and the process sees at least one device.
bool cuda_available();
// Throws UnverifiedError (SPEC §8: nothing verified, exit 4) naming why when `device` is CUDA and
// none is available.
void require_device(Device device);

// Worker threads for the CPU twins: LOSSGUARD_NUM_THREADS, else the hardware's concurrency.
int cpu_threads();

}  // namespace lossguard::kernels

namespace lossguard {
template <>
struct ModeNames<kernels::Device> {
  static constexpr std::pair<kernels::Device, const char*> kTable[] = {
      {kernels::Device::kCpu, "cpu"}, {kernels::Device::kCuda, "cuda"}};
};
}  // namespace lossguard
