// FlashAttention-2 backward, dK/dV kernel on Hopper tensor cores for large head dims (192, 256):
// the algorithm of flash_bwd_dkv_kernel.cuh (Dao 2023, Alg. 2 outer loop over K/V blocks j; dQ left
// to the dQ kernel: no atomics, deterministic), with its two warpgroups split by role instead of by
// K rows. There, each warpgroup holds dK and dV of its 64 K rows (d fp32 registers per thread) next
// to S^T and dP^T: past d = 128 that does not fit in 255 registers. Here both warpgroups work on
// the same 64 K rows and each holds one accumulator (d / 2 registers):
//
//   warpgroup 0 (P role)                         warpgroup 1 (dS role)
//   S^T  = K_j Q_i^T          (line 11)          dP^T = V_j dO_i^T             (line 14)
//   P^T  = exp2(S^T c - LSE)  (line 12)
//   P^T -> shared memory  --- mbarrier p_full --->  dS^T = P^T o (dP^T - D_i)   (line 15)
//   dV_j += P^T dO_i          (line 13)          dK_j += dS^T Q_i              (line 17)
//
// Both run the same matmul work per Q tile (two 64 x 64 x d products each), and each one's
// element-wise phase runs while the other's products are on the tensor cores. P^T crosses in fp32,
// in the accumulator layout (thread i of one warpgroup hands its registers to thread i of the
// other), double-buffered by iteration, so dS^T is computed exactly as in the rows kernel's fp32
// path. Warpgroup 0 never waits for warpgroup 1 inside an iteration: it hands P^T over through an
// mbarrier (arrive, no wait) and may start the next Q tile while warpgroup 1 finishes this one.
//
// Q_i, dO_i and their row statistics (hi, lo, D) stream through two stages, in one of two ways:
//   kTma (calls whose q / dout TMA can describe): one thread of warpgroup 1 loads a stage by TMA
//     (Q, dO: the 128-byte-swizzle boxes of primitives/tma.cuh; rows past seqlen_q read as zeros,
//     varlen: zeroed after landing, smem_layout.cuh: zero_stage_tail) and bulk copies (the
//     statistics), completing on the stage's full mbarrier; every thread arrives on its empty
//     mbarrier once its products of the stage are done, and the loading thread refills the stage
//     once all have. No CTA-wide barrier in the loop (but at a varlen sequence's last Q tile):
//     warpgroup 0 runs ahead into the next Q tile while warpgroup 1 finishes dK of this one.
//   cp.async (strides TMA cannot describe): every thread copies its share of the next stage while
//     this one is computed (kernels/common/work.cuh), with a CTA barrier per Q tile.
// Masks, tile ranges, ragged edges, GQA and the exact recompute are the rows kernel's.
//
// Accumulator bookkeeping (thread = 128 wg + 32 w + 4 g + t): S^T / dP^T acc[j][e] hold
//   K row n = n0 + 16 w + g + 8 (e / 2),  Q row m = m0 + 8 j + 2 t + (e % 2).
#pragma once

#include "kernels/sm90/smem_layout.cuh"  // with everything an sm90 kernel uses

