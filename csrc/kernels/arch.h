// Arch paths, the one arch selector, and the launch-template declarations every instantiation file
// defines. A new arch path is a new tag here, a folder csrc/kernels/<arch>/ (kernels, launch
// templates, tile table) and a row of the kernel manifest (csrc/kernels/generate_kernels.py).
#pragma once

#include <cuda_runtime.h>

#include "flash.h"

namespace flash {

// FlashAttention-2-class path: mma.sync.m16n8k16 + ldmatrix + cp.async.
// Runs on every SM >= 8.0 (sm_80, 86, 89, 90, and newer through PTX).
struct Sm80 {};

// Hopper-native path: wgmma (warpgroup MMA from swizzled shared memory); tiles by TMA on mbarriers
// (the forward with warp specialization; the backward falls back to cp.async where TMA cannot
// describe the inputs). sm_90a machine code only
// (built when FLASH_ATTN_EXT_CUDA_ARCHS has 90a); the kernels and head dims of the manifest's sm90 row.
struct Sm90 {};

enum class ArchPath { kSm80, kSm90 };

// The arch path of a GPU of compute capability `arch` (major*10 + minor): kSm90 on 9.0 when this
// build has sm_90a code, unless the environment variable FLASH_ATTN_EXT_DISABLE_SM90 is set to
// something other than "0" (read once, at the first call) or force_sm80_path(true) (flash.h) was
// called: the GPU tests run both paths that way. A kernel the manifest has only for sm80 runs the sm80 path on any GPU.
// Used by the forward and the backward dispatch alike (kernels/dispatch.cu).
ArchPath select_arch(int arch);

// Launch templates, one overload per arch tag (the tag is the first argument), defined in
// csrc/kernels/<arch>/flash_fwd_launch.cuh and flash_bwd_{dkv,dq}_kernel.cuh and explicitly
// instantiated per (dtype, head dim) by the generated csrc/kernels/<arch>/instantiations/*.cu.
#define FLASH_LAUNCH_TEMPLATE(Tag, fn, Params) \
  template <typename Element, int kHeadDim>     \
  void fn(Tag, Params& params, cudaStream_t stream);
FLASH_LAUNCH_TEMPLATE(Sm80, run_mha_fwd_, Flash_fwd_params)
FLASH_LAUNCH_TEMPLATE(Sm80, run_mha_bwd_dkv_, Flash_bwd_params)
FLASH_LAUNCH_TEMPLATE(Sm80, run_mha_bwd_dq_, Flash_bwd_params)
FLASH_LAUNCH_TEMPLATE(Sm80, run_mha_fwd_splitkv_, Flash_fwd_params)  // sm80/flash_fwd_splitkv_kernel.cuh
FLASH_LAUNCH_TEMPLATE(Sm90, run_mha_fwd_, Flash_fwd_params)
FLASH_LAUNCH_TEMPLATE(Sm90, run_mha_bwd_dkv_, Flash_bwd_params)
FLASH_LAUNCH_TEMPLATE(Sm90, run_mha_bwd_dq_, Flash_bwd_params)
// The sm80 forward kernel with its sm_90 row (sm90/tile_config.h: Sm80FwdTile), compiled for
// sm_90a only (sm90/flash_fwd_sm80_launch.cuh).
FLASH_LAUNCH_TEMPLATE(Sm90, run_mha_fwd_sm80_, Flash_fwd_params)
// The sm90 forward with its long-key tile row (sm90/tile_config.h: FwdLongTile;
// sm90/flash_fwd_long_launch.cuh).
FLASH_LAUNCH_TEMPLATE(Sm90, run_mha_fwd_long_, Flash_fwd_params)
// The sm90 forward with its short causal tile row (sm90/tile_config.h: FwdShortTile;
// sm90/flash_fwd_short_launch.cuh).
FLASH_LAUNCH_TEMPLATE(Sm90, run_mha_fwd_short_, Flash_fwd_params)
// The sm90 dK/dV kernel with its long-query tile row (sm90/tile_config.h: DkvLongTile;
// sm90/flash_bwd_dkv_long_launch.cuh).
FLASH_LAUNCH_TEMPLATE(Sm90, run_mha_bwd_dkv_long_, Flash_bwd_params)
// The sm90 dK/dV kernel with its middle-length tile row (sm90/tile_config.h: DkvMidTile;
// sm90/flash_bwd_dkv_mid_launch.cuh).
FLASH_LAUNCH_TEMPLATE(Sm90, run_mha_bwd_dkv_mid_, Flash_bwd_params)
// The sm90 dQ kernel with its short-sequence tile row (sm90/tile_config.h: DqShortTile;
// sm90/flash_bwd_dq_short_launch.cuh).
FLASH_LAUNCH_TEMPLATE(Sm90, run_mha_bwd_dq_short_, Flash_bwd_params)
#undef FLASH_LAUNCH_TEMPLATE

}  // namespace flash
