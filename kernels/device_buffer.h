// Memory on a Device (64-byte aligned on the CPU), owned, with copies from and to the host.
#pragma once
#include <cstddef>

#include "kernels/device.h"

namespace lossguard::kernels {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Device device, std::size_t size_bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& o) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  std::size_t size_bytes() const { return size_bytes_; }
  void upload(const void* host, std::size_t n);    // host -> buffer[0, n)
  void download(void* host, std::size_t n) const;  // buffer[0, n) -> host
  void zero();

 private:
  Device device_ = Device::kCpu;
  void* data_ = nullptr;
  std::size_t size_bytes_ = 0;
};

// The CUDA side of the buffer (cuda/runtime.cu; throws when the build has no CUDA).
void* cuda_alloc(std::size_t n);
void cuda_free(void* p);
void cuda_copy(void* dst, const void* src, std::size_t n, bool to_device);
void cuda_zero(void* p, std::size_t n);
void cuda_copy_device(void* dst, const void* src, std::size_t n);  // device to device
void cuda_synchronize();

}  // namespace lossguard::kernels
