// Launch templates of the Hopper (sm90) backward kernels (dK/dV and dQ, wgmma), explicitly
// instantiated per (dtype, head dim) by csrc/kernels/sm90/instantiations/flash_bwd_{dkv,dq}_*.cu.
// The preprocess (D, lse_log2) is the sm80 one, launched by csrc/kernels/flash_bwd_dispatch.cu.
// Tile shapes come from sm90/tile_config_bwd.h only.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "flash.h"
#include "kernels/arch.h"
#include "kernels/cuda_check.h"
#include "kernels/launch_utils.h"
#include "kernels/sm90/flash_bwd_dkv_kernel.cuh"
#include "kernels/sm90/flash_bwd_dq_kernel.cuh"
#include "kernels/sm90/tile_config_bwd.h"

namespace flash {
namespace sm90 {

// dK, dV for every (K/V block, batch, kv head): 1-D grid, key block fastest.
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kSplit = 1>
void launch_bwd_dkv(Flash_bwd_params& params, cudaStream_t stream) {
  using Traits = DkvKernelTraits<Element, kHeadDim, kBlockM, kBlockN, kSplit>;
  auto kernel = flash_bwd_dkv_kernel<Element, kHeadDim, kBlockM, kBlockN, kSplit>;
  const int64_t blocks = int64_t(ceil_div(params.seqlen_k, kBlockN)) * params.b * params.h_k;
  launch_1d(kernel, blocks, Traits::kThreads, Traits::kSmemBytes, "dK/dV", kHeadDim, stream, params);
}

// dQ for every (Q tile, batch, query head): 1-D grid, Q tile fastest.
template <typename Element, int kHeadDim, int kBlockM, int kBlockN>
void launch_bwd_dq(Flash_bwd_params& params, cudaStream_t stream) {
  using Traits = DqKernelTraits<Element, kHeadDim, kBlockM, kBlockN>;
  auto kernel = flash_bwd_dq_kernel<Element, kHeadDim, kBlockM, kBlockN>;
  const int64_t blocks = int64_t(ceil_div(params.seqlen_q, kBlockM)) * params.b * params.h;
  launch_1d(kernel, blocks, Traits::kThreads, Traits::kSmemBytes, "dQ", kHeadDim, stream, params);
}

}  // namespace sm90

template <typename Element, int kHeadDim>
void run_mha_bwd_dkv_(Sm90, Flash_bwd_params& params, cudaStream_t stream) {
  using Cfg = BwdTileConfigSm90<kHeadDim>;
  static_assert(Cfg::kSupported, "no sm90 backward tile config for this head dim");
  static_assert(sm90::DkvKernelTraits<Element, kHeadDim, Cfg::kDkvBlockM, Cfg::kDkvBlockN,
                                      Cfg::kDkvSplit>::kSmemBytes <= kMaxSmemSm90,
                "dK/dV tile config exceeds sm_90 shared memory");
  sm90::launch_bwd_dkv<Element, kHeadDim, Cfg::kDkvBlockM, Cfg::kDkvBlockN, Cfg::kDkvSplit>(params, stream);
}

template <typename Element, int kHeadDim>
void run_mha_bwd_dq_(Sm90, Flash_bwd_params& params, cudaStream_t stream) {
  using Cfg = BwdTileConfigSm90<kHeadDim>;
  static_assert(Cfg::kSupported, "no sm90 backward tile config for this head dim");
  static_assert(sm90::DqKernelTraits<Element, kHeadDim, Cfg::kDqBlockM, Cfg::kDqBlockN>::kSmemBytes <=
                    kMaxSmemSm90,
                "dQ tile config exceeds sm_90 shared memory");
  sm90::launch_bwd_dq<Element, kHeadDim, Cfg::kDqBlockM, Cfg::kDqBlockN>(params, stream);
}

}  // namespace flash
