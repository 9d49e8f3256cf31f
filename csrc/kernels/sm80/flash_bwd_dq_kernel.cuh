// FlashAttention-2 backward, dQ kernel: Alg. 2 line 16 (dQ_i += dS_i^(j) K_j) done as its own
// loop over K/V blocks per Q tile instead of FA2's atomicAdd into dQ, so the summation order is
// fixed and the result bitwise deterministic. Recomputes S and dP (Alg. 2 lines 11-15).
//
// One CTA per (Q tile i of kBlockM rows, batch, query head); warp w owns Q rows
// [kWarpRows*w, +kWarpRows) as kMA = kWarpRows/16 m16 atoms (atom ma: rows +16ma): with
// kWarpRows = 32 every K / V B fragment loaded by ldmatrix feeds two mma (half the shared-memory
// traffic per FLOP, as in the forward kernel).
// Q_i and dO_i stay in shared memory, hi (LSE_log2) / D of the thread's rows in registers;
// K_j, V_j stream through a 2-stage cp.async pipeline:
//   S   = Q_i K_j^T                               (line 11)
//   P   = exp2(S * scale_log2 - LSE_log2_i)       (line 12; masked keys -> 0)
//   dP  = dO_i V_j^T                              (line 14)
//   dS  = P o (dP - D_i)                          (line 15)
//   dQ_i += dS K_j                                (line 16; times softmax_scale at the end)
// dS stays in registers: its C fragments are the A fragments of dS K_j (acc_to_a_frag).
//
// Fragment bookkeeping (lane = 4g + t): S acc[ma][nb][e] holds
//   Q row m = m0 + kWarpRows*warp + 16*ma + g + 8*(e/2),  key n = n0 + 8*nb + 2t + (e%2).
// Masks and tile ranges come from kernels/common/mask.cuh (DqWork): key blocks past the last one a
// row of the tile sees are skipped; blocks crossing seqlen_k or the causal diagonal, and every
// block of a tile holding a large-magnitude row, run the masked and exact copies of the P code (lo
// from the workspace). A row that sees no key has hi = +inf: P = dS = 0, dQ row exactly 0.
#pragma once

#include "kernels/sm80/kernel_common.cuh"  // everything an sm80 kernel uses

