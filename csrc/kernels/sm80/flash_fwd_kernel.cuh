// FlashAttention-2 forward kernel (Dao 2023, "FlashAttention-2", Algorithm 1) for every SM >= 8.0:
// mma.sync.m16n8k16 tensor cores, ldmatrix operand loads, cp.async K/V streaming.
//
// One CTA = one (query tile of kBlockM rows, batch, head). Warp w owns kBlockM/kNWarps query
// rows (kMAtoms m16 atoms) and all head-dim columns of the output, so the online softmax of a
// row never leaves its quad of lanes and P goes from the S accumulators straight into the A
// operand of P·V (no shared-memory round trip).
//
// Shared memory: Q [kBlockM][kHeadDim+8], K [kBlockN][kHeadDim+8], V [kBlockN][kHeadDim+8];
// the +8 element (16 B) row padding puts the 8 rows of every ldmatrix 8x8 matrix on 8 distinct
// 4-bank groups (row pitch = 4 mod 32 words, or 20 mod 32 for d 32/96): conflict-free.
//
// Pipeline (FA2 scheme, cp.async groups always drained with wait_group 0):
//   prologue      : issue Q, K_last                                   [1 group]
//   per K tile j  : wait + barrier  (K_j landed, every warp done with V_{j+1})
//                   issue V_j                                         [1 group]
//                   S = Q K_j^T            (overlaps V_j's load)
//                   wait + barrier  (V_j landed, every warp done with K_j)
//                   issue K_{j-1}                                     [1 group, if j > 0]
//                   softmax, O += P V_j    (overlaps K_{j-1}'s load)
// K tiles run from the last to the first, so the tiles that need a mask (crossing the causal
// diagonal or the seqlen_k edge) come first; the rest skip the mask code (a CTA-uniform branch:
// one loop body keeps the register footprint spill-free, see tile_config.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "flash.h"
#include "kernels/sm80/tile_config.h"
#include "primitives/cp_async.cuh"
#include "primitives/ldmatrix.cuh"
#include "primitives/mask.cuh"
#include "primitives/math.cuh"
#include "primitives/mma.cuh"
#include "primitives/softmax.cuh"

namespace flash {

// Config defaults to the production row of tile_config.h; the tuning harness
// (benchmarks/tune_kernels.cu) instantiates other TileConfigs to compare them in one binary.
template <typename Element_, int kHeadDim_, typename Config_ = FwdTileConfigSm80<kHeadDim_>>
struct FwdKernelTraits {
  using Element = Element_;
  using Config = Config_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kNWarps = Config::kNWarps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr bool kQInRegs = Config::kQInRegs;
  static constexpr int kMinBlocks = Config::kMinBlocks;

  static constexpr int kWarpRows = kBlockM / kNWarps;  // query rows per warp
  static constexpr int kMAtoms = kWarpRows / 16;       // m16 atoms per warp
  static constexpr int kNAtoms = kBlockN / 8;          // n8 atoms of S (keys)
  static constexpr int kDAtoms = kHeadDim / 8;         // n8 atoms of O (head dim)
  static constexpr int kQKSteps = kHeadDim / 16;       // k16 steps of Q K^T
  static constexpr int kPVSteps = kBlockN / 16;        // k16 steps of P V

  static constexpr int kSmemStride = kHeadDim + 8;  // elements per padded smem row
  static constexpr int kSmemQ = kBlockM * kSmemStride;
  static constexpr int kSmemKV = kBlockN * kSmemStride;
  static constexpr int kSmemBytes = (kSmemQ + 2 * kSmemKV) * int(sizeof(Element));
  static constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks per row

