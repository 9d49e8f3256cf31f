// FlashAttention-2 backward, dQ kernel: Alg. 2 line 16 (dQ_i += dS_i^(j) K_j) done as its own
// loop over K/V blocks per Q tile instead of FA2's atomicAdd into dQ, so the summation order is
// fixed and the result bitwise deterministic. Recomputes S and dP (Alg. 2 lines 11-15).
//
// One CTA per (Q tile i of kBlockM rows, batch, query head); warp w owns Q rows
// [kWarpRows*w, +kWarpRows) as kMA = kWarpRows/16 m16 atoms (atom ma: rows +16ma): with
// kWarpRows = 32 every K / V B fragment loaded by ldmatrix feeds two mma (half the shared-memory
// traffic per FLOP, as in the forward kernel).
// Q_i and dO_i stay in shared memory, lse_log2 / D of the thread's two rows in registers;
// K_j, V_j stream through a 2-stage cp.async pipeline:
//   S   = Q_i K_j^T                               (line 11)
//   P   = exp2(S * scale_log2 - lse_log2_i)       (line 12; masked keys -> 0)
//   dP  = dO_i V_j^T                              (line 14)
//   dS  = P o (dP - D_i)                          (line 15)
//   dQ_i += dS K_j                                (line 16; times softmax_scale at the end)
// dS stays in registers: its C fragments are the A fragments of dS K_j (acc_to_a_frag).
//
// Fragment bookkeeping (lane = 4g + t): S acc[ma][nb][e] holds
//   Q row m = m0 + kWarpRows*warp + 16*ma + g + 8*(e/2),  key n = n0 + 8*nb + 2t + (e%2).
// Causal (bottom-right, off = seqlen_k - seqlen_q): the tile's last row m0 + kBlockM - 1 sees keys
// < m0 + kBlockM + off, so key blocks [0, ceil((m0 + kBlockM + off) / kBlockN)) are visited; a
// block needs the mask only if it crosses seqlen_k or j0 + kBlockN - 1 > m0 + off. A row that
// sees no key has every score masked and lse_log2 = +inf: P = dS = 0, dQ row exactly 0.
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

