// Launch templates of the sm80 backward kernels (dK/dV and dQ), explicitly instantiated per
// (dtype, head dim) by csrc/kernels/sm80/instantiations/flash_bwd_{dkv,dq}_hdim*_*.cu. The
// preprocess (D, lse_log2) is launched by csrc/kernels/flash_bwd_dispatch.cu before these.
// Tile shapes come from tile_config_bwd.h only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "flash.h"
#include "kernels/arch.h"
#include "kernels/cuda_check.h"
#include "kernels/sm80/flash_bwd_dkv_kernel.cuh"
#include "kernels/sm80/flash_bwd_dq_kernel.cuh"
#include "kernels/sm80/tile_config_bwd.h"

namespace flash {
namespace bwd {

// Opts the kernel into `smem_bytes` of dynamic shared memory (needed above 48 KB) after checking
// the device allows it; the error names the head dim and the limit.
template <typename Kernel>
void set_smem_or_throw(Kernel kernel, int smem_bytes, const char* what, int head_dim) {
  int device = 0, max_optin = 0;
  FLASH_CHECK_CUDA(cudaGetDevice(&device));
  FLASH_CHECK_CUDA(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (smem_bytes > max_optin) {
    throw std::runtime_error(std::string("flash_attn_ext backward: the ") + what + " kernel for head dim " +
                             std::to_string(head_dim) + " needs " + std::to_string(smem_bytes) +
                             " bytes of shared memory per block; this GPU allows " +
                             std::to_string(max_optin));
  }
  if (smem_bytes > 48 * 1024) {
    FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  }
}

inline unsigned checked_grid(int64_t blocks, const char* what) {
  if (blocks > INT32_MAX) {
    throw std::runtime_error(std::string("flash_attn_ext backward: ") + what + " grid of " +
                             std::to_string(blocks) + " blocks exceeds 2^31 - 1");
  }
  return unsigned(blocks);
}

}  // namespace bwd

// dK, dV for every (K/V block, batch, kv head): 1-D grid, key block fastest. Any tile shape:
// run_mha_bwd_dkv_ passes the production row of tile_config_bwd.h, the tuning harness
// (benchmarks/tune_kernels.cu) others.
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kColSplit, int kWarpRows = 16>
void launch_bwd_dkv(Flash_bwd_params& params, cudaStream_t stream) {
  using Traits = bwd::DkvKernelTraits<Element, kHeadDim, kBlockM, kBlockN, kColSplit, kWarpRows>;
  auto kernel = bwd::flash_bwd_dkv_kernel<Element, kHeadDim, kBlockM, kBlockN, kColSplit, kWarpRows>;
  const int64_t blocks = int64_t(bwd::ceil_div(params.seqlen_k, kBlockN)) * params.b * params.h_k;
  if (blocks == 0) return;
  const unsigned grid = bwd::checked_grid(blocks, "dK/dV");
  bwd::set_smem_or_throw(kernel, Traits::kSmemBytes, "dK/dV", kHeadDim);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  FLASH_CHECK_LAUNCH();
}

// dQ for every (Q tile, batch, query head): 1-D grid, Q tile fastest.
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarpRows = 16>
void launch_bwd_dq(Flash_bwd_params& params, cudaStream_t stream) {
  using Traits = bwd::DqKernelTraits<Element, kHeadDim, kBlockM, kBlockN, kWarpRows>;
  auto kernel = bwd::flash_bwd_dq_kernel<Element, kHeadDim, kBlockM, kBlockN, kWarpRows>;
  const int64_t blocks = int64_t(bwd::ceil_div(params.seqlen_q, kBlockM)) * params.b * params.h;
  if (blocks == 0) return;
  const unsigned grid = bwd::checked_grid(blocks, "dQ");
  bwd::set_smem_or_throw(kernel, Traits::kSmemBytes, "dQ", kHeadDim);
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(params);
  FLASH_CHECK_LAUNCH();
}

template <typename Element, int kHeadDim>
void run_mha_bwd_dkv_(Sm80, Flash_bwd_params& params, cudaStream_t stream) {
  using Cfg = BwdTileConfigSm80<kHeadDim>;
  static_assert(bwd::DkvKernelTraits<Element, kHeadDim, Cfg::kDkvBlockM, Cfg::kDkvBlockN, Cfg::kDkvColSplit,
                                     Cfg::kDkvWarpRows>::kSmemBytes <= kMaxSmemSm80,
                "dK/dV tile config exceeds sm_80 shared memory");
  launch_bwd_dkv<Element, kHeadDim, Cfg::kDkvBlockM, Cfg::kDkvBlockN, Cfg::kDkvColSplit, Cfg::kDkvWarpRows>(
      params, stream);
}

template <typename Element, int kHeadDim>
void run_mha_bwd_dq_(Sm80, Flash_bwd_params& params, cudaStream_t stream) {
  using Cfg = BwdTileConfigSm80<kHeadDim>;
  static_assert(bwd::DqKernelTraits<Element, kHeadDim, Cfg::kDqBlockM, Cfg::kDqBlockN,
                                    Cfg::kDqWarpRows>::kSmemBytes <= kMaxSmemSm80,
                "dQ tile config exceeds sm_80 shared memory");
  launch_bwd_dq<Element, kHeadDim, Cfg::kDqBlockM, Cfg::kDqBlockN, Cfg::kDqWarpRows>(params, stream);
}

}  // namespace flash
