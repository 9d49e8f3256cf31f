// FlashAttention-2 backward, dQ kernel on Hopper tensor cores for large head dims (192, 256): the
// algorithm of flash_bwd_dq_kernel.cuh (Alg. 2 line 16, dQ_i += dS_i^(j) K_j, as its own loop over
// K/V blocks per Q tile instead of atomics: bitwise deterministic), with its two warpgroups split by
// role instead of by Q rows, as in flash_bwd_dkv_roles_kernel.cuh. Both work on the same 64 Q rows:
//
//   warpgroup 0 (P role)                         warpgroup 1 (dS role)
//   S  = Q_i K_j^T            (line 11)          dP = dO_i V_j^T               (line 14)
//   P  = exp2(S c - LSE)      (line 12)
//   P -> shared memory  ---- CTA barrier ---->  dS = P o (dP - D_i)           (line 15)
//                                                dS -> shared memory (swizzled A operand)
//   ---------------------------- both: __syncthreads ----------------------------
//   dQ_i[:, :kCols0] += dS K_j[:, :kCols0]       dQ_i[:, kCols0:] += dS K_j[:, kCols0:]   (line 16)
//
// Each warpgroup keeps its columns of dQ (at most 128: 64 registers per thread), so S and dP have
// room for 64-key tiles; the dQ columns split at a 64-column swizzle block (d192: 128 + 64,
// d256: 128 + 128). P crosses in fp32 in the accumulator layout; dS crosses rounded to Element, as
// the rows kernel's register A operand is.
//
// K_j, V_j stream through two stages as the dK/dV roles kernel's Q tiles do: by TMA with full /
// empty mbarriers (kTma: calls whose k / v TMA can describe; keys past seqlen_k read as zeros,
// varlen: zeroed after landing, and the mask hides them), else by cp.async with a CTA barrier per
// key block.
//
// Accumulator bookkeeping (thread = 128 wg + 32 w + 4 g + t): S / dP acc[j][e] hold
//   Q row m = m0 + 16 w + g + 8 (e / 2),  key n = n0 + 8 j + 2 t + (e % 2).
#pragma once

#include "kernels/sm90/smem_layout.cuh"  // with everything an sm90 kernel uses

