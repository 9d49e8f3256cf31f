// flash::run_mha_bwd: the backward dispatch point (csrc/flash.h). Picks the arch path, dtype
// (params.is_bf16) and compiled head dim (params.d_rounded), then runs FlashAttention-2's
// backward (Dao 2023, Alg. 2) as three launches on `stream`:
//   1. preprocess: D = rowsum(dO o O), lse_log2 = LSE * log2(e)   (sm80/flash_bwd_preprocess_kernel.cuh)
//   2. dK, dV per K/V block                                        (<arch>/flash_bwd_dkv_kernel.cuh)
//   3. dQ per Q tile                                               (<arch>/flash_bwd_dq_kernel.cuh)
// Arch path: Sm90 (wgmma) on compute capability 9.0 for the head dims of
// sm90/tile_config_bwd.h when the build has sm_90a code (FLASH_ATTN_EXT_WITH_SM90) and the
// environment variable FLASH_ATTN_EXT_DISABLE_SM90 is unset or 0; Sm80 (mma.sync) otherwise.
// No atomics: every output element is written once by one thread, in a fixed order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdlib>
#include <stdexcept>
#include <string>

#include "flash.h"
#include "kernels/arch.h"
#include "kernels/cuda_check.h"
#include "kernels/sm80/flash_bwd_preprocess_kernel.cuh"
#include "kernels/sm90/tile_config_bwd.h"

namespace flash {
namespace {

bool bwd_headdim_compiled(int d) {
  switch (d) {
#ifdef FLASH_ATTN_EXT_HDIM_32
    case 32: return true;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_64
    case 64: return true;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_96
    case 96: return true;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_128
    case 128: return true;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_192
    case 192: return true;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_256
    case 256: return true;
#endif
    default: return false;
  }
}

bool sm90_path_enabled(const Flash_bwd_params& params) {
#ifdef FLASH_ATTN_EXT_WITH_SM90
  const char* off = std::getenv("FLASH_ATTN_EXT_DISABLE_SM90");
  return params.arch == 90 && !(off && off[0] && !(off[0] == '0' && off[1] == 0));
#else
  (void)params;
  return false;
#endif
}

template <typename Arch, typename Element, int kHeadDim>
void run_bwd_arch(Flash_bwd_params& params, cudaStream_t stream) {
  bwd::run_bwd_preprocess<Element>(params, stream);
  run_mha_bwd_dkv_<Element, kHeadDim>(Arch{}, params, stream);
  run_mha_bwd_dq_<Element, kHeadDim>(Arch{}, params, stream);
}

template <typename Element, int kHeadDim>
void run_bwd_hdim(Flash_bwd_params& params, cudaStream_t stream) {
#ifdef FLASH_ATTN_EXT_WITH_SM90
  if constexpr (BwdTileConfigSm90<kHeadDim>::kSupported) {
    if (sm90_path_enabled(params)) return run_bwd_arch<Sm90, Element, kHeadDim>(params, stream);
  }
#endif
  run_bwd_arch<Sm80, Element, kHeadDim>(params, stream);
}

template <typename Element>
void run_bwd_dtype(Flash_bwd_params& params, cudaStream_t stream) {
  switch (params.d_rounded) {
#ifdef FLASH_ATTN_EXT_HDIM_32
    case 32: return run_bwd_hdim<Element, 32>(params, stream);
#endif
#ifdef FLASH_ATTN_EXT_HDIM_64
    case 64: return run_bwd_hdim<Element, 64>(params, stream);
#endif
#ifdef FLASH_ATTN_EXT_HDIM_96
    case 96: return run_bwd_hdim<Element, 96>(params, stream);
#endif
#ifdef FLASH_ATTN_EXT_HDIM_128
    case 128: return run_bwd_hdim<Element, 128>(params, stream);
#endif
#ifdef FLASH_ATTN_EXT_HDIM_192
    case 192: return run_bwd_hdim<Element, 192>(params, stream);
#endif
#ifdef FLASH_ATTN_EXT_HDIM_256
    case 256: return run_bwd_hdim<Element, 256>(params, stream);
#endif
    default: break;
  }
  throw std::runtime_error("flash_attn_ext backward: head dim " + std::to_string(params.d_rounded) +
                           " is not compiled in this build");
}

}  // namespace

void run_mha_bwd(Flash_bwd_params& params, cudaStream_t stream) {
  // Everything checkable is checked before the first launch.
  if (params.arch < 80) {
    throw std::runtime_error("flash_attn_ext backward: needs a GPU of compute capability >= 8.0, got " +
                             std::to_string(params.arch / 10) + "." + std::to_string(params.arch % 10));
  }
  if (params.d <= 0 || params.d % 8 != 0 || params.d > params.d_rounded ||
      !bwd_headdim_compiled(params.d_rounded)) {
    throw std::runtime_error("flash_attn_ext backward: headdim " + std::to_string(params.d) +
                             " (run as " + std::to_string(params.d_rounded) +
                             ") is not a multiple of 8 covered by a compiled head dim");
  }
  if (params.seqlen_q_rounded % 128 != 0 || params.seqlen_q_rounded < params.seqlen_q) {
    throw std::runtime_error("flash_attn_ext backward: seqlen_q_rounded must be seqlen_q rounded up to 128");
  }
  if (params.h_k <= 0 || params.h % params.h_k != 0 || params.h / params.h_k != params.h_h_k_ratio) {
    throw std::runtime_error("flash_attn_ext backward: nheads must be a multiple of nheads_k");
  }
  // Arch path: chosen per head dim in run_bwd_hdim (see the header of this file).
  if (params.is_bf16) {
    run_bwd_dtype<__nv_bfloat16>(params, stream);
  } else {
    run_bwd_dtype<__half>(params, stream);
  }
}

// Smallest compiled head dim >= d (the kernels zero-pad columns d..d_rounded), 0 if none.
int bwd_rounded_headdim(int d) {
  if (d <= 0) return 0;
#ifdef FLASH_ATTN_EXT_HDIM_32
  if (d <= 32) return 32;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_64
  if (d <= 64) return 64;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_96
  if (d <= 96) return 96;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_128
  if (d <= 128) return 128;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_192
  if (d <= 192) return 192;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_256
  if (d <= 256) return 256;
#endif
  return 0;
}

}  // namespace flash
