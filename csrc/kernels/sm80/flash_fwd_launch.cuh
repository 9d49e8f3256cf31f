// Launch template of the sm80 forward kernel: grid, shared memory, checks. Explicitly
// instantiated per (dtype, head dim) by csrc/kernels/sm80/instantiations/flash_fwd_hdim*_sm80.cu.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "flash.h"
#include "kernels/arch.h"
#include "kernels/cuda_check.h"
#include "kernels/sm80/flash_fwd_kernel.cuh"

namespace flash {

// Launches flash_fwd_kernel<Traits> (any tile config: the production one comes from
// run_mha_fwd_ below, others from the tuning harness benchmarks/tune_kernels.cu).
template <typename Traits>
void launch_fwd(Flash_fwd_params& params, cudaStream_t stream) {
  constexpr int kHeadDim = Traits::kHeadDim;
  if (params.d_rounded != kHeadDim || params.d < 8 || params.d > kHeadDim || params.d % 8 != 0) {
    throw std::runtime_error("flash_attn_ext: forward kernel hdim" + std::to_string(kHeadDim) +
                             " called with headdim " + std::to_string(params.d) +
                             " (d_rounded " + std::to_string(params.d_rounded) + ")");
  }
  if (params.seqlen_q < 1 || params.seqlen_k < 1 || params.h < 1 || params.h_k < 1 ||
      params.h_h_k_ratio < 1 || params.h != params.h_k * params.h_h_k_ratio) {
    throw std::runtime_error("flash_attn_ext: forward kernel got invalid sizes (seqlen_q " +
                             std::to_string(params.seqlen_q) + ", seqlen_k " +
                             std::to_string(params.seqlen_k) + ", nheads " +
                             std::to_string(params.h) + ", nheads_k " + std::to_string(params.h_k) + ")");
  }
  if (params.b == 0) return;  // empty batch: nothing to write

  // 1-D grid over (query tile, batch*heads): batch*heads above 65,535 is fine.
  const int64_t num_m_blocks = (params.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  const int64_t num_blocks = num_m_blocks * params.b * params.h;
  if (num_blocks > INT_MAX) {
    throw std::runtime_error("flash_attn_ext: forward grid of " + std::to_string(num_blocks) +
                             " CTAs exceeds 2^31-1 (batch*nheads*ceil(seqlen_q/" +
                             std::to_string(Traits::kBlockM) + ") too large)");
  }

  auto kernel = &flash_fwd_kernel<Traits>;
  constexpr int kSmem = Traits::kSmemBytes;
  if (kSmem > 48 * 1024) {
    FLASH_CHECK_CUDA(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  }
  kernel<<<dim3(unsigned(num_blocks)), dim3(Traits::kNThreads), kSmem, stream>>>(params);
  FLASH_CHECK_LAUNCH();
}

template <typename Element, int kHeadDim>
void run_mha_fwd_(Sm80, Flash_fwd_params& params, cudaStream_t stream) {
  launch_fwd<FwdKernelTraits<Element, kHeadDim>>(params, stream);
}

}  // namespace flash