  static_assert(kHeadDim % 16 == 0 && kHeadDim <= 256, "head dim: multiple of 16, <= 256");
  static_assert(kWarpRows % 16 == 0 && kMAtoms >= 1, "each warp owns whole m16 atoms");
  static_assert(kBlockN % 16 == 0, "BLOCK_N: multiple of 16");
  static_assert(Config::kStages == 1, "only the FA2 one-K/one-V-buffer pipeline is implemented");
  static_assert((kBlockM * kChunksPerRow) % kNThreads == 0, "Q tile: whole chunks per thread");
  static_assert((kBlockN * kChunksPerRow) % kNThreads == 0, "K/V tile: whole chunks per thread");
};

// cp.async a [kRows][kHeadDim] tile (row r at gmem + r*row_stride) into padded shared memory.
// Rows >= rows_valid and columns >= d are zero-filled (ragged edges, padded head dim).
// Thread tid copies the 16-byte chunks c = tid + i*kNThreads, c = row*kChunksPerRow + col/8.
// kRowPred = false: the caller guarantees rows_valid >= kRows (a full tile: no row tests).
// The source of a zero-fill copy is never read, but is kept a valid address (the tile base).
template <typename Traits, int kRows, bool kRowPred>
__device__ __forceinline__ void load_tile_async_impl(typename Traits::Element* smem,
                                                     const typename Traits::Element* gmem,
                                                     int64_t row_stride, int rows_valid, int d) {
  using Element = typename Traits::Element;
  constexpr int kChunks = kRows * Traits::kChunksPerRow;
  constexpr int kIters = kChunks / Traits::kNThreads;
  if constexpr (Traits::kNThreads % Traits::kChunksPerRow == 0) {
    // Every pass moves whole rows: the thread's column is fixed, its row advances by kRowStep.
    // One pointer + a step keeps the address math out of the register budget; a column
    // past d uses step 0, so its (never read) source stays the tile base.
    constexpr int kRowStep = Traits::kNThreads / Traits::kChunksPerRow;
    const int row0 = int(threadIdx.x) / Traits::kChunksPerRow;
    const int col = (int(threadIdx.x) % Traits::kChunksPerRow) * 8;
    const bool col_ok = col < d;
    const Element* src = col_ok ? gmem + row0 * row_stride + col : gmem;
    const int64_t src_step = col_ok ? kRowStep * row_stride : 0;
    const uint32_t dst = smem_u32addr(smem + row0 * Traits::kSmemStride + col);
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      constexpr int kDstStep = kRowStep * Traits::kSmemStride * int(sizeof(Element));
      if constexpr (kRowPred) {
        const bool pred = col_ok && row0 + i * kRowStep < rows_valid;
        cp_async_16(dst + i * kDstStep, pred ? src + i * src_step : gmem, pred);
      } else {
        cp_async_16(dst + i * kDstStep, src + i * src_step, col_ok);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < kIters; ++i) {
      const int c = int(threadIdx.x) + i * Traits::kNThreads;
      const int row = c / Traits::kChunksPerRow;
      const int col = (c % Traits::kChunksPerRow) * 8;
      const bool pred = (!kRowPred || row < rows_valid) && col < d;
      cp_async_16(smem_u32addr(smem + row * Traits::kSmemStride + col),
                  pred ? gmem + row * row_stride + col : gmem, pred);
    }
  }
}

template <typename Traits, int kRows>
__device__ __forceinline__ void load_tile_async(typename Traits::Element* smem,
                                                const typename Traits::Element* gmem,
                                                int64_t row_stride, int rows_valid, int d) {
  if (rows_valid >= kRows) {
    load_tile_async_impl<Traits, kRows, false>(smem, gmem, row_stride, rows_valid, d);
  } else {
    load_tile_async_impl<Traits, kRows, true>(smem, gmem, row_stride, rows_valid, d);
  }
}

template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocks)
    flash_fwd_kernel(const Flash_fwd_params params) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  constexpr int kMAtoms = Traits::kMAtoms, kNAtoms = Traits::kNAtoms, kDAtoms = Traits::kDAtoms;
  constexpr int kStride = Traits::kSmemStride;
  constexpr int kStrideBytes = kStride * int(sizeof(Element));

  extern __shared__ __align__(16) unsigned char smem_raw[];
  Element* sQ = reinterpret_cast<Element*>(smem_raw);
  Element* sK = sQ + Traits::kSmemQ;
  Element* sV = sK + Traits::kSmemKV;

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int warp_row0 = warp * Traits::kWarpRows;  // warp's first row inside the Q tile

  // ---- Which tile: blockIdx.x = (b*h + head) * num_m_blocks + (num_m_blocks-1-m_block), so the
  // heaviest causal tiles (largest m_block) start first. 64-bit throughout.
  const int seqlen_q = params.seqlen_q, seqlen_k = params.seqlen_k, d = params.d;
  const int num_m_blocks = (seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t bid = blockIdx.x;
  const int m_block = num_m_blocks - 1 - int(bid % num_m_blocks);
  const int64_t bh = bid / num_m_blocks;  // b*h + head: also the LSE row-block index
  const int bidb = int(bh / params.h), bidh = int(bh % params.h);
  const int bidh_k = bidh / params.h_h_k_ratio;  // GQA/MQA: shared K/V head, never copied

  const int row_start = m_block * kBlockM;
  const int rows_q = min(kBlockM, seqlen_q - row_start);  // valid rows of this Q tile
  const Element* gQ = reinterpret_cast<const Element*>(params.q_ptr) + bidb * params.q_batch_stride +
                      int64_t(row_start) * params.q_row_stride + bidh * params.q_head_stride;
  const Element* gK = reinterpret_cast<const Element*>(params.k_ptr) + bidb * params.k_batch_stride +
                      bidh_k * params.k_head_stride;
  const Element* gV = reinterpret_cast<const Element*>(params.v_ptr) + bidb * params.v_batch_stride +
                      bidh_k * params.v_head_stride;
  Element* gO = reinterpret_cast<Element*>(params.o_ptr) + bidb * params.o_batch_stride +
                int64_t(row_start) * params.o_row_stride + bidh * params.o_head_stride;
  float* gLse = params.softmax_lse_ptr + bh * seqlen_q + row_start;

  // ---- K tile range. Causal (bottom-right): query i sees key j <= i + causal_offset.
  const bool causal = params.is_causal;
  const int causal_offset = seqlen_k - seqlen_q;
  int n_block_max = (seqlen_k + kBlockN - 1) / kBlockN;  // exclusive
  // Tiles [0, n_unmasked) need no mask: fully inside seqlen_k and, if causal, fully left of the
  // diagonal for the tile's first row: (n+1)*kBlockN - 1 <= row_start + causal_offset.
  int n_unmasked = seqlen_k / kBlockN;
  if (causal) {
    // Keys visible to the tile's last row: j < row_start + rows_q + causal_offset.
    const int last_visible = row_start + rows_q + causal_offset;  // exclusive; may be <= 0
    n_block_max = min(n_block_max, last_visible <= 0 ? 0 : (last_visible + kBlockN - 1) / kBlockN);
    n_unmasked = min(n_unmasked, max(0, row_start + causal_offset + 1) / kBlockN);
  }

  if (n_block_max <= 0) {
    // Causal with seqlen_q > seqlen_k: no row of this tile sees a key. out = 0, lse = +inf.
#pragma unroll
    for (int i = 0; i < kBlockM * Traits::kChunksPerRow / Traits::kNThreads; ++i) {
      const int c = tid + i * Traits::kNThreads;
      const int row = c / Traits::kChunksPerRow, col = (c % Traits::kChunksPerRow) * 8;
      if (row < rows_q && col < d) {
        *reinterpret_cast<uint4*>(gO + row * params.o_row_stride + col) = make_uint4(0, 0, 0, 0);
      }
    }
    for (int row = tid; row < rows_q; row += Traits::kNThreads) gLse[row] = INFINITY;
    return;
  }

  // ---- Prologue: Q tile (loaded once, FA2 Alg. 1 line 4) and the first K tile, one group.
  load_tile_async<Traits, kBlockM>(sQ, gQ, params.q_row_stride, rows_q, d);
  {
    const int n = n_block_max - 1;
    load_tile_async<Traits, kBlockN>(sK, gK + int64_t(n) * kBlockN * params.k_row_stride,
                                     params.k_row_stride, seqlen_k - n * kBlockN, d);
  }
  cp_async_commit();

  // Per-lane ldmatrix addresses (primitives/ldmatrix.cuh recipes).
  // Q, A operand of a 16x16 block: row = lane%16, col = (lane/16)*8.
  const uint32_t q_addr =
      smem_u32addr(sQ + (warp_row0 + lane % 16) * kStride + (lane / 16) * 8);
  // K as the [n][k] B operand, two n8 blocks: n = (lane/16)*8 + lane%8, k = ((lane/8)%2)*8.
  const uint32_t k_addr =
      smem_u32addr(sK + ((lane / 16) * 8 + lane % 8) * kStride + ((lane / 8) % 2) * 8);
  // V as the [k][n] B operand (.trans), two n8 blocks: k = lane%16, n = (lane/16)*8.
  const uint32_t v_addr = smem_u32addr(sV + (lane % 16) * kStride + (lane / 16) * 8);

  // Q A-fragments kept in registers when the table says so (small head dims).
  uint32_t q_frag[Traits::kQInRegs ? kMAtoms : 1][Traits::kQInRegs ? Traits::kQKSteps : 1][4];
  if constexpr (Traits::kQInRegs) {
    cp_async_wait<0>();
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < kMAtoms; ++mi) {
#pragma unroll
      for (int kk = 0; kk < Traits::kQKSteps; ++kk) {
        ldmatrix_x4(q_frag[mi][kk], q_addr + mi * 16 * kStrideBytes + kk * 32);
      }
    }
  }

  float acc_o[kMAtoms][kDAtoms][4];  // FA2 Alg. 1 line 5: O = 0
