// FlashAttention-2 backward, dQ kernel on Hopper tensor cores (wgmma): the same algorithm as
// csrc/kernels/sm80/flash_bwd_dq_kernel.cuh (Alg. 2 line 16, dQ_i += dS_i^(j) K_j, as its own loop
// over K/V blocks per Q tile instead of atomics: fixed summation order, bitwise deterministic),
// recomputing S and dP (Alg. 2 lines 11-15) with warpgroup-wide asynchronous wgmma.
//
// One CTA per (Q tile i of kBlockM rows, batch, query head); warpgroup wg owns Q rows
// [64 wg, 64 wg + 64). Q_i and dO_i stay in shared memory, hi (LSE_log2) / D of the thread's two
// rows in registers; K_j, V_j stream through the tile row's kStages stages (BwdStages,
// smem_layout.cuh: by TMA on full / empty mbarriers for calls whose k / v TMA can describe,
// the loader's refill issued under the next block's first products; else by cp.async through two):
//   S   = Q_i K_j^T                    wgmma SS, B = K_j K-major            (line 11)
//   dP  = dO_i V_j^T                   wgmma SS, B = V_j K-major            (line 14)
//   P   = exp2(S scale_log2 - LSE_log2_i)   while dP runs                   (line 12; masked -> 0)
//   dS  = P o (dP - D_i)                                                    (line 15)
//   dQ_i += dS K_j                     wgmma RS, A = dS from registers, B = K_j N-major (line 16)
//
// Accumulator bookkeeping (thread = 128 wg + 32 w + 4 g + t): S acc[j][e] holds
//   Q row m = m0 + 64 wg + 16 w + g + 8 (e / 2),  key n = n0 + 8 j + 2 t + (e % 2).
// Masks, tile ranges and the exact recompute as in the sm80 kernel (kernels/common/mask.cuh,
// work.cuh): a row that sees no key gets P = dS = 0 and dQ = 0 exactly.
#pragma once

#include "kernels/sm90/smem_layout.cuh"  // with everything an sm90 kernel uses
#include "kernels/sm90/flash_bwd_dq_roles_kernel.cuh"  // the Roles<> rows' kernel, launched below

