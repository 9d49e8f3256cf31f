// The dispatch points of csrc/flash.h: run_mha_fwd and run_mha_bwd pick the arch path
// (select_arch), dtype (params.is_bf16) and compiled head dim (params.d_rounded) from the kernel
// manifest and call the launch template of that (arch, kernel, head dim, dtype), or throw
// std::runtime_error naming what is missing. Everything checkable is checked before the first
// launch.
//
// The manifest (csrc/kernels/generate_kernels.py) is the one list of (arch path, kernel, head dim,
// dtype); setup.py writes the subset this build compiles into csrc/generated/build_config.h as
// X-macros (FLASH_ATTN_EXT_HDIMS, FLASH_ATTN_EXT_SM90_FWD_HDIMS, FLASH_ATTN_EXT_SM90_BWD_HDIMS)
// and the flag FLASH_ATTN_EXT_WITH_SM90, read here only.
//
// The backward (FlashAttention-2, Dao 2023, Alg. 2) is three launches on `stream`:
//   1. preprocess: D = rowsum(dO o O), LSE_log2 = hi + lo   (common/bwd_preprocess.cuh)
//   2. dK, dV per K/V block                                  (<arch>/flash_bwd_dkv_kernel.cuh)
//   3. dQ per Q tile                                         (<arch>/flash_bwd_dq_kernel.cuh)
// No atomics: every output element is written once by one thread, in a fixed order.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "flash.h"
#include "generated/build_config.h"
#include "kernels/arch.h"
#include "kernels/common/bwd_preprocess.cuh"
#include "primitives/tma.cuh"

