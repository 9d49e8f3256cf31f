// Shared-memory helpers of the sm80 kernels (forward, dK/dV, dQ), and the one include of their
// headers (the work split, mask, softmax, primitives, tile table, launch): the tile layout, mma C
// fragments -> shared memory, and the ldmatrix-fed mma.sync products of the backward kernels.
// Global <-> shared tile copies are primitives/tile_copy.cuh with the SmemTile layout below; the
// CTA's work split is kernels/common/work.cuh.
//
// Shared tiles are row-major with a row pitch of kHeadDim + 8 elements: the 16-byte pad puts
// the 8 row addresses of every ldmatrix 8x8 matrix in 8 distinct 4-bank groups (pitch in
// 32-bit words = kHeadDim/2 + 4 = 4 or 20 mod 32), so ldmatrix and the fragment stores below
// are bank-conflict free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "flash.h"
#include "kernels/arch.h"
#include "kernels/common/long_rows.cuh"
#include "kernels/common/work.cuh"
#include "kernels/launch_utils.h"
#include "kernels/sm80/tile_config.h"
#include "primitives/cp_async.cuh"
#include "primitives/ldmatrix.cuh"
#include "primitives/math.cuh"
#include "primitives/mma.cuh"
#include "primitives/philox.cuh"
#include "primitives/softmax.cuh"
#include "primitives/tile_copy.cuh"

namespace flash {
namespace sm80 {

// Shared tile layout of the sm80 kernels (the Layout of primitives/tile_copy.cuh): row-major,
// kPitch elements per row.
template <int kHeadDim>
struct SmemTile {
  static constexpr int kPitch = kHeadDim + 8;  // elements per shared row
  static constexpr int kRowAlign = 1, kRowBytes = kPitch * 2;
  __device__ __forceinline__ static uint32_t offset(int r, int c) { return uint32_t(r * kPitch + c) * 2; }
};

// Writes a warp's fp32 accumulator tile (16 rows x kNBlk*8 columns, mma C fragments:
// acc[nb][0..1] = C[g][nb*8 + 2t..+1], acc[nb][2..3] = C[g+8][nb*8 + 2t..+1], lane = 4g + t)
// times `scale` into a shared tile at (row0, col0), converted to Element.
template <int kNBlk, int kPitch, typename Element>
__device__ __forceinline__ void store_acc_to_smem(Element* smem, const float (&acc)[kNBlk][4],
                                                  int row0, int col0, float scale, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nb = 0; nb < kNBlk; ++nb) {
    Element* p = smem + (row0 + g) * kPitch + col0 + nb * 8 + 2 * t;
    *reinterpret_cast<uint32_t*>(p) = pack2<Element>(acc[nb][0] * scale, acc[nb][1] * scale);
    *reinterpret_cast<uint32_t*>(p + 8 * kPitch) =
        pack2<Element>(acc[nb][2] * scale, acc[nb][3] * scale);
  }
}

// acc[ma] (16 x kNBlk*8, C fragments) += A (16 x kHeadDim, rows [a_row0 + 16ma, +16) of a shared
// [row][d] tile) * B^T for ma < kMA, where B is a shared [n][d] tile (rows [0, kNBlk*8)): the
// "S = Q K^T" shape. A comes through ldmatrix (A recipe), B through non-transposed ldmatrix
// (K-like recipe, primitives/ldmatrix.cuh), one x4 giving the k16 fragments of two n8 blocks,
// which feed all kMA m16 atoms of the warp (kMA = 2 halves the B traffic per mma).
template <int kMA, int kNBlk, int kHeadDim, typename Element>
__device__ __forceinline__ void gemm_abt_smem(float (&acc)[kMA][kNBlk][4], const Element* sA,
                                              int a_row0, const Element* sB, int lane) {
  constexpr int kPitch = SmemTile<kHeadDim>::kPitch;
  static_assert(kNBlk % 2 == 0, "n8 blocks come in pairs (ldmatrix x4)");
  const Element* a_ptr = sA + (a_row0 + lane % 16) * kPitch + (lane / 16) * 8;
  const Element* b_ptr = sB + ((lane / 16) * 8 + lane % 8) * kPitch + ((lane / 8) % 2) * 8;
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
    uint32_t a[kMA][4];
#pragma unroll
    for (int ma = 0; ma < kMA; ++ma) ldmatrix_x4(a[ma], smem_u32addr(a_ptr + ma * 16 * kPitch + kk * 16));
#pragma unroll
    for (int nb2 = 0; nb2 < kNBlk / 2; ++nb2) {
      uint32_t b[4];
      ldmatrix_x4(b, smem_u32addr(b_ptr + nb2 * 16 * kPitch + kk * 16));
      mma_m16n16k16<Element>(acc, 2 * nb2, a, b);
    }
  }
}

// acc[ma] (16 x kNBlkD*8 columns [col0, col0 + kNBlkD*8) of d) += A[ma] (16 x 16) * B for
// ma < kMA, B = rows [k0, k0+16) of a shared [k][d] tile, read with ldmatrix.trans (V-like
// recipe): the "O += P V", "dV += P^T dO", "dQ += dS K" shape. Each B x4 feeds 2*kMA mma.
template <int kMA, int kNBlkD, int kPitch, typename Element>
__device__ __forceinline__ void gemm_ab_trans_smem(float (&acc)[kMA][kNBlkD][4],
                                                   const uint32_t (&a)[kMA][4], const Element* sB,
                                                   int k0, int col0, int lane) {
  static_assert(kNBlkD % 2 == 0, "d8 blocks come in pairs (ldmatrix x4)");
  const Element* b_ptr = sB + (k0 + ((lane / 8) % 2) * 8 + lane % 8) * kPitch + col0 + (lane / 16) * 8;
#pragma unroll
  for (int db2 = 0; db2 < kNBlkD / 2; ++db2) {
    uint32_t b[4];
    ldmatrix_x4_trans(b, smem_u32addr(b_ptr + db2 * 16));
    mma_m16n16k16<Element>(acc, 2 * db2, a, b);
  }
}

template <int kA, int kRows, int kCols>
__device__ __forceinline__ void zero_acc(float (&acc)[kA][kRows][kCols]) {
#pragma unroll
  for (int a = 0; a < kA; ++a) {
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
#pragma unroll
      for (int j = 0; j < kCols; ++j) acc[a][i][j] = 0.f;
    }
  }
}

// What the traits of every sm80 forward kernel take from its tile row (tile_config.h): element
// type, head dim, the row's block sizes, warps, Q-in-registers flag and minimum CTAs per SM.
template <typename Element_, int kHeadDim_, typename Config_>
struct RowTraits {
  using Element = Element_;
  using Config = Config_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kNWarps = Config::kNWarps;
  static constexpr int kThreads = kNWarps * 32;
  static constexpr bool kQInRegs = Config::kQInRegs;
  static constexpr int kMinBlocks = Config::kMinBlocks;
};

}  // namespace sm80
}  // namespace flash
