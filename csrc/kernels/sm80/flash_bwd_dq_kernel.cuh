// FlashAttention-2 backward, dQ kernel: Alg. 2 line 16 (dQ_i += dS_i^(j) K_j) done as its own
// loop over K/V blocks per Q tile instead of FA2's atomicAdd into dQ, so the summation order is
// fixed and the result bitwise deterministic. Recomputes S and dP (Alg. 2 lines 11-15).
//
// One CTA per (Q tile i of kBlockM rows, batch, query head); warp w owns Q rows [16w, 16w+16).
// Q_i and dO_i stay in shared memory, lse_log2 / D of the thread's two rows in registers;
// K_j, V_j stream through a 2-stage cp.async pipeline:
//   S   = Q_i K_j^T                               (line 11)
//   P   = exp2(S * scale_log2 - lse_log2_i)       (line 12; masked keys -> 0)
//   dP  = dO_i V_j^T                              (line 14)
//   dS  = P o (dP - D_i)                          (line 15)
//   dQ_i += dS K_j                                (line 16; times softmax_scale at the end)
// dS stays in registers: its C fragments are the A fragments of dS K_j (acc_to_a_frag).
//
// Fragment bookkeeping (lane = 4g + t): S acc[nb][e] holds
//   Q row m = m0 + 16*warp + g + 8*(e/2),  key n = n0 + 8*nb + 2t + (e%2).
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

template <typename Element, int kHeadDim, int kBlockM, int kBlockN>
struct DqKernelTraits {
  static constexpr int kNWarps = kBlockM / 16;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr int kPitch = SmemTile<kHeadDim>::kPitch;
  static constexpr int kNBlkN = kBlockN / 8;    // n8 blocks of S (keys)
  static constexpr int kNBlkD = kHeadDim / 8;   // n8 blocks of dQ
  // Shared layout: sQ, sdO (kBlockM rows), then 2 stages of sK and sV (kBlockN rows).
  static constexpr int kTileQ = kBlockM * kPitch;
  static constexpr int kTileKV = kBlockN * kPitch;
  static constexpr int kSmemBytes = (2 * kTileQ + 4 * kTileKV) * int(sizeof(Element));
  static_assert(kBlockM % 16 == 0 && kBlockN % 16 == 0, "tiles are multiples of the m16/k16 atom");
  static_assert(kHeadDim % 16 == 0, "head dim is a multiple of 16");
  static_assert(128 % kBlockM == 0, "Q tiles must tile the 128-rounded workspaces");
};

