// Launch templates of the sm80 backward kernels (dK/dV and dQ), explicitly instantiated per
// (dtype, head dim) by csrc/kernels/sm80/instantiations/flash_bwd_{dkv,dq}_hdim*_*.cu. The
// preprocess (kernels/common/bwd_preprocess.cuh) is launched by csrc/kernels/dispatch.cu
// before these. Tile rows come from tile_config.h (or the tuning harness).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flash.h"
#include "kernels/arch.h"
#include "kernels/launch_utils.h"
#include "kernels/sm80/flash_bwd_dkv_kernel.cuh"
#include "kernels/sm80/flash_bwd_dq_kernel.cuh"
#include "kernels/sm80/tile_config.h"

namespace flash {
namespace sm80 {

// dK, dV for every (K/V block, batch, kv head): 1-D grid, key block fastest.
template <typename Element, int kHeadDim, typename Tile>
void launch_bwd_dkv(Flash_bwd_params& params, cudaStream_t stream) {
  using Traits = DkvKernelTraits<Element, kHeadDim, Tile>;
  static_assert(Traits::kSmemBytes <= kMaxSmem, "dK/dV tile row exceeds sm_80 shared memory");
  const int64_t blocks = DkvWork<Tile::kBlockM, Tile::kBlockN>::grid_size(params);
  launch_1d(flash_bwd_dkv_kernel<Element, kHeadDim, Tile>, blocks, Traits::kThreads, Traits::kSmemBytes, "dK/dV",
            kHeadDim, stream, params);
}

// dQ for every (Q tile, batch, query head): 1-D grid, Q tile fastest.
template <typename Element, int kHeadDim, typename Tile>
void launch_bwd_dq(Flash_bwd_params& params, cudaStream_t stream) {
  using Traits = DqKernelTraits<Element, kHeadDim, Tile>;
  static_assert(Traits::kSmemBytes <= kMaxSmem, "dQ tile row exceeds sm_80 shared memory");
  const int64_t blocks = DqWork<Tile::kBlockM, Tile::kBlockN>::grid_size(params);
  launch_1d(flash_bwd_dq_kernel<Element, kHeadDim, Tile>, blocks, Traits::kThreads, Traits::kSmemBytes, "dQ",
            kHeadDim, stream, params);
}

}  // namespace sm80

template <typename Element, int kHeadDim>
void run_mha_bwd_dkv_(Sm80, Flash_bwd_params& params, cudaStream_t stream) {
  sm80::launch_bwd_dkv<Element, kHeadDim, sm80::DkvTile<kHeadDim>>(params, stream);
}

template <typename Element, int kHeadDim>
void run_mha_bwd_dq_(Sm80, Flash_bwd_params& params, cudaStream_t stream) {
  sm80::launch_bwd_dq<Element, kHeadDim, sm80::DqTile<kHeadDim>>(params, stream);
}

}  // namespace flash