namespace flash {
namespace {

#define FLASH_ATTN_EXT_LIST_ITEM(d) d,
constexpr int kHdims[] = {FLASH_ATTN_EXT_HDIMS(FLASH_ATTN_EXT_LIST_ITEM) 0};  // ascending, 0-terminated
constexpr int kSm90FwdHdims[] = {FLASH_ATTN_EXT_SM90_FWD_HDIMS(FLASH_ATTN_EXT_LIST_ITEM) 0};
constexpr int kSm90BwdHdims[] = {FLASH_ATTN_EXT_SM90_BWD_HDIMS(FLASH_ATTN_EXT_LIST_ITEM) 0};
#undef FLASH_ATTN_EXT_LIST_ITEM

template <int N>
constexpr bool contains(const int (&list)[N], int d) {
  for (int x : list) {
    if (x == d && d != 0) return true;
  }
  return false;
}

std::string arch_name(int arch) { return std::to_string(arch / 10) + "." + std::to_string(arch % 10); }

// Calls f(std::integral_constant<int, d>{}) for the compiled head dim d == params.d_rounded, with
// Element the params' dtype; throws if that head dim is not compiled or d does not fit it.
template <typename F>
void dispatch(const Flash_fwd_params& params, const char* op, F&& f) {
  if (params.arch < 80) {
    throw std::runtime_error(std::string("flash_attn_ext ") + op + ": CUDA kernels need compute capability >= 8.0, got " +
                             arch_name(params.arch));
  }
  if (params.d <= 0 || params.d % 8 != 0 || params.d > params.d_rounded || rounded_headdim(params.d) != params.d_rounded) {
    throw std::runtime_error(std::string("flash_attn_ext ") + op + ": headdim " + std::to_string(params.d) +
                             " (run as " + std::to_string(params.d_rounded) +
                             ") is not covered by a compiled head dim; compiled head dims: [" + compiled_headdims() +
                             "] (rebuild with FLASH_ATTN_EXT_HDIMS covering it)");
  }
  if (params.h_k <= 0 || params.h % params.h_k != 0 || params.h / params.h_k != params.h_h_k_ratio) {
    throw std::runtime_error(std::string("flash_attn_ext ") + op + ": nheads must be a multiple of nheads_k");
  }
  auto with_dtype = [&](auto element) {
    using Element = typename decltype(element)::type;
#define FLASH_ATTN_EXT_CASE(d) \
  case d: return f(Element{}, std::integral_constant<int, d>{});
    switch (params.d_rounded) {
      FLASH_ATTN_EXT_HDIMS(FLASH_ATTN_EXT_CASE)
      default: break;
    }
#undef FLASH_ATTN_EXT_CASE
  };
  if (params.is_bf16) {
    with_dtype(std::common_type<__nv_bfloat16>{});
  } else {
    with_dtype(std::common_type<__half>{});
  }
}

}  // namespace

// -1: not read yet; then 0 / 1. Read from the environment once, set by force_sm80_path after.
std::atomic<int> g_force_sm80{-1};

bool force_sm80_path(bool force) {
  select_arch(90);  // reads the environment first, if nothing did yet
  return g_force_sm80.exchange(force ? 1 : 0) == 1;
}

ArchPath select_arch(int arch) {
  if (g_force_sm80.load() < 0) {
    const char* off = std::getenv("FLASH_ATTN_EXT_DISABLE_SM90");
    int expected = -1;
    g_force_sm80.compare_exchange_strong(expected, off != nullptr && off[0] != 0 && !(off[0] == '0' && off[1] == 0));
  }
#ifdef FLASH_ATTN_EXT_WITH_SM90
  return arch == 90 && g_force_sm80.load() == 0 ? ArchPath::kSm90 : ArchPath::kSm80;
#else
  (void)arch;
  return ArchPath::kSm80;
#endif
}

// The sm90 forward loads Q/K/V by TMA, which needs 16-byte-aligned bases and strides
// (primitives/tma.cuh); any other input (e.g. an odd storage offset into a fused qkv buffer) runs
// the sm80 kernel. Host arithmetic only: decided before anything is launched.
static bool tma_can_describe_inputs(const Flash_fwd_params& params) {
  return tma_can_describe(params.q, params.b, params.seqlen_q, params.h, params.d, 2) &&
         tma_can_describe(params.k, params.b, params.seqlen_k, params.h_k, params.d, 2) &&
         tma_can_describe(params.v, params.b, params.seqlen_k, params.h_k, params.d, 2);
}

void run_mha_fwd(Flash_fwd_params& params, cudaStream_t stream) {
  const ArchPath path = select_arch(params.arch);
  dispatch(params, "forward", [&](auto element, auto hdim) {
    using Element = decltype(element);
    constexpr int kHeadDim = decltype(hdim)::value;
    if constexpr (contains(kSm90FwdHdims, kHeadDim)) {
      if (path == ArchPath::kSm90 && tma_can_describe_inputs(params)) {
        run_mha_fwd_<Element, kHeadDim>(Sm90{}, params, stream);
        return;
      }
    }
    run_mha_fwd_<Element, kHeadDim>(Sm80{}, params, stream);
  });
}

void run_mha_bwd(Flash_bwd_params& params, cudaStream_t stream) {
  if (params.seqlen_q_rounded % 128 != 0 || params.seqlen_q_rounded < params.seqlen_q) {
    throw std::runtime_error("flash_attn_ext backward: seqlen_q_rounded must be seqlen_q rounded up to 128");
  }
  const ArchPath path = select_arch(params.arch);
  dispatch(params, "backward", [&](auto element, auto hdim) {
    using Element = decltype(element);
    constexpr int kHeadDim = decltype(hdim)::value;
    run_bwd_preprocess<Element>(params, stream);
    if constexpr (contains(kSm90BwdHdims, kHeadDim)) {
      if (path == ArchPath::kSm90) {
        run_mha_bwd_dkv_<Element, kHeadDim>(Sm90{}, params, stream);
        run_mha_bwd_dq_<Element, kHeadDim>(Sm90{}, params, stream);
        return;
      }
    }
    run_mha_bwd_dkv_<Element, kHeadDim>(Sm80{}, params, stream);
    run_mha_bwd_dq_<Element, kHeadDim>(Sm80{}, params, stream);
  });
}

// Smallest compiled head dim >= d (the kernels zero-pad columns d..d_rounded), 0 if none.
int rounded_headdim(int d) {
  if (d <= 0) return 0;
  for (int h : kHdims) {
    if (h >= d) return h;
  }
  return 0;
}

const char* compiled_headdims() {
  static const std::string names = [] {
    std::string s;
    for (int h : kHdims) {
      if (h == 0) continue;
      if (!s.empty()) s += ",";
      s += std::to_string(h);
    }
    return s;
  }();
  return names.c_str();
}

}  // namespace flash