#pragma unroll
  for (int mi = 0; mi < kMAtoms; ++mi)
#pragma unroll
    for (int di = 0; di < kDAtoms; ++di)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc_o[mi][di][e] = 0.f;
  OnlineSoftmax<kMAtoms> softmax;  // m = -inf, l = 0
  const float scale_log2 = params.scale_softmax_log2;

  // FA2 Alg. 1 lines 6-11: loop over K/V tiles, last to first (the masked tiles come first).
#pragma unroll 1
  for (int n = n_block_max - 1; n >= 0; --n) {
    float s[kMAtoms][kNAtoms][4];
#pragma unroll
    for (int mi = 0; mi < kMAtoms; ++mi)
#pragma unroll
      for (int ni = 0; ni < kNAtoms; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mi][ni][e] = 0.f;

    cp_async_wait<0>();  // K_n landed (this thread's copies) ...
    __syncthreads();     // ... everyone's; and every warp finished P V_{n+1}: V buffer free
    load_tile_async<Traits, kBlockN>(sV, gV + int64_t(n) * kBlockN * params.v_row_stride,
                                     params.v_row_stride, seqlen_k - n * kBlockN, d);
    cp_async_commit();

    // Alg. 1 line 8: S = Q K_n^T (unscaled; the scale goes into exp2).
#pragma unroll
    for (int kk = 0; kk < Traits::kQKSteps; ++kk) {
      uint32_t a[kMAtoms][4];
#pragma unroll
      for (int mi = 0; mi < kMAtoms; ++mi) {
        if constexpr (Traits::kQInRegs) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mi][e] = q_frag[mi][kk][e];
        } else {
          ldmatrix_x4(a[mi], q_addr + mi * 16 * kStrideBytes + kk * 32);
        }
      }
