// Launch templates of the Hopper (sm90) backward kernels (dK/dV and dQ, wgmma), explicitly
// instantiated per (dtype, head dim) by csrc/kernels/sm90/instantiations/flash_bwd_{dkv,dq}_*.cu.
// The preprocess (kernels/common/bwd_preprocess.cuh) is launched by csrc/kernels/dispatch.cu.
// Tile rows come from sm90/tile_config.h (or the tuning harness).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flash.h"
#include "kernels/arch.h"
#include "kernels/launch_utils.h"
#include "kernels/sm90/flash_bwd_dkv_kernel.cuh"
#include "kernels/sm90/flash_bwd_dq_kernel.cuh"
#include "kernels/sm90/tile_config.h"

namespace flash {
namespace sm90 {

// dK, dV for every (K/V block, batch, kv head): 1-D grid, key block fastest.
template <typename Element, int kHeadDim, typename Tile>
void launch_bwd_dkv(Flash_bwd_params& params, cudaStream_t stream) {
  using Traits = DkvKernelTraits<Element, kHeadDim, Tile>;
  static_assert(Traits::kSmemBytes <= kMaxSmem, "dK/dV tile row exceeds sm_90 shared memory");
  const int64_t blocks = DkvWork<Tile::kBlockM, Tile::kBlockN>::grid_size(params);
  launch_1d(flash_bwd_dkv_kernel<Element, kHeadDim, Tile>, blocks, Traits::kThreads, Traits::kSmemBytes, "dK/dV",
            kHeadDim, stream, params);
}

// dQ for every (Q tile, batch, query head): 1-D grid, Q tile fastest.
template <typename Element, int kHeadDim, typename Tile>
void launch_bwd_dq(Flash_bwd_params& params, cudaStream_t stream) {
  using Traits = DqKernelTraits<Element, kHeadDim, Tile>;
  static_assert(Traits::kSmemBytes <= kMaxSmem, "dQ tile row exceeds sm_90 shared memory");
  const int64_t blocks = DqWork<Tile::kBlockM, Tile::kBlockN>::grid_size(params);
  launch_1d(flash_bwd_dq_kernel<Element, kHeadDim, Tile>, blocks, Traits::kThreads, Traits::kSmemBytes, "dQ",
            kHeadDim, stream, params);
}

}  // namespace sm90

template <typename Element, int kHeadDim>
void run_mha_bwd_dkv_(Sm90, Flash_bwd_params& params, cudaStream_t stream) {
  static_assert(sm90::DkvTile<kHeadDim>::kSupported, "no sm90 dK/dV tile row for this head dim");
  sm90::launch_bwd_dkv<Element, kHeadDim, sm90::DkvTile<kHeadDim>>(params, stream);
}

template <typename Element, int kHeadDim>
void run_mha_bwd_dq_(Sm90, Flash_bwd_params& params, cudaStream_t stream) {
  static_assert(sm90::DqTile<kHeadDim>::kSupported, "no sm90 dQ tile row for this head dim");
  sm90::launch_bwd_dq<Element, kHeadDim, sm90::DqTile<kHeadDim>>(params, stream);
}

}  // namespace flash
