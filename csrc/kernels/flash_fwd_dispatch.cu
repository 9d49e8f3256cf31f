// Forward dispatch: arch path x head dim x dtype -> run_mha_fwd_<Element, kHeadDim>(Arch{}, ...).
// Only head dims compiled in this build (setup.py defines FLASH_ATTN_EXT_HDIM_<d>) are reachable;
// anything else raises std::runtime_error naming what is missing.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "flash.h"
#include "kernels/arch.h"

namespace flash {

namespace {

// Compiled head dims, ascending.
constexpr int kCompiledHdims[] = {
#ifdef FLASH_ATTN_EXT_HDIM_32
    32,
#endif
#ifdef FLASH_ATTN_EXT_HDIM_64
    64,
#endif
#ifdef FLASH_ATTN_EXT_HDIM_96
    96,
#endif
#ifdef FLASH_ATTN_EXT_HDIM_128
    128,
#endif
#ifdef FLASH_ATTN_EXT_HDIM_192
    192,
#endif
#ifdef FLASH_ATTN_EXT_HDIM_256
    256,
#endif
    0,  // sentinel (keeps the array non-empty when nothing is compiled)
};

template <typename Arch, typename Element>
void run_fwd_hdim(Flash_fwd_params& params, cudaStream_t stream) {
  switch (params.d_rounded) {
#ifdef FLASH_ATTN_EXT_HDIM_32
    case 32: run_mha_fwd_<Element, 32>(Arch{}, params, stream); return;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_64
    case 64: run_mha_fwd_<Element, 64>(Arch{}, params, stream); return;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_96
    case 96: run_mha_fwd_<Element, 96>(Arch{}, params, stream); return;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_128
    case 128: run_mha_fwd_<Element, 128>(Arch{}, params, stream); return;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_192
    case 192: run_mha_fwd_<Element, 192>(Arch{}, params, stream); return;
#endif
#ifdef FLASH_ATTN_EXT_HDIM_256
    case 256: run_mha_fwd_<Element, 256>(Arch{}, params, stream); return;
#endif
    default: break;
  }
  throw std::runtime_error(
      "flash_attn_ext: no CUDA forward kernel for headdim " + std::to_string(params.d) +
      " (rounded to " + std::to_string(params.d_rounded) + ") in this build; compiled head dims: [" +
      std::string(compiled_headdims()) + "] (rebuild with FLASH_ATTN_EXT_HDIMS covering it)");
}

}  // namespace

void run_mha_fwd(Flash_fwd_params& params, cudaStream_t stream) {
  if (params.arch < 80) {
    throw std::runtime_error("flash_attn_ext: CUDA kernels need compute capability >= 8.0, got " +
                             std::to_string(params.arch / 10) + "." +
                             std::to_string(params.arch % 10));
  }
  // Arch path: the FA2-class mma.sync path serves every SM >= 8.0 (sm_80/86/89/90/...).
  if (params.is_bf16) {
    run_fwd_hdim<Sm80, __nv_bfloat16>(params, stream);
  } else {
    run_fwd_hdim<Sm80, __half>(params, stream);
  }
}

int fwd_rounded_headdim(int d) {
  if (d <= 0) return 0;
  for (int h : kCompiledHdims) {
    if (h >= d) return h;
  }
  return 0;
}

const char* compiled_headdims() {
  static const std::string names = [] {
    std::string s;
    for (int h : kCompiledHdims) {
      if (h == 0) continue;
      if (!s.empty()) s += ",";
      s += std::to_string(h);
    }
    return s;
  }();
  return names.c_str();
}

}  // namespace flash