#pragma unroll
      for (int np = 0; np < kNAtoms / 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, k_addr + np * 16 * kStrideBytes + kk * 32);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
        for (int mi = 0; mi < kMAtoms; ++mi) {
          mma_m16n8k16<Element>(s[mi][2 * np], a[mi], b0);
          mma_m16n8k16<Element>(s[mi][2 * np + 1], a[mi], b1);
        }
      }
    }

    // Only tiles crossing the causal diagonal or the seqlen_k edge run mask code; the branch is
    // uniform over the CTA, so tiles below the diagonal pay nothing for it.
    if (n >= n_unmasked) {
      apply_mask(s, row_start + warp_row0, n * kBlockN, seqlen_k, causal, causal_offset);
    }

    cp_async_wait<0>();  // V_n landed ...
    __syncthreads();     // ... everyone's; and every warp finished reading K_n: K buffer free
    if (n > 0) {
      load_tile_async<Traits, kBlockN>(sK, gK + int64_t(n - 1) * kBlockN * params.k_row_stride,
                                       params.k_row_stride, seqlen_k - (n - 1) * kBlockN, d);
      cp_async_commit();
    }

    // Alg. 1 lines 9-10: m, P = exp2(...), l, O *= alpha.
    softmax.update(s, acc_o, scale_log2);

    // Alg. 1 line 10: O += P V_n. The S accumulator of n8 atoms 2kk, 2kk+1 is exactly the
    // A fragment of k16 step kk: a0 = P[g][2t..], a1 = P[g+8][2t..], a2/a3 the same 8 keys on.