namespace flash::sm90 {

// Tile: a Roles<DkvTileShape> row (tile_config.h) of 64 K rows and kBlockM-row Q tiles.
template <typename Element, int kHeadDim, typename Tile>
struct DkvRolesKernelTraits : BwdTileTraits<kHeadDim, Tile, 2> {
  using Base = BwdTileTraits<kHeadDim, Tile, 2>;
  using Base::kBlockM, Base::kBlockN, typename Base::TileQ, typename Base::TileKV;  // (the names used below)
  // Shared layout (1024-byte aligned): sK, sV, 2 stages x (sQ, sdO), 2 x P^T (fp32, kBlockM / 2
  // floats per thread of a warpgroup), 2 stages x (hi, lo, D) of kBlockM floats each, then the
  // mbarriers: full and empty of the two stages, p_full of the two P^T buffers.
  static constexpr int kPBytes = 128 * (kBlockM / 2) * 4, kStatBytes = 2 * kBlockM * 4;
  using Regions = SmemRegions<TileKV::kBytes, TileKV::kBytes, 2 * TileQ::kBytes, 2 * TileQ::kBytes,
                              2 * kPBytes, kStatBytes, kStatBytes, kStatBytes, 6 * 8>;
  static constexpr int kOffV = Regions::offset(1), kOffQ = Regions::offset(2), kOffDO = Regions::offset(3),
                       kOffP = Regions::offset(4), kOffHi = Regions::offset(5), kOffLo = Regions::offset(6),
                       kOffDsum = Regions::offset(7), kOffBar = Regions::offset(8);
  static constexpr int kSmemBytes = Regions::kBytes + 1024;  // + alignment slack
  static_assert(Tile::kStages == 2, "the roles kernels stream through two stages (BwdStages' default)");
  static_assert(Tile::kRoles && kBlockN == 64, "both warpgroups work on the same 64 K rows");
  static_assert(kBlockM % 16 == 0 && kBlockM <= 128 && 128 % kBlockM == 0,
                "S^T is one m64nNk16 wgmma wide (N = kBlockM); Q tiles must tile the 128-rounded workspaces");
};

// kLocal: the call has a sliding window's left bound (the launch picks: smem_layout.cuh,
// FLASH_SM90_BWD_LAUNCH); without it the kernel is the causal mask's code alone. kSoftcap: logit
// soft-capping (params.softcap > 0): S^T -> t first, and role 1 is handed P^T (1 - t^2) for dS^T
// while role 0 keeps P^T for dV (softmax.cuh). kDropout: attention dropout (params.dropout_p > 0;
// flash.h): role 0 regenerates the mask Z (primitives/philox.cuh, as every dropout twin) and hands
// role 1 P^T with each dropped element's sign flipped (P^T >= 0: the sign carries Z, no second
// Philox pass); role 1 forms dS^T = P^T o (Z o dP^T rp - D), role 0 multiplies Z o P^T into dV,
// times rp at the end.
// kAlibi: ALiBi (params.alibi_slopes_ptr; flash.h): S^T gains the bias before P^T is recomputed
// (common/mask.cuh: add_alibi, key rows); dS^T needs nothing more.
template <typename Element, int kHeadDim, typename TileShape, bool kTma, bool kLocal = false, bool kSoftcap = false,
          bool kDropout = false, bool kAlibi = false>
__global__ void __launch_bounds__(256, 1)
flash_bwd_dkv_roles_kernel(const __grid_constant__ Flash_bwd_params params, const __grid_constant__ BwdTmaMaps maps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using T = DkvRolesKernelTraits<Element, kHeadDim, TileShape>;
  constexpr int kBlockM = T::kBlockM, kHeadDimPad = T::kHeadDimPad;  // the K tile is 64 rows (T::kBlockN)
  using TileKV = typename T::TileKV;
  using TileQ = typename T::TileQ;
  constexpr int kNBlkM = kBlockM / 8, kNBlkD = kHeadDimPad / 8;  // n8 blocks of S^T (Q rows), of dK / dV

  unsigned char* smem = aligned_dynamic_smem();
  const uint32_t smem_addr = smem_u32addr(smem);
  const uint32_t sK = smem_addr, sV = smem_addr + T::kOffV;
  auto sQ = [&](int stage) { return smem_addr + T::kOffQ + stage * TileQ::kBytes; };
  auto sdO = [&](int stage) { return smem_addr + T::kOffDO + stage * TileQ::kBytes; };
  auto sHi = [&](int stage) { return reinterpret_cast<float*>(smem + T::kOffHi) + stage * kBlockM; };
  auto sLo = [&](int stage) { return reinterpret_cast<float*>(smem + T::kOffLo) + stage * kBlockM; };
  auto sDsum = [&](int stage) { return reinterpret_cast<float*>(smem + T::kOffDsum) + stage * kBlockM; };
  // P^T of iteration it: float4 j of thread tid_wg at j * 128 + tid_wg.
  auto sP = [&](int it) { return reinterpret_cast<float4*>(smem + T::kOffP + (it % 2) * T::kPBytes); };

  // Thread = 128 wg + 32 warp_wg + 4 g + t; wg is the role (0: S, P^T, dV; 1: dP^T, dS^T, dK).
  const int tid = threadIdx.x, wg = warpgroup_index(tid), tid_wg = tid % 128, warp_wg = tid_wg / 32;
  const int lane = tid % 32, g = lane / 4, t = lane % 4;

  // This CTA's key block, batch, kv head and the Q tiles that see the block (kernels/common/work.cuh).
  const DkvWork<kBlockM, T::kBlockN> w(params);
  if (w.past_end()) return;  // varlen: a key block past its sequence's end (work.cuh: past_end)

  // Alg. 2 line 10: Q_i, dO_i, hi, lo, D of iteration `it` (query head, Q tile) into `stage`
  // (smem_layout.cuh). Line 7: K_j, V_j (resident, cp.async), with the first Q tiles.
  const BwdStages<kTma, T::kThreads> stages(smem_addr + T::kOffBar);
  const uint32_t p_full0 = stages.end();  // P^T buffer b's barrier: + 8 b
  auto load_q_tile = [&](int it, int s) {
    load_dkv_stage<kTma, Element, T>(w, params, maps, smem, it, s, stages.full(s), tid);
  };
  if (tid == stages.kLoader) {
#pragma unroll
    for (int s = 0; s < 2; ++s) mbarrier_init(p_full0 + 8 * s, 128);  // every thread of role 0, once its P^T is written
  }
  stages.start(tid, maps, w.n_iter, load_q_tile,
               [&] { w.template copy_kv_tiles_async<Element, TileKV, kHeadDimPad, T::kThreads>(params, sK, sV, tid); });

  // Alg. 2 line 8: this warpgroup's accumulator, dV_j (role 0) or dK_j (role 1), = 0.
  float acc[kNBlkD][4];
#pragma unroll
  for (int j = 0; j < kNBlkD; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  }

  // Role 0 multiplies K_j by Q_i, role 1 V_j by dO_i; role 0 then multiplies by dO_i, role 1 by Q_i.
  const uint32_t sA = wg == 0 ? sK : sV;
  const int key0 = w.n0 + 16 * warp_wg + g;
  const DropoutRng dropout = DropoutRng::of<kDropout>(params);
  bool precise_next = w.precise(params, 0);  // large-magnitude rows in the next Q tile (one load ahead)
#pragma unroll 1
  for (int it = 0; it < w.n_iter; ++it) {
    const int stage = it % 2;
    const uint32_t phase = (it / 2) % 2;
    const bool precise = precise_next;
    precise_next = w.precise(params, it + 1);
    stages.acquire(it, w.n_iter, load_q_tile);  // Q_it, dO_it and their statistics landed
    // Varlen by TMA: the rows of a sequence's last Q tile past its end, zeroed (smem_layout.cuh).
    if (kTma && params.cu_seqlens_q != nullptr) {
      zero_stage_tail<TileQ, kBlockM, kHeadDimPad, T::kThreads>(sQ(stage), sdO(stage), w.seq.seqlen_q - w.m0(it), tid);
    }
    const uint32_t sFirst = wg == 0 ? sQ(stage) : sdO(stage), sSecond = wg == 0 ? sdO(stage) : sQ(stage);

    // Alg. 2 line 11 (role 0: S^T = K_j Q_i^T) or line 14 (role 1: dP^T = V_j dO_i^T).
    float acc_s[kNBlkM][4];
    gemm_ss<Element, kBlockM, kHeadDim / 16, TileKV, TileQ>(flat(acc_s), sA, sFirst);
    stages.refill(it - 1, w.n_iter, tid, load_q_tile);  // under the products just issued (smem_layout.cuh)
    wgmma_wait<0>();

    float4* p_xchg = sP(it);
    if (wg == 0) {
      [[maybe_unused]] SoftcapGrad<float[kNBlkM][4]> dt;
      if constexpr (kSoftcap) {
        softcap_scores(acc_s, params.softcap_prescale);
        dt.set(acc_s);
      }
      if constexpr (kAlibi) {  // S^T + ALiBi's bias of this iteration's query head (mask.cuh)
        w.mask.template add_alibi<true>(acc_s, w.n0 + 16 * warp_wg, w.m0(it), alibi_slope(params, w.seq.bidb, w.head(it)));
      }
      // Alg. 2 line 12: P^T = exp2(S^T scale_log2 - LSE_log2) (fp32; masked -> 0), handed to role 1.
      recompute_pt<kLocal>(acc_s, w.mask, precise, w.template needs_mask<kLocal>(it), params.scale_softmax_log2, sHi(stage), sLo(stage),
                   w.m0(it), 0, key0, t);
      if constexpr (kDropout) {
        // Z: a dropped element's P^T handed over as -P^T (a whole warp per call: the S^T lanes
        // share their Philox pairs by shuffle).
        const uint32_t bh = DropoutRng::head_word(w.seq.bidb, params.h, w.head(it));
        dropout.template for_each_kept<true, 1, kNBlkM>(bh, key0, w.m0(it) + 2 * t, [&](int, int j, int e, bool kept) {
          if (!kept) acc_s[j][e] = -acc_s[j][e];
        });
      }
#pragma unroll
      for (int j = 0; j < kNBlkM; ++j) {
        float4 p = make_float4(acc_s[j][0], acc_s[j][1], acc_s[j][2], acc_s[j][3]);
        if constexpr (kSoftcap) {  // dS^T's P^T: times 1 - t^2
          const float2 c0 = dt.pair(2 * j), c1 = dt.pair(2 * j + 1);
          p = make_float4(p.x * c0.x, p.y * c0.y, p.z * c1.x, p.w * c1.y);
        }
        p_xchg[j * 128 + tid_wg] = p;
      }
      if constexpr (kDropout) {  // dV's A operand: Z o P^T (the flipped ones -> 0; a kept NaN stays NaN)
#pragma unroll
        for (int j = 0; j < kNBlkM; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc_s[j][e] = signbit(acc_s[j][e]) ? 0.f : acc_s[j][e];
        }
      }
      // Release (no wait). The buffer is written again two iterations on, once role 1 read it:
      // kTma, that iteration's Q tile loads only after every thread released this iteration's stage;
      // cp.async, a CTA barrier ends each iteration.
      mbarrier_arrive(p_full0 + 8 * (it % 2));
    } else {
      // Alg. 2 line 15: dS^T = P^T o (dP^T - D), D broadcast along the K rows (dropout: dP^T ->
      // Z o dP^T rp first, Z the sign of what role 0 handed over).
      mbarrier_wait(p_full0 + 8 * (it % 2), phase);
      const float* dsum = sDsum(stage);
#pragma unroll
      for (int j = 0; j < kNBlkM; ++j) {
        float4 p = p_xchg[j * 128 + tid_wg];
        if constexpr (kDropout) {
          const float rp = params.dropout_rp;  // kept: the sign bit clear (-0: a dropped 0)
          acc_s[j][0] = signbit(p.x) ? 0.f : acc_s[j][0] * rp;
          acc_s[j][1] = signbit(p.y) ? 0.f : acc_s[j][1] * rp;
          acc_s[j][2] = signbit(p.z) ? 0.f : acc_s[j][2] * rp;
          acc_s[j][3] = signbit(p.w) ? 0.f : acc_s[j][3] * rp;
          p = make_float4(fabsf(p.x), fabsf(p.y), fabsf(p.z), fabsf(p.w));
        }
        const float2 dsum2 = *reinterpret_cast<const float2*>(dsum + 8 * j + 2 * t);
        acc_s[j][0] = p.x * (acc_s[j][0] - dsum2.x);
        acc_s[j][1] = p.y * (acc_s[j][1] - dsum2.y);
        acc_s[j][2] = p.z * (acc_s[j][2] - dsum2.x);
        acc_s[j][3] = p.w * (acc_s[j][3] - dsum2.y);
      }
    }
    // Alg. 2 line 13 (role 0: dV_j += P^T dO_i) or line 17 (role 1: dK_j += dS^T Q_i), the A operand
    // from registers.
    uint32_t a_frag[kBlockM / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) acc_to_a_frag<kNBlkM, Element>(a_frag[kk], acc_s, kk);
    wgmma_rs_group<Element, kHeadDimPad, 1>(flat(acc), a_frag, [&](int kk) { return TileQ::desc_mn_major(sSecond, kk); });
    wgmma_wait<0>();
    // This thread is done with the stage (role 1 with P^T of iteration it too).
    stages.release(it);
  }

  // Alg. 2 line 19: dK_j (times softmax_scale: S was scaled) and dV_j, staged through the K/V
  // tiles (no copy may still be writing them) for coalesced 16-byte stores.
  cp_async_wait<0>();
  __syncthreads();
  const float dv_scale = kDropout ? params.dropout_rp : 1.f;  // dropout: dV = (Z o P)^T dO rp
  store_acc_to_smem<T::kBlockN, kHeadDimPad, kNBlkD, Element>(wg == 0 ? smem + T::kOffV : smem, acc, 0,
                                                           wg == 0 ? dv_scale : float(params.scale_softmax), tid_wg);
  __syncthreads();
  w.template store_kv_tile<Element, TileKV, kHeadDimPad, T::kThreads>(params, params.dk, smem, tid);
  w.template store_kv_tile<Element, TileKV, kHeadDimPad, T::kThreads>(params, params.dv, smem + T::kOffV, tid);
#endif
}

}  // namespace flash::sm90
