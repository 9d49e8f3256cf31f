// FlashAttention-2 backward, dK/dV kernel (Dao 2023, Alg. 2 outer loop over K/V blocks j;
// dQ is left to flash_bwd_dq_kernel.cuh instead of atomics, so the result is deterministic).
//
// One CTA per (K/V block j of kBlockN rows, batch, kv head). K_j, V_j stay in shared memory;
// for every query head of the GQA group and every Q tile i of kBlockM rows that sees block j,
// Q_i, dO_i, lse_log2_i, D_i stream in through a 2-stage cp.async pipeline and
//   S^T  = K_j Q_i^T                                  (Alg. 2 line 11, transposed)
//   P^T  = exp2(S^T * scale_log2 - lse_log2_i)        (line 12; masked keys -> 0)
//   dV_j += P^T dO_i                                  (line 13)
//   dP^T = V_j dO_i^T                                 (line 14)
//   dS^T = P^T o (dP^T - D_i)                         (line 15)
//   dK_j += dS^T Q_i                                  (line 17; times softmax_scale at the end)
// Transposed products put the K-tile rows on the mma M axis: warp w owns K rows
// [kWarpRows*(w % kRowWarps), +kWarpRows) as kMA = kWarpRows/16 m16 atoms, so P^T and dS^T come
// out as C fragments whose k16 slices are exactly the A fragments of the dV / dK products
// (acc_to_a_frag): no shared-memory round trip. kWarpRows = 32 (d <= 64 only: the dK/dV
// accumulators take kWarpRows*kDW/16 registers) lets every Q / dO B fragment feed two mma.
//
// Fragment bookkeeping (lane = 4g + t, mma.cuh): S^T acc[ma][nb][e] holds
//   K row n = kWarpRows*warp_n + 16*ma + g + 8*(e/2),  Q row m = m0 + 8*nb + 2t + (e%2),
// so lse_log2 and D depend only on (nb, t, e%2): one float2 at tile column 8nb + 2t.
//
// Causal (bottom-right, off = seqlen_k - seqlen_q): query i sees key j iff j <= i + off. Tile
// i0 sees block j0 iff j0 <= i0 + kBlockM - 1 + off, i.e. from m_block_min = floor((j0-off)/kBlockM)
// on; only tiles with j0 + kBlockN - 1 > i0 + off hold masked pairs. Query rows >= seqlen_q are
// zero-filled with lse_log2 = +inf (preprocess), so their P = 0. Keys >= seqlen_k only touch
// dK/dV rows that are never stored (each output row depends on its own P^T / dS^T row only).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "flash.h"
#include "kernels/sm80/flash_bwd_common.cuh"
#include "primitives/cp_async.cuh"
#include "primitives/math.cuh"
#include "primitives/mma.cuh"

