// Launch template of the Hopper (sm90) forward kernel: tensor maps, grid, shared memory, checks.
// Explicitly instantiated per (dtype, head dim) by csrc/kernels/sm90/instantiations/flash_fwd_*.cu.
// csrc/kernels/dispatch.cu sends a call here only when the inputs pass tma_can_describe
// (primitives/tma.cuh); the output is the op's own contiguous tensor of q's shape, so it passes
// too. Should the driver still refuse a tensor map, the call runs the sm80 kernel instead (nothing
// was launched yet).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "flash.h"
#include "kernels/arch.h"
#include "kernels/launch_utils.h"
#include "kernels/sm90/flash_fwd_kernel.cuh"
#include "kernels/sm90/tile_config.h"
#include "primitives/tma.cuh"

namespace flash {
namespace sm90 {

// Launches flash_fwd_kernel<Traits> on the persistent grid of common/tile_scheduler.cuh: one CTA
// per SM (fewer when the call has fewer work units), each looping over its Q tiles (one CTA per
// tile when sm90_fwd_schedule (flash.h, dispatch.cu) says kSm90FwdTile, or a varlen call on the
// dynamic walk has no tile_counter). The head dim is dispatch.cu's guarantee (d_rounded ==
// kHeadDim). False (nothing launched) when a tensor map cannot be encoded, or the call has more
// than 2^30 work units (the scheduler's limit).
template <typename Traits>
bool launch_fwd(Flash_fwd_params& params, cudaStream_t stream) {
  constexpr int kHeadDim = Traits::kHeadDim;
  static_assert(Traits::kSmemBytes <= kMaxSmem, "forward tile row exceeds sm_90 shared memory");
  constexpr bool kBf16 = std::is_same_v<typename Traits::Element, __nv_bfloat16>;
  if (params.is_bf16 != kBf16) throw std::runtime_error("flash_attn_ext: sm90 forward called with the wrong dtype");
  // Varlen: the packed (total, heads, d) tensors as one batch of total_q / total_k rows; the kernel
  // loads sequence b's rows at its offset (SeqInfo::q_tma_row / k_tma_row, batch coordinate 0).
  const bool varlen = params.cu_seqlens_q != nullptr;
  const int batch = varlen ? 1 : params.b;
  const int rows_q = varlen ? params.total_q : params.seqlen_q, rows_k = varlen ? params.total_k : params.seqlen_k;
  // O: stored by TMA in boxes of one consumer warpgroup's 64 rows (varlen: those whose rows all lie
  // inside the sequence; a box over its end would overrun into the next one: the kernel stores
  // that warpgroup's rows itself).
  FwdTmaMaps maps{};
  if (!tma_encode_bshd(&maps.q, params.q, batch, rows_q, params.h, params.d, kBf16, Traits::kBlockM) ||
      !tma_encode_bshd(&maps.k, params.k, batch, rows_k, params.h_k, params.d, kBf16, Traits::kBlockN) ||
      !tma_encode_bshd(&maps.v, params.v, batch, rows_k, params.h_k, params.d, kBf16, Traits::kBlockN) ||
      !tma_encode_bshd(&maps.o, params.o, batch, rows_q, params.h, params.d, kBf16, 64)) {
    return false;
  }
  using Sched = FwdTileScheduler<Traits::kBlockM>;
  auto sched = Sched::make(params, typename Sched::Schedule(sm90_fwd_schedule(params)), Traits::kWarpgroupKeyRanges);
  // The long rows' workspaces are per CTA (below): a varlen grid of one CTA per (sequence, head,
  // max_seqlen_q tile), most of them empty (the SCHEDULE knob's "tile" without the tight grid),
  // would take one copy per empty tile too, so a call that may have long rows walks persistently.
  if (params.long_rows_alloc != nullptr && varlen && !sched.persistent && !sched.dynamic && !sched.varlen_tight) {
    sched = Sched::make(params, Sched::kPersistent, Traits::kWarpgroupKeyRanges);
  }
  if (sched.num_units == 0 && sched.tiles(params) > 0) return false;  // > 2^30 work units: the sm80 grid
  // Long rows' workspaces (common/long_rows.cuh), from here on nothing declines the call: one slot
  // per CTA, as each runs its tiles one after another.
  const int grid = sched.grid_size(params);
  if (grid > 0) alloc_long_rows(params, grid, Traits::kBlockM, Traits::kHeadDimMma);
  // The call's twin of the kernel (a window's left bound, soft-capping, dropout, ALiBi:
  // flash_fwd_kernel.cuh).
  launch_1d(pick_attention_twin(params,
                                [](auto local, auto softcap, auto dropout, auto alibi) {
                                  return &flash_fwd_kernel<Traits, decltype(local)::value, decltype(softcap)::value,
                                                           decltype(dropout)::value, decltype(alibi)::value>;
                                }),
            grid, Traits::kThreads, Traits::kSmemBytes, "forward (sm90)", kHeadDim, stream, params,
            maps, sched);
  return true;
}

}  // namespace sm90

namespace sm90 {
// The sm90 forward declined a call whose inputs passed tma_can_describe (the driver refused a
// tensor map, or has no cuTensorMapEncodeTiled; or more than 2^30 work units): the sm80 kernel
// runs it, correctly but slower, and the first such call says so on stderr.
inline void note_sm80_fallback() {
  static std::atomic<bool> said{false};
  if (!said.exchange(true)) {
    std::fprintf(stderr,
                 "flash_attn_ext: the sm90 forward could not take a call (TMA tensor map refused by the driver, "
                 "or more than 2^30 tiles); running the sm80 forward kernel for such calls\n");
  }
}
}  // namespace sm90

namespace sm90 {
// launch_fwd with the tile row Tile, or the sm80 kernel where it declines the call.
template <typename Element, int kHeadDim, typename Tile>
void launch_fwd_or_sm80(Flash_fwd_params& params, cudaStream_t stream) {
  static_assert(Tile::kSupported, "no sm90 forward tile row for this head dim");
  if (!launch_fwd<FwdKernelTraits<Element, kHeadDim, Tile>>(params, stream)) {
    note_sm80_fallback();
    run_mha_fwd_<Element, kHeadDim>(Sm80{}, params, stream);  // defined by the sm80 instantiations
  }
}
}  // namespace sm90

template <typename Element, int kHeadDim>
void run_mha_fwd_(Sm90, Flash_fwd_params& params, cudaStream_t stream) {
  sm90::launch_fwd_or_sm80<Element, kHeadDim, sm90::FwdTile<kHeadDim>>(params, stream);
}

}  // namespace flash
