// The one switch: every op routes to its CPU twin or its CUDA kernel here. Also the device buffer.
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <thread>
#include <utility>

#include "core/errors.h"
#include "kernels/device_buffer.h"
#include "kernels/device_info.h"
#include "kernels/fused_xent.h"
#include "kernels/token_count.h"
#include "kernels/zero_flag.h"

namespace lossguard::kernels {

bool cuda_available() { return query_device_info().device_count > 0; }

void require_device(Device device) {
  if (device != Device::kCuda) return;
  const DeviceInfo info = query_device_info();
  if (info.device_count > 0) return;
  throw UnverifiedError("--device cuda: no CUDA device (" +
                        (info.status.empty() ? std::string("none found") : info.status) + ")");
}

int cpu_threads() {
  if (const char* e = std::getenv("LOSSGUARD_NUM_THREADS")) {
    const int n = std::atoi(e);
    if (n > 0) return n;
  }
  const unsigned hw = std::thread::hardware_concurrency();
  return hw > 0 ? static_cast<int>(hw) : 1;
}

void count_tokens(const TokenCountArgs& a, Device device) {
  switch (device) {
    case Device::kCpu:
      return count_tokens_cpu(a);
    case Device::kCuda:
      return count_tokens_cuda(a);
  }
}

void fused_xent(const XentArgs& a, Device device) {
  if (!fused_xent_takes(a.dtype)) {
    throw std::invalid_argument("fused_xent: logits must be float32, float16 or bfloat16, got " +
                                std::string(dtype_name(a.dtype)));
  }
  if (a.rows < 0 || a.vocab < 1 || a.row_stride < a.vocab)
    throw std::invalid_argument("fused_xent: inconsistent sizes");
  switch (device) {
    case Device::kCpu:
      return fused_xent_cpu(a);
    case Device::kCuda:
      return fused_xent_cuda(a);
  }
}

void reduce_skip_decision(const int64_t* counts, int64_t n, SkipDecision* decision, Device device) {
  switch (device) {
    case Device::kCpu:
      return reduce_skip_decision_cpu(counts, n, decision);
    case Device::kCuda:
      return reduce_skip_decision_cuda(counts, n, decision);
  }
}

SkipDecision read_skip_decision(const SkipDecision* decision, Device device) {
  switch (device) {
    case Device::kCpu:
      return *decision;
    case Device::kCuda:
      return read_skip_decision_cuda(decision);
  }
  return {};
}

DeviceBuffer::DeviceBuffer(Device device, std::size_t n) : device_(device), size_bytes_(n) {
  if (n == 0) return;
  if (device == Device::kCuda) {
    data_ = cuda_alloc(n);
  } else {
    data_ = std::aligned_alloc(64, (n + 63) / 64 * 64);
    if (data_ == nullptr) throw std::bad_alloc();
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ == nullptr) return;
  if (device_ == Device::kCuda)
    cuda_free(data_);
  else
    std::free(data_);
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : device_(o.device_),
      data_(std::exchange(o.data_, nullptr)),
      size_bytes_(std::exchange(o.size_bytes_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    this->~DeviceBuffer();
    device_ = o.device_;
    data_ = std::exchange(o.data_, nullptr);
    size_bytes_ = std::exchange(o.size_bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::upload(const void* host, std::size_t n) {
  if (n == 0) return;
  if (device_ == Device::kCuda)
    cuda_copy(data_, host, n, true);
  else
    std::memcpy(data_, host, n);
}

void DeviceBuffer::download(void* host, std::size_t n) const {
  if (n == 0) return;
  if (device_ == Device::kCuda)
    cuda_copy(host, data_, n, false);
  else
    std::memcpy(host, data_, n);
}

void DeviceBuffer::zero() {
  if (size_bytes_ == 0) return;
  if (device_ == Device::kCuda)
    cuda_zero(data_, size_bytes_);
  else
    std::memset(data_, 0, size_bytes_);
}

}  // namespace lossguard::kernels
