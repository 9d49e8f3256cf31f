// Launch template of the sm80 forward kernel: grid, shared memory, checks. Explicitly
// instantiated per (dtype, head dim) by csrc/kernels/sm80/instantiations/flash_fwd_hdim*_sm80.cu.
#pragma once

#include "kernels/sm80/flash_fwd_kernel.cuh"  // with kernel_common.cuh: arch.h, launch_utils.h, tile_config.h

namespace flash {
namespace sm80 {

// Launches flash_fwd_kernel<Traits> (any tile row: the production one comes from run_mha_fwd_
// below, others from the tuning harness benchmarks/tune_kernels.cu) on a 1-D grid over
// (query tile, batch * heads): batch * heads above 65,535 is fine. dispatch.cu picked the kernel
// whose kHeadDim is params.d_rounded.
template <typename Traits>
void launch_fwd(Flash_fwd_params& params, cudaStream_t stream) {
  static_assert(Traits::kSmemBytes <= kMaxSmem, "forward tile row exceeds sm_80 shared memory");
  // Long rows' workspaces (common/long_rows.cuh): one slot per query row (one CTA per tile).
  alloc_long_rows(params, 0, 0, Traits::kHeadDim);
  if (params.dropout_p > 0.0) {  // attention dropout: its twin on its own row (tile_config.h: FwdDropoutTile)
    using Dropout = FwdKernelTraits<typename Traits::Element, Traits::kHeadDim, FwdDropoutTile<Traits::kHeadDim>>;
    static_assert(Dropout::kSmemBytes <= 99 * 1024, "the dropout row fits every sm_8x GPU's shared memory");
    launch_tiles<Dropout, QTileWork<Dropout::kBlockM, Dropout::kBlockN, false>>(
        &flash_fwd_kernel<Dropout, false, false, true>, "forward (dropout)", params, stream);
    return;
  }
  if (params.alibi_slopes_ptr != nullptr) {  // ALiBi: its twin (neither a window's left bound nor softcap)
    launch_tiles<Traits, QTileWork<Traits::kBlockM, Traits::kBlockN, false>>(
        &flash_fwd_kernel<Traits, false, false, false, true>, "forward (ALiBi)", params, stream);
    return;
  }
  // The call's twin of the kernel (a window's left bound, soft-capping: flash_fwd_kernel.cuh).
  launch_tiles<Traits, QTileWork<Traits::kBlockM, Traits::kBlockN, false>>(
      pick_twin(params,
                [](auto local, auto softcap) {
                  return &flash_fwd_kernel<Traits, decltype(local)::value, decltype(softcap)::value>;
                }),
      "forward", params, stream);
}

}  // namespace sm80

template <typename Element, int kHeadDim>
void run_mha_fwd_(Sm80, Flash_fwd_params& params, cudaStream_t stream) {
  sm80::launch_fwd<sm80::FwdKernelTraits<Element, kHeadDim>>(params, stream);
}

}  // namespace flash
