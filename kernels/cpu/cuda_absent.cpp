// The CUDA entry points of a build without CUDA: each says so (the CPU twins always exist).
#include <stdexcept>

#include "kernels/device_buffer.h"
#include "kernels/fused_xent.h"
#include "kernels/token_count.h"
#include "kernels/zero_flag.h"

namespace lossguard::kernels {

namespace {
[[noreturn]] void no_cuda() {
  throw std::runtime_error("this build of lossguard has no CUDA support (use --device cpu)");
}
}  // namespace

void count_tokens_cuda(const TokenCountArgs&) { no_cuda(); }
void fused_xent_cuda(const XentArgs&) { no_cuda(); }
void reduce_skip_decision_cuda(const int64_t*, int64_t, SkipDecision*) { no_cuda(); }
SkipDecision read_skip_decision_cuda(const SkipDecision*) { no_cuda(); }
void* cuda_alloc(std::size_t) { no_cuda(); }
void cuda_free(void*) {}
void cuda_copy(void*, const void*, std::size_t, bool) { no_cuda(); }
void cuda_zero(void*, std::size_t) { no_cuda(); }
void cuda_copy_device(void*, const void*, std::size_t) { no_cuda(); }
void cuda_synchronize() { no_cuda(); }

}  // namespace lossguard::kernels
