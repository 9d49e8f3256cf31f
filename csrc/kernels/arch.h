// Arch paths and the launch-template declarations every instantiation file defines.
// A new arch path is a new tag here, a new folder csrc/kernels/<arch>/ (kernels, launch
// templates, tile table, generated instantiations), and one branch in each dispatch file.
#pragma once

#include <cuda_runtime.h>

#include "flash.h"

namespace flash {

// FlashAttention-2-class path: mma.sync.m16n8k16 + ldmatrix + cp.async.
// Runs on every SM >= 8.0 (sm_80, 86, 89, 90, and newer through PTX).
struct Sm80 {};

// Hopper-native path: wgmma (warpgroup MMA from swizzled shared memory) + cp.async.
// sm_90a machine code only (built when FLASH_ATTN_EXT_CUDA_ARCHS has 90a); today the backward
// dK/dV and dQ kernels for the head dims in csrc/kernels/sm90/tile_config_bwd.h.
struct Sm90 {};

// Launch templates, one overload per arch tag (the tag is the first argument), defined in
// csrc/kernels/<arch>/flash_{fwd,bwd}_launch.cuh and explicitly instantiated per (dtype, head
// dim) by csrc/kernels/<arch>/instantiations/*.cu.
template <typename Element, int kHeadDim>
void run_mha_fwd_(Sm80, Flash_fwd_params& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
void run_mha_bwd_dkv_(Sm80, Flash_bwd_params& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
void run_mha_bwd_dq_(Sm80, Flash_bwd_params& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
void run_mha_bwd_dkv_(Sm90, Flash_bwd_params& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
void run_mha_bwd_dq_(Sm90, Flash_bwd_params& params, cudaStream_t stream);

}  // namespace flash
