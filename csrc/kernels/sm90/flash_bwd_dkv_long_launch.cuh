// Launch template of the Hopper dK/dV kernel with the long-query tile row (tile_config.h:
// DkvLongTile), for the calls that dkv_long_rows picks (kernels/dispatch.cu). Explicitly
// instantiated per (dtype, head dim) by
// csrc/kernels/sm90/instantiations/flash_bwd_dkv_long_hdim*_sm90.cu, which the build compiles for
// sm_90a only.
#pragma once

#include <stdexcept>

#include "kernels/sm90/flash_bwd_dkv_kernel.cuh"

namespace flash {

template <typename Element, int kHeadDim>
void run_mha_bwd_dkv_long_(Sm90, Flash_bwd_params& params, cudaStream_t stream) {
  using Tile = sm90::DkvLongTile<kHeadDim>;
  if constexpr (Tile::kSoftcapDropout) {
    sm90::launch_bwd_dkv<Element, kHeadDim, Tile>(params, stream);
  } else {
    // A row without soft-capping and dropout twins (d96: they spill or serialize on three
    // warpgroups): the dispatch keeps those calls on DkvTile, and their twins of this row are not
    // compiled.
    pick_attention_twin(params, [&](auto local, auto softcap, auto dropout, auto alibi) {
      if constexpr (decltype(softcap)::value || decltype(dropout)::value) {
        throw std::runtime_error("flash_attn_ext: the long-query dK/dV row has no soft-capping or dropout twin");
      } else {
        sm90::launch_bwd_dkv_twin<Element, kHeadDim, Tile, decltype(local)::value, false, false,
                                  decltype(alibi)::value>(params, stream, true);
      }
      return 0;
    });
  }
}

}  // namespace flash
