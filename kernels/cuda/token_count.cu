// CUDA twin of the masked token counter: one block per sample. Thread 0 sorts the chunk boundaries
// of every requested CP size into shared memory; the block sums the mask segment by segment (each
// byte read once) into int64 prefix sums; each (CP size, chunk) count is a difference of two of
// them.
#include <stdexcept>
#include <string>

#include "kernels/cuda/check.cuh"
#include "kernels/token_count.h"

namespace lossguard::kernels {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxCp = 16;

struct CpList {
  int n;
  int64_t cp[kMaxCp];
  int64_t out_offset[kMaxCp];
};

__global__ void count_kernel(TokenCountArgs a, CpList cps) {
  extern __shared__ long long shared[];
  __shared__ int num_cuts;
  __shared__ long long warp_sums[kThreads / 32];
  const int64_t i = blockIdx.x;
  const int64_t t = a.total_lengths[i], r = a.response_lengths[i];
  const int64_t padded = a.chunk.padded_lengths != nullptr ? a.chunk.padded_lengths[i] : 0;
  const bool sft = r == t;
  const int64_t off = sft ? 0 : t - r - 1;
  const int64_t owned_len = sft ? (t > 1 ? t - 1 : 0) : r;
  long long* cuts = shared;
  long long* prefix = nullptr;
  auto clip = [&](int64_t position) -> long long {
    const int64_t k = position - off;
    return k < 0 ? 0 : k > owned_len ? owned_len : k;
  };
  if (threadIdx.x == 0) {  // insertion into a sorted, duplicate-free list
    int n = 0;
    auto insert = [&](long long v) {
      int k = n;
      while (k > 0 && cuts[k - 1] > v) --k;
      if (k > 0 && cuts[k - 1] == v) return;
      for (int j = n; j > k; --j) cuts[j] = cuts[j - 1];
      cuts[k] = v;
      ++n;
    };
    insert(0);
    insert(owned_len);
    insert(r);  // at CP = 1 the unsharded trainer sums the whole mask
    for (int c = 0; c < cps.n; ++c) {
      const int64_t cs = chunk_size_of(t, cps.cp[c], a.chunk, padded);
      for (int64_t b = 1; b < 2 * cps.cp[c]; ++b) insert(clip(b * cs));
    }
    num_cuts = n;
  }
  __syncthreads();
  prefix = cuts + num_cuts;
  const uint8_t* mask = a.loss_mask + a.mask_offsets[i];
  if (threadIdx.x == 0) prefix[0] = 0;
  for (int s = 1; s < num_cuts; ++s) {
    long long v = 0;
    for (long long k = cuts[s - 1] + threadIdx.x; k < cuts[s]; k += blockDim.x) v += mask[k];
    for (int w = 16; w > 0; w /= 2) v += __shfl_down_sync(0xffffffffu, v, w);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
      long long total = 0;
      for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
      prefix[s] = prefix[s - 1] + total;
    }
    __syncthreads();
  }
  auto prefix_at = [&](long long k) {
    int lo = 0, hi = num_cuts - 1;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (cuts[mid] < k)
        lo = mid + 1;
      else
        hi = mid;
    }
    return prefix[lo];
  };
  for (int c = 0; c < cps.n; ++c) {
    const int64_t cp = cps.cp[c], cs = chunk_size_of(t, cp, a.chunk, padded);
    int64_t* out = a.counts + cps.out_offset[c] + i * cp;
    if (cp == 1) {
      if (threadIdx.x == 0) out[0] = prefix_at(r);
      continue;
    }
    for (int64_t rank = threadIdx.x; rank < cp; rank += blockDim.x) {
      const int64_t chunks[2] = {rank, 2 * cp - 1 - rank};
      long long v = 0;
      for (int64_t b : chunks) v += prefix_at(clip((b + 1) * cs)) - prefix_at(clip(b * cs));
      out[rank] = v;
    }
  }
}

}  // namespace

void count_tokens_cuda(const TokenCountArgs& a) {
  if (a.num_cp > kMaxCp)
    throw std::invalid_argument("count_tokens_cuda: at most 16 CP sizes per call");
  CpList cps{};
  cps.n = a.num_cp;
  int64_t max_cuts = 3, offset = 0;
  for (int c = 0; c < a.num_cp; ++c) {
    cps.cp[c] = a.cp_sizes[c];
    cps.out_offset[c] = offset;
    offset += a.num_samples * a.cp_sizes[c];
    max_cuts += 2 * a.cp_sizes[c] - 1;
  }
  const std::size_t shared_bytes = static_cast<std::size_t>(2 * max_cuts) * sizeof(long long);
  if (shared_bytes > 48 * 1024)
    throw std::invalid_argument(
        "count_tokens_cuda: the CP sizes of one call must add up to at most 1500");
  if (a.num_samples == 0) return;
  count_kernel<<<static_cast<unsigned>(a.num_samples), kThreads, shared_bytes>>>(a, cps);
  LOSSGUARD_CUDA_CHECK(cudaGetLastError());
}

}  // namespace lossguard::kernels
