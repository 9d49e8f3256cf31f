// Launch template of the split-KV kernel with its small sm_90 row (tile_config.h: SplitKvSmallTile),
// for the decode grids kernels/dispatch.cu runs unsplit on it. Explicitly instantiated per (dtype,
// head dim) by csrc/kernels/sm90/instantiations/flash_fwd_splitkv_small_hdim*_sm90.cu, which the
// build compiles for sm_90a only.
#pragma once

#include "kernels/sm80/flash_fwd_splitkv_kernel.cuh"
#include "kernels/sm90/tile_config.h"

namespace flash {

template <typename Element, int kHeadDim>
void run_mha_fwd_splitkv_small_(Sm90, Flash_fwd_params& params, cudaStream_t stream) {
  static_assert(sm90::SplitKvSmallTile<kHeadDim>::kSupported, "no small split-KV row for this head dim");
  sm80::launch_fwd_splitkv<sm80::SplitKvKernelTraits<Element, kHeadDim, sm90::SplitKvSmallTile<kHeadDim>>>(params, stream);
}

}  // namespace flash