template <typename Element, int kHeadDim, int kBlockM, int kBlockN>
__global__ void __launch_bounds__(DqKernelTraits<Element, kHeadDim, kBlockM, kBlockN>::kThreads, 1)
flash_bwd_dq_kernel(const Flash_bwd_params params) {
  using T = DqKernelTraits<Element, kHeadDim, kBlockM, kBlockN>;
  constexpr int kPitch = T::kPitch;
  constexpr int kThreads = T::kThreads;

  extern __shared__ __align__(128) unsigned char flash_bwd_smem[];
  Element* sQ = reinterpret_cast<Element*>(flash_bwd_smem);
  Element* sdO = sQ + T::kTileQ;
  Element* sK0 = sdO + T::kTileQ;  // stage s: sK0 + s * kTileKV
  Element* sV0 = sK0 + 2 * T::kTileKV;

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int g = lane / 4, t = lane % 4;

  // Block index: m_block fastest and reversed, so the heavy (late, under causal) Q tiles go
  // first and CTAs of one (batch, head) run together and share K / V in L2.
  const int num_m_blocks = ceil_div(params.seqlen_q, kBlockM);
  const int m_block = num_m_blocks - 1 - int(blockIdx.x % num_m_blocks);
  const int bh = blockIdx.x / num_m_blocks;
  const int bidb = bh / params.h, bidh = bh % params.h;
  const int bidhk = bidh / params.h_h_k_ratio;
  const int m0 = m_block * kBlockM;
  const int off = params.seqlen_k - params.seqlen_q;

  int n_block_max = ceil_div(params.seqlen_k, kBlockN);
  if (params.is_causal) {
    const int keys_seen = m0 + kBlockM + off;  // keys [0, keys_seen) are visible to some row
    n_block_max = keys_seen <= 0 ? 0 : min(n_block_max, ceil_div(keys_seen, kBlockN));
  }

  const Element* k_base = reinterpret_cast<const Element*>(params.k_ptr) + bidb * params.k_batch_stride +
                          bidhk * params.k_head_stride;
  const Element* v_base = reinterpret_cast<const Element*>(params.v_ptr) + bidb * params.v_batch_stride +
                          bidhk * params.v_head_stride;
  // Alg. 2 line 7 (K_j, V_j), into `stage`.
  auto load_kv_tile = [&](int n_block, int stage) {
    const int n0 = n_block * kBlockN;
    load_tile_async<kBlockN, kHeadDim, kThreads>(sK0 + stage * T::kTileKV,
                                                 k_base + n0 * params.k_row_stride,
                                                 params.k_row_stride, params.seqlen_k - n0,
                                                 params.d, tid);
    load_tile_async<kBlockN, kHeadDim, kThreads>(sV0 + stage * T::kTileKV,
                                                 v_base + n0 * params.v_row_stride,
                                                 params.v_row_stride, params.seqlen_k - n0,
                                                 params.d, tid);
  };

  // Alg. 2 line 10: Q_i, dO_i (resident), lse_log2 and D of this thread's rows r and r + 8.
  const Element* q_tile = reinterpret_cast<const Element*>(params.q_ptr) + bidb * params.q_batch_stride +
                          bidh * params.q_head_stride + m0 * params.q_row_stride;
  const Element* do_tile = reinterpret_cast<const Element*>(params.do_ptr) +
                           bidb * params.do_batch_stride + bidh * params.do_head_stride +
                           m0 * params.do_row_stride;
  load_tile_async<kBlockM, kHeadDim, kThreads>(sQ, q_tile, params.q_row_stride,
                                               params.seqlen_q - m0, params.d, tid);
  load_tile_async<kBlockM, kHeadDim, kThreads>(sdO, do_tile, params.do_row_stride,
                                               params.seqlen_q - m0, params.d, tid);
  if (n_block_max > 0) load_kv_tile(0, 0);
  cp_async_commit();

  const int row_lo = m0 + 16 * warp + g;  // query rows of e = 0,1; e = 2,3 are row_lo + 8
  const int64_t ws = (int64_t(bidb) * params.h + bidh) * params.seqlen_q_rounded;
  float lse_log2[2], dsum[2];  // rows < seqlen_q_rounded: whole tiles are in the workspace
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    lse_log2[r] = params.softmax_lse_log2_ptr[ws + row_lo + 8 * r];
    dsum[r] = params.dsoftmax_sum_ptr[ws + row_lo + 8 * r];
  }

  float acc_dq[T::kNBlkD][4];
  zero_acc(acc_dq);

  for (int n_block = 0; n_block < n_block_max; ++n_block) {
    const int stage = n_block % 2;
    // Prefetch K_{j+1}, V_{j+1} into the stage freed at the end of the previous iteration;
    // one (possibly empty) group per iteration, so wait_group 1 = "all but the prefetch".
    if (n_block + 1 < n_block_max) load_kv_tile(n_block + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    const Element* sK = sK0 + stage * T::kTileKV;
    const Element* sV = sV0 + stage * T::kTileKV;
    const int n0 = n_block * kBlockN;

    // Alg. 2 line 11: S = Q_i K_j^T (this warp's 16 rows x kBlockN keys).
    float acc_s[T::kNBlkN][4];
    zero_acc(acc_s);
    gemm_abt_smem<T::kNBlkN, kHeadDim>(acc_s, sQ, 16 * warp, sK, lane);
    // Alg. 2 line 14: dP = dO_i V_j^T.
    float acc_dp[T::kNBlkN][4];
    zero_acc(acc_dp);
    gemm_abt_smem<T::kNBlkN, kHeadDim>(acc_dp, sdO, 16 * warp, sV, lane);

    // Alg. 2 lines 12 and 15: P = exp2(S scale_log2 - lse_log2), dS = P o (dP - D) (in acc_dp).
    const bool need_mask =
        n0 + kBlockN > params.seqlen_k || (params.is_causal && n0 + kBlockN - 1 > m0 + off);
#pragma unroll
    for (int nb = 0; nb < T::kNBlkN; ++nb) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = acc_s[nb][e] * params.scale_softmax_log2 - lse_log2[e / 2];
        if (need_mask) {
          const int key = n0 + nb * 8 + 2 * t + (e % 2);
          const int query = row_lo + 8 * (e / 2);
          if (key >= params.seqlen_k || (params.is_causal && key > query + off)) x = -INFINITY;
        }
        const float p = fast_exp2(x);
        acc_dp[nb][e] = p * (acc_dp[nb][e] - dsum[e / 2]);
      }
    }

    // Alg. 2 line 16: dQ_i += dS K_j (A = dS from registers, B = K_j via ldmatrix.trans).
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      uint32_t a_ds[4];
      acc_to_a_frag<T::kNBlkN, Element>(a_ds, acc_dp, kk);
      gemm_ab_trans_smem<T::kNBlkD, kPitch>(acc_dq, a_ds, sK, 16 * kk, 0, lane);
    }
    __syncthreads();  // every warp is done with this stage before it is refilled
  }

  // Write dQ_i (times softmax_scale), staged through sQ for coalesced 16-byte stores.
  cp_async_wait<0>();
  __syncthreads();
  store_acc_to_smem<T::kNBlkD, kPitch>(sQ, acc_dq, 16 * warp, 0, params.scale_softmax, lane);
  __syncthreads();
  Element* dq_tile = reinterpret_cast<Element*>(params.dq_ptr) + bidb * params.dq_batch_stride +
                     bidh * params.dq_head_stride + m0 * params.dq_row_stride;
  store_tile<kBlockM, kHeadDim, kThreads>(dq_tile, params.dq_row_stride, sQ, params.seqlen_q - m0,
                                          params.d, tid);
}

}  // namespace bwd
}  // namespace flash
