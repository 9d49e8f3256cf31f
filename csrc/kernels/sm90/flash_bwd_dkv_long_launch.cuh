// Launch template of the Hopper dK/dV kernel with the long-query tile row (tile_config.h:
// DkvLongTile), for the calls that dkv_long_rows picks (kernels/dispatch.cu). Explicitly
// instantiated per (dtype, head dim) by
// csrc/kernels/sm90/instantiations/flash_bwd_dkv_long_hdim*_sm90.cu, which the build compiles for
// sm_90a only.
#pragma once

#include "kernels/sm90/flash_bwd_dkv_kernel.cuh"

namespace flash {

template <typename Element, int kHeadDim>
void run_mha_bwd_dkv_long_(Sm90, Flash_bwd_params& params, cudaStream_t stream) {
  // A row without soft-capping and dropout twins (d96's: they spill or serialize on three
  // warpgroups; kSoftcapDropout false) has those twins not compiled: the dispatch keeps such calls
  // on another row (launch_bwd_dkv, smem_layout.cuh, throws if one came).
  sm90::launch_bwd_dkv<Element, kHeadDim, sm90::DkvLongTile<kHeadDim>>(params, stream);
}

}  // namespace flash
