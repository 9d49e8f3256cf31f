// Launch template of the Hopper dK/dV kernel with the middle-length tile row (tile_config.h:
// DkvMidTile), for the calls that dkv_long_rows picks with its numbers where DkvLongTile is not
// taken (kernels/dispatch.cu). Explicitly instantiated per (dtype, head dim) by
// csrc/kernels/sm90/instantiations/flash_bwd_dkv_mid_hdim*_sm90.cu, which the build compiles for
// sm_90a only.
#pragma once

#include "kernels/sm90/flash_bwd_dkv_kernel.cuh"

namespace flash {

template <typename Element, int kHeadDim>
void run_mha_bwd_dkv_mid_(Sm90, Flash_bwd_params& params, cudaStream_t stream) {
  // Every twin (dispatch.cu sends this row the soft-capping and dropout calls from 2048 too).
  static_assert(sm90::DkvMidTile<kHeadDim>::kSoftcapDropout, "the middle-length row runs every twin");
  sm90::launch_bwd_dkv<Element, kHeadDim, sm90::DkvMidTile<kHeadDim>>(params, stream);
}

}  // namespace flash