namespace flash::sm90 {

// Tile: a DqTileShape row (tile_config.h).
template <typename Element, int kHeadDim, typename Tile>
struct DqKernelTraits : BwdTileTraits<kHeadDim, Tile, Tile::kBlockM / 64> {
  static_assert(Tile::kBlockM % 64 == 0 && Tile::kBlockN % 16 == 0, "64 Q rows per warpgroup, k16 steps of keys");
  using Base = BwdTileTraits<kHeadDim, Tile, Tile::kBlockM / 64>;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDimPad, Base::kHeadDimMma, typename Base::TileQ, typename Base::TileKV;
  // Shared layout (1024-byte aligned): sQ, sdO, then kStages x (sK, sV), then the stages' full and
  // empty mbarriers (BwdStages).
  static constexpr int kStages = Tile::kStages;
  using Regions = SmemRegions<TileQ::kBytes, TileQ::kBytes, kStages * TileKV::kBytes, kStages * TileKV::kBytes,
                              2 * kStages * 8>;
  static constexpr int kOffDO = Regions::offset(1), kOffK = Regions::offset(2), kOffV = Regions::offset(3),
                       kOffBar = Regions::offset(4);
  static constexpr int kSmemBytes = Regions::kBytes + 1024;  // + alignment slack
  static_assert(kBlockN == 64 || kBlockN == 128, "S is one m64nNk16 wgmma wide (N = kBlockN)");
  static_assert(kHeadDimMma == 64 || kHeadDimMma == 96 || kHeadDimMma == 128,
                "dQ is one m64nNk16 wgmma wide (N = d, or d padded)");
  static_assert(128 % kBlockM == 0, "Q tiles must tile the 128-rounded workspaces");
};

// kLocal: the call has a sliding window's left bound (the launch picks: smem_layout.cuh,
// FLASH_SM90_BWD_LAUNCH); without it the kernel is the causal mask's code alone. kSoftcap: logit
// soft-capping (params.softcap > 0): S -> t first, and P (1 - t^2), the P of dS (softmax.cuh).
// kDropout: attention dropout (params.dropout_p > 0; flash.h): dS = P o (Z o dP rp - D), the mask
// regenerated from primitives/philox.cuh (as the sm80 kernel's twin).
// kAlibi: ALiBi (params.alibi_slopes_ptr; flash.h): S gains the bias before P is recomputed
// (common/mask.cuh: add_alibi); dS needs nothing more.
template <typename Element, int kHeadDim, typename TileShape, bool kTma, bool kLocal = false, bool kSoftcap = false,
          bool kDropout = false, bool kAlibi = false>
__global__ void __launch_bounds__(DqKernelTraits<Element, kHeadDim, TileShape>::kThreads, TileShape::kMinBlocks)
flash_bwd_dq_kernel(const __grid_constant__ Flash_bwd_params params, const __grid_constant__ BwdTmaMaps maps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = DqKernelTraits<Element, kHeadDim, TileShape>;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN;
  using TileQ = typename T::TileQ;
  using TileKV = typename T::TileKV;
  constexpr int kThreads = T::kThreads, kHeadDimPad = T::kHeadDimPad;  // shared tiles' columns
  constexpr int kHeadDimMma = T::kHeadDimMma;                          // dQ's columns (smem_layout.cuh)
  constexpr int kNBlkN = kBlockN / 8, kNBlkD = kHeadDimMma / 8;      // n8 blocks of S (keys), of dQ

  // This CTA's Q tile, batch, head and the key blocks its rows see (kernels/common/work.cuh).
  const DqWork<kBlockM, kBlockN> w(params);
  if (w.past_end()) return;  // varlen: a Q tile past its sequence's end (work.cuh: past_end)

  unsigned char* smem = aligned_dynamic_smem();
  const uint32_t smem_addr = smem_u32addr(smem);
  const uint32_t sQ = smem_addr, sdO = smem_addr + T::kOffDO;

  // Thread = 128 wg + 32 warp_wg + 4 g + t (see the header).
  const int tid = threadIdx.x, wg = warpgroup_index(tid), tid_wg = tid % 128, warp_wg = tid_wg / 32;
  const int lane = tid % 32, g = lane / 4, t = lane % 4;

  // Alg. 2 line 7: K_j, V_j of step i (key block n_block_min + i: a sliding window's first block,
  // else 0) into `stage` (smem_layout.cuh). Line 10: Q_i, dO_i (resident, cp.async) with the first
  // K/V tiles.
  const int n_block_min = kLocal ? w.n_block_min() : 0, n_steps = max(w.n_block_max - n_block_min, 0);
  const BwdStages<kTma, kThreads, T::kStages> stages(smem_addr + T::kOffBar);
  auto load_kv_tile = [&](int i, int s) {
    load_dq_stage<kTma, Element, T>(w, params, maps, smem, n_block_min + i, s, stages.full(s), tid);
  };
  stages.start(tid, maps, n_steps, load_kv_tile,
               [&] { w.template copy_q_tiles_async<Element, TileQ, kHeadDimPad, kThreads>(params, sQ, sdO, tid); });

  // hi and D of this thread's rows (whole tiles lie inside the 128-rounded workspaces).
  const int row0 = w.m0 + 64 * wg + 16 * warp_wg + g;  // e = 0,1; e = 2,3 are row0 + 8
  const int64_t ws = w.seq.ws_index(params, w.bidh, row0);
  const float hi[2] = {params.softmax_lse_log2_ptr[ws], params.softmax_lse_log2_ptr[ws + 8]};
  const float dsum[2] = {params.dsoftmax_sum_ptr[ws], params.dsoftmax_sum_ptr[ws + 8]};
  const DropoutRng dropout = DropoutRng::of<kDropout>(params);
  [[maybe_unused]] const uint32_t dropout_bh = DropoutRng::head_word(w.seq.bidb, params.h, w.bidh);
  [[maybe_unused]] const float alibi_slope_u = kAlibi ? alibi_slope(params, w.seq.bidb, w.bidh) : 0.f;

  float acc_dq[kNBlkD][4];
#pragma unroll
  for (int j = 0; j < kNBlkD; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dq[j][e] = 0.f;
  }

  for (int i = 0; i < n_steps; ++i) {
    const int n_block = n_block_min + i, stage = stages.stage(i);
    stages.acquire(i, n_steps, load_kv_tile);  // K_j, V_j landed

    const uint32_t sK = smem_addr + T::kOffK + stage * TileKV::kBytes;
    const uint32_t sV = smem_addr + T::kOffV + stage * TileKV::kBytes;
    const int n0 = n_block * kBlockN;
    // Varlen by TMA: the rows of a sequence's last key block past its end, zeroed (smem_layout.cuh).
    if (kTma && params.cu_seqlens_k != nullptr) {
      zero_stage_tail<TileKV, kBlockN, kHeadDimPad, kThreads>(sK, sV, w.seq.seqlen_k - n0, tid);
    }

    // Alg. 2 lines 11 and 14, issued back to back: S = Q_i K_j^T, dP = dO_i V_j^T.
    float acc_s[kNBlkN][4], acc_dp[kNBlkN][4];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      Wgmma<Element, kBlockN>::template ss<0>(flat(acc_s), TileQ::desc_k_major(sQ, 64 * wg, kk),
                                              TileKV::desc_k_major(sK, 0, kk), kk > 0);
    }
    wgmma_commit();
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      Wgmma<Element, kBlockN>::template ss<0>(flat(acc_dp), TileQ::desc_k_major(sdO, 64 * wg, kk),
                                              TileKV::desc_k_major(sV, 0, kk), kk > 0);
    }
    wgmma_commit();
    // Key block n_block + 1 into the stage an earlier block released (kTma: the loader's wait and
    // copies run under the products just issued).
    stages.refill(i + 1 - stages.kStages, n_steps, tid, load_kv_tile);

