// Launch template of the sm80 forward kernel: grid, shared memory, checks. Explicitly
// instantiated per (dtype, head dim) by csrc/kernels/sm80/instantiations/flash_fwd_hdim*_sm80.cu.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "flash.h"
#include "kernels/arch.h"
#include "kernels/launch_utils.h"
#include "kernels/sm80/flash_fwd_kernel.cuh"
#include "kernels/sm80/tile_config.h"

namespace flash {
namespace sm80 {

// Launches flash_fwd_kernel<Traits> (any tile row: the production one comes from run_mha_fwd_
// below, others from the tuning harness benchmarks/tune_kernels.cu) on a 1-D grid over
// (query tile, batch * heads): batch * heads above 65,535 is fine.
template <typename Traits>
void launch_fwd(Flash_fwd_params& params, cudaStream_t stream) {
  constexpr int kHeadDim = Traits::kHeadDim;
  if (params.d_rounded != kHeadDim || params.d < 8 || params.d > kHeadDim || params.d % 8 != 0) {
    throw std::runtime_error("flash_attn_ext: forward kernel hdim" + std::to_string(kHeadDim) +
                             " called with headdim " + std::to_string(params.d) +
                             " (d_rounded " + std::to_string(params.d_rounded) + ")");
  }
  static_assert(Traits::kSmemBytes <= kMaxSmem, "forward tile row exceeds sm_80 shared memory");
  const int64_t blocks = QTileWork<Traits::kBlockM, Traits::kBlockN>::grid_size(params);
  launch_1d(flash_fwd_kernel<Traits>, blocks, Traits::kNThreads, Traits::kSmemBytes, "forward", kHeadDim, stream,
            params);
}

}  // namespace sm80

template <typename Element, int kHeadDim>
void run_mha_fwd_(Sm80, Flash_fwd_params& params, cudaStream_t stream) {
  sm80::launch_fwd<sm80::FwdKernelTraits<Element, kHeadDim>>(params, stream);
}

}  // namespace flash
