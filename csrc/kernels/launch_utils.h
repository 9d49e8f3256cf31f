// Host-side launch helpers shared by the launch templates of every kernel and arch path:
// the checks that come before a launch, each failure a std::runtime_error naming the kernel.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "kernels/cuda_check.h"

namespace flash {

// The twin of a kernel template a call runs: kLocal for a sliding window's left bound
// (params.window_left >= 0), kSoftcap for logit soft-capping (params.softcap > 0). `twin` is a
// generic lambda returning the kernel for (std::bool_constant<kLocal>, std::bool_constant<kSoftcap>):
//   pick_twin(params, [](auto local, auto softcap) {
//     return &kernel<Traits, decltype(local)::value, decltype(softcap)::value>; })
template <typename Params, typename Twin>
auto pick_twin(const Params& params, Twin twin) {
  using Y = std::true_type;
  using N = std::false_type;
  const bool local = params.window_left >= 0;
  if (params.softcap > 0.f) return local ? twin(Y{}, Y{}) : twin(N{}, Y{});
  return local ? twin(Y{}, N{}) : twin(N{}, N{});
}

// pick_twin for the attention kernels that also have an attention-dropout and an ALiBi twin (the
// sm80 and sm90 forward, dK/dV and dQ kernels, the sm90 Roles<> ones included; flash.h: dropout_p >
// 0, alibi_slopes_ptr): `twin` takes two more std::bool_constant, kDropout and kAlibi. Neither twin
// has a window's left bound nor soft-capping, and they are not combined (the API refuses those
// combinations).
template <typename Params, typename Twin>
auto pick_attention_twin(const Params& params, Twin twin) {
  using Y = std::true_type;
  using N = std::false_type;
  if (params.dropout_p > 0.0) return twin(N{}, N{}, Y{}, N{});
  if (params.alibi_slopes_ptr != nullptr) return twin(N{}, N{}, N{}, Y{});
  return pick_twin(params, [&](auto local, auto softcap) { return twin(local, softcap, N{}, N{}); });
}

// Opts the kernel into `smem_bytes` of dynamic shared memory (needed above 48 KB, which every GPU
// allows without opting in) after checking the device allows it; the error names the head dim and
// the limit.
template <typename Kernel>
void set_smem_or_throw(Kernel kernel, int smem_bytes, const char* what, int head_dim) {
  if (smem_bytes <= 48 * 1024) return;
  int device = 0, max_optin = 0;
  FLASH_CHECK_CUDA(cudaGetDevice(&device));
  FLASH_CHECK_CUDA(cudaDeviceGetAttribute(&max_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (smem_bytes > max_optin) {
    throw std::runtime_error(std::string("flash_attn_ext: the ") + what + " kernel for head dim " +
                             std::to_string(head_dim) + " needs " + std::to_string(smem_bytes) +
                             " bytes of shared memory per block; this GPU allows " +
                             std::to_string(max_optin));
  }
  FLASH_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
}

// Launches kernel<<<blocks, threads, smem_bytes, stream>>>(args...) on a 1-D grid (nothing when
// blocks == 0), after checking the grid fits and opting into the shared memory; the launch is
// checked.
template <typename Kernel, typename... Args>
void launch_1d(Kernel kernel, int64_t blocks, int threads, int smem_bytes, const char* what, int head_dim,
               cudaStream_t stream, const Args&... args) {
  if (blocks == 0) return;
  if (blocks > INT32_MAX) {
    throw std::runtime_error(std::string("flash_attn_ext: ") + what + " grid of " +
                             std::to_string(blocks) + " blocks exceeds 2^31 - 1");
  }
  set_smem_or_throw(kernel, smem_bytes, what, head_dim);
  kernel<<<unsigned(blocks), threads, smem_bytes, stream>>>(args...);
  FLASH_CHECK_LAUNCH();
}

// Whether `kernel`, as loaded on the current device, was compiled from PTX for sm_90 or later
// (cudaFuncAttributes::ptxVersion): only then does it hold the griddepcontrol instructions
// (primitives/barrier.cuh compiles them for __CUDA_ARCH__ >= 900). A build without sm_90 code run
// on an sm_90+ GPU JIT-compiles compute_80 PTX: such a kernel launched as a programmatic dependent
// would not wait for the kernel before it. Asked once per (kernel, device).
template <typename Kernel>
bool has_grid_dependency_control(Kernel kernel) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, bool> cache;
  int device = 0;
  FLASH_CHECK_CUDA(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  cudaFuncAttributes attr{};
  FLASH_CHECK_CUDA(cudaFuncGetAttributes(&attr, kernel));
  return cache[key] = attr.ptxVersion >= 90;
}

// launch_1d for a kernel that reads what the kernel before it on `stream` writes, as a programmatic
// dependent launch where `programmatic` (the device is sm_90+) and the kernel has the instructions
// (has_grid_dependency_control; CUDA Programming Guide,
// "Programmatic Dependent Launch and Synchronization"): its CTAs may start while that kernel's
// last CTAs finish (once they all ran griddepcontrol.launch_dependents or exited), so the launch
// latency hides behind them. The kernel must run grid_dependency_wait() (primitives/barrier.cuh)
// before it touches global memory. Without `programmatic`: an ordinary launch. Stream capture
// records the programmatic edge (CUDA >= 12.3), so CUDA graphs keep the overlap.
template <typename... KernelArgs, typename... Args>
void launch_1d_dependent(bool programmatic, void (*kernel)(KernelArgs...), int64_t blocks, int threads,
                         int smem_bytes, const char* what, int head_dim, cudaStream_t stream, const Args&... args) {
  if (!programmatic || !has_grid_dependency_control(kernel)) {
    launch_1d(kernel, blocks, threads, smem_bytes, what, head_dim, stream, args...);
    return;
  }
  if (blocks == 0) return;
  if (blocks > INT32_MAX) {
    throw std::runtime_error(std::string("flash_attn_ext: ") + what + " grid of " +
                             std::to_string(blocks) + " blocks exceeds 2^31 - 1");
  }
  set_smem_or_throw(kernel, smem_bytes, what, head_dim);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(unsigned(blocks));
  config.blockDim = dim3(unsigned(threads));
  config.dynamicSmemBytes = size_t(smem_bytes);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = 1;
  FLASH_CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, args...));
  FLASH_CHECK_LAUNCH();
}

// The launch of a tile kernel of either arch path: one CTA per item of Work (kernels/common/work.cuh:
// Work::grid_size), Traits::kThreads threads, Traits::kSmemBytes of dynamic shared memory; errors
// name the kernel (`what`) and the head dim.
template <typename Traits, typename Work, typename Params>
void launch_tiles(void (*kernel)(Params), const char* what, Params& params, cudaStream_t stream) {
  launch_1d(kernel, Work::grid_size(params), Traits::kThreads, Traits::kSmemBytes, what, params.d_rounded, stream,
            params);
}

// Defines flash::run_mha_bwd_<kind>_(Tag, ...) (kernels/arch.h), the launch template the generated
// instantiations of arch path `ns` compile: flash_bwd_<kind>_kernel with the production row
// <Kind>Tile of the arch's tile table (<Kind>KernelTraits; its CTAs are <Kind>Work items), through
// launch_tiles; the call's twin of the kernel by pick_attention_twin (a window's left bound,
// soft-capping, attention dropout, ALiBi).
// Used at global scope, after the kernel; the tuning harness launches other rows.
#define FLASH_BWD_LAUNCH_TEMPLATE(Tag, ns, Kind, kind, what)                                               \
  template <typename Element, int kHeadDim>                                                               \
  void flash::run_mha_bwd_##kind##_(flash::Tag, flash::Flash_bwd_params& params, cudaStream_t stream) {   \
    using Tile = flash::ns::Kind##Tile<kHeadDim>;                                                          \
    using Traits = flash::ns::Kind##KernelTraits<Element, kHeadDim, Tile>;                                 \
    static_assert(Traits::kSmemBytes <= flash::ns::kMaxSmem, what " tile row exceeds " #ns " shared memory"); \
    flash::launch_tiles<Traits, flash::Kind##Work<Traits::kBlockM, Traits::kBlockN>>(                      \
        flash::pick_attention_twin(params,                                                                   \
                                 [](auto local, auto softcap, auto dropout, auto alibi) {                  \
                                   return &flash::ns::flash_bwd_##kind##_kernel<Element, kHeadDim, Tile,  \
                                                                                 decltype(local)::value,  \
                                                                                 decltype(softcap)::value, \
                                                                                 decltype(dropout)::value, \
                                                                                 decltype(alibi)::value>; \
                                 }),                                                                       \
        what, params, stream);                                                                             \
  }

}  // namespace flash