namespace flash {
namespace bwd {

// kWarpRows: K rows per warp, 16 (one m16 atom) or 32 (two).
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kColSplit, int kWarpRows = 16>
struct DkvKernelTraits {
  static constexpr int kMA = kWarpRows / 16;  // m16 atoms per warp
  static constexpr int kRowWarps = kBlockN / kWarpRows;
  static constexpr int kNWarps = kRowWarps * kColSplit;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kPitch = SmemTile<kHeadDim>::kPitch;
  static constexpr int kDW = kHeadDim / kColSplit;  // dK/dV columns per warp
  static constexpr int kNBlkM = kBlockM / 8;        // n8 blocks of S^T (Q rows)
  static constexpr int kNBlkD = kDW / 8;            // n8 blocks of a warp's dK/dV slice
  // dS^T from the Element-rounded P^T where the dK/dV accumulators (kMA * kDW fp32 per thread)
  // leave no room for an fp32 copy of P^T next to dP^T (kMA * kDW >= 128).
  static constexpr bool kPRounded = kMA * kDW >= 128;
  // Shared layout: sK, sV (kBlockN rows), then 2 stages of sQ, sdO (kBlockM rows), then
  // 2 stages of lse_log2 and D (kBlockM floats each).
  static constexpr int kTileKV = kBlockN * kPitch;
  static constexpr int kTileQ = kBlockM * kPitch;
  static constexpr int kSmemBytes =
      (2 * kTileKV + 4 * kTileQ) * int(sizeof(Element)) + 4 * kBlockM * int(sizeof(float));
  static_assert(kWarpRows == 16 || kWarpRows == 32, "a warp owns one or two m16 atoms");
  static_assert(kBlockN % kWarpRows == 0 && kBlockM % 16 == 0, "tiles are multiples of the warp / k16 atom");
  static_assert(kDW % 16 == 0, "a warp's dK/dV slice is a multiple of 16 columns");
  static_assert(128 % kBlockM == 0, "Q tiles must tile the 128-rounded workspaces");
  static_assert(kBlockM / 4 * 2 <= kThreads, "one thread per 16 B of the lse/D tiles");
};

// kFastCopy: predicate-free copies of whole Q / dO tiles (primitives/tile_copy.cuh), used where
// the registers allow it (tile_config_bwd.h).
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kColSplit, int kWarpRows = 16,
          bool kFastCopy = true>
__global__ void __launch_bounds__(
    DkvKernelTraits<Element, kHeadDim, kBlockM, kBlockN, kColSplit, kWarpRows>::kThreads, 1)
flash_bwd_dkv_kernel(const Flash_bwd_params params) {
  using T = DkvKernelTraits<Element, kHeadDim, kBlockM, kBlockN, kColSplit, kWarpRows>;
  using Tile = SmemTile<kHeadDim>;
  constexpr int kMA = T::kMA;
  constexpr int kPitch = T::kPitch;
  constexpr int kThreads = T::kThreads;

  extern __shared__ __align__(128) unsigned char flash_bwd_smem[];
  Element* sK = reinterpret_cast<Element*>(flash_bwd_smem);
  Element* sV = sK + T::kTileKV;
  Element* sQ0 = sV + T::kTileKV;  // stage s: sQ0 + s * kTileQ
  Element* sdO0 = sQ0 + 2 * T::kTileQ;
  float* sLse0 = reinterpret_cast<float*>(sdO0 + 2 * T::kTileQ);  // stage s: + s * kBlockM
  float* sDsum0 = sLse0 + 2 * kBlockM;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int warp_n = warp % T::kRowWarps;  // K rows [kWarpRows*warp_n, +kWarpRows)
  const int warp_d = warp / T::kRowWarps;  // dK/dV columns [kDW*warp_d, +kDW)
  const int g = lane / 4, t = lane % 4;

  // This CTA's key block, batch, kv head and the Q tiles that see the block (see the header).
  const DkvWork<kBlockM, kBlockN> w(params);

  const Element* q_base = reinterpret_cast<const Element*>(params.q_ptr) + w.bidb * params.q_batch_stride;
  const Element* do_base = reinterpret_cast<const Element*>(params.do_ptr) + w.bidb * params.do_batch_stride;

  // Alg. 2 line 10: issues the cp.async copies of iteration `it` (query head, Q tile) into `stage`.
  auto load_q_tile = [&](int it, int stage) {
    const int bidh = w.head(it);
    const int m0 = w.m0(it);
    copy_tile_async<Tile, kBlockM, kHeadDim, kThreads, kFastCopy>(
        smem_u32addr(sQ0 + stage * T::kTileQ), q_base + bidh * params.q_head_stride + m0 * params.q_row_stride,
        params.q_row_stride, params.seqlen_q - m0, params.d, tid);
    copy_tile_async<Tile, kBlockM, kHeadDim, kThreads, kFastCopy>(
        smem_u32addr(sdO0 + stage * T::kTileQ), do_base + bidh * params.do_head_stride + m0 * params.do_row_stride,
        params.do_row_stride, params.seqlen_q - m0, params.d, tid);
    w.copy_row_stats_async(params, it, sLse0 + stage * kBlockM, sDsum0 + stage * kBlockM, tid);
  };

  // Alg. 2 line 7: load K_j, V_j (resident for the whole CTA), with the first Q tile.
  const Element* k_tile = reinterpret_cast<const Element*>(params.k_ptr) + w.bidb * params.k_batch_stride +
                          w.bidhk * params.k_head_stride + w.n0 * params.k_row_stride;
  const Element* v_tile = reinterpret_cast<const Element*>(params.v_ptr) + w.bidb * params.v_batch_stride +
                          w.bidhk * params.v_head_stride + w.n0 * params.v_row_stride;
  copy_tile_async<Tile, kBlockN, kHeadDim, kThreads>(
      smem_u32addr(sK), k_tile, params.k_row_stride, params.seqlen_k - w.n0, params.d, tid);
  copy_tile_async<Tile, kBlockN, kHeadDim, kThreads>(
      smem_u32addr(sV), v_tile, params.v_row_stride, params.seqlen_k - w.n0, params.d, tid);
  if (w.n_iter > 0) load_q_tile(0, 0);
  cp_async_commit();

  // Alg. 2 line 8: dK_j = dV_j = 0 (this warp's kWarpRows rows x kDW columns).
  float acc_dk[kMA][T::kNBlkD][4], acc_dv[kMA][T::kNBlkD][4];
  zero_acc(acc_dk);
  zero_acc(acc_dv);

  for (int it = 0; it < w.n_iter; ++it) {
    const int stage = it % 2;
    pipeline_step(it, w.n_iter, load_q_tile);  // Q_{it+1}, dO_{it+1} in flight; Q_it, dO_it landed

    const Element* sQ = sQ0 + stage * T::kTileQ;
    const Element* sdO = sdO0 + stage * T::kTileQ;
    const float* sLse = sLse0 + stage * kBlockM;
    const float* sDsum = sDsum0 + stage * kBlockM;
    const int m0 = w.m0(it);

    // Alg. 2 line 11 (transposed): S^T = K_j Q_i^T, this warp's kWarpRows K rows x kBlockM Q rows.
    float acc_s[kMA][T::kNBlkM][4];
    zero_acc(acc_s);
    gemm_abt_smem<kMA, T::kNBlkM, kHeadDim>(acc_s, sK, kWarpRows * warp_n, sQ, lane);

    // Alg. 2 line 12: P^T = exp2(S^T scale_log2 - lse_log2) in place (fp32; masked pairs -> 0).
    const bool need_mask = params.is_causal && w.n0 + kBlockN - 1 > m0 + w.off;
#pragma unroll
    for (int nb = 0; nb < T::kNBlkM; ++nb) {
      const int mc = nb * 8 + 2 * t;  // tile column (Q row) of e = 0; e = 1 is mc + 1
      const float2 lse2 = *reinterpret_cast<const float2*>(sLse + mc);
#pragma unroll
      for (int ma = 0; ma < kMA; ++ma) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float x = acc_s[ma][nb][e] * params.scale_softmax_log2 - ((e % 2) ? lse2.y : lse2.x);
          if (need_mask) {
            const int key = w.n0 + kWarpRows * warp_n + g + 8 * (e / 2) + 16 * ma;
            const int query = m0 + mc + (e % 2);
            if (key > query + w.off) x = -INFINITY;
          }
          acc_s[ma][nb][e] = fast_exp2(x);
        }
      }
    }
    // P^T as Element A fragments (k16 slices of Q rows, per atom) for dV += P^T dO.
    uint32_t a_p[kBlockM / 16][kMA][4];
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
#pragma unroll
      for (int ma = 0; ma < kMA; ++ma) acc_to_a_frag<T::kNBlkM, Element>(a_p[kk][ma], acc_s[ma], kk);
    }

