// Fused log-prob / loss / gradient of the next-token cross entropy from logits (SPEC §4, nll from
// logits): one online log-sum-exp pass and one gradient pass per row, reading the logits at most
// twice (the CPU twin reads them once from memory: the row's exponentials stay in cache for the
// gradient pass), bf16 / fp16 / fp32 inputs with fp32 arithmetic, never materialising log_softmax.
//
// Shared parameters (pointers in the memory of the Device the op runs on):
//   logits      [rows, vocab] in `dtype` (float32, float16, bfloat16), row r at logits + r *
//   row_stride targets     [rows] int64 in [0, vocab): y_r grad_scale  [rows] float32: c_r = d loss
//   / d l_r (the reduction's coefficient; 0 on masked rows) active      [rows] uint8 or null (every
//   row): inactive rows are not read; their outputs are 0 lse         out [rows] float32:
//   logsumexp(z_r) token_loss  out [rows] float32: l_r = lse_r - z_r[y_r]  (= -log p_r(y_r)) grad
//   out [rows, vocab] in `dtype` (row-major, stride vocab) or null (loss only):
//               c_r * (softmax(z_r) - onehot(y_r)); exactly 0 on inactive rows and where c_r == 0
#pragma once
#include <cstdint>

#include "core/array.h"
#include "kernels/device.h"

namespace lossguard::kernels {

// The CPU twin sums a row's exponentials in blocks of kXentBlock floats, each block in two vector
// accumulators of L lanes (L = 16 AVX-512, 8 AVX2, 4 generic), whose lanes are then added, and the
// block sums in float64: at most kXentBlock / (2 L) + 2 L + 2 float additions reach one block sum.
// kFusedXentSumChain is that chain for the narrowest build (L = 4), the one check's tolerances
// assume whatever the ISA (the CUDA kernel's tree reduction is shorter).
inline constexpr int64_t kXentBlock = 2048;
inline constexpr int64_t kFusedXentSumChain = kXentBlock / 8 + 8 + 2;

struct XentArgs {
  const void* logits = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0, vocab = 0, row_stride = 0;
  const int64_t* targets = nullptr;
  const float* grad_scale = nullptr;
  const uint8_t* active = nullptr;
  float* lse = nullptr;
  float* token_loss = nullptr;
  void* grad = nullptr;
};

// The logits dtypes the fused kernel takes: float32, float16, bfloat16.
inline bool fused_xent_takes(DType d) {
  return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16;
}

// Throws std::invalid_argument on a dtype fused_xent_takes refuses, or inconsistent sizes.
void fused_xent(const XentArgs& a, Device device);

void fused_xent_cpu(const XentArgs& a);
void fused_xent_cuda(const XentArgs& a);  // throws when the build has no CUDA

}  // namespace lossguard::kernels
