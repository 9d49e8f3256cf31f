// Launch templates of the sm80 backward kernels (dK/dV and dQ), explicitly instantiated per
// (dtype, head dim) by csrc/kernels/sm80/instantiations/flash_bwd_{dkv,dq}_hdim*_*.cu. The
// preprocess (D, lse_log2) is launched by csrc/kernels/flash_bwd_dispatch.cu before these.
// Tile shapes come from tile_config_bwd.h only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "flash.h"
#include "kernels/arch.h"
#include "kernels/cuda_check.h"
#include "kernels/launch_utils.h"
#include "kernels/sm80/flash_bwd_dkv_kernel.cuh"
#include "kernels/sm80/flash_bwd_dq_kernel.cuh"
#include "kernels/sm80/tile_config_bwd.h"

namespace flash {

// dK, dV for every (K/V block, batch, kv head): 1-D grid, key block fastest. Any tile shape:
// run_mha_bwd_dkv_ passes the production row of tile_config_bwd.h, the tuning harness
// (benchmarks/tune_kernels.cu) others.
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kColSplit, int kWarpRows = 16,
          bool kFastCopy = true>
void launch_bwd_dkv(Flash_bwd_params& params, cudaStream_t stream) {
  using Traits = bwd::DkvKernelTraits<Element, kHeadDim, kBlockM, kBlockN, kColSplit, kWarpRows>;
  auto kernel = bwd::flash_bwd_dkv_kernel<Element, kHeadDim, kBlockM, kBlockN, kColSplit, kWarpRows, kFastCopy>;
  const int64_t blocks = int64_t(ceil_div(params.seqlen_k, kBlockN)) * params.b * params.h_k;
  launch_1d(kernel, blocks, Traits::kThreads, Traits::kSmemBytes, "dK/dV", kHeadDim, stream, params);
}

// dQ for every (Q tile, batch, query head): 1-D grid, Q tile fastest.
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarpRows = 16, bool kFastCopy = true>
void launch_bwd_dq(Flash_bwd_params& params, cudaStream_t stream) {
  using Traits = bwd::DqKernelTraits<Element, kHeadDim, kBlockM, kBlockN, kWarpRows>;
  auto kernel = bwd::flash_bwd_dq_kernel<Element, kHeadDim, kBlockM, kBlockN, kWarpRows, kFastCopy>;
  const int64_t blocks = int64_t(ceil_div(params.seqlen_q, kBlockM)) * params.b * params.h;
  launch_1d(kernel, blocks, Traits::kThreads, Traits::kSmemBytes, "dQ", kHeadDim, stream, params);
}

template <typename Element, int kHeadDim>
void run_mha_bwd_dkv_(Sm80, Flash_bwd_params& params, cudaStream_t stream) {
  using Cfg = BwdTileConfigSm80<kHeadDim>;
  static_assert(bwd::DkvKernelTraits<Element, kHeadDim, Cfg::kDkvBlockM, Cfg::kDkvBlockN, Cfg::kDkvColSplit,
                                     Cfg::kDkvWarpRows>::kSmemBytes <= kMaxSmemSm80,
                "dK/dV tile config exceeds sm_80 shared memory");
  launch_bwd_dkv<Element, kHeadDim, Cfg::kDkvBlockM, Cfg::kDkvBlockN, Cfg::kDkvColSplit, Cfg::kDkvWarpRows,
                 Cfg::kDkvFastCopy>(
      params, stream);
}

template <typename Element, int kHeadDim>
void run_mha_bwd_dq_(Sm80, Flash_bwd_params& params, cudaStream_t stream) {
  using Cfg = BwdTileConfigSm80<kHeadDim>;
  static_assert(bwd::DqKernelTraits<Element, kHeadDim, Cfg::kDqBlockM, Cfg::kDqBlockN,
                                    Cfg::kDqWarpRows>::kSmemBytes <= kMaxSmemSm80,
                "dQ tile config exceeds sm_80 shared memory");
  launch_bwd_dq<Element, kHeadDim, Cfg::kDqBlockM, Cfg::kDqBlockN, Cfg::kDqWarpRows, Cfg::kDqFastCopy>(params, stream);
}

}  // namespace flash
