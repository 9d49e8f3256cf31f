// Launch template of the Hopper forward kernel with the short causal tile row (tile_config.h:
// FwdShortTile), for the short causal calls (varlen: by max_seqlen_q) that fwd_short_causal picks (kernels/dispatch.cu).
// Explicitly instantiated per (dtype, head dim) by
// csrc/kernels/sm90/instantiations/flash_fwd_short_hdim*_sm90.cu, which the build compiles for
// sm_90a only.
#pragma once

#include "kernels/sm90/flash_fwd_launch.cuh"

namespace flash {

template <typename Element, int kHeadDim>
void run_mha_fwd_short_(Sm90, Flash_fwd_params& params, cudaStream_t stream) {
  sm90::launch_fwd_or_sm80<Element, kHeadDim, sm90::FwdShortTile<kHeadDim>>(params, stream);
}

}  // namespace flash