    wgmma_wait<1>();
    // Alg. 2 line 12: P = exp2(S scale_log2 - LSE_log2), while dP runs (masked -> 0; smem_layout.cuh).
    // Soft-capping: S -> t first, and P (1 - t^2), the P of dS.
    if constexpr (kSoftcap) softcap_scores(acc_s, params.softcap_prescale);
    if constexpr (kAlibi) w.mask.template add_alibi<false>(acc_s, w.m0 + 64 * wg + 16 * warp_wg, n0, alibi_slope_u);
    recompute_p_rows<kLocal, kSoftcap>(acc_s, w.mask, w.precise, w.template block_needs_mask<kLocal>(n_block), params.scale_softmax_log2, hi,
                     params.softmax_lse_log2_lo_ptr + ws, row0, n0, t);

    // Alg. 2 line 15: dS = P o (dP - D) (dropout: dP -> Z o dP rp first).
    wgmma_wait<0>();
    if constexpr (kDropout) {
      dropout.template for_each_kept<false, 1, kNBlkN>(dropout_bh, row0, n0 + 2 * t, [&](int, int j, int e, bool kept) {
        acc_dp[j][e] = kept ? acc_dp[j][e] * params.dropout_rp : 0.f;
      });
    }
#pragma unroll
    for (int j = 0; j < kNBlkN; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_dp[j][e] = acc_s[j][e] * (acc_dp[j][e] - dsum[e / 2]);
    }
    uint32_t a_ds[kBlockN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) acc_to_a_frag<kNBlkN, Element>(a_ds[kk], acc_dp, kk);

    // Alg. 2 line 16: dQ_i += dS K_j.
    wgmma_rs_group<Element, kHeadDimMma, 1>(flat(acc_dq), a_ds, [&](int kk) { return TileKV::desc_mn_major(sK, kk); });
    wgmma_wait<0>();
    stages.release(i);  // this thread is done with the stage
  }

  // dQ_i (times softmax_scale), staged through sQ for coalesced 16-byte stores.
  cp_async_wait<0>();
  __syncthreads();
  store_acc_to_smem<kBlockM, kHeadDimPad, kNBlkD, Element>(smem, acc_dq, 64 * wg, float(params.scale_softmax), tid_wg);
  __syncthreads();
  w.template store_q_tile<Element, TileQ, kHeadDimPad, kThreads>(params, params.dq, smem, tid);
#endif
}

}  // namespace flash::sm90

// The sm90 dQ launch: the roles kernel (flash_bwd_dq_roles_kernel.cuh) for a Roles<> row, the rows
// kernel above for other rows; k / v by TMA for calls whose tensors TMA can describe, else by
// cp.async (smem_layout.cuh: FLASH_SM90_BWD_LAUNCH).
FLASH_SM90_BWD_LAUNCH(Dq, dq, "dQ", k, v, seqlen_k, total_k, h_k, kBlockN)
