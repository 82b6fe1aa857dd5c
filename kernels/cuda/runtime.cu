// Device memory for DeviceBuffer; every call checked.
#include "kernels/cuda/check.cuh"
#include "kernels/device_buffer.h"

namespace lossguard::kernels {

void* cuda_alloc(std::size_t n) {
  void* p = nullptr;
  LOSSGUARD_CUDA_CHECK(cudaMalloc(&p, n));
  return p;
}
void cuda_free(void* p) { cudaFree(p); }
void cuda_copy(void* dst, const void* src, std::size_t n, bool to_device) {
  LOSSGUARD_CUDA_CHECK(
      cudaMemcpy(dst, src, n, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost));
}
void cuda_copy_device(void* dst, const void* src, std::size_t n) {
  LOSSGUARD_CUDA_CHECK(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToDevice));
}
void cuda_zero(void* p, std::size_t n) { LOSSGUARD_CUDA_CHECK(cudaMemset(p, 0, n)); }
void cuda_synchronize() { LOSSGUARD_CUDA_CHECK(cudaDeviceSynchronize()); }

}  // namespace lossguard::kernels
