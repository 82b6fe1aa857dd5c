// The skip decision on the device: a block reduction of the counts into an int64 (64-bit atomics
// only), the flag set by the last block to finish, and one copy to the host when the caller asks
// for it.
#include "kernels/cuda/check.cuh"
#include "kernels/zero_flag.h"

namespace lossguard::kernels {

namespace {

constexpr int kThreads = 256;

__global__ void reduce_counts(const int64_t* counts, int64_t n, SkipDecision* out,
                              unsigned int* blocks_done) {
  __shared__ long long partial[kThreads];
  long long s = 0;
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    s += counts[k];
  }
  partial[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) partial[threadIdx.x] += partial[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    atomicAdd(reinterpret_cast<unsigned long long*>(&out->num_tokens),
              static_cast<unsigned long long>(partial[0]));
    __threadfence();
    if (atomicAdd(blocks_done, 1u) == gridDim.x - 1) {  // the last block sees every sum
      out->skip =
          atomicAdd(reinterpret_cast<unsigned long long*>(&out->num_tokens), 0ull) == 0 ? 1 : 0;
      *blocks_done = 0;
    }
  }
}

}  // namespace

void reduce_skip_decision_cuda(const int64_t* counts, int64_t n, SkipDecision* decision) {
  static unsigned int* blocks_done =
      nullptr;  // one counter per process, reset by the kernel itself
  if (blocks_done == nullptr) {
    LOSSGUARD_CUDA_CHECK(cudaMalloc(&blocks_done, sizeof(unsigned int)));
    LOSSGUARD_CUDA_CHECK(cudaMemset(blocks_done, 0, sizeof(unsigned int)));
  }
  LOSSGUARD_CUDA_CHECK(cudaMemsetAsync(decision, 0, sizeof(SkipDecision)));
  const int64_t want = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(want < 1 ? 1 : want > 1024 ? 1024 : want);
  reduce_counts<<<blocks, kThreads>>>(counts, n, decision, blocks_done);
  LOSSGUARD_CUDA_CHECK(cudaGetLastError());
}

SkipDecision read_skip_decision_cuda(const SkipDecision* decision) {
  SkipDecision host;
  LOSSGUARD_CUDA_CHECK(
      cudaMemcpy(&host, decision, sizeof host, cudaMemcpyDeviceToHost));  // the one sync
  return host;
}

}  // namespace lossguard::kernels