    // Alg. 2 line 14 (transposed): dP^T = V_j dO_i^T.
    float acc_dp[kMA][T::kNBlkM][4];
    zero_acc(acc_dp);
    gemm_abt_smem<kMA, T::kNBlkM, kHeadDim>(acc_dp, sV, kWarpRows * warp_n, sdO, lane);

    // Alg. 2 line 15: dS^T = P^T o (dP^T - D) in place (D broadcast along the K rows). With
    // kPRounded, P^T is read back from its Element fragments (what the baseline's softmax
    // backward also uses) so the fp32 copy is dead during the dP^T product: 16 fewer registers.
#pragma unroll
    for (int nb = 0; nb < T::kNBlkM; ++nb) {
      const float2 dsum2 = *reinterpret_cast<const float2*>(sDsum + nb * 8 + 2 * t);
#pragma unroll
      for (int ma = 0; ma < kMA; ++ma) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // h: row g (e = 0,1) or g + 8 (e = 2,3)
          float2 p;
          if constexpr (T::kPRounded) {
            p = unpack2<Element>(a_p[nb / 2][ma][(nb % 2) * 2 + h]);
          } else {
            p = make_float2(acc_s[ma][nb][2 * h], acc_s[ma][nb][2 * h + 1]);
          }
          acc_dp[ma][nb][2 * h] = p.x * (acc_dp[ma][nb][2 * h] - dsum2.x);
          acc_dp[ma][nb][2 * h + 1] = p.y * (acc_dp[ma][nb][2 * h + 1] - dsum2.y);
        }
      }
    }

    // Alg. 2 lines 13 and 17: dV_j += P^T dO_i, dK_j += dS^T Q_i, with P^T / dS^T as
    // register A fragments (k = Q rows) and dO_i / Q_i as ldmatrix.trans B fragments.
