// CUDA twin of the fused cross entropy: one block per row. Pass 1 keeps an online (max, sum) per
// thread (one exp per element), merged across the block; pass 2 reads the row again (mostly from
// L2) and writes c * (softmax - onehot) in the logits' dtype. float arithmetic throughout, as the
// CPU twin.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "kernels/cuda/check.cuh"
#include "kernels/fused_xent.h"

namespace lossguard::kernels {

namespace {

constexpr int kThreads = 512;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Merges two (max, sum of exp(x - max)) pairs; an empty pair has max -inf.
__device__ __forceinline__ void merge(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    s = s2;
    return;
  }
  const float mx = fmaxf(m, m2);
  s = s * expf(m - mx) + s2 * expf(m2 - mx);
  m = mx;
}

template <typename T>
__global__ void xent_kernel(XentArgs a) {
  __shared__ float sh_m[kThreads / 32], sh_s[kThreads / 32];
  __shared__ float sh_lse;
  const int64_t row = blockIdx.x;
  T* g = a.grad != nullptr ? static_cast<T*>(a.grad) + row * a.vocab : nullptr;
  if (a.active != nullptr && !a.active[row]) {
    if (threadIdx.x == 0) a.lse[row] = a.token_loss[row] = 0.0f;
    if (g != nullptr)
      for (int64_t k = threadIdx.x; k < a.vocab; k += blockDim.x) g[k] = from_float<T>(0.0f);
    return;
  }
  const T* z = static_cast<const T*>(a.logits) + row * a.row_stride;
  float m = -INFINITY, s = 0.0f;
  for (int64_t k = threadIdx.x; k < a.vocab; k += blockDim.x) {
    const float x = to_float(z[k]);
    if (x > m) {
      s = (m == -INFINITY ? 0.0f : s * expf(m - x)) + 1.0f;
      m = x;
    } else {
      s += expf(x - m);
    }
  }
  for (int w = 16; w > 0; w /= 2)
    merge(m, s, __shfl_down_sync(0xffffffffu, m, w), __shfl_down_sync(0xffffffffu, s, w));
  if (threadIdx.x % 32 == 0) {
    sh_m[threadIdx.x / 32] = m;
    sh_s[threadIdx.x / 32] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float bm = sh_m[0], bs = sh_s[0];
    for (int w = 1; w < kThreads / 32; ++w) merge(bm, bs, sh_m[w], sh_s[w]);
    const float lse = bm + logf(bs);
    const int64_t y = a.targets[row];
    sh_lse = lse;
    a.lse[row] = lse;
    a.token_loss[row] = lse - to_float(z[y]);
  }
  __syncthreads();
  if (g == nullptr) return;
  const float lse = sh_lse, c = a.grad_scale[row];
  const int64_t y = a.targets[row];
  for (int64_t k = threadIdx.x; k < a.vocab; k += blockDim.x) {
    const float x = to_float(z[k]);
    const float v = c == 0.0f ? 0.0f : k == y ? c * expm1f(x - lse) : c * expf(x - lse);
    g[k] = from_float<T>(v);
  }
}

}  // namespace

void fused_xent_cuda(const XentArgs& a) {
  if (a.rows == 0) return;
  const unsigned grid = static_cast<unsigned>(a.rows);
  switch (a.dtype) {
    case DType::kFloat16:
      xent_kernel<__half><<<grid, kThreads>>>(a);
      break;
    case DType::kBFloat16:
      xent_kernel<__nv_bfloat16><<<grid, kThreads>>>(a);
      break;
    default:
      xent_kernel<float><<<grid, kThreads>>>(a);
      break;
  }
  LOSSGUARD_CUDA_CHECK(cudaGetLastError());
}

}  // namespace lossguard::kernels
