// Arch paths and the launch-template declarations every instantiation file defines.
// A new arch path (e.g. a Hopper-native wgmma/TMA path) is a new tag here, a new folder
// csrc/kernels/<arch>/, and one branch in each dispatch file; nothing else changes.
#pragma once

#include <cuda_runtime.h>

#include "flash.h"

namespace flash {

// FlashAttention-2-class path: mma.sync.m16n8k16 + ldmatrix + cp.async.
// Runs on every SM >= 8.0 (sm_80, 86, 89, 90, and newer through PTX).
struct Sm80 {};

// Defined in csrc/kernels/<arch>/flash_fwd_launch.cuh / flash_bwd_launch.cuh, explicitly
// instantiated per (arch, dtype, head dim) by csrc/kernels/<arch>/instantiations/*.cu.
template <typename Arch, typename Element, int kHeadDim>
void run_mha_fwd_(Flash_fwd_params& params, cudaStream_t stream);
template <typename Arch, typename Element, int kHeadDim>
void run_mha_bwd_dkv_(Flash_bwd_params& params, cudaStream_t stream);
template <typename Arch, typename Element, int kHeadDim>
void run_mha_bwd_dq_(Flash_bwd_params& params, cudaStream_t stream);

}  // namespace flash