namespace flash::sm80 {

// Tile: a DqTileShape row (tile_config.h); kWarpRows 16 (one m16 atom) or 32 (two).
template <typename Element, int kHeadDim, typename Tile>
struct DqKernelTraits {
  static constexpr int kBlockM = Tile::kBlockM, kBlockN = Tile::kBlockN, kWarpRows = Tile::kWarpRows;
  static constexpr int kMA = kWarpRows / 16;     // m16 atoms per warp
  static constexpr int kNWarps = kBlockM / kWarpRows;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kPitch = SmemTile<kHeadDim>::kPitch;
  static constexpr int kNBlkN = kBlockN / 8;    // n8 blocks of S (keys)
  static constexpr int kNBlkD = kHeadDim / 8;   // n8 blocks of dQ
  // With two atoms per warp the dQ, S and dP accumulators (kMA * (kHeadDim/2 + 2*kBlockN/2)
  // fp32 per thread) leave no room for an fp32 P next to dP: P is rounded to Element right
  // after S (as the dK/dV kernel does for kPRounded) and dS computed from the rounded P.
  static constexpr bool kPRounded = kMA > 1;
  // Shared layout: sQ, sdO (kBlockM rows), then 2 stages of sK and sV (kBlockN rows).
  static constexpr int kTileQ = kBlockM * kPitch;
  static constexpr int kTileKV = kBlockN * kPitch;
  static constexpr int kSmemBytes = (2 * kTileQ + 4 * kTileKV) * int(sizeof(Element));
  static_assert(kWarpRows == 16 || kWarpRows == 32, "a warp owns one or two m16 atoms");
  static_assert(kBlockM % kWarpRows == 0 && kBlockN % 16 == 0, "tiles are multiples of the warp / k16 atom");
  static_assert(kHeadDim % 16 == 0, "head dim is a multiple of 16");
  static_assert(128 % kBlockM == 0, "Q tiles must tile the 128-rounded workspaces");
};

// Tile::kFastCopy: predicate-free copies of whole K / V tiles (primitives/tile_copy.cuh), used
// where the registers allow it (tile_config.h).
// kLocal: the call has a sliding window's left bound (the launch picks: launch_utils.h,
// FLASH_BWD_LAUNCH_TEMPLATE); without it the kernel is the causal mask's code alone. kSoftcap: logit
// soft-capping (params.softcap > 0): S -> t first, and P (1 - t^2), the P of dS (softmax.cuh).
// kDropout: attention dropout (params.dropout_p > 0; flash.h): dS = P o (Z o dP rp - D), rp = 1 / (1 -
// p), the mask regenerated from primitives/philox.cuh. kAlibi: ALiBi (params.alibi_slopes_ptr;
// flash.h): S gains the bias before P is recomputed (common/mask.cuh: add_alibi).
template <typename Element, int kHeadDim, typename TileShape, bool kLocal = false, bool kSoftcap = false,
          bool kDropout = false, bool kAlibi = false>
__global__ void __launch_bounds__(DqKernelTraits<Element, kHeadDim, TileShape>::kThreads, 1)
flash_bwd_dq_kernel(const Flash_bwd_params params) {
  using T = DqKernelTraits<Element, kHeadDim, TileShape>;
#if defined(__CUDA_ARCH__)  // device code only: the host pass needs just the stub
  constexpr int kBlockM = T::kBlockM, kBlockN = T::kBlockN, kWarpRows = T::kWarpRows;
  constexpr int kMA = T::kMA, kPitch = T::kPitch, kThreads = T::kThreads;
  constexpr bool kFastCopy = TileShape::kFastCopy, kPRounded = T::kPRounded;

  extern __shared__ __align__(128) unsigned char flash_bwd_smem[];
  Element* sQ = reinterpret_cast<Element*>(flash_bwd_smem);
  Element* sdO = sQ + T::kTileQ;
  Element* sK0 = sdO + T::kTileQ;  // stage s: sK0 + s * kTileKV
  Element* sV0 = sK0 + 2 * T::kTileKV;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;

  // This CTA's Q tile, batch, head and the key blocks its rows see (kernels/common/work.cuh); a Q
  // tile past its sequence's end (varlen; work.cuh: past_end) has nothing to do.
  const DqWork<kBlockM, kBlockN> w(params);
  if (w.past_end()) return;

  // Alg. 2 line 7 (K_j, V_j) of step i (key block n_block_min + i: a sliding window's first block,
  // else 0), into `stage`.
  const int n_block_min = kLocal ? w.n_block_min() : 0, n_steps = max(w.n_block_max - n_block_min, 0);
  auto load_kv_tile = [&](int i, int stage) {
    w.template copy_kv_tiles_async<Element, SmemTile<kHeadDim>, kHeadDim, kThreads, kFastCopy>(
        params, n_block_min + i, smem_u32addr(sK0 + stage * T::kTileKV), smem_u32addr(sV0 + stage * T::kTileKV), tid);
  };

  // Alg. 2 line 10: Q_i, dO_i (resident), hi and D of this thread's rows r and r + 8.
  w.template copy_q_tiles_async<Element, SmemTile<kHeadDim>, kHeadDim, kThreads>(params, smem_u32addr(sQ),
                                                                               smem_u32addr(sdO), tid);
  if (n_steps > 0) load_kv_tile(0, 0);
  cp_async_commit();

  const int warp_row0 = kWarpRows * warp;  // first tile row of this warp
  // Query row of atom ma, e = 0,1: row_lo + 16*ma; e = 2,3 are 8 rows further.
  const int row_lo = w.m0 + warp_row0 + g;
  const int64_t ws = w.seq.ws_index(params, w.bidh, 0);
  float hi[kMA][2], dsum[kMA][2];  // rows < seqlen_q_rounded: whole tiles are in the workspace
#pragma unroll
  for (int ma = 0; ma < kMA; ++ma) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      hi[ma][r] = params.softmax_lse_log2_ptr[ws + row_lo + 16 * ma + 8 * r];
      dsum[ma][r] = params.dsoftmax_sum_ptr[ws + row_lo + 16 * ma + 8 * r];
    }
  }
  // P of element e of (atom ma, n8 block nb) of the S tile at key n0 (Alg. 2 line 12) in the
  // block's mode (primitives/softmax.cuh); the exact one reads lo from the workspace.
  auto p_of = [&](auto mode, float s, int n0, int ma, int nb, int e) {
    constexpr PMode kMode = decltype(mode)::value;
    const int row = row_lo + 16 * ma + 8 * (e / 2);
    const float lo = kMode == PMode::kExact ? params.softmax_lse_log2_lo_ptr[ws + row] : 0.f;
    const bool visible = w.mask.template visible<kLocal>(row, n0 + nb * 8 + 2 * t + (e % 2));
    const float p = recompute_p<kMode>(s, params.scale_softmax_log2, hi[ma][e / 2], lo, visible);
    return kSoftcap ? p * fmaf(-s, s, 1.f) : p;  // soft-capping: s is t, and dS's P is P (1 - t^2)
  };

  float acc_dq[kMA][T::kNBlkD][4];
  zero_acc(acc_dq);
  const DropoutRng dropout = DropoutRng::of<kDropout>(params);
  const uint32_t dropout_bh = DropoutRng::head_word(w.seq.bidb, params.h, w.bidh);
  const float alibi_slope_u = kAlibi ? alibi_slope(params, w.seq.bidb, w.bidh) : 0.f;  // ALiBi's, in score units

  for (int i = 0; i < n_steps; ++i) {
    const int n_block = n_block_min + i, stage = i % 2;
    pipeline_step(i, n_steps, load_kv_tile);  // K_{j+1}, V_{j+1} in flight; K_j, V_j landed

    const Element* sK = sK0 + stage * T::kTileKV;
    const Element* sV = sV0 + stage * T::kTileKV;
    const int n0 = n_block * kBlockN;

    // Alg. 2 line 11: S = Q_i K_j^T (this warp's kWarpRows rows x kBlockN keys).
    float acc_s[kMA][T::kNBlkN][4];
    zero_acc(acc_s);
    gemm_abt_smem<kMA, T::kNBlkN, kHeadDim>(acc_s, sQ, warp_row0, sK, lane);
    if constexpr (kSoftcap) softcap_scores(acc_s, params.softcap_prescale);  // S -> t (softmax.cuh)
    if constexpr (kAlibi) w.mask.template add_alibi<false>(acc_s, w.m0 + warp_row0, n0, alibi_slope_u);  // mask.cuh

    // Alg. 2 line 12: P = exp2(S scale_log2 - LSE_log2), masked keys -> 0; the masked and exact
    // copies run on the blocks that need them only (a CTA-uniform branch).
    const bool needs_mask = w.template block_needs_mask<kLocal>(n_block);
    // kPRounded: P as Element pairs p_rounded[ma][nb][h] (row g + 8h, keys 8nb + 2t, +1) before
    // dP is computed, so the fp32 S is dead during the dP product.
    uint32_t p_rounded[kPRounded ? kMA : 1][kPRounded ? T::kNBlkN : 1][2];
    if constexpr (kPRounded) {
      auto round_p = [&](auto ex) {
#pragma unroll
        for (int ma = 0; ma < kMA; ++ma) {
#pragma unroll
          for (int nb = 0; nb < T::kNBlkN; ++nb) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              p_rounded[ma][nb][h] = pack2<Element>(p_of(ex, acc_s[ma][nb][2 * h], n0, ma, nb, 2 * h),
                                                    p_of(ex, acc_s[ma][nb][2 * h + 1], n0, ma, nb, 2 * h + 1));
            }
          }
        }
      };
      with_p_mode(w.precise, needs_mask, round_p);
    }

    // Alg. 2 line 14: dP = dO_i V_j^T.
    float acc_dp[kMA][T::kNBlkN][4];
    zero_acc(acc_dp);
    gemm_abt_smem<kMA, T::kNBlkN, kHeadDim>(acc_dp, sdO, warp_row0, sV, lane);

    // Dropout: dP -> Z o dP rp in place (dS below then is P o (Z o dP rp - D)).
    if constexpr (kDropout) {
      dropout.template for_each_kept<false, kMA, T::kNBlkN>(dropout_bh, row_lo, n0 + 2 * t,
                                                            [&](int ma, int nb, int e, bool kept) {
                                                              acc_dp[ma][nb][e] =
                                                                  kept ? acc_dp[ma][nb][e] * params.dropout_rp : 0.f;
                                                            });
    }

    // Alg. 2 line 15: dS = P o (dP - D) (in acc_dp; without kPRounded, P (line 12) is made here).
    auto make_ds = [&](auto ex) {
#pragma unroll
      for (int ma = 0; ma < kMA; ++ma) {
#pragma unroll
        for (int nb = 0; nb < T::kNBlkN; ++nb) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float p;
            if constexpr (kPRounded) {
              const float2 p2 = unpack2<Element>(p_rounded[ma][nb][e / 2]);
              p = (e % 2) ? p2.y : p2.x;
            } else {
              p = p_of(ex, acc_s[ma][nb][e], n0, ma, nb, e);
            }
            acc_dp[ma][nb][e] = p * (acc_dp[ma][nb][e] - dsum[ma][e / 2]);
          }
        }
      }
    };
    if constexpr (kPRounded) {
      make_ds(std::integral_constant<PMode, PMode::kFast>{});  // P comes from p_rounded
    } else {
      with_p_mode(w.precise, needs_mask, make_ds);
    }

    // Alg. 2 line 16: dQ_i += dS K_j (A = dS from registers, B = K_j via ldmatrix.trans).
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a_ds[kMA][4];
#pragma unroll
      for (int ma = 0; ma < kMA; ++ma) acc_to_a_frag<T::kNBlkN, Element>(a_ds[ma], acc_dp[ma], kk);
      gemm_ab_trans_smem<kMA, T::kNBlkD, kPitch>(acc_dq, a_ds, sK, 16 * kk, 0, lane);
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }

  // Write dQ_i (times softmax_scale), staged through sQ for coalesced 16-byte stores.
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int ma = 0; ma < kMA; ++ma) {
    store_acc_to_smem<T::kNBlkD, kPitch>(sQ, acc_dq[ma], warp_row0 + 16 * ma, 0, float(params.scale_softmax), lane);
  }
  __syncthreads();
  w.template store_q_tile<Element, SmemTile<kHeadDim>, kHeadDim, kThreads>(params, params.dq, sQ, tid);
#endif
}

}  // namespace flash::sm80

FLASH_BWD_LAUNCH_TEMPLATE(Sm80, sm80, Dq, dq, "dQ")