#pragma unroll
    for (int kk = 0; kk < Traits::kPVSteps; ++kk) {
      uint32_t a[kMAtoms][4];
#pragma unroll
      for (int mi = 0; mi < kMAtoms; ++mi) {
        a[mi][0] = pack2<Element>(s[mi][2 * kk][0], s[mi][2 * kk][1]);
        a[mi][1] = pack2<Element>(s[mi][2 * kk][2], s[mi][2 * kk][3]);
        a[mi][2] = pack2<Element>(s[mi][2 * kk + 1][0], s[mi][2 * kk + 1][1]);
        a[mi][3] = pack2<Element>(s[mi][2 * kk + 1][2], s[mi][2 * kk + 1][3]);
      }
#pragma unroll
      for (int dp = 0; dp < kDAtoms / 2; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, v_addr + kk * 16 * kStrideBytes + dp * 32);
        const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
#pragma unroll
        for (int mi = 0; mi < kMAtoms; ++mi) {
          mma_m16n8k16<Element>(acc_o[mi][2 * dp], a[mi], b0);
          mma_m16n8k16<Element>(acc_o[mi][2 * dp + 1], a[mi], b1);
        }
      }
    }
  }

  // ---- Epilogue (Alg. 1 lines 12-13): O = acc_o / l, LSE = m + log(l).
  float lse[2 * kMAtoms];
  softmax.finalize(acc_o, scale_log2, lse);

  __syncthreads();  // every warp is done reading Q/K/V smem: reuse sQ to stage O
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int mi = 0; mi < kMAtoms; ++mi) {
    const int row = warp_row0 + mi * 16 + g;
#pragma unroll
    for (int di = 0; di < kDAtoms; ++di) {
      const int col = di * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(sQ + row * kStride + col) =
          pack2<Element>(acc_o[mi][di][0], acc_o[mi][di][1]);
      *reinterpret_cast<uint32_t*>(sQ + (row + 8) * kStride + col) =
          pack2<Element>(acc_o[mi][di][2], acc_o[mi][di][3]);
    }
  }
  __syncthreads();
  // Coalesced 16-byte stores of the valid rows / head-dim columns.
#pragma unroll
  for (int i = 0; i < kBlockM * Traits::kChunksPerRow / Traits::kNThreads; ++i) {
    const int c = tid + i * Traits::kNThreads;
    const int row = c / Traits::kChunksPerRow, col = (c % Traits::kChunksPerRow) * 8;
    if (row < rows_q && col < d) {
      *reinterpret_cast<uint4*>(gO + row * params.o_row_stride + col) =
          *reinterpret_cast<const uint4*>(sQ + row * kStride + col);
    }
  }
  if (t == 0) {
#pragma unroll
    for (int mi = 0; mi < kMAtoms; ++mi) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = warp_row0 + mi * 16 + g + h * 8;
        if (row < rows_q) gLse[row] = lse[2 * mi + h];
      }
    }
  }
}

}  // namespace flash