// kWarpRows: Q rows per warp, 16 (one m16 atom) or 32 (two).
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarpRows = 16>
struct DqKernelTraits {
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

// kFastCopy: predicate-free copies of whole K / V tiles (primitives/tile_copy.cuh), used where
// the registers allow it (tile_config_bwd.h).
template <typename Element, int kHeadDim, int kBlockM, int kBlockN, int kWarpRows = 16, bool kFastCopy = true>
__global__ void __launch_bounds__(DqKernelTraits<Element, kHeadDim, kBlockM, kBlockN, kWarpRows>::kThreads, 1)
flash_bwd_dq_kernel(const Flash_bwd_params params) {
  using T = DqKernelTraits<Element, kHeadDim, kBlockM, kBlockN, kWarpRows>;
  using Tile = SmemTile<kHeadDim>;
  constexpr int kMA = T::kMA;
  constexpr bool kPRounded = T::kPRounded;
  constexpr int kPitch = T::kPitch;
  constexpr int kThreads = T::kThreads;

  extern __shared__ __align__(128) unsigned char flash_bwd_smem[];
  Element* sQ = reinterpret_cast<Element*>(flash_bwd_smem);
  Element* sdO = sQ + T::kTileQ;
  Element* sK0 = sdO + T::kTileQ;  // stage s: sK0 + s * kTileKV
  Element* sV0 = sK0 + 2 * T::kTileKV;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;

  // This CTA's Q tile, batch, head and the key blocks its rows see (kernels/bwd_work.cuh).
  const DqWork<kBlockM, kBlockN> w(params);

  const Element* k_base = reinterpret_cast<const Element*>(params.k_ptr) + w.bidb * params.k_batch_stride +
                          w.bidhk * params.k_head_stride;
  const Element* v_base = reinterpret_cast<const Element*>(params.v_ptr) + w.bidb * params.v_batch_stride +
                          w.bidhk * params.v_head_stride;
  // Alg. 2 line 7 (K_j, V_j), into `stage`.
  auto load_kv_tile = [&](int n_block, int stage) {
    const int n0 = n_block * kBlockN;
    copy_tile_async<Tile, kBlockN, kHeadDim, kThreads, kFastCopy>(
        smem_u32addr(sK0 + stage * T::kTileKV), k_base + n0 * params.k_row_stride, params.k_row_stride,
        params.seqlen_k - n0, params.d, tid);
    copy_tile_async<Tile, kBlockN, kHeadDim, kThreads, kFastCopy>(
        smem_u32addr(sV0 + stage * T::kTileKV), v_base + n0 * params.v_row_stride, params.v_row_stride,
        params.seqlen_k - n0, params.d, tid);
  };

  // Alg. 2 line 10: Q_i, dO_i (resident), lse_log2 and D of this thread's rows r and r + 8.
  const Element* q_tile = reinterpret_cast<const Element*>(params.q_ptr) + w.bidb * params.q_batch_stride +
                          w.bidh * params.q_head_stride + w.m0 * params.q_row_stride;
  const Element* do_tile = reinterpret_cast<const Element*>(params.do_ptr) +
                           w.bidb * params.do_batch_stride + w.bidh * params.do_head_stride +
                           w.m0 * params.do_row_stride;
  copy_tile_async<Tile, kBlockM, kHeadDim, kThreads>(
      smem_u32addr(sQ), q_tile, params.q_row_stride, params.seqlen_q - w.m0, params.d, tid);
  copy_tile_async<Tile, kBlockM, kHeadDim, kThreads>(
      smem_u32addr(sdO), do_tile, params.do_row_stride, params.seqlen_q - w.m0, params.d, tid);
  if (w.n_block_max > 0) load_kv_tile(0, 0);
  cp_async_commit();

  const int warp_row0 = kWarpRows * warp;  // first tile row of this warp
  // Query row of atom ma, e = 0,1: row_lo + 16*ma; e = 2,3 are 8 rows further.
  const int row_lo = w.m0 + warp_row0 + g;
  const int64_t ws = (int64_t(w.bidb) * params.h + w.bidh) * params.seqlen_q_rounded;
  float lse_log2[kMA][2], dsum[kMA][2];  // rows < seqlen_q_rounded: whole tiles are in the workspace
#pragma unroll
  for (int ma = 0; ma < kMA; ++ma) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      lse_log2[ma][r] = params.softmax_lse_log2_ptr[ws + row_lo + 16 * ma + 8 * r];
      dsum[ma][r] = params.dsoftmax_sum_ptr[ws + row_lo + 16 * ma + 8 * r];
    }
  }

  float acc_dq[kMA][T::kNBlkD][4];
  zero_acc(acc_dq);

  for (int n_block = 0; n_block < w.n_block_max; ++n_block) {
    const int stage = n_block % 2;
    pipeline_step(n_block, w.n_block_max, load_kv_tile);  // K_{j+1}, V_{j+1} in flight; K_j, V_j landed

    const Element* sK = sK0 + stage * T::kTileKV;
    const Element* sV = sV0 + stage * T::kTileKV;
    const int n0 = n_block * kBlockN;

    // Alg. 2 line 11: S = Q_i K_j^T (this warp's kWarpRows rows x kBlockN keys).
    float acc_s[kMA][T::kNBlkN][4];
    zero_acc(acc_s);
    gemm_abt_smem<kMA, T::kNBlkN, kHeadDim>(acc_s, sQ, warp_row0, sK, lane);

    // Alg. 2 line 12: P = exp2(S scale_log2 - lse_log2), masked keys -> 0.
    const bool need_mask =
        n0 + kBlockN > params.seqlen_k || (params.is_causal && n0 + kBlockN - 1 > w.m0 + w.off);
    // kPRounded: P as Element pairs p_rounded[ma][nb][h] (row g + 8h, keys 8nb + 2t, +1) before
    // dP is computed, so the fp32 S is dead during the dP product.
    uint32_t p_rounded[kPRounded ? kMA : 1][kPRounded ? T::kNBlkN : 1][2];
    if constexpr (kPRounded) {
#pragma unroll
      for (int ma = 0; ma < kMA; ++ma) {
#pragma unroll
        for (int nb = 0; nb < T::kNBlkN; ++nb) {
          auto p_of = [&](int e) {
            float x = acc_s[ma][nb][e] * params.scale_softmax_log2 - lse_log2[ma][e / 2];
            if (need_mask) {
              const int key = n0 + nb * 8 + 2 * t + (e % 2);
              const int query = row_lo + 16 * ma + 8 * (e / 2);
              if (key >= params.seqlen_k || (params.is_causal && key > query + w.off)) x = -INFINITY;
            }
            return fast_exp2(x);
          };
#pragma unroll
          for (int h = 0; h < 2; ++h) p_rounded[ma][nb][h] = pack2<Element>(p_of(2 * h), p_of(2 * h + 1));
        }
      }
    }

    // Alg. 2 line 14: dP = dO_i V_j^T.
    float acc_dp[kMA][T::kNBlkN][4];
    zero_acc(acc_dp);
    gemm_abt_smem<kMA, T::kNBlkN, kHeadDim>(acc_dp, sdO, warp_row0, sV, lane);

    // Alg. 2 line 15: dS = P o (dP - D) (in acc_dp; without kPRounded, P (line 12) is made here).
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
            float x = acc_s[ma][nb][e] * params.scale_softmax_log2 - lse_log2[ma][e / 2];
            if (need_mask) {
              const int key = n0 + nb * 8 + 2 * t + (e % 2);
              const int query = row_lo + 16 * ma + 8 * (e / 2);
              if (key >= params.seqlen_k || (params.is_causal && key > query + w.off)) x = -INFINITY;
            }
            p = fast_exp2(x);
          }
          acc_dp[ma][nb][e] = p * (acc_dp[ma][nb][e] - dsum[ma][e / 2]);
        }
      }
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
  Element* dq_tile = reinterpret_cast<Element*>(params.dq_ptr) + w.bidb * params.dq_batch_stride +
                     w.bidh * params.dq_head_stride + w.m0 * params.dq_row_stride;
  store_tile<Tile, kBlockM, kHeadDim, kThreads>(
      dq_tile, params.dq_row_stride, sQ, params.seqlen_q - w.m0, params.d, tid);
}

}  // namespace bwd
}  // namespace flash
