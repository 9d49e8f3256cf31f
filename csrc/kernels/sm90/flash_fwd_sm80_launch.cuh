// Launch template of the sm80 forward kernel with its sm_90 row (tile_config.h: Sm80FwdTile), for
// the forward calls that run the sm80 kernel on an sm_90 GPU (kernels/dispatch.cu). Explicitly
// instantiated per (dtype, head dim) by csrc/kernels/sm90/instantiations/flash_fwd_sm80_hdim*_sm90.cu,
// which the build compiles for sm_90a only.
#pragma once

#include "kernels/sm80/flash_fwd_launch.cuh"
#include "kernels/sm90/tile_config.h"

namespace flash {

template <typename Element, int kHeadDim>
void run_mha_fwd_sm80_(Sm90, Flash_fwd_params& params, cudaStream_t stream) {
  static_assert(sm90::Sm80FwdTile<kHeadDim>::kSupported, "no sm_90 row of the sm80 forward for this head dim");
  sm80::launch_fwd<sm80::FwdKernelTraits<Element, kHeadDim, sm90::Sm80FwdTile<kHeadDim>>>(params, stream);
}

}  // namespace flash
