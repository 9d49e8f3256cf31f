// Launch template of the Hopper dQ kernel with the short-sequence tile row (tile_config.h:
// DqShortTile), for the calls that dq_short_rows picks (kernels/dispatch.cu). Explicitly
// instantiated per (dtype, head dim) by
// csrc/kernels/sm90/instantiations/flash_bwd_dq_short_hdim*_sm90.cu, which the build compiles for
// sm_90a only.
#pragma once

#include "kernels/sm90/flash_bwd_dq_kernel.cuh"

namespace flash {

template <typename Element, int kHeadDim>
void run_mha_bwd_dq_short_(Sm90, Flash_bwd_params& params, cudaStream_t stream) {
  sm90::launch_bwd_dq<Element, kHeadDim, sm90::DqShortTile<kHeadDim>>(params, stream);
}

}  // namespace flash
