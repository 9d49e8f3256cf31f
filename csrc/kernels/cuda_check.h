// Every CUDA call and every launch is checked; failures become std::runtime_error,
// which the torch-facing API turns into a Python RuntimeError.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define FLASH_CHECK_CUDA(expr)                                                           \
  do {                                                                                   \
    cudaError_t flash_err_ = (expr);                                                     \
    if (flash_err_ != cudaSuccess) {                                                     \
      throw std::runtime_error(std::string("flash_attn_ext: CUDA error '") +             \
                               cudaGetErrorString(flash_err_) + "' at " + __FILE__ + ":" + \
                               std::to_string(__LINE__) + " (" #expr ")");               \
    }                                                                                    \
  } while (0)

// After a <<<...>>> launch: catches bad configurations (too much shared memory, grid
// too large) at the launch site instead of at the next synchronizing call.
#define FLASH_CHECK_LAUNCH() FLASH_CHECK_CUDA(cudaGetLastError())
