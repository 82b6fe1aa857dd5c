// One checking macro for CUDA calls: throws with file:line and the runtime's message.
#pragma once
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define LOSSGUARD_CUDA_CHECK(expr)                                                      \
  do {                                                                                  \
    const cudaError_t lossguard_err_ = (expr);                                          \
    if (lossguard_err_ != cudaSuccess) {                                                \
      throw std::runtime_error(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                               ": " #expr ": " + cudaGetErrorString(lossguard_err_));   \
    }                                                                                   \
  } while (0)