#pragma unroll
    for (int kk = 0; kk < kBlockM / 16; ++kk) {
      uint32_t a_ds[kMA][4];
#pragma unroll
      for (int ma = 0; ma < kMA; ++ma) acc_to_a_frag<T::kNBlkM, Element>(a_ds[ma], acc_dp[ma], kk);
      gemm_ab_trans_smem<kMA, T::kNBlkD, kPitch>(acc_dv, a_p[kk], sdO, 16 * kk, T::kDW * warp_d, lane);
      gemm_ab_trans_smem<kMA, T::kNBlkD, kPitch>(acc_dk, a_ds, sQ, 16 * kk, T::kDW * warp_d, lane);
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }

  // Alg. 2 line 19: write dK_j (times softmax_scale: S was scaled) and dV_j, staged through the
  // K/V buffers (no copy may still be writing them) for coalesced 16-byte stores.
  cp_async_wait<0>();
  __syncthreads();
#pragma unroll
  for (int ma = 0; ma < kMA; ++ma) {
    store_acc_to_smem<T::kNBlkD, kPitch>(sK, acc_dk[ma], kWarpRows * warp_n + 16 * ma, T::kDW * warp_d,
                                         float(params.scale_softmax), lane);
    store_acc_to_smem<T::kNBlkD, kPitch>(sV, acc_dv[ma], kWarpRows * warp_n + 16 * ma, T::kDW * warp_d, 1.f,
                                         lane);
  }
  __syncthreads();
  Element* dk_tile = reinterpret_cast<Element*>(params.dk_ptr) + w.bidb * params.dk_batch_stride +
                     w.bidhk * params.dk_head_stride + w.n0 * params.dk_row_stride;
  Element* dv_tile = reinterpret_cast<Element*>(params.dv_ptr) + w.bidb * params.dv_batch_stride +
                     w.bidhk * params.dv_head_stride + w.n0 * params.dv_row_stride;
  store_tile<Tile, kBlockN, kHeadDim, kThreads>(
      dk_tile, params.dk_row_stride, sK, params.seqlen_k - w.n0, params.d, tid);
  store_tile<Tile, kBlockN, kHeadDim, kThreads>(
      dv_tile, params.dv_row_stride, sV, params.seqlen_k - w.n0, params.d, tid);
}

}  // namespace bwd
}  // namespace flash