namespace flash::sm90 {

// Tile: a Roles<DqTileShape> row (tile_config.h) of 64 Q rows and kBlockN-key K/V tiles.
template <typename Element, int kHeadDim, typename Tile>
struct DqRolesKernelTraits : BwdTileTraits<kHeadDim, Tile, 2> {
  using Base = BwdTileTraits<kHeadDim, Tile, 2>;
  using Base::kBlockM, Base::kBlockN, Base::kHeadDimPad, typename Base::TileQ, typename Base::TileKV;
  using TileDs = SwizzledTile<kBlockM, kBlockN>;
  // dQ columns of warpgroup 0 (whole swizzle blocks, at least half) and of warpgroup 1.
  static constexpr int kCols0 = (kHeadDimPad / 2 + 63) / 64 * 64, kCols1 = kHeadDimPad - kCols0;
  // Shared layout (1024-byte aligned): sQ, sdO, 2 stages x (sK, sV), dS, P (fp32, kBlockN / 2
  // floats per thread of a warpgroup), the stages' mbarriers.
  using Regions = SmemRegions<TileQ::kBytes, TileQ::kBytes, 2 * TileKV::kBytes, 2 * TileKV::kBytes, TileDs::kBytes,
                              128 * (kBlockN / 2) * 4, 4 * 8>;  // the last: full and empty mbarriers of the 2 stages
  static constexpr int kOffDO = Regions::offset(1), kOffK = Regions::offset(2), kOffV = Regions::offset(3),
                       kOffDs = Regions::offset(4), kOffP = Regions::offset(5), kOffBar = Regions::offset(6);
  static constexpr int kSmemBytes = Regions::kBytes + 1024;  // + alignment slack
  static_assert(Tile::kStages == 2, "the roles kernels stream through two stages (BwdStages' default)");
  static_assert(Tile::kRoles && kBlockM == 64, "both warpgroups work on the same 64 Q rows");
  static_assert(kBlockN % 64 == 0 && kBlockN <= 128, "S is one m64nNk16 wgmma wide; dS whole swizzle blocks");
  static_assert(kCols1 > 0 && kCols0 <= 128, "each warpgroup holds at most 128 dQ columns");
};

// kLocal: the call has a sliding window's left bound (the launch picks: smem_layout.cuh,
// FLASH_SM90_BWD_LAUNCH); without it the kernel is the causal mask's code alone. kSoftcap: logit
// soft-capping (params.softcap > 0): S -> t first, and role 1 is handed P (1 - t^2) (softmax.cuh).
// kDropout: attention dropout (params.dropout_p > 0; flash.h): role 1 regenerates the mask Z
// (primitives/philox.cuh, as every dropout twin) and forms Z o dP rp while role 0 computes P (before
// the P barrier it waits at anyway), then dS = P o (Z o dP rp - D).
// kAlibi: ALiBi (params.alibi_slopes_ptr; flash.h): S gains the bias before P is recomputed
// (common/mask.cuh: add_alibi); dS needs nothing more.
template <typename Element, int kHeadDim, typename TileShape, bool kTma, bool kLocal = false, bool kSoftcap = false,
          bool kDropout = false, bool kAlibi = false>
__global__ void __launch_bounds__(256, 1)
flash_bwd_dq_roles_kernel(const __grid_constant__ Flash_bwd_params params, const __grid_constant__ BwdTmaMaps maps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = DqRolesKernelTraits<Element, kHeadDim, TileShape>;
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kHeadDimPad = T::kHeadDimPad;
  constexpr int kCols0 = T::kCols0, kCols1 = T::kCols1;
  using TileQ = typename T::TileQ;
  using TileKV = typename T::TileKV;
  using TileDs = typename T::TileDs;
  constexpr int kThreads = T::kThreads;
  constexpr int kNBlkN = kBlockN / 8;  // n8 blocks of S (keys)

  // This CTA's Q tile, batch, head and the key blocks its rows see (kernels/common/work.cuh).
  const DqWork<kBlockM, kBlockN> w(params);
  if (w.past_end()) return;  // varlen: a Q tile past its sequence's end (work.cuh: past_end)

  unsigned char* smem = aligned_dynamic_smem();
  const uint32_t smem_addr = smem_u32addr(smem);
  const uint32_t sQ = smem_addr, sdO = smem_addr + T::kOffDO, sDs = smem_addr + T::kOffDs;
  float4* sP = reinterpret_cast<float4*>(smem + T::kOffP);  // P, float4 j of thread tid_wg at j * 128 + tid_wg

  // Thread = 128 wg + 32 warp_wg + 4 g + t; wg is the role (0: S, P; 1: dP, dS).
  const int tid = threadIdx.x, wg = warpgroup_index(tid), tid_wg = tid % 128, warp_wg = tid_wg / 32;
  const int lane = tid % 32, g = lane / 4, t = lane % 4;

  // Alg. 2 line 7: K_j, V_j of step i (key block n_block_min + i: a sliding window's first block,
  // else 0) into `stage` (smem_layout.cuh). Line 10: Q_i, dO_i (resident, cp.async) with the first
  // K/V tiles.
  const int n_block_min = kLocal ? w.n_block_min() : 0, n_steps = max(w.n_block_max - n_block_min, 0);
  const BwdStages<kTma, kThreads> stages(smem_addr + T::kOffBar);
  auto load_kv_tile = [&](int i, int s) {
    load_dq_stage<kTma, Element, T>(w, params, maps, smem, n_block_min + i, s, stages.full(s), tid);
  };
  stages.start(tid, maps, n_steps, load_kv_tile,
               [&] { w.template copy_q_tiles_async<Element, TileQ, kHeadDimPad, kThreads>(params, sQ, sdO, tid); });

  // The row statistic of this thread's two rows its role needs: hi (LSE_log2) for role 0, D for
  // role 1 (whole tiles lie inside the 128-rounded workspaces).
  const int row0 = w.m0 + 16 * warp_wg + g;  // e = 0,1; e = 2,3 are row0 + 8
  const int64_t ws = w.seq.ws_index(params, w.bidh, row0);
  const float* stat = wg == 0 ? params.softmax_lse_log2_ptr : params.dsoftmax_sum_ptr;
  const float row_stat[2] = {stat[ws], stat[ws + 8]};

  // This warpgroup's dQ columns [col0, col0 + kCols0 or kCols1) (role 1 uses the first kCols1 / 8
  // blocks of acc_dq).
  const int col0 = wg == 0 ? 0 : kCols0;
  float acc_dq[kCols0 / 8][4];
#pragma unroll
  for (int j = 0; j < kCols0 / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_dq[j][e] = 0.f;
  }

#pragma unroll 1
  for (int i = 0; i < n_steps; ++i) {
    const int n_block = n_block_min + i, stage = i % 2;
    stages.acquire(i, n_steps, load_kv_tile);  // K_j, V_j landed
    const uint32_t sK = smem_addr + T::kOffK + stage * TileKV::kBytes;
    const uint32_t sV = smem_addr + T::kOffV + stage * TileKV::kBytes;
    const int n0 = n_block * kBlockN;
    // Varlen by TMA: the rows of a sequence's last key block past its end, zeroed (smem_layout.cuh).
    if (kTma && params.cu_seqlens_k != nullptr) {
      zero_stage_tail<TileKV, kBlockN, kHeadDimPad, kThreads>(sK, sV, w.seq.seqlen_k - n0, tid);
    }

    // Alg. 2 line 11 (role 0: S = Q_i K_j^T) or line 14 (role 1: dP = dO_i V_j^T).
    float acc_s[kNBlkN][4];
    gemm_ss<Element, kBlockN, kHeadDim / 16, TileQ, TileKV>(flat(acc_s), wg == 0 ? sQ : sdO, wg == 0 ? sK : sV);
    wgmma_wait<0>();

    if (wg == 0) {
      // Alg. 2 line 12: P = exp2(S scale_log2 - LSE_log2) (masked -> 0), handed to role 1 (with
      // soft-capping: S -> t first, and P (1 - t^2), the P of dS).
      if constexpr (kSoftcap) softcap_scores(acc_s, params.softcap_prescale);
      if constexpr (kAlibi) {  // S + ALiBi's bias (mask.cuh)
        w.mask.template add_alibi<false>(acc_s, w.m0 + 16 * warp_wg, n0, alibi_slope(params, w.seq.bidb, w.bidh));
      }
      recompute_p_rows<kLocal, kSoftcap>(acc_s, w.mask, w.precise, w.template block_needs_mask<kLocal>(n_block), params.scale_softmax_log2, row_stat,
                       params.softmax_lse_log2_lo_ptr + ws, row0, n0, t);
#pragma unroll
      for (int j = 0; j < kNBlkN; ++j) sP[j * 128 + tid_wg] = make_float4(acc_s[j][0], acc_s[j][1], acc_s[j][2], acc_s[j][3]);
    }
    if (kDropout && wg == 1) {
      // Dropout: dP -> Z o dP rp, under role 0's P.
      const DropoutRng dropout = DropoutRng::of<true>(params);
      const uint32_t bh = DropoutRng::head_word(w.seq.bidb, params.h, w.bidh);
      dropout.template for_each_kept<false, 1, kNBlkN>(bh, row0, n0 + 2 * t, [&](int, int j, int e, bool kept) {
        acc_s[j][e] = kept ? acc_s[j][e] * params.dropout_rp : 0.f;
      });
    }
    // P complete (role 1 waits here from the end of its dP product: no longer than role 0's). A
    // CTA barrier outside the role branches (a bar.sync is aligned: every thread at one instruction).
    __syncthreads();
    if (wg == 1) {
      // Alg. 2 line 15: dS = P o (dP - D), rounded into the swizzled A operand of line 16.
#pragma unroll
      for (int j = 0; j < kNBlkN; ++j) {
        const float4 p = sP[j * 128 + tid_wg];
        acc_s[j][0] = p.x * (acc_s[j][0] - row_stat[0]);
        acc_s[j][1] = p.y * (acc_s[j][1] - row_stat[0]);
        acc_s[j][2] = p.z * (acc_s[j][2] - row_stat[1]);
        acc_s[j][3] = p.w * (acc_s[j][3] - row_stat[1]);
      }
      store_acc_to_smem<kBlockM, kBlockN, kNBlkN, Element>(smem + T::kOffDs, acc_s, 0, 1.f, tid_wg);
      fence_proxy_async();  // generic stores -> the wgmma (async proxy) reads below
    }
    __syncthreads();  // dS complete

    // Alg. 2 line 16: dQ_i[:, this warpgroup's columns] += dS K_j[:, the same columns].
    // (Each branch waits for its own group: the accumulators of the two widths never meet at a
    // merge point while a product is in flight.)
    const uint32_t sKcols = sK + (col0 / 64) * TileKV::kColBlockBytes;
    auto gemm_dq = [&](auto& acc) {
      constexpr int kCols = 2 * int(sizeof(acc) / sizeof(float));
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        Wgmma<Element, kCols>::template ss<1>(acc, TileDs::desc_k_major(sDs, 0, kk), TileKV::desc_mn_major(sKcols, kk),
                                              1);
      }
      wgmma_commit();
      wgmma_wait<0>();
    };
    if constexpr (kCols0 == kCols1) {
      gemm_dq(flat(acc_dq));
    } else if (wg == 0) {
      gemm_dq(flat(acc_dq));
    } else {
      gemm_dq(reinterpret_cast<float(&)[kCols1 / 2]>(acc_dq));
    }
    // P and dS are free again once both roles passed the P barrier of the next key block (each
    // waited for its dQ product before); this thread is done with the K/V stage.
    stages.release(i);
    // Here, not under this key block's S / dP products as in the other sm90 backward kernels: there,
    // this kernel ran 6-9 % slower (tune_kernels.py dq90:256, N >= 4k; docs/PERF_NOTES.md).
    stages.refill(i, n_steps, tid, load_kv_tile);
  }

  // dQ_i (times softmax_scale), staged through sQ for coalesced 16-byte stores: each warpgroup its
  // columns (a whole number of swizzle blocks from col0).
  cp_async_wait<0>();
  __syncthreads();
  unsigned char* sQcols = smem + (col0 / 64) * TileQ::kColBlockBytes;
  if (wg == 0) {
    store_acc_to_smem<kBlockM, kHeadDimPad, kCols0 / 8, Element>(sQcols, acc_dq, 0, float(params.scale_softmax), tid_wg);
  } else {
    store_acc_to_smem<kBlockM, kHeadDimPad, kCols1 / 8, Element>(
        sQcols, reinterpret_cast<float(&)[kCols1 / 8][4]>(acc_dq), 0, float(params.scale_softmax), tid_wg);
  }
  __syncthreads();
  w.template store_q_tile<Element, TileQ, kHeadDimPad, kThreads>(params, params.dq, smem, tid);
#endif
}

}  // namespace flash::sm90
